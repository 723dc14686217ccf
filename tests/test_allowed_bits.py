"""warp.allowed_bits_of on numba's simulator: the bits of a warp's C
fragments (a tile's diagonal, its edges, ragged ends) against
flashlab.masks.pair_allowed element by element, for rows that are queries
(the forwards, dQ) and rows that are keys (dK, dV), with and without a
mask array; the interval form without one must agree with the rule it
replaces."""

import numpy as np
import pytest
from numba import cuda, int64

from flashlab import masks
from flashlab.gpu import _Call, warp


@cuda.jit
def _bits(out, b, r0, c0, nq, nk, rules, kv_len, mask, keys_in_rows):
    # one warp: lane 4 g + t holds rows r0 + g and r0 + g + 8
    lane = cuda.threadIdx.x
    out[lane] = warp.allowed_bits_of(b, r0 + lane // 4, c0, nq, nk, rules,
                                     kv_len, mask, TILES, keys_in_rows)


TILES = 16  # n-tiles of 8 columns: a 128-wide tile, as v8's S at d = 128


def _want(b, r0, c0, nq, nk, rules, lengths, keep, keys_in_rows):
    """The bits each lane should hold, from the numpy rule."""
    out = np.zeros(32, np.int64)
    for lane in range(32):
        g, t = divmod(lane, 4)
        bits = 0
        for n in range(TILES):
            for e in range(4):
                row = r0 + g + 8 * (e >> 1)
                col = c0 + 8 * n + 2 * t + (e & 1)
                i, j = (col, row) if keys_in_rows else (row, col)
                ok = (0 <= i < nq and 0 <= j < nk and masks.pair_allowed(
                    i, j, rules, lengths[b]))
                if ok and keep is not None:
                    ok = bool(keep[b, i, j])
                if ok:
                    bits |= 1 << (4 * n + e)
        out[lane] = np.int64(np.uint64(bits).view(np.int64))
    return out


@pytest.mark.parametrize("keys_in_rows", [False, True])
@pytest.mark.parametrize("opts", [
    dict(), dict(causal=True), dict(causal="bottom_right"),
    dict(window=(20, 5)), dict(window=(0, 0)), dict(window=(40, None)),
    dict(causal=True, window=(33, 0)), dict(kv_lengths="ragged"),
    dict(causal=True, mask="random")])
def test_allowed_bits_match_pair_allowed(rng, opts, keys_in_rows):
    nq, nk = (int(x) for x in rng.integers(1, 300, 2))
    heads = 2
    q = rng.standard_normal((1, heads, nq, 16)).astype(np.float32)
    k = rng.standard_normal((1, heads, nk, 16)).astype(np.float32)
    opts = dict(opts)
    keep = None
    if opts.get("kv_lengths") == "ragged":
        opts["kv_lengths"] = np.array([[0, int(rng.integers(1, nk + 1))]])
    if opts.get("mask") == "random":
        keep = rng.random((1, heads, nq, nk)) < 0.6
        opts["mask"] = keep
    full = dict(scale=None, causal=False, mask=None, window=None,
                kv_lengths=None, dropout_p=0.0, seed=None, align=None)
    call = _Call(q, k, k, full | opts)
    rules, kv_len, mask = call.args
    lengths = np.asarray(kv_len.copy_to_host() if hasattr(
        kv_len, "copy_to_host") else kv_len)
    flat_keep = None if keep is None else keep.reshape(heads, nq, nk)
    rows, cols = (nk, nq) if keys_in_rows else (nq, nk)
    for b in range(heads):
        # tiles on the diagonal and off it, ragged at both ends
        for r0 in sorted({0, int(rng.integers(0, rows)), max(rows - 9, 0)}):
            for c0 in sorted({0, int(rng.integers(0, cols)),
                              max(cols - 100, 0), r0 - r0 % 8}):
                out = np.full(32, -7, np.int64)  # poison
                _bits[1, 32](out, b, r0, c0, nq, nk, rules, kv_len, mask,
                             keys_in_rows)
                want = _want(b, r0, c0, nq, nk, rules, lengths, flat_keep,
                             keys_in_rows)
                assert np.array_equal(out, want), (b, r0, c0)


def test_spread_pairs_places_each_pair():
    # bits 2 n, 2 n + 1 -> 4 n, 4 n + 1, for every single pair and all
    @cuda.jit
    def spread(runs, out):
        i = cuda.grid(1)
        if i < runs.size:
            out[i] = warp.spread_pairs(int64(runs[i]))

    runs = np.array([1 << k for k in range(32)] + [0xFFFFFFFF, 0x5A5A5A5A],
                    np.int64)
    out = np.zeros_like(runs)
    spread[1, 64](runs, out)
    for run, got in zip(runs, out):
        want = sum(1 << (4 * (k // 2) + k % 2) for k in range(32)
                   if run >> k & 1)
        assert int(np.uint64(got.view(np.uint64))) == want, hex(run)


def test_fragment_run_is_one_test_per_element(rng):
    # the kernel's run arithmetic (columns_below, spread_pairs) against
    # the plain loop, for lanes of 8- and 16-n-tile rows
    from flashlab import fragments

    for _ in range(3000):
        tiles = int(rng.choice([4, 8, 16]))
        base = int(rng.integers(-40, 300))
        lo, hi = (int(x) for x in rng.integers(-60, 400, 2))
        want = sum(1 << (4 * n + e) for n in range(tiles) for e in (0, 1)
                   if lo <= base + 8 * n + e <= hi)
        assert fragments.fragment_run(lo, hi, base, tiles) == want


def test_allowed_range_is_the_rows_allowed_columns(rng):
    # masks.allowed_range against pair_allowed over every column, rows as
    # queries and as keys, for random index rules (either alignment's
    # offset, windows open or bounded on each side, padded keys)
    for _ in range(60):
        nq, nk = (int(x) for x in rng.integers(1, 50, 2))
        kv = int(rng.integers(0, nk + 2))
        left, right = (int(x) if x >= 0 else -1
                       for x in rng.integers(-3, 20, 2))
        r = masks.Index(causal=bool(rng.integers(0, 2)),
                        offset=int(rng.integers(-nq, nk + 1)), left=left,
                        right=right)
        for keys_in_rows in (False, True):
            rows, cols = (nk, nq) if keys_in_rows else (nq, nk)
            for x in range(rows + 2):
                lo, hi = masks.allowed_range(x, keys_in_rows, nq, nk, r, kv)
                for c in range(-1, cols + 2):
                    i, j = (c, x) if keys_in_rows else (x, c)
                    ok = (0 <= i < nq and 0 <= j < nk
                          and masks.pair_allowed(i, j, r, kv))
                    assert ok == (lo <= c <= hi), (r, keys_in_rows, x, c)
