"""flashlab.exp2: the polynomial 2**x that v8 runs on the FMA pipe.

The numpy model is checked against float64 here; on a GPU the
instruction sequence (intrinsics.ex2_poly) is checked against the model
and against ex2.approx, the instruction it stands in for."""

import numpy as np
import pytest
from numba import cuda

from flashlab import exp2
from flashlab.gpu.intrinsics import ex2, ex2_poly

ULP = 2.0**-23  # float32's relative spacing at 1


def _grid(rng, n=200_000):
    """Fresh x in [-130, 1]: uniform, near each integer and near 0."""
    whole = rng.integers(-130, 1, n // 4).astype(np.float32)
    return np.concatenate([
        rng.uniform(-130, 1, n // 2).astype(np.float32),
        whole + rng.uniform(-1e-5, 1e-5, n // 4).astype(np.float32),
        -np.abs(rng.standard_normal(n // 4) * 1e-6).astype(np.float32),
    ])


def test_coefficients_are_the_minimax_fit():
    c, worst = exp2.fit()
    assert len(exp2.COEFFS) == exp2.DEGREE
    # rounding the fit to float32 moves each by at most half an ulp
    np.testing.assert_allclose(exp2.COEFFS, c, rtol=ULP, atol=0)
    assert worst < 9e-5  # degree 3's minimax relative error: 8.6e-5
    # the fit is minimax: degree 2 errs 25x more, degree 4 30x less
    assert exp2.fit(2)[1] > 20 * worst > 400 * exp2.fit(4)[1]


def test_model_within_its_bound_of_float64(rng):
    x = _grid(rng)
    got = exp2.model(x).astype(np.float64)
    want = np.exp2(x.astype(np.float64))
    normal = want >= 2.0**-126
    rel = np.abs(got[normal] / want[normal] - 1)
    assert rel.max() < exp2.MAX_REL_ERROR
    # the bound is not loose: the fit's own error shows
    assert rel.max() > 0.5 * exp2.MAX_REL_ERROR
    # below 2**-126 both this and ex2.approx.ftz give 0
    assert np.all(got[~normal] == 0)


def test_model_edge_cases():
    x = np.array([-np.inf, np.nan, 0, -126, -127, -126.5, -1000, 3],
                 np.float32)
    got = exp2.model(x)
    assert got[0] == 0 and np.isnan(got[1])
    assert got[2] == 1  # a row's maximum weighs exactly 1
    assert got[3] == np.float32(2.0**-126)  # the smallest normal
    assert got[4] == got[5] == got[6] == 0
    assert got[7] == 8


def test_floor_by_the_rounded_magic_sum():
    # the kernel's floor: MAGIC + t rounded toward -inf, less MAGIC. The
    # exact sum lies in [MAGIC + floor(t), MAGIC + floor(t) + 1), whose
    # ends are neighbouring float32 for every floor the kernel meets
    # (t >= -127, and t below 2 as a shifted score is), so rounding down
    # gives the first; the second subtraction is then exact
    for j in range(-127, 2):
        low = np.float32(exp2.MAGIC + j)
        assert float(low) == float(exp2.MAGIC) + j
        assert np.nextafter(low, np.float32(np.inf)) == low + 1
        assert np.float32(low - exp2.MAGIC) == j


def test_tile_cycles_balance_where_the_fma_pipe_helps():
    # per warpgroup tile of 64 x 128: bf16 at d = 128 needs the tensor
    # cores twice as long as the exponentials; bf16 at d = 64 and e4m3
    # at d = 128 need both equally (where v8 moves exponentials)
    big, small = exp2.tile_cycles(128), exp2.tile_cycles(64)
    eight = exp2.tile_cycles(128, "e4m3")
    assert big["products"] == 2 * big["exponentials"] == 1024
    assert small["products"] == small["exponentials"] == 512
    assert eight == small


@cuda.jit
def _both(x, poly, fast):
    i = cuda.grid(1)
    if i < x.size:
        poly[i] = ex2_poly(x[i])
        fast[i] = ex2(x[i])


@pytest.mark.gpu  # inline PTX: not on the simulator
def test_ex2_poly_is_its_model_on_the_gpu(rng):
    x = np.concatenate([_grid(rng), np.array(
        [-np.inf, np.nan, 0, -127, -126, -1e-30, 1e-7], np.float32)])
    poly = np.full_like(x, 7.0)  # poison: no 2**x is 7 here
    fast = np.full_like(x, 7.0)
    _both[(x.size + 255) // 256, 256](x, poly, fast)
    want = exp2.model(x)
    assert np.array_equal(np.isnan(poly), np.isnan(x))
    finite = ~np.isnan(x)
    # the model's FMAs round through float64: at most an ulp apart
    np.testing.assert_allclose(poly[finite], want[finite], rtol=2 * ULP,
                               atol=0)
    # and within the fit's bound of the special-function unit's result
    # (whose own error is about 2 ulps), zero where it gives zero
    np.testing.assert_allclose(poly[finite], fast[finite],
                               rtol=exp2.MAX_REL_ERROR + 4 * ULP, atol=0)
