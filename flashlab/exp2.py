"""2**x without the special-function unit: a polynomial on the FMA pipe.

An SM's special-function unit gives 16 exponentials a clock; its FMA
pipe 128 fused multiply-adds. Where a tile's products take no longer
than its exponentials (v8 at d = 64, e4m3 at d = 128), some of the
exponentials can run as a few FMAs each instead (FlashAttention-4 does
this on Blackwell). Write t = j + f with j = floor(t), f in [0, 1):

    2**t = 2**j 2**f,  2**f ~ 1 + f (c1 + f (c2 + f c3))

with c1..c3 the minimax fit of 2**f's relative error on [0, 1) and the
constant term pinned to 1, so that a row's maximum (t = 0) gives exactly
1. 2**j is built from its bits, (j + 127) << 23. Each step is one PTX
instruction of `flashlab.gpu.intrinsics.ex2_poly`; `model` runs the same
steps in numpy, where CI checks them.

Edge cases, as ex2.approx.ftz gives them: t is first raised to -127, so
-inf (a masked score) and anything below gives 2**-127's bits, 0; NaN
stays NaN (max.NaN, then NaN times 2**j); results below 2**-126 flush
to 0.
"""

import numpy as np

DEGREE = 3
# c1, c2, c3 as float32 bits: fit(3) rounded to float32 (test_exp2
# checks them against a fresh fit and the error bound below)
COEFF_BITS = (0x3F31F32C, 0x3E691BC5, 0x3D9DD553)
COEFFS = np.array(COEFF_BITS, np.uint32).view(np.float32)
# the largest relative error of the float32 steps on [-127, 0]
MAX_REL_ERROR = 1.0e-4
LOWEST = np.float32(-127)  # t is raised to this: 2**-127 is 0 here
# 1.5 2**23 + t rounded toward -inf is 1.5 2**23 + floor(t): its ulp is
# 1 there, and the 1.5 keeps the sum's exponent fixed for t in
# [-2**22, 2**22)
MAGIC = np.float32(1.5 * 2**23)


# an H100 / H200 SM's rates a clock: exponentials on the special-function
# unit, fused multiply-adds on the FMA pipe, and the tensor cores' dense
# multiply-adds by input kind (989 TFLOP/s of bf16 over 132 SMs at
# 1.83 GHz is 2048; e4m3 twice that)
SFU_PER_CLOCK = 16
FMA_PER_CLOCK = 128
TENSOR_PER_CLOCK = {"bf16": 2048, "f16": 2048, "e4m3": 4096}


def tile_cycles(d, kind="bf16", rows=64, keys=128):
    """SM clocks one warpgroup's tile (rows x keys, head dim d) needs of
    each unit: {"products": S = Q K^T and O += P V on the tensor cores,
    "exponentials": its rows x keys ex2 on the special-function unit}."""
    return {"products": 2 * rows * keys * d / TENSOR_PER_CLOCK[kind],
            "exponentials": rows * keys / SFU_PER_CLOCK}


def fit(degree=DEGREE, nodes=4000, rounds=2000):
    """(c1..c_degree, largest relative error) of the polynomial 1 + c1 f
    + ... + c_degree f**degree closest to 2**f on [0, 1) in relative
    error (minimax), float64.

    Lawson's algorithm: least squares on Chebyshev nodes, each round
    reweighting the nodes by their error, which converges to the
    minimax fit of a linear family."""
    f = 0.5 - 0.5 * np.cos(np.pi * (np.arange(nodes) + 0.5) / nodes)
    y = np.exp2(f)
    # relative error (1 + A c) / y - 1 = A c / y - (y - 1) / y
    a = np.stack([f**k for k in range(1, degree + 1)], 1) / y[:, None]
    b = (y - 1) / y
    w = np.full(nodes, 1.0 / nodes)
    for _ in range(rounds):
        root = np.sqrt(w)
        c = np.linalg.lstsq(a * root[:, None], b * root, rcond=None)[0]
        r = np.abs(a @ c - b)
        w = w * r / np.sum(w * r)
    return c, float(r.max())


def _fma(a, b, c):
    """a b + c rounded once to float32 (a b is exact in float64)."""
    return (a.astype(np.float64) * b + c).astype(np.float32)


def model(x):
    """2**x of float32 x < 128, step by step as ex2_poly runs it."""
    x = np.asarray(x, np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        t = np.where(np.isnan(x), np.float32(np.nan),
                     np.maximum(x, LOWEST))  # max.NaN
        j = np.floor(t)  # add.rm of MAGIC, less MAGIC: exact
        f = t - j  # sub.rn: rounds to 1.0 for t just below 0
        p = _fma(np.full_like(f, COEFFS[2]), f, COEFFS[1])
        p = _fma(p, f, COEFFS[0])
        p = _fma(p, f, np.float32(1))
        # (j + 127) << 23 as bits: 2**j, and 0 for j = -127
        e = np.where(np.isnan(j), 0, j + 127).astype(np.int64)
        scale = (np.clip(e, 0, 255).astype(np.uint32) << np.uint32(23)
                 ).view(np.float32)
        return (p * scale).astype(np.float32)
