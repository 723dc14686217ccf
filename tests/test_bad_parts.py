"""device.find_bad_parts on numba's simulator: every flag of every chunk
written (the outputs start as poison, not zeros), set exactly where a
chunk of V's rows holds a NaN or an inf, float32 values and 16-bit bits
alike; and bad_bits, the tensor-core epilogues' reading of the flags."""

import math

import numpy as np
import pytest
from numba import cuda

from flashlab.gpu import device


@pytest.mark.parametrize("half", [False, True])
@pytest.mark.parametrize("nk", [1, 70, 333])
def test_flags_match_numpy(rng, half, nk):
    bh, d_v = 2, 16
    v = rng.standard_normal((bh, nk, d_v)).astype(np.float16 if half
                                                  else np.float32)
    for _ in range(3):  # a NaN, an inf, a -inf at random places
        b, j, x = (int(rng.integers(0, n)) for n in (bh, nk, d_v))
        v[b, j, x] = rng.choice([np.nan, np.inf, -np.inf])
    shape = device.bad_parts_shape(bh, nk, d_v)
    parts = np.full(shape, 7, np.uint8)  # poison: every entry rewritten
    kernel = device.find_bad_parts16 if half else device.find_bad_parts32
    arg = v.view(np.int16) if half else v
    kernel[shape[1::-1], device.THREADS](arg, parts, 0x7C00 if half else 0)
    rows = math.ceil(nk / shape[1])
    want = np.zeros(shape, np.uint8)
    for c in range(shape[1]):
        chunk = v[:, c * rows:(c + 1) * rows]
        want[:, c] = ~np.isfinite(chunk).all(axis=1)
    assert np.array_equal(parts, want)
    # the column rule of flashlab.nonfinite: any chunk flags the column
    assert np.array_equal(parts.any(axis=1),
                          ~np.isfinite(v).all(axis=1))


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
