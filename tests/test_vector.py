"""flashlab.vector: the exp2 and max the CPU kernels vectorize with.

exp2 is checked against numpy's float64 exp2 on a spread of every
float32 bit pattern (one in 4096, both signs, all exponents), on random
scores like the kernels see, and at every edge: -inf -> 0, NaN -> NaN,
overflow -> inf, underflow through the subnormals to 0.
"""

import math

import numpy as np
import pytest
from numba import njit

from flashlab import vector

ULP = 2.0**-23


@njit
def _exp2_all(x, out):
    for i in range(x.size):
        out[i] = vector.exp2(x[i])


@njit
def _max_all(a, b, out):
    for i in range(a.size):
        out[i] = vector.maximum(a[i], b[i])


def exp2(x):
    x = np.ascontiguousarray(x)
    out = np.empty_like(x)
    _exp2_all(x, out)
    return out


def check_against_numpy(x):
    got = exp2(x)
    with np.errstate(over="ignore"):
        want = np.exp2(x.astype(np.float64))
        want32 = want.astype(np.float32)
    assert np.array_equal(np.isnan(got), np.isnan(x))
    assert np.array_equal(np.isinf(got), np.isinf(want32))
    normal = np.isfinite(want32) & (want >= np.finfo(np.float32).tiny)
    rel = np.abs(got[normal] - want[normal]) / want[normal]
    assert rel.max(initial=0) < 2 * ULP  # stated: below 2e-7
    # subnormal or 0: the polynomial's relative budget, then one rounding
    # to the subnormal grid (half of 2**-149); near the smallest normal
    # number the first is about a subnormal ulp itself
    sub = np.isfinite(want32) & ~normal
    assert np.all(np.abs(got[sub] - want[sub])
                  <= 2 * ULP * want[sub] + 2.0**-150)


def test_exp2_over_the_whole_float32_range():
    bits = np.arange(0, 2**32, 4096 + 1, dtype=np.uint64).astype(np.uint32)
    check_against_numpy(bits.view(np.float32))


def test_exp2_on_scores(rng):
    x = (rng.standard_normal(10**6) * 30).astype(np.float32)
    check_against_numpy(x)
    check_against_numpy(-np.abs(x))  # softmax terms: x - max <= 0


def test_exp2_edges():
    x = np.array([-np.inf, np.inf, np.nan, 0, -0.0, 1, -1, 127.99, 128,
                  -126, -149, -149.5, -150, -151, 1e30, -1e30],
                 dtype=np.float32)
    got = exp2(x)
    assert got[0] == 0 and got[1] == np.inf and np.isnan(got[2])
    assert got[3] == got[4] == 1 and got[5] == 2 and got[6] == 0.5
    assert got[8] == np.inf and got[14] == np.inf and got[15] == 0
    assert got[13] == 0  # below half the smallest subnormal
    for value, g in zip(x[7:13], got[7:13]):  # near the ends: exactly
        assert g == np.float32(2.0 ** float(value)) or abs(
            g - 2.0 ** float(value)) <= 2 * ULP * 2.0 ** float(value)


def test_exp2_float64_is_libm():
    x = np.array([-1074.5, -3.25, 0.1, 700.0, np.nan, -np.inf])
    got = exp2(x)
    want = np.array([math.exp2(v) for v in x])
    assert np.array_equal(got, want, equal_nan=True)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_maximum_propagates_nan(dtype):
    a = np.array([1, np.nan, -np.inf, 3, -0.0, np.inf], dtype)
    b = np.array([np.nan, 2, -5, 4, 0.0, np.nan], dtype)
    out = np.empty_like(a)
    _max_all(a, b, out)
    assert np.isnan(out[[0, 1, 5]]).all()
    assert out[2] == -5 and out[3] == 4 and out[4] == 0


def test_exp2_degree_is_the_lowest_within_two_ulps():
    # the fitted polynomial's own relative error on |f| <= 1/2, in exact
    # arithmetic: degree DEGREE keeps under the 2-ulp budget with room
    # for float32 rounding, one degree less does not
    f = np.linspace(-0.5, 0.5, 200001)

    def worst(degree):
        c = vector.fit_exp2(degree)
        p = np.polynomial.polynomial.polyval(f, c)
        return float(np.max(np.abs(p / np.exp2(f) - 1)) / ULP)

    assert worst(vector.DEGREE) < 1.0
    assert worst(vector.DEGREE - 1) > 2.0
    assert vector.fit_exp2(vector.DEGREE)[0] == 1.0  # exp2(0) exact
