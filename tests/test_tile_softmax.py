"""warp.full_run (on numba's simulator) and warp.plain_softmax (on a GPU:
its shuffles and ex2 have no simulator form).

forward_v8 finds, once a block, the run of its tiles that need no mask
(`full_run`). With three consumer warpgroups it runs the softmax of a
full tile without dropout by plain_softmax, under P V, and every other
tile's by tile_softmax after P V; with two, known_softmax masks only the
tiles outside the run. So the run must hold exactly the tiles whose
every pair masks.pair_allowed allows, and plain_softmax and
tile_softmax must agree exactly on such a tile."""

import numpy as np
import pytest
from numba import cuda, float32, int32

from flashlab import exp2, masks
from flashlab.gpu import _Call, warp

TILES = 16  # n-tiles of 8 keys: v8's 128-key tile
BC = 8 * TILES
FULL = dict(scale=None, causal=False, mask=None, window=None,
            kv_lengths=None, dropout_p=0.0, seed=None, align=None)


@cuda.jit
def _runs(blocks, out, bc, nk, rules, kv_len):
    # blocks[x] = (b, i0, i1): one thread a block of rows; out[x] = its
    # tile_range and full_run, as forward_v8 finds them
    x = cuda.grid(1)
    if x < blocks.shape[0]:
        b, i0, i1 = blocks[x, 0], blocks[x, 1], blocks[x, 2]
        first, last = warp.tile_range(i0, i1, nk, bc, rules, kv_len[b])
        lo, hi = warp.full_run(i0, i1, first, last, nk, bc, rules,
                               kv_len[b])
        out[x, 0], out[x, 1], out[x, 2], out[x, 3] = first, last, lo, hi


@cuda.jit
def _softmax(s, state, b, i0, i1, j0, nq, nk, rules, kv_len, mask, plain,
             poly, out_s, out_state):
    # one warp: lane 4 g + t holds rows i0 + g and i0 + g + 8 of S
    lane = cuda.threadIdx.x
    sf = cuda.local.array((TILES, 4), float32)
    m = cuda.local.array(2, float32)
    l = cuda.local.array(2, float32)
    al = cuda.local.array(2, float32)
    seen = cuda.local.array(2, int32)
    for n in range(TILES):
        for e in range(4):
            sf[n, e] = s[lane, n, e]
    for h in range(2):
        m[h], l[h], al[h] = state[lane, 0, h], state[lane, 1, h], 0
        seen[h] = int32(state[lane, 2, h])
    row = i0 + lane // 4
    if plain:
        warp.plain_softmax(sf, m, l, al, seen, TILES, rules, poly)
    else:
        warp.tile_softmax(sf, m, l, al, seen, TILES, BC, b, row, i0, i1,
                          j0, nq, nk, rules, kv_len, mask, kv_len[b], poly)
    for n in range(TILES):
        for e in range(4):
            out_s[lane, n, e] = sf[n, e]
    for h in range(2):
        out_state[lane, 0, h] = m[h]
        out_state[lane, 1, h] = l[h]
        out_state[lane, 2, h] = al[h]
        out_state[lane, 3, h] = seen[h]


def _rules(rng, nq, nk, opts):
    """(rules, kv_len, mask, per-head key lengths) of a _Call."""
    q = rng.standard_normal((1, 2, nq, 16)).astype(np.float32)
    k = rng.standard_normal((1, 2, nk, 16)).astype(np.float32)
    rules, kv_len, mask = _Call(q, k, k, FULL | opts).args
    lengths = np.asarray(kv_len.copy_to_host() if hasattr(
        kv_len, "copy_to_host") else kv_len)
    return rules, kv_len, mask, lengths


@pytest.mark.parametrize("opts", [
    dict(), dict(causal=True), dict(causal="bottom_right"),
    dict(window=(40, 5)), dict(causal=True, window=(200, 0)),
    dict(window=(300, 150)), dict(kv_lengths="ragged")])
def test_full_run_is_the_tiles_whose_every_pair_is_allowed(rng, opts):
    nq, nk = (int(x) for x in rng.integers(130, 600, 2))
    if opts.get("causal") == "bottom_right":
        # a full tile needs a row that sees the first 128 keys: row i
        # sees keys up to i + nk - nq, and the last 64-row block starts
        # past nq - 64, so nk >= 191 gives one whatever nq
        nk = int(rng.integers(191, 600))
    nk += nk % BC == 0  # a ragged last tile, never full
    opts = dict(opts)
    if opts.get("kv_lengths") == "ragged":
        opts["kv_lengths"] = np.array([[nk, int(rng.integers(1, nk))]])
    rules, kv_len, _, lengths = _rules(rng, nq, nk, opts)
    blocks = np.array([(b, i0, min(i0 + br, nq)) for b in range(2)
                       for br in (64, 128, 192) for i0 in range(0, nq, br)],
                      np.int64)
    out = np.full((len(blocks), 4), -7, np.int64)  # poison: no tile index
    _runs[(len(blocks) + 63) // 64, 64](blocks, out, BC, nk, rules, kv_len)
    fulls = 0
    for (b, i0, i1), (first, last, lo, hi) in zip(blocks, out):
        for t in range(first, last + 1):
            want = t * BC + BC <= nk and all(
                masks.pair_allowed(i, j, rules, lengths[b])
                for i in range(i0, i1) for j in range(t * BC, t * BC + BC))
            assert (lo <= t <= hi) == want, (b, i0, i1, t)
            fulls += want
        assert lo > hi or first <= lo <= hi <= last
    visited = sum(last - first + 1 for first, last, _, _ in out)
    if opts.get("window") != (40, 5):  # narrower than a tile
        assert fulls > 0  # both answers were checked
    assert fulls < visited  # the ragged last tile at least


@pytest.mark.gpu  # the softmax's shuffles and ex2: not on the simulator
@pytest.mark.parametrize("scale", [None, -0.3])
@pytest.mark.parametrize("fresh", [True, False])
@pytest.mark.parametrize("poly", [0, 3])
def test_plain_softmax_is_tile_softmax_on_a_plain_tile(rng, scale, fresh,
                                                        poly):
    # a tile wholly below a causal diagonal, as most of a long row's are;
    # from a fresh row (m = -inf) and from one with earlier tiles seen;
    # tau <= 0 is scaled first (it reorders the scores); with poly 3,
    # every third term's exponential is flashlab.exp2's polynomial
    nq = nk = 512
    i0, j0 = 256, 128  # keys 128..255: every one below each row
    rules, kv_len, mask, _ = _rules(rng, nq, nk,
                                    dict(causal=True, scale=scale))
    block = np.array([[0, i0, i0 + 16]], np.int64)
    run = np.full((1, 4), -7, np.int64)
    _runs[1, 1](block, run, BC, nk, rules, kv_len)
    assert run[0, 2] <= j0 // BC <= run[0, 3]  # a full tile
    s = (3 * rng.standard_normal((32, TILES, 4))).astype(np.float32)
    state = np.zeros((32, 3, 2), np.float32)
    if fresh:
        state[:, 0] = -np.inf
    else:  # each row's m the same in its four lanes, l each lane's share
        state[:, 0] = np.repeat(rng.uniform(-2, 6, (8, 2)), 4, axis=0)
        state[:, 1] = rng.uniform(0.5, 4, (32, 2))
        state[:, 2] = 1
    got = {}
    for way in (True, False):
        out_s = np.full((32, TILES, 4), np.nan, np.float32)  # poison
        out_state = np.full((32, 4, 2), np.nan, np.float32)
        _softmax[1, 32](s, state, 0, i0, i0 + 16, j0, nq, nk, rules,
                        kv_len, mask, way, poly, out_s, out_state)
        got[way] = out_s, out_state
    for a, b in zip(got[True], got[False]):
        assert np.array_equal(a, b)
    # and both are the online softmax: P = exp(tau s - m_new), l_new =
    # alpha l + row sum of P (over the row's four lanes), in float64;
    # ex2 errs by about 2 ulps, the polynomial by MAX_REL_ERROR
    tol = 1e-5 if poly == 0 else exp2.MAX_REL_ERROR + 1e-5
    tau = rules.scale
    out_s, out_state = got[True]
    for g in range(8):
        lanes = slice(4 * g, 4 * g + 4)
        for h in range(2):
            row = (tau * s[lanes, :, 2 * h:2 * h + 2]).astype(np.float64)
            m_old = float(state[4 * g, 0, h])
            m_new = max(m_old, row.max())
            p = np.exp(row - m_new)
            assert np.allclose(out_s[lanes, :, 2 * h:2 * h + 2], p,
                               rtol=tol, atol=1e-7)
            assert np.allclose(out_state[lanes, 0, h], m_new, rtol=1e-6)
            alpha = np.exp(m_old - m_new)
            l_new = alpha * state[lanes, 1, h].sum() + p.sum()
            assert np.isclose(out_state[lanes, 1, h].sum(), l_new,
                              rtol=tol)
            assert (out_state[lanes, 3, h] == 1).all()  # rows met a key
