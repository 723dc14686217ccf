"""device.find_bad_parts on numba's simulator: every word of every chunk
written (the outputs start as poison, not zeros), a bit set exactly where
a chunk of V's rows holds a NaN or an inf in that bit's column, float32
values and 16-bit bits alike; and bad_bits, the tensor-core epilogues'
reading of the words."""

import math

import numpy as np
import pytest
from numba import cuda

from flashlab import fp8, fragments
from flashlab.gpu import device


def _e4m3(x):
    """float64 values as e4m3 codes (NaN codes where x is not finite)."""
    codes = fp8.to_e4m3(np.where(np.isfinite(x), x, 0))
    return np.where(np.isfinite(x), codes, fp8.NAN_CODE).astype(np.uint8)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16",
                                   "float8_e4m3fn"])
@pytest.mark.parametrize("nk, d_v, fill", [(1, 16, None), (70, 16, None),
                                           (333, 48, None),
                                           (1100, 128, None),
                                           (1100, 48, 2)])
def test_flags_match_numpy(rng, monkeypatch, dtype, nk, d_v, fill):
    # fill: FILL_BLOCKS as if the heads alone filled the GPU, so a chunk
    # holds many PART_ROWS (1100 rows in one or two chunks, not nine)
    if fill is not None:
        monkeypatch.setattr(device, "FILL_BLOCKS", fill)
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
    if fill is not None:  # fewer chunks than PART_ROWS would give
        assert shape[1] < math.ceil(nk / device.PART_ROWS)
    parts = np.full(shape, 7, np.int32)  # poison: every entry rewritten
    kernel = getattr(device, f"find_bad_parts{device.WIDTHS[dtype]}")
    kernel[shape[1::-1], device.FIND_THREADS](
        v.view(np.int32), parts, device.EXPONENT_BITS[dtype])
    rows = math.ceil(nk / shape[1])
    flags = np.stack([~np.isfinite(x[:, c * rows:(c + 1) * rows]).all(1)
                      for c in range(shape[1])], 1)  # (bh, chunks, d_v)
    assert np.array_equal(column_flags(parts, d_v), flags)
    # the column rule of flashlab.nonfinite: any chunk flags the column
    assert np.array_equal(column_flags(parts, d_v).any(axis=1),
                          ~np.isfinite(x).all(axis=1))


def column_flags(parts, d_v):
    """(..., d_v) bool: each column's bit of its quad word (the layout
    the epilogues read, unpacked the slow way)."""
    bits = parts.view(np.uint32)
    out = np.zeros((*parts.shape[:-1], d_v), bool)
    for x in range(d_v):
        q, bit = device.quad_bit(x)
        out[..., x] = (bits[..., q] >> np.uint32(bit)) & 1
    return out


def test_quad_bits_follow_the_accumulator():
    # the epilogue tests bit 2 n + e of word lane % 4 for accumulator
    # register r = 4 n + 2 h + e (n-tile n, row half h, element e): that
    # must be the bit of the column fragments' model puts register r at
    places = fragments.wgmma_c_places(device.PART_COLUMNS)
    for t in range(128):
        for r in range(device.PART_COLUMNS // 2):
            column = int(places[t, r, 1])
            assert device.quad_bit(column) == (t % 4, 2 * (r // 4) + r % 2)


def test_quad_bits_are_a_thread_s_columns():
    # word q holds the columns lane q of a quad writes, 8 n + 2 q + e, at
    # bit 2 n + e: every column of 128 once, and no two share a bit
    places = {device.quad_bit(x) for x in range(device.PART_COLUMNS)}
    assert len(places) == device.PART_COLUMNS
    assert all(0 <= bit < 32 for _, bit in places)
    assert device.quad_bit(8 * 15 + 2 * 3 + 1) == (3, 31)


def test_chunks_stay_few():
    assert device.bad_parts_shape(3, 1, 64) == (3, 1, device.QUADS)
    assert device.bad_parts_shape(3, 10**6, 64)[1] == device.MAX_PARTS
    # enough blocks to fill the GPU, no more: B16 H12 and B8 H16 at the
    # training shapes, 16 heads at 4K (every chunk of PART_ROWS rows)
    fill = device.FILL_BLOCKS
    assert device.bad_parts_shape(192, 1024, 64)[1] == 3 == -(-fill // 192)
    assert device.bad_parts_shape(128, 2048, 128)[1] == 4
    assert device.bad_parts_shape(16, 4096, 128)[1] == device.MAX_PARTS
    assert device.bad_parts_shape(2 * fill, 4096, 128)[1] == 1
    assert device.bad_parts_shape(16, 300, 64)[1] == 3  # short keys
    assert device.bad_parts_shape(0, 300, 64)[1] == 3  # no heads
    with pytest.raises(ValueError, match="d_v: expected at most 128"):
        device.bad_parts_shape(3, 100, 256)


def test_bad_bits_ors_a_lane_s_word_over_the_chunks():
    # head 1: column 21 (n = 2, q = 2, e = 1: bit 5) in chunk 2, column
    # 125 (q = 2, bit 31) in chunk 0, column 3 (q = 1, bit 1) in chunk 1;
    # lane 2 reads the first two, lane 1 the third, head 0 none
    parts = np.zeros((2, 3, device.QUADS), np.int32)
    bits = parts.view(np.uint32)
    for chunk, x in ((2, 21), (0, 125), (1, 3)):
        q, bit = device.quad_bit(x)
        bits[1, chunk, q] |= np.uint32(1) << np.uint32(bit)
    out = np.zeros(3, np.uint32)

    @cuda.jit
    def read(parts, out):
        out[0] = device.bad_bits(parts, 1, 2)
        out[1] = device.bad_bits(parts, 1, 1)
        out[2] = device.bad_bits(parts, 0, 2)

    read[1, 1](parts, out)
    assert list(out) == [(1 << 5) | (1 << 31), 1 << 1, 0]
