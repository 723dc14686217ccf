"""Forward v8's split tail without a GPU: the model that chooses it and
the halves of a block's keys (tests/test_gpu_split_tail.py runs it on a
GPU)."""

import numpy as np
import pytest

from flashlab import order
from flashlab.gpu import host
from flashlab.kernel_args import KernelRules

PLAIN = KernelRules(np.float32(0.125), False, 0, -1, -1, False,
                    np.uint64(0), np.uint64(0), False, np.float32(1),
                    np.float32(-1), 1)


def test_key_halves_cover_the_tiles_once():
    for first in range(4):
        for last in range(first - 1, first + 9):
            a = order.key_half_tiles(first, last, 0)
            b = order.key_half_tiles(first, last, 1)
            tiles = list(range(a[0], a[1] + 1)) + list(range(b[0],
                                                             b[1] + 1))
            assert tiles == list(range(first, last + 1))
            assert 0 <= (b[1] - b[0]) - (a[1] - a[0]) <= 1  # 0 the smaller


def test_split_works_follow_the_launches():
    # one head of 300 rows in 128-row blocks: ranks cost 0.5 (the 44-row
    # block), 1, 1; tail 1 splits rank 0 into two pieces, launched after
    cost = {1: 0.5, 2: 1.0}
    whole, halves = order.split_works(300, 1, 128, cost, 0, 0.1)
    assert whole.tolist() == [0.5, 1.0, 1.0] and not halves.size
    whole, halves = order.split_works(300, 2, 128, cost, 1, 0.1)
    assert whole.tolist() == [1.0] * 4
    assert halves == pytest.approx([0.35] * 4)
    # two SMs: the whole blocks end at 2 and the pieces at 2.7, later
    # than the launch without (2.5): the model would not split here
    assert order.finish(whole, 2) + order.finish(halves, 2) == \
        pytest.approx(2.7)
    assert order.split_tail(300, 2, 128, cost, 2, 0.1) == (0, 1.0)


def test_model_splits_the_targets_shape(monkeypatch):
    # B2 H8, 16K, d = 64 without a mask: 4 ranks (1312 whole blocks,
    # 9.94 waves of 132 SMs, then 128 pieces), 4% sooner in the model;
    # with a causal mask, at d = 128 (no costs measured there), or at 23
    # heads (full waves), none
    monkeypatch.setattr(host, "SPLIT_TAIL", None)
    tail, ratio = order.split_tail(16384, 16, 192, host.PART_COST, 132,
                                   host.PIECE_COST)
    assert tail == 4 and 0.95 < ratio < 0.97
    assert host.split_tail("forward_v8_bf16", 192, 16384, 16, PLAIN,
                           132) == 4
    for name, br, heads, rules in (
            ("forward_v8_bf16", 192, 16, PLAIN._replace(causal=True)),
            ("forward_v8_bf16", 128, 16, PLAIN),
            ("forward_v8_bf16", 192, 23, PLAIN),
            ("forward_v7_bf16", 192, 16, PLAIN),
            ("forward_v8_e4m3", 192, 16, PLAIN)):
        assert host.split_tail(name, br, 16384, heads, rules, 132) == 0
    # forced: at most every rank but one
    monkeypatch.setattr(host, "SPLIT_TAIL", 9)
    assert host.split_tail("forward_v8_f16", 192, 1000, 2, PLAIN,
                           132) == 5
    assert host.split_tail("forward_v7_f16", 192, 1000, 2, PLAIN,
                           132) == 0
