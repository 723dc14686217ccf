"""Measured traffic: counts from running the loops, against closed forms."""

import itertools

import numpy as np
import pytest

from flashlab import io


def test_seed_001_declared_example():
    for block_k in (1, 2, 3, 4, 7):  # the key tile does not matter
        dense = io.ledger("dense", 6, 2, block_q=2, block_k=block_k)
        fa2 = io.ledger("fa2", 6, 2, block_q=2, block_k=block_k)
        assert (dense.total, fa2.total) == (240, 96)
        assert (fa2.reads["Q"], fa2.reads["K"], fa2.reads["V"]) == (12, 36,
                                                                     36)
        assert fa2.writes["O"] == 12
        for t in ("S", "P"):
            assert dense.reads[t] == dense.writes[t] == 36


SHAPES = list(itertools.product(
    [1, 5, 16, 33], [1, 4], [None, 3], [1, 4, 7, 40], [1, 5, 16, 50],
))


@pytest.mark.parametrize("schedule", io.SCHEDULES)
@pytest.mark.parametrize("n, d, dv, bq, bk", SHAPES)
def test_measured_equals_closed_form(schedule, n, d, dv, bq, bk):
    for save_lse in (False, True):
        got = io.ledger(schedule, n, d, dv, block_q=bq, block_k=bk,
                        save_lse=save_lse)
        want = io.predicted(schedule, n, d, dv, block_q=bq, block_k=bk,
                            save_lse=save_lse)
        assert got == want


def test_causal_moves_less(rng):
    n, d = 96, 8
    for schedule in io.SCHEDULES:
        full = io.ledger(schedule, n, d, block_q=16, block_k=16)
        causal = io.ledger(schedule, n, d, block_q=16, block_k=16,
                           causal=True)
        if schedule == "dense":  # S and P are still stored whole
            assert causal.total == full.total
        else:
            assert causal.total < full.total


def test_counted_array_counts_slices():
    book = io._empty_ledger()
    x = io.Counted("Q", np.arange(12.0).reshape(3, 4), book)
    assert x[1:, :2].tolist() == [[4.0, 5.0], [8.0, 9.0]]
    x[0] = 7.0
    assert (book.reads["Q"], book.writes["Q"]) == (4, 4)
    assert x.data[0].tolist() == [7.0] * 4


def test_fa1_blocks_follow_algorithm_1():
    assert io.fa1_blocks(4096, 64) == (16, 16)
    assert io.fa1_blocks(100_000, 64) == (64, 391)
    with pytest.raises(ValueError, match="sram"):
        io.fa1_blocks(100, 64)


def test_bad_schedule():
    with pytest.raises(ValueError, match="schedule"):
        io.ledger("fa3", 8, 2, block_q=2, block_k=2)
    with pytest.raises(ValueError, match="schedule"):
        io.predicted("fa3", 8, 2, block_q=2, block_k=2)
