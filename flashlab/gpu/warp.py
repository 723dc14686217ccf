"""Device functions of the tensor-core kernels (forward v5 and v6).

In these kernels a warp, not a thread, owns a piece of the work: 16 query
rows of the block's Q_i, with S_ij and O_i held in mma fragments spread
over its 32 lanes (`flashlab.fragments` models them). Lane 4 g + t holds
parts of rows g and g + 8 ("half" h = 0 and 1 of its fragments), so the
four lanes of a group share a row and meet by shuffles. See chapter 10.
"""

import math

import numpy as np
from numba import cuda, int32, int64

from flashlab import fragments, merge, nonfinite
from flashlab.gpu.device import (
    F0,
    NEG_INF,
    allowed,
    dropout_weight,
    inline,
    tile_skipped,
)
from flashlab.gpu.intrinsics import (
    cp_async16,
    global_address,
    shared_address,
)

WARPS = 4  # warps per block, 16 query rows each
THREADS = 32 * WARPS
BR = 16 * WARPS  # query rows per block
LOG2E = np.float32(math.log2(math.e))
LN2 = np.float32(math.log(2.0))
FULL_MASK = 0xFFFFFFFF  # every lane takes part in a shuffle

swizzle = cuda.jit(device=True)(fragments.swizzle)
ldmatrix_a = cuda.jit(device=True)(fragments.ldmatrix_a)
ldmatrix_b = cuda.jit(device=True)(fragments.ldmatrix_b)
ldmatrix_b_trans = cuda.jit(device=True)(fragments.ldmatrix_b_trans)
a_from_c = cuda.jit(device=True)(fragments.a_from_c)
row_step2 = cuda.jit(device=True)(merge.row_step2)
_mark_bad_bits = cuda.jit(device=True)(nonfinite.mark_bad_bits)
_finish_row = cuda.jit(device=True)(nonfinite.finish_row)


@inline
def tile_range(i0, i1, nk, bc, rules, kv):
    """(first, last): the K/V tiles that rows i0..i1-1 visit.

    Causal, window and padding bounds leave a contiguous run of tiles;
    tiles outside it are never loaded. last < first when none is left.
    """
    n_tiles = (nk + bc - 1) // bc
    first = 0
    while first < n_tiles and tile_skipped(
            i0, i1, first * bc, min(first * bc + bc, nk), rules, kv):
        first += 1
    last = n_tiles - 1
    while last >= first and tile_skipped(
            i0, i1, last * bc, min(last * bc + bc, nk), rules, kv):
        last -= 1
    return first, last


@inline
def load_tile16(dst, src, b, r0, rows, cols, t):
    """HBM -> SRAM without registers: rows r0.. of src[b] into dst.

    src holds 16-bit values (int16 bits), dst is a 1-D shared array of
    rows x cols in 16-byte chunks placed by `swizzle`; rows past the end
    of src are zero-filled. Asynchronous: commit, wait and sync after.
    """
    n = src.shape[1]
    per_row = cols // 8
    for e in range(t, rows * per_row, THREADS):
        r = e // per_row
        c = e - r * per_row
        inside = r0 + r < n
        cp_async16(shared_address(dst, (r * per_row + swizzle(r, c)) * 8),
                   global_address(src, (b, min(r0 + r, n - 1), c * 8)),
                   int32(16 if inside else 0))


@inline
def load_tile32(dst, src, b, r0, rows, cols, stride, t):
    """As load_tile16 for float32 src, into rows of `stride` floats.

    A stride of cols + 4 puts the fragment reads of v6 (lane g, t reads
    row g or 2t, column t or g) in 32 different banks.
    """
    n = src.shape[1]
    per_row = cols // 4
    for e in range(t, rows * per_row, THREADS):
        r = e // per_row
        c = e - r * per_row
        inside = r0 + r < n
        cp_async16(shared_address(dst, r * stride + c * 4),
                   global_address(src, (b, min(r0 + r, n - 1), c * 4)),
                   int32(16 if inside else 0))


@inline
def quad_max(x):
    """Maximum of x over the four lanes of this lane's group."""
    x = max(x, cuda.shfl_xor_sync(FULL_MASK, x, 1))
    return max(x, cuda.shfl_xor_sync(FULL_MASK, x, 2))


@inline
def quad_sum(x):
    """Sum of x over the four lanes of this lane's group."""
    x += cuda.shfl_xor_sync(FULL_MASK, x, 1)
    return x + cuda.shfl_xor_sync(FULL_MASK, x, 2)


@inline
def allowed_bits(b, i, j0, nq, nk, rules, kv_len, mask, tiles):
    """Bit 4 n + e set: pair e of S n-tile n is allowed. i: the lane's
    first row; j0: the tile's first key.

    A loop this large may stay a loop; returning bits instead of writing
    a fragment array keeps the fragments in registers whatever it does.
    """
    t = cuda.threadIdx.x % 4
    bits = int64(0)
    for n in range(tiles):
        for e in range(4):
            if allowed(b, i + 8 * (e >> 1), j0 + 8 * n + 2 * t + (e & 1),
                       nq, nk, rules, kv_len, mask):
                bits |= int64(1) << (4 * n + e)
    return bits


@inline
def dropped_bits(b, i, j0, rules, tiles):
    """Bit 4 n + e set: dropout drops pair e of S n-tile n."""
    t = cuda.threadIdx.x % 4
    bits = int64(0)
    for n in range(tiles):
        for e in range(4):
            if dropout_weight(b, i + 8 * (e >> 1),
                              j0 + 8 * n + 2 * t + (e & 1), rules) == F0:
                bits |= int64(1) << (4 * n + e)
    return bits


@inline
def mask_scores(sf, b, i, j0, nq, nk, rules, kv_len, mask, tiles):
    """Scores of masked pairs -> -inf in `tiles` S fragments (n-tiles of 8).

    i is the lane's first row (g of its warp), j0 the tile's first key.
    """
    bits = allowed_bits(b, i, j0, nq, nk, rules, kv_len, mask, tiles)
    for n in range(tiles):
        for e in range(4):
            if not (bits >> (4 * n + e)) & 1:
                sf[n, e] = NEG_INF


@inline
def online_softmax(sf, m, l, al, tiles, b, i, j0, rules):
    """S fragments (log2 units) -> P in place; m, l, alpha per half.

    Each lane keeps its own share of l (summed over the group at the
    end); m is the group's row maximum, the same in all four lanes. The
    dropout weight multiplies P after l has counted it, as in `tiled`.
    """
    for h in range(2):
        mx = NEG_INF
        for n in range(tiles):
            mx = max(mx, max(sf[n, 2 * h], sf[n, 2 * h + 1]))
        m[h], shift, al[h] = row_step2(m[h], quad_max(mx), rules.lowest)
        part = np.float32(0)
        for n in range(tiles):
            for e in range(2 * h, 2 * h + 2):
                p = math.exp2(sf[n, e] - shift)
                part += p
                sf[n, e] = p
        l[h] = al[h] * l[h] + part
    if rules.use_dropout:
        gone = dropped_bits(b, i, j0, rules, tiles)
        for n in range(tiles):
            for e in range(4):
                sf[n, e] *= (F0 if (gone >> (4 * n + e)) & 1
                             else rules.drop_scale)


@inline
def rescale(of, al, tiles):
    """O fragments times alpha of their rows."""
    for n in range(tiles):
        for e in range(4):
            of[n, e] *= al[e >> 1]


@cuda.jit
def find_bad_columns16(v, bad, exponent):
    """bad[b, x] |= V[b, j, x] (16-bit bits) is NaN or inf."""
    b = cuda.blockIdx.y
    e = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    d_v = v.shape[2]
    if e < v.shape[1] * d_v:
        _mark_bad_bits(v, bad, b, e // d_v, e % d_v, exponent)


@cuda.jit
def finish_rows16(o, lse, bad, empty, nan_bits):
    """flashlab.nonfinite's rule on 16-bit output rows (int16 bits)."""
    b = cuda.blockIdx.y
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i < o.shape[1]:
        _finish_row(o, lse, bad, empty, b, i, nan_bits,
                    np.float32(np.nan), NEG_INF)
