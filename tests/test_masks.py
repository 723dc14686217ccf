"""Masking rules: windows, key padding, and which tiles are skipped."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashlab import masks, reference, tiled
from helpers import max_abs_err, qkv


def explicit(nq, nk, causal, window):
    """The allowed matrix built from the definitions, pair by pair."""
    offset = nk - nq if causal == "bottom_right" else 0
    keep = np.ones((nq, nk), dtype=bool)
    for i in range(nq):
        for j in range(nk):
            if causal and j > i + offset:
                keep[i, j] = False
            if window is not None:
                left, right = window
                if left is not None and j < i + offset - left:
                    keep[i, j] = False
                if right is not None and j > i + offset + right:
                    keep[i, j] = False
    return keep


windows = st.one_of(
    st.none(),
    st.tuples(st.one_of(st.none(), st.integers(0, 20)),
              st.one_of(st.none(), st.integers(0, 20))),
)


@settings(max_examples=150, deadline=None)
@given(nq=st.integers(1, 40), nk=st.integers(1, 40),
       causal=st.sampled_from([False, True, "bottom_right"]),
       window=windows, bq=st.integers(1, 45), bk=st.integers(1, 45),
       seed=st.integers(0, 2**32 - 1))
def test_patterns_match_definition_and_skip_only_empty_tiles(
        nq, nk, causal, window, bq, bk, seed):
    rules = masks.rules(causal, window, None, None, (), nq, nk)
    keep = rules.allowed(range(nq), range(nk))
    want = explicit(nq, nk, causal, window)
    assert np.array_equal(np.ones_like(want) if keep is None else keep, want)
    scalar = (rules.index(), nk)
    assert np.array_equal(rules.empty_rows((), nq, nk), ~want.any(axis=-1))
    for i in range(nq):  # the kernels' scalar form agrees pair by pair
        for j in range(nk):
            assert masks.pair_allowed(i, j, *scalar) == want[i, j]
    for i0 in range(0, nq, bq):
        for j0 in range(0, nk, bk):
            rows = range(i0, min(i0 + bq, nq))
            cols = range(j0, min(j0 + bk, nk))
            tile = want[i0:rows.stop, j0:cols.stop]
            assert rules.skips(rows, cols) == (not tile.any())
            assert masks.tile_skipped(i0, rows.stop, j0, cols.stop,
                                      *scalar) == (not tile.any())
            assert masks.tile_full(i0, rows.stop, j0, cols.stop,
                                   *scalar) == bool(tile.all())
    # and the tiled result is the masked reference
    rng = np.random.default_rng(seed)
    q, k, v = qkv(rng, (), nq, nk, 3, 2)
    o = tiled.attention(q, k, v, block_q=bq, block_k=bk, causal=causal,
                        window=window)
    mask_ref = reference.attention(q, k, v, mask=want)
    assert max_abs_err(o, mask_ref) < 1e-12


# blocks of rows against tiles of keys, with padding: the kernels' cases
BLOCKS = dict(nq=st.integers(1, 60), nk=st.integers(1, 60),
              causal=st.sampled_from([False, True, "bottom_right"]),
              window=windows, kv=st.integers(0, 60), bq=st.integers(1, 20),
              bk=st.integers(1, 20))


def row_blocks(nq, nk, causal, window, kv, bq, bk):
    """(rules, valid keys, n_tiles, i0, i1) for each block of bq rows."""
    rules = masks.rules(causal, window, None, None, (), nq, nk).index()
    for i0 in range(0, nq, bq):
        yield rules, min(kv, nk), -(-nk // bk), i0, min(i0 + bq, nq)


@settings(max_examples=150, deadline=None)
@given(**BLOCKS)
def test_full_run_is_every_full_tile_and_only_those(nq, nk, causal, window,
                                                    kv, bq, bk):
    # the tiles a block visits that need no mask are one run (forward_v8
    # finds it once a block): exactly the tiles tile_full passes
    for rules, valid, n_tiles, i0, i1 in row_blocks(nq, nk, causal, window,
                                                    kv, bq, bk):
        for first in range(n_tiles):
            for last in range(first - 1, n_tiles):
                lo, hi = masks.full_run(i0, i1, first, last, nk, bk, rules,
                                        valid)
                want = [t for t in range(first, last + 1)
                        if t * bk + bk <= nk and masks.tile_full(
                            i0, i1, t * bk, t * bk + bk, rules, valid)]
                assert list(range(lo, hi + 1)) == want


@settings(max_examples=300, deadline=None)
@given(**BLOCKS)
def test_tile_range_is_the_run_tile_skipped_leaves(nq, nk, causal, window,
                                                   kv, bq, bk):
    # the kernels find a block's tiles in closed form: the same tiles as
    # asking tile_skipped of each, and the same empty answer
    for rules, valid, n_tiles, i0, i1 in row_blocks(nq, nk, causal, window,
                                                    kv, bq, bk):
        first, last = masks.tile_range(i0, i1, nk, bk, rules, valid)
        want = [t for t in range(n_tiles) if not masks.tile_skipped(
            i0, i1, t * bk, min(t * bk + bk, nk), rules, valid)]
        assert list(range(first, last + 1)) == want
        if not want:
            assert (first, last) == (n_tiles, n_tiles - 1)


@settings(max_examples=300, deadline=None)
@given(**BLOCKS, part=st.integers(1, 33))
def test_last_tile_leaves_only_skipped_tiles(nq, nk, causal, window, kv,
                                             bq, bk, part):
    # forward v8's warpgroups stop at last_tile of their own rows: every
    # later tile of the block is skipped for those rows, the tile itself
    # is not (where the rows see any key), and it never passes the
    # block's own last tile
    for rules, valid, _, i0, i1 in row_blocks(nq, nk, causal, window,
                                                    kv, bq, bk):
        first, last = masks.tile_range(i0, i1, nk, bk, rules, valid)
        for r0 in range(i0, i1, part):
            r1 = min(r0 + part, i1)
            own = min(last, masks.last_tile(r1, nk, bk, rules, valid))
            assert all(masks.tile_skipped(
                r0, r1, t * bk, min(t * bk + bk, nk), rules, valid)
                for t in range(max(own + 1, first), last + 1))
            lo, hi = masks.tile_range(r0, r1, nk, bk, rules, valid)
            if lo <= hi:
                assert own == hi


@settings(max_examples=60, deadline=None)
@given(batch=st.integers(1, 3), nq=st.integers(1, 30), nk=st.integers(1, 30),
       density=st.floats(0, 1), seed=st.integers(0, 2**32 - 1),
       bq=st.integers(1, 33), bk=st.integers(1, 33))
def test_random_boolean_masks(batch, nq, nk, density, seed, bq, bk):
    rng = np.random.default_rng(seed)
    q, k, v = qkv(rng, (batch,), nq, nk, 4, 3)
    mask = rng.random((batch, nq, nk)) < density
    with np.errstate(all="raise"):
        o, lse = tiled.attention(q, k, v, block_q=bq, block_k=bk, mask=mask,
                                 return_lse=True)
    o_ref, lse_ref = reference.attention(q, k, v, mask=mask, return_lse=True)
    assert max_abs_err(o, o_ref) < 1e-12
    empty = ~mask.any(axis=-1)
    assert np.all(o[empty] == 0) and np.all(lse[empty] == -np.inf)
    assert max_abs_err(lse[~empty], lse_ref[~empty]) < 1e-12


def test_key_padding_equals_truncated_keys(rng):
    q, k, v = qkv(rng, (3, 2), 11, 17, 5, 4)
    lengths = np.array([17, 9, 0])[:, None]  # per sequence, all heads
    o = tiled.attention(q, k, v, block_q=4, block_k=5, kv_lengths=lengths)
    for b, n in enumerate([17, 9, 0]):
        if n == 0:
            assert np.all(o[b] == 0)
            continue
        want = reference.attention(q[b], k[b, :, :n], v[b, :, :n])
        assert max_abs_err(o[b], want) < 1e-12


def test_padding_skips_tiles_past_the_longest_sequence(rng):
    q, k, v = qkv(rng, (2,), 32, 64, 4, 4)
    lengths = np.array([20, 30])
    steps = tiled.trace(q, k, v, block_q=16, block_k=16, kv_lengths=lengths)
    assert {t.cols.start for t in steps} == {0, 16}  # keys 32.. never read


@pytest.mark.parametrize("n, blk", [(1024, 64), (1000, 64), (512, 128)])
def test_causal_visits_about_half_the_tiles(rng, n, blk):
    x = rng.standard_normal((n, 4))
    t = n // blk + (n % blk > 0)
    visited = len(tiled.trace(x, x, x, block_q=blk, block_k=blk,
                              causal=True))
    assert visited == t * (t + 1) // 2  # the diagonal and below


def test_sliding_window_visits_a_band(rng):
    x = rng.standard_normal((256, 4))
    steps = tiled.trace(x, x, x, block_q=32, block_k=32, causal=True,
                        window=(32, 0))
    assert all(0 <= t.rows.start - t.cols.start <= 32 for t in steps)
    assert len(steps) == 8 + 7  # diagonal tiles and one band below
