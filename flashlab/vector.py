"""exp2 and max for numba CPU kernels, written so that loops vectorize.

numba's `math.exp` and `math.exp2` call libm one value at a time (this
llvmlite has no vector math library), and its `max()` of floats compiles
to compare-and-branch: either keeps LLVM from turning a loop over a row
of scores into vector instructions. Here:

- `exp2(x)`: for float32, 2**x as 2**n 2**f with n = round(x) and a
  polynomial for 2**f, |f| <= 1/2, of the lowest degree that keeps the
  relative error below 2e-7 (2 ulps): degree 5, fitted for the least
  largest relative error, 1.4 ulps (degree 4 is 24; tests/test_vector.py
  measures it over the whole float32 range); -inf gives 0, NaN stays
  NaN, overflow gives inf and underflow goes through the subnormals to
  0, as `math.exp2` does. float64 keeps
  `math.exp2` (libm), since the float64 paths are the accurate ones.
- `maximum(a, b)`: llvm's `maximum`, one vector instruction sequence,
  NaN if either is NaN.

See chapter 9.
"""

import math

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

DEGREE = 5  # the lowest within 2 ulps (see fit_exp2)


def fit_exp2(degree, points=1001, rounds=100):
    """Coefficients (1, c_1..c_degree) of p(f) = 1 + f q(f) ~ 2**f on
    |f| <= 1/2 with the least largest relative error: least squares
    reweighted by each point's error (Lawson's iteration), on Chebyshev
    points. p(0) = 1 exactly, so exp2 of an integer is exact."""
    f = np.cos(np.linspace(0, math.pi, points)) / 2
    y = np.exp2(f)
    a = f[:, None] ** np.arange(1, degree + 1) / y[:, None]  # rows / 2**f
    b = 1 - 1 / y  # (2**f - 1) / 2**f: the relative residual's target
    w = np.full(points, 1.0 / points)
    for _ in range(rounds):
        root = np.sqrt(w)
        c = np.linalg.lstsq(a * root[:, None], b * root, rcond=None)[0]
        w *= np.abs(a @ c - b)  # weight moves to where the error peaks
        w /= w.sum()
    return (1.0, *(float(x) for x in c))


# Horner from the top, float32 coefficients
_C = tuple(np.float32(c) for c in fit_exp2(DEGREE))


@intrinsic
def _from_bits(typingctx, bits):
    """The float32 whose bit pattern is the int32 `bits`."""
    sig = types.float32(types.int32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


@intrinsic
def maximum(typingctx, a, b):
    """max(a, b), NaN if either is NaN (llvm.maximum); vectorizes."""
    if not (isinstance(a, types.Float) and a == b):
        return None
    sig = a(a, b)

    def codegen(context, builder, signature, args):
        ty = args[0].type
        name = ("llvm.maximum.f32" if ty == ir.FloatType()
                else "llvm.maximum.f64")
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ty, [ty, ty]), name)
        return builder.call(fn, args)

    return sig, codegen


def exp2(x):
    """2**x (numba-compiled; see the module docstring)."""
    return math.exp2(x)


@overload(exp2)
def _exp2(x):
    if x == types.float32:
        return _exp2_float32
    if isinstance(x, types.Float):
        return lambda x: math.exp2(x)
    return None


def _exp2_float32(x):
    # clamp first: past 128 the result is inf, below -150 it is 0; NaN
    # fails both comparisons (selects, not branches) and comes back last
    xc = np.float32(128) if x > np.float32(128) else x
    xc = np.float32(-150) if xc < np.float32(-150) else xc
    n = np.floor(xc + np.float32(0.5))  # float32 (math.floor: int64)
    f = xc - n  # in [-1/2, 1/2]
    p = ((((_C[5] * f + _C[4]) * f + _C[3]) * f + _C[2]) * f + _C[1]) * f \
        + _C[0]
    # 2**n as two normal powers of two, so subnormal results round right
    k = np.int32(n)
    k1 = k >> 1
    k2 = k - k1
    y = (p * _from_bits((k1 + 127) << 23)) * _from_bits((k2 + 127) << 23)
    return y if x == x else x


exp2_float32 = njit(_exp2_float32)
