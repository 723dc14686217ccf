"""flashlab.blas: numpy's OpenBLAS gemm from numba, and its stand-in."""

import numpy as np
import pytest

from flashlab import blas


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("gemm", [blas.gemm, blas.loop_gemm],
                         ids=["blas", "loops"])
@pytest.mark.parametrize("trans_a, trans_b", [(False, False), (False, True),
                                              (True, False)])
def test_gemm_against_numpy(rng, dtype, gemm, trans_a, trans_b):
    m, n, k = 37, 45, 19
    a = rng.standard_normal((k, m) if trans_a else (m, k)).astype(dtype)
    b = rng.standard_normal((n, k) if trans_b else (k, n)).astype(dtype)
    # views into larger buffers: rows strided, the rest must stay NaN
    big_a = np.full((a.shape[0] + 3, a.shape[1] + 5), np.nan, dtype)
    big_a[:a.shape[0], :a.shape[1]] = a
    c = np.full((m + 4, n + 6), np.nan, dtype)
    c0 = rng.standard_normal((m, n)).astype(dtype)
    want = 0.5 * (a.T if trans_a else a) @ (b.T if trans_b else b)
    tol = 50 * np.finfo(dtype).eps * np.sqrt(k)  # sums of k products
    gemm(trans_a, trans_b, m, n, k, dtype(0.5), big_a[:a.shape[0]], b,
         dtype(0), c)  # beta 0: the NaN c held is ignored
    assert np.abs(c[:m, :n] - want).max() < tol
    assert np.isnan(c[m:]).all() and np.isnan(c[:, n:]).all()
    c[:m, :n] = c0
    gemm(trans_a, trans_b, m, n, k, dtype(0.5), big_a[:a.shape[0]], b,
         dtype(2), c)  # beta 2: c = 0.5 A B + 2 c
    assert np.abs(c[:m, :n] - (want + 2 * c0)).max() < 2 * tol


def test_found_numpys_openblas():
    # the course's numpy wheels ship it; elsewhere gemm is loop_gemm
    assert blas.available
    assert blas.gemm is not blas.loop_gemm


def test_a_single_row_with_a_free_stride_is_multiplied():
    # numpy leaves a one-row array's row stride free: a C-contiguous
    # broadcast view carries 0 there, which BLAS refuses as a leading
    # dimension (the drop-in hit it with L = S = E = 1 and grouped heads)
    a = np.lib.stride_tricks.as_strided(np.array([[2.0]], np.float32),
                                        (1, 1), (0, 4))
    b = np.array([[3.0, -1.0]], np.float32)
    c = np.full((1, 2), np.nan, np.float32)
    assert a.flags.c_contiguous and a.strides[0] == 0
    blas.gemm(False, False, 1, 2, 1, 1.0, a, b, 0.0, c)
    assert np.array_equal(c, [[6.0, -2.0]])
