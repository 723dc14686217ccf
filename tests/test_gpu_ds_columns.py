"""backward_v5.ds_of_full_columns against ds_of_columns, on a GPU (p_of's
ex2 has no simulator form).

backward_v7's and v8's consumers take a tile whose every pair is allowed
and none dropped through ds_of_full_columns, and every other tile
through ds_of_columns; so on such a tile the two must give the same
bits, and both P^T Z and dS^T of the float64 formulas within float32's
rounding."""

import numpy as np
import pytest
from numba import cuda, float32, int64

from flashlab.gpu import backward_v5

pytestmark = pytest.mark.gpu

TILES = 8  # n-tiles of 8 query columns: a streamed tile of 64 queries
COLS = 8 * TILES
LOG2E = np.log2(np.e)


@cuda.jit
def _ds(s, dp, sh, zn, dl, tau, full, out_p, out_ds):
    # lane 4 g + t: keys g, g + 8 of the tile, columns 2 t + 8 n (+ 1)
    lane = cuda.threadIdx.x
    sf = cuda.local.array((TILES, 4), float32)
    pf = cuda.local.array((TILES, 4), float32)
    for n in range(TILES):
        for x in range(4):
            sf[n, x] = s[lane, n, x]
            pf[n, x] = dp[lane, n, x]
    c0 = 2 * (lane % 4)
    if full:
        backward_v5.ds_of_full_columns(sf, pf, TILES, tau, c0, sh, zn, dl)
    else:
        backward_v5.ds_of_columns(sf, pf, TILES, tau, c0, sh, zn, dl,
                                  int64(-1), int64(0))
    for n in range(TILES):
        for x in range(4):
            out_p[lane, n, x] = sf[n, x]
            out_ds[lane, n, x] = pf[n, x]


def _columns():
    """Query column of each (lane, n, x) fragment element."""
    lane, n, x = np.meshgrid(np.arange(32), np.arange(TILES),
                             np.arange(4), indexing="ij")
    return 2 * (lane % 4) + 8 * n + (x & 1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_full_columns_give_ds_of_columns_bits(seed):
    rng = np.random.default_rng(seed)
    tau = np.float32(1 / np.sqrt(128))
    # scores near each column's shift (P up to 1) and far below it
    # (P rounding to zero), huge ones among them
    s = (rng.standard_normal((32, TILES, 4)) * 30).astype(np.float32)
    s[0, 0, 0] = 3e4
    c = _columns()
    shift = np.zeros(COLS, np.float32)
    for col in range(COLS):
        shift[col] = (s[c == col] * tau).max()  # the row max of S^T's col
    norm = rng.uniform(0.01, 1, COLS).astype(np.float32)
    delta = rng.standard_normal(COLS).astype(np.float32)
    dp = rng.standard_normal((32, TILES, 4)).astype(np.float32)
    got = {}
    for full in (True, False):
        out_p = np.full((32, TILES, 4), np.nan, np.float32)
        out_ds = np.full((32, TILES, 4), np.nan, np.float32)
        _ds[1, 32](s, dp, shift, norm, delta, tau, full, out_p, out_ds)
        got[full] = out_p, out_ds
    for a, b in zip(got[True], got[False]):
        assert np.array_equal(a.view(np.int32), b.view(np.int32))
    # float64: P = exp(s tau - shift), P^T Z = P norm, dS^T = P (dP norm
    # - delta); the kernel's s tau and its ex2 each round to float32 (ex2
    # within 2 ulp), and the shifted exponent of a large score loses
    # |s tau| 2^-24 to s tau's rounding
    p64 = np.exp2((s.astype(np.float64) * float(tau) - shift[c]) * LOG2E)
    want_p = p64 * norm[c]
    want_ds = p64 * (dp * norm[c] - delta[c].astype(np.float64))
    slack = np.abs(s * tau) * 2.0**-23 + 2.0**-20
    p_err = np.abs(got[True][0] - want_p)
    assert np.all(p_err <= np.abs(want_p) * slack + 1e-30)
    ds_err = np.abs(got[True][1] - want_ds)
    scale = p64 * (np.abs(dp * norm[c]) + np.abs(delta[c]))
    assert np.all(ds_err <= scale * (slack + 2.0**-21) + 1e-30)
    assert np.isfinite(got[True][0]).all() and (got[True][0] > 0).any()
