"""device.find_bad_parts on numba's simulator: every flag of every chunk
written (the outputs start as poison, not zeros), set exactly where a
chunk of V's rows holds a NaN or an inf, float32 values and 16-bit bits
alike; and bad_bits, the tensor-core epilogues' reading of the flags."""

import math

import numpy as np
import pytest
from numba import cuda

from flashlab import fp8
from flashlab.gpu import device


def _e4m3(x):
    """float64 values as e4m3 codes (NaN codes where x is not finite)."""
    codes = fp8.to_e4m3(np.where(np.isfinite(x), x, 0))
    return np.where(np.isfinite(x), codes, fp8.NAN_CODE).astype(np.uint8)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16",
                                   "float8_e4m3fn"])
@pytest.mark.parametrize("nk, d_v", [(1, 16), (70, 16), (333, 48),
                                     (1100, 128)])
def test_flags_match_numpy(rng, dtype, nk, d_v):
    # V as int32 words of 1, 2 or 4 values; the flags against numpy's
    # isfinite of each chunk's rows, with a few NaN and inf (NaN codes in
    # e4m3, and 0xFF, the negative one) at random places, some of them in
    # the unrolled part of a thread's rows and some in its tail
    bh = 1 if nk > 1000 else 2  # the simulator runs every thread
    x = rng.standard_normal((bh, nk, d_v))
    for _ in range(4):
        b, j, c = (int(rng.integers(0, n)) for n in (bh, nk, d_v))
        x[b, j, c] = rng.choice([np.nan, np.inf, -np.inf])
    if dtype == "float8_e4m3fn":
        v = _e4m3(x)
        v[x == -np.inf] = 0xFF  # -NaN: both NaN codes are found
    elif dtype == "bfloat16":  # float32's upper half: the same NaN, inf
        v = (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    else:
        v = x.astype(dtype)
    shape = device.bad_parts_shape(bh, nk, d_v)
    parts = np.full(shape, 7, np.uint8)  # poison: every entry rewritten
    kernel = getattr(device, f"find_bad_parts{device.WIDTHS[dtype]}")
    kernel[shape[1::-1], device.FIND_THREADS](
        v.view(np.int32), parts, device.EXPONENT_BITS[dtype])
    rows = math.ceil(nk / shape[1])
    want = np.zeros(shape, np.uint8)
    for c in range(shape[1]):
        chunk = x[:, c * rows:(c + 1) * rows]
        want[:, c] = ~np.isfinite(chunk).all(axis=1)
    assert np.array_equal(parts, want)
    # the column rule of flashlab.nonfinite: any chunk flags the column
    assert np.array_equal(parts.any(axis=1),
                          ~np.isfinite(x).all(axis=1))


def test_chunks_stay_few():
    assert device.bad_parts_shape(3, 1, 64) == (3, 1, 64)
    assert device.bad_parts_shape(3, 10**6, 64)[1] == device.MAX_PARTS


def test_bad_bits_reads_a_threads_columns():
    parts = np.zeros((2, 3, 32), np.uint8)
    parts[1, 2, 8 * 2 + 4 + 1] = 1  # column 21: n = 2, x0 = 4, e = 1
    out = np.zeros(1, np.uint32)

    @cuda.jit
    def read(parts, out):
        out[0] = device.bad_bits(parts, 1, 4, 4)

    read[1, 1](parts, out)
    assert out[0] == 1 << (2 * 2 + 1)
