"""Matrix products from inside numba CPU kernels: numpy's own OpenBLAS.

numba compiles `np.dot` only with scipy installed, but it can call a C
function through ctypes. numpy's Linux wheels ship OpenBLAS (as
libscipy_openblas64_, 64-bit integers, symbols suffixed 64_), so its CBLAS
gemm is one ctypes declaration away. `gemm` is that call, for float32 and
float64 row-major arrays; `available` says whether the library was found
(other builds of numpy use other BLAS libraries, and `gemm` is then
`loop_gemm`, correct and slow). Inside numba's parallel loops each call
must run on its own thread: `one_thread` pins OpenBLAS to one thread for
the duration, since its threads and numba's would compete for the same
cores. See chapter 9.
"""

import contextlib
import ctypes
import glob
import os

import numpy as np
from numba import njit

ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112  # CBLAS enums


def _find():
    """ctypes handle of numpy's bundled OpenBLAS, or None."""
    root = os.path.dirname(os.path.dirname(np.__file__))
    for pattern in ("numpy.libs/libscipy_openblas64_*.so*",
                    "numpy/.dylibs/libscipy_openblas64_*.dylib"):
        for path in sorted(glob.glob(os.path.join(root, pattern))):
            try:
                return ctypes.CDLL(path)
            except OSError:
                continue
    return None


_lib = _find()
available = _lib is not None


def _declare(name, real):
    """The CBLAS gemm `name` with ctypes argument types (None if absent)."""
    f = getattr(_lib, name, None) if available else None
    if f is None:
        return None
    i32, i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
    f.argtypes = [i32, i32, i32, i64, i64, i64, real, ptr, i64, ptr, i64,
                  real, ptr, i64]
    f.restype = None
    return f


_sgemm = _declare("scipy_cblas_sgemm64_", ctypes.c_float)
_dgemm = _declare("scipy_cblas_dgemm64_", ctypes.c_double)
available = available and _sgemm is not None and _dgemm is not None


@njit
def _blas_gemm(trans_a, trans_b, m, n, k, alpha, a, b, beta, c):
    """c[:m, :n] = alpha op(a) op(b) + beta c[:m, :n]; op transposes if
    trans_*. a, b, c are 2-d row-major views (rows may be strided: each
    row contiguous), all of one dtype, float32 or float64."""
    ta = TRANS if trans_a else NO_TRANS
    tb = TRANS if trans_b else NO_TRANS
    size = c.itemsize
    lda, ldb, ldc = _ld(a, size), _ld(b, size), _ld(c, size)
    if size == 4:  # float32
        _sgemm(ROW_MAJOR, ta, tb, m, n, k, alpha, a.ctypes, lda,
               b.ctypes, ldb, beta, c.ctypes, ldc)
    else:
        _dgemm(ROW_MAJOR, ta, tb, m, n, k, alpha, a.ctypes, lda,
               b.ctypes, ldb, beta, c.ctypes, ldc)


@njit
def _ld(x, size):
    """BLAS's leading dimension of row-major x: its row stride, or for a
    single row, whose stride numpy leaves free (a C-contiguous array may
    carry stride 0 there, from a broadcast), its width."""
    if x.shape[0] > 1:
        return x.strides[0] // size
    return max(x.shape[1], 1)


@njit
def loop_gemm(trans_a, trans_b, m, n, k, alpha, a, b, beta, c):
    """gemm by plain loops: the stand-in where numpy has no OpenBLAS."""
    for i in range(m):
        for j in range(n):
            acc = alpha * 0  # a zero of the dtype (c may hold NaN)
            for x in range(k):
                av = a[x, i] if trans_a else a[i, x]
                bv = b[j, x] if trans_b else b[x, j]
                acc += av * bv
            # beta == 0 ignores what c held, NaN included, as BLAS does
            c[i, j] = alpha * acc + (beta * c[i, j] if beta != 0 else 0)


gemm = _blas_gemm if available else loop_gemm


@contextlib.contextmanager
def one_thread():
    """OpenBLAS on one thread for the duration (restored after)."""
    if not available:
        yield
        return
    get = _lib.scipy_openblas_get_num_threads64_
    put = _lib.scipy_openblas_set_num_threads64_
    get.restype, put.argtypes = ctypes.c_int, [ctypes.c_int]
    before = get()
    put(1)
    try:
        yield
    finally:
        put(before)
