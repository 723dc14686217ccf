"""Device functions of the tensor-core kernels (forward v5 and v6).

In these kernels a warp, not a thread, owns a piece of the work: 16 query
rows of the block's Q_i, with S_ij and O_i held in mma fragments spread
over its 32 lanes (`flashlab.fragments` models them). Lane 4 g + t holds
parts of rows g and g + 8 ("half" h = 0 and 1 of its fragments), so the
four lanes of a group share a row and meet by shuffles. See chapter 10.
"""

import math

import numpy as np
from numba import cuda, float32, int32, int64, uint32, uint64

from flashlab import fragments, masks, order
from flashlab.gpu.device import (
    F0,
    NAN,
    NEG_INF,
    allowed,
    bad_bits,
    dropout_weight,
    inline,
    row_step,
    tile_full,
)
from flashlab.gpu.intrinsics import (
    cp_async16,
    ex2,
    ex2_poly,
    global_address,
    ld_global_nc_v4,
    ld_shared_v4,
    opaque,
    st_global_v4,
    st_shared32,
    unpack_bf16x2,
    unpack_f16x2,
)

WARPS = 4  # warps per block, 16 query rows each
THREADS = 32 * WARPS
BR = 16 * WARPS  # query rows per block
LOG2E = np.float32(math.log2(math.e))
LN2 = np.float32(math.log(2.0))
# Up to this |shift| (natural units), exp(s tau - shift) is one FMA and
# one exp2: s (tau log2 e) - shift log2 e, with tau log2 e, the shift
# and shift log2 e each rounded to float32. Together they move the
# exponent by at most 2**-12 (|shift| log2 e <= 1477, whose half-ulp is
# 2**-14), so P errs by at most 2**-12 ln 2 (0.017%), below a 16-bit
# output's rounding; the error grows with the shift (at |shift| = 1e19
# it is 2**38 and P overflows). Beyond it the row's scores are shifted
# first (exact where they matter: near the shift) and its shift is then
# 0, which also keeps scores near the float32 limit finite
WIDE = np.float32(2.0**10)
FULL_MASK = 0xFFFFFFFF  # every lane takes part in a shuffle

swizzle = cuda.jit(device=True)(fragments.swizzle)
swizzled_offset = cuda.jit(device=True)(fragments.swizzled_offset)
ldmatrix_a = cuda.jit(device=True)(fragments.ldmatrix_a)
ldmatrix_b = cuda.jit(device=True)(fragments.ldmatrix_b)
ldmatrix_b_trans = cuda.jit(device=True)(fragments.ldmatrix_b_trans)
swizzle_base = cuda.jit(device=True)(fragments.swizzle_base)
swizzle_step = cuda.jit(device=True)(fragments.swizzle_step)
a_from_c = cuda.jit(device=True)(fragments.a_from_c)
staged_chunk = cuda.jit(device=True)(fragments.staged_chunk)
# a row's allowed columns as one interval, and a lane's run of them as
# C-fragment bits (allowed_bits_of)
allowed_range = inline(masks.allowed_range)
columns_below = inline(fragments.columns_below)
spread_pairs = inline(fragments.spread_pairs)
# the run of tiles that need no mask, found once a block (v8)
full_run = inline(masks.full_run_of(tile_full))
# the run of tiles a block visits (in closed form, once a block)
last_tile = inline(masks.last_tile)
tile_range = inline(masks.tile_range_of(last_tile))
# a block's head and rank in the order blocks start in
block_place = inline(order.place)
# a block's half of its key tiles (the host's split tail)
key_half_tiles = inline(order.key_half_tiles)


@inline
def warp_uniform(x):
    """x as lane 0 of the warp holds it. A warpgroup's index (the thread
    index over 128) is the same in every lane, but ptxas cannot know
    that: through a shuffle from lane 0 it does, and the bounds worked
    out from it, and a loop's count and stages that follow, stay in
    uniform registers (from the thread index itself they took vector
    registers, and forward v8 spilled)."""
    return cuda.shfl_sync(FULL_MASK, x, 0)


@inline
def lane_bases(bases, at, row, chunk, per_row):
    """bases[r] = at + swizzle_base(row, chunk, r, per_row), r = 0..3: a
    lane's ldmatrix bases in the SRAM tile at `at`.

    Kernels make them afresh in each tile, through `opaque`: left alone
    the compiler hoists every base + step sum out of the tile loop and
    holds each in registers of its own (64 sums at d = 128), which made
    the d = 128 backward spill to local memory.
    """
    row, chunk = opaque(uint32(row)), opaque(uint32(chunk))
    for r in range(4):
        bases[r] = uint32(at + swizzle_base(row, chunk, r, per_row))


@inline
def at_step(bases, rows, chunks, per_row):
    """The ldmatrix address `rows` rows and `chunks` chunks on from the
    bases' place (fragments.swizzle_step); both constants in a kernel."""
    return bases[chunks % 8 // 2] + uint32(swizzle_step(rows, chunks,
                                                        per_row))


@inline
def load_tile16(dst, src, b, r0, rows, cols, t):
    """HBM -> SRAM without registers: rows r0.. of src[b] into dst.

    src holds 16-bit values (int16 bits); dst is the shared_address of a
    tile of rows x cols in 16-byte chunks placed by `swizzle`. Rows past
    the end of src are zero-filled. Asynchronous: commit, wait and sync
    after. With cols // 8 chunks per row dividing THREADS, a thread copies
    the same chunk of every (THREADS / chunks per row)-th row: a multiple
    of 8 rows apart, so its swizzle is the same in every pass and its SRAM
    address moves by a constant.
    """
    n = src.shape[1]
    per_row = cols // 8
    step = THREADS // per_row  # rows one pass of the block copies
    r, c = t // per_row, t % per_row  # this thread's first row, chunk
    to = dst + uint32(swizzled_offset(r, c, per_row))
    at = global_address(src, (b, 0, 0)) + uint64(c * 16)
    for p in range(rows // step):
        i = r0 + r + p * step
        cp_async16(to + uint32(p * THREADS * 16),
                   at + uint64(min(i, n - 1)) * uint64(cols * 2),
                   int32(16 if i < n else 0))


@inline
def load_tile32(dst, src, b, r0, rows, cols, stride, t):
    """As load_tile16 for float32 src, into rows of `stride` floats.

    A stride of cols + 4 puts the fragment reads of v6 (lane g, t reads
    row g or 2t, column t or g) in 32 different banks.
    """
    n = src.shape[1]
    per_row = cols // 4
    at = global_address(src, (b, 0, 0))
    for e in range(t, rows * per_row, THREADS):
        r = e // per_row
        c = e - r * per_row
        inside = r0 + r < n
        cp_async16(dst + uint32((r * stride + c * 4) * 4),
                   at + uint64((min(r0 + r, n - 1) * cols + c * 4) * 4),
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
def allowed_bits_of(b, r, c0, nq, nk, rules, kv_len, mask, tiles,
                    keys_in_rows):
    """Bit 4 n + e set: element e of C n-tile n is an allowed pair. The
    lane's rows are r and r + 8, its columns c0 + 8 n + 2 t and one more;
    rows are queries, or keys where keys_in_rows (the backward's
    transposed tiles).

    Without a mask array each row's allowed columns are one interval
    (`allowed_range`), so a half's bits are one run, made by a few integer
    steps instead of a test per element: that matters in the diagonal
    tiles of a causal mask. With one, a loop this large may stay a loop;
    returning bits instead of writing a fragment array keeps the
    fragments in registers whatever it does.
    """
    t = cuda.threadIdx.x % 4
    bits = int64(0)
    if not rules.use_mask:
        kv = kv_len[b]
        base = c0 + 2 * t  # the lane's columns: base + 8 n + e
        for h in range(2):
            lo, hi = allowed_range(r + 8 * h, keys_in_rows, nq, nk, rules,
                                   kv)
            # the columns in order are k = 2 n + e: those in lo..hi are a
            # run k0 <= k < k1, spread from pairs to their places 4 n + e
            # (fragments.fragment_run)
            k0 = columns_below(lo, base, tiles)
            k1 = columns_below(hi + 1, base, tiles)
            if k1 > k0:
                run = ((int64(1) << k1) - 1) ^ ((int64(1) << k0) - 1)
                bits |= spread_pairs(run) << (2 * h)
        return bits
    for n in range(tiles):
        for e in range(4):
            row, col = r + 8 * (e >> 1), c0 + 8 * n + 2 * t + (e & 1)
            i, j = (col, row) if keys_in_rows else (row, col)
            if allowed(b, i, j, nq, nk, rules, kv_len, mask):
                bits |= int64(1) << (4 * n + e)
    return bits


@inline
def allowed_bits(b, i, j0, nq, nk, rules, kv_len, mask, tiles):
    """allowed_bits_of a tile whose rows are queries: i the lane's first
    row, j0 the tile's first key."""
    return allowed_bits_of(b, i, j0, nq, nk, rules, kv_len, mask, tiles,
                           False)


@inline
def dropped_bits_of(b, r, c0, rules, tiles, keys_in_rows):
    """Bit 4 n + e set: dropout drops element e of C n-tile n (places as
    allowed_bits_of)."""
    t = cuda.threadIdx.x % 4
    bits = int64(0)
    for n in range(tiles):
        for e in range(4):
            row, col = r + 8 * (e >> 1), c0 + 8 * n + 2 * t + (e & 1)
            i, j = (col, row) if keys_in_rows else (row, col)
            if dropout_weight(b, i, j, rules) == F0:
                bits |= int64(1) << (4 * n + e)
    return bits


@inline
def dropped_bits(b, i, j0, rules, tiles):
    """dropped_bits_of a tile whose rows are queries."""
    return dropped_bits_of(b, i, j0, rules, tiles, False)


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
    return bits


@inline
def note_allowed(seen, bits, tiles):
    """seen[h] = 1 once row h (g or g + 8) has met an allowed key: bits
    from mask_scores, or -1 for a tile whose pairs are all allowed."""
    if bits == -1:  # a full tile
        seen[0] = seen[1] = 1
        return
    for h in range(2):
        for n in range(tiles):
            if (bits >> (4 * n + 2 * h)) & 3:
                seen[h] = 1


@inline
def row_end(m_h, l_h, seen_h):
    """(1 / l, lse, state) of a row at the end, the rule of
    flashlab.nonfinite: state 0 normal, 1 no allowed key (0 and lse
    -inf), 2 allowed keys whose scores were all -inf (NaN)."""
    total = quad_sum(l_h)
    if quad_max(seen_h) == 0:
        return F0, NEG_INF, 1
    if total == F0:
        return NAN, NAN, 2
    return np.float32(1) / total, m_h + math.log2(total) * LN2, 0


def make_store_rows16(pack, n_tiles):
    """store_rows16 for one 16-bit `pack` and n_tiles 8-column groups of
    O (the epilogue of every 16-bit tensor-core forward)."""

    @inline
    def store_rows16(o, lse, of, m, l, seen, bad, bk, b, row, lane, nq):
        """A warp's rows g and g + 8 out: O_i / l rounded to 16-bit pairs
        and lse = m + ln 2 log2 l, with the rule of flashlab.nonfinite:
        no key 0 and -inf, all scores -inf NaN, and NaN in the columns
        where V[bk] holds a NaN or inf (bad, device.find_bad_parts)."""
        bits = bad_bits(bad, bk, lane % 4)
        for h in range(2):
            inv, lse_i, state = row_end(m[h], l[h], seen[h])
            i = row + 8 * h
            if i < nq:
                for n in range(n_tiles):
                    x = 8 * n + 2 * (lane % 4)
                    v0, v1 = of[n, 2 * h] * inv, of[n, 2 * h + 1] * inv
                    if state == 1:  # no key: 0, even where O_i is NaN
                        v0 = v1 = F0
                    else:
                        v0 = NAN if (bits >> uint32(2 * n)) & 1 else v0
                        v1 = NAN if (bits >> uint32(2 * n + 1)) & 1 else v1
                    o[b, i, x // 2] = pack(v0, v1)
                if lane % 4 == 0:
                    lse[b, i] = lse_i

    return store_rows16


def make_store_rows_staged(pack, n_tiles):
    """store_rows16's rows through shared memory, for one 16-bit `pack`
    and n_tiles (8 or 16) 8-column groups of O: forward v8's epilogue."""

    @inline
    def store_rows_staged(o, lse, of, m, l, seen, bad, bk, b, row, lane,
                          nq, at):
        """store_rows16, each 16-bit pair first put in the warp's 16
        staged rows at .shared address `at` (16 x 16 n_tiles bytes, its
        16-byte chunks swizzled by row: each store of the warp hits 32
        banks), then read back 16 bytes a lane and written whole: the
        warp's four-byte stores wrote 16 bytes of each of 8 rows, and
        their count and addresses held the end of every block."""
        g, t = lane // 4, lane % 4
        bits = bad_bits(bad, bk, t)
        for h in range(2):
            inv, lse_i, state = row_end(m[h], l[h], seen[h])
            if row + 8 * h < nq:  # rows past Nq: neither staged nor read
                for n in range(n_tiles):
                    v0, v1 = of[n, 2 * h] * inv, of[n, 2 * h + 1] * inv
                    if state == 1:  # no key: 0, even where O_i is NaN
                        v0 = v1 = F0
                    else:
                        v0 = NAN if (bits >> uint32(2 * n)) & 1 else v0
                        v1 = NAN if (bits >> uint32(2 * n + 1)) & 1 \
                            else v1
                    st_shared32(at + uint32(swizzled_offset(
                        g + 8 * h, n, n_tiles) + 4 * t), pack(v0, v1))
                if t == 0:
                    lse[b, row + 8 * h] = lse_i
        cuda.syncwarp()  # the warp's rows staged before its lanes read
        # the lane's chunk c of rows r0, r0 + 32 / n_tiles, ...: one
        # address, moved by whole rows (2 d_v bytes, as o is laid out)
        r0, c = staged_chunk(0, lane, n_tiles)
        top = row - g + r0  # the lane's first row
        out = global_address(o, (b, top, 4 * c))
        for k in range(n_tiles // 2):
            r = staged_chunk(k, lane, n_tiles)[0]
            if top + (r - r0) < nq:
                w0, w1, w2, w3 = ld_shared_v4(
                    at + uint32(swizzled_offset(r, c, n_tiles)))
                st_global_v4(out + uint64(16 * n_tiles * (r - r0)),
                             w0, w1, w2, w3)

    return store_rows_staged


CHAINS = 8  # independent partial maxima and sums of a row's terms


@inline
def online_softmax(sf, m, l, al, tiles, rules, poly):
    """S fragments (S, or tau S where tau <= 0) -> P in place; m, l,
    alpha per half.

    Each lane keeps its own share of l (summed over the group at the
    end); m is the group's row maximum, the same in all four lanes. Each
    term is one FMA and one exp2: s (tau log2 e) - shift log2 e, tau
    folded into the FMA's constant (`WIDE` says how exact that is and
    what happens beyond it). The maximum and the sum run as CHAINS
    independent chains, merged at the end: one long chain would make
    every step wait for the one before. Dropout is `drop`'s, after it.
    Where poly > 0, every poly-th of a lane's terms in a row takes its
    exponential on the FMA pipe (ex2_poly), the others on the
    special-function unit: poly is a constant, so each compiles to one.
    """
    # tau > 0 keeps the order of scores, so the maximum of raw scores
    # gives the scaled one; otherwise tile_softmax has scaled them
    tau = rules.scale if rules.scale > F0 else np.float32(1)
    per = tau * LOG2E
    part = cuda.local.array(CHAINS, float32)
    for h in range(2):
        for c in range(CHAINS):
            part[c] = NEG_INF
        for n in range(tiles):
            for e in range(2):
                c = (2 * n + e) % CHAINS
                part[c] = max(part[c], sf[n, 2 * h + e])
        width = CHAINS // 2
        while width > 0:
            for c in range(width):
                part[c] = max(part[c], part[c + width])
            width //= 2
        m[h], shift, al[h] = row_step(m[h], quad_max(part[0]) * tau,
                                      rules.lowest)
        shift2, per_h = shift * LOG2E, per
        if abs(shift) > WIDE:  # scores near the float32 limit
            shift2, per_h = F0, LOG2E
            for n in range(tiles):
                for e in range(2 * h, 2 * h + 2):
                    sf[n, e] = sf[n, e] * tau - shift  # shifted first
        for c in range(CHAINS):
            part[c] = F0
        for n in range(tiles):
            for e in range(2):
                x = sf[n, 2 * h + e] * per_h - shift2
                k = 2 * n + e  # the term's place in the lane's row
                p = (ex2_poly(x) if poly > 0 and k % poly == poly - 1
                     else ex2(x))
                c = (2 * n + e) % CHAINS
                part[c] += p
                sf[n, 2 * h + e] = p
        width = CHAINS // 2
        while width > 0:
            for c in range(width):
                part[c] += part[c + width]
            width //= 2
        l[h] = al[h] * l[h] + part[0]


@inline
def drop(sf, b, i, j0, rules, tiles):
    """The dropout weights on P (0 or 1 / (1 - p)), after l has counted
    P undropped, as in `tiled`."""
    if rules.use_dropout:
        gone = dropped_bits(b, i, j0, rules, tiles)
        for n in range(tiles):
            for e in range(4):
                sf[n, e] *= (F0 if (gone >> (4 * n + e)) & 1
                             else rules.drop_scale)


@inline
def rescale(of, al, tiles):
    """O fragments times alpha of their rows: skipped where no row of the
    warp has a new maximum (alpha 1 in every lane), as in most tiles of a
    long row once its largest scores have been seen."""
    if cuda.all_sync(FULL_MASK, al[0] == np.float32(1)
                     and al[1] == np.float32(1)):
        return
    for n in range(tiles):
        for e in range(4):
            of[n, e] *= al[e >> 1]


@inline
def tile_softmax(sf, m, l, al, seen, tiles, bc, b, row, i0, i1, j0, nq, nk,
                 rules, kv_len, mask, kv, poly):
    """One K/V tile's S fragments -> P, for every tensor-core forward.

    Pairs are masked (score -inf) only in tiles that are not wholly
    allowed, `seen` notes the rows that met an allowed key, and the
    online softmax scales the scores by tau, updates m, l and alpha (al)
    and leaves P in sf. kv is kv_len[b], read once by the caller: a load
    here would sit between each S and its softmax. poly: see
    online_softmax (0 in all but v8).
    """
    scale_first(sf, tiles, rules)
    full = not rules.use_mask and j0 + bc <= nk and tile_full(
        i0, i1, j0, j0 + bc, rules, kv)
    scaled_softmax(sf, m, l, al, seen, tiles, b, row, j0, nq, nk, rules,
                   kv_len, mask, full, poly)


@inline
def known_softmax(sf, m, l, al, seen, tiles, b, row, j0, nq, nk, rules,
                  kv_len, mask, full, poly):
    """tile_softmax of a tile the caller knows to be full (every pair
    allowed, no mask array) or not: v8 finds its run of full tiles once
    a block (`full_run`), not once a tile."""
    scale_first(sf, tiles, rules)
    scaled_softmax(sf, m, l, al, seen, tiles, b, row, j0, nq, nk, rules,
                   kv_len, mask, full, poly)


@inline
def scaled_softmax(sf, m, l, al, seen, tiles, b, row, j0, nq, nk, rules,
                   kv_len, mask, full, poly):
    """known_softmax after scale_first: the mask where the tile is not
    full, then the online softmax and dropout."""
    bits = int64(-1)  # every pair of a full tile is allowed
    if not full:
        bits = mask_scores(sf, b, row, j0, nq, nk, rules, kv_len, mask,
                           tiles)
    note_allowed(seen, bits, tiles)
    online_softmax(sf, m, l, al, tiles, rules, poly)
    drop(sf, b, row, j0, rules, tiles)


@inline
def scale_first(sf, tiles, rules):
    """S times tau where tau <= 0 (it reorders the scores, so the online
    softmax cannot fold it into its exponents)."""
    if not rules.scale > F0:
        for n in range(tiles):
            for x in range(4):
                sf[n, x] *= rules.scale


@inline
def plain_softmax(sf, m, l, al, seen, tiles, rules, poly):
    """tile_softmax of a full tile (`full_run`) without dropout: no mask,
    so none of its registers (v8 runs it while P V holds its operands)."""
    scale_first(sf, tiles, rules)
    note_allowed(seen, int64(-1), tiles)
    online_softmax(sf, m, l, al, tiles, rules, poly)


DOT_UNROLL = fragments.ROW_DOT_UNROLL  # rows a lane loads before summing
# row_dot16's blocks an SM holds at once, at DOT_REGISTERS a thread: its
# 61 registers uncapped; capped at 64, 8 blocks fit without a spill
DOT_BLOCKS_PER_SM = 8
DOT_REGISTERS = 65536 // (DOT_BLOCKS_PER_SM * THREADS)
# prepare16's (backward_v5), which holds each row's lse and the arrays of
# its other work too: at 64 registers ptxas spills 16 bytes, at 72 none
PREPARE_BLOCKS_PER_SM = 7
PREPARE_REGISTERS = 65536 // (PREPARE_BLOCKS_PER_SM * THREADS) // 8 * 8


def dot_grid(rows, d_v, multiprocessors, blocks_per_sm=DOT_BLOCKS_PER_SM):
    """row_dot16's grid for `rows` rows of d_v values (one dimension):
    enough blocks of THREADS for every row, at most as many as the GPU's
    `multiprocessors` hold at once (`blocks_per_sm` each: prepare16's is
    PREPARE_BLOCKS_PER_SM), which then take turns over the rows: a second
    wave of blocks would leave most of the GPU idle while its last blocks
    run."""
    rows_a_block = THREADS // fragments.row_dot_lanes(d_v) * DOT_UNROLL
    most = blocks_per_sm * multiprocessors
    return (max(1, min(most, math.ceil(rows / rows_a_block))),)


# row_dot16's own: a lane's row and piece once, then a base a turn
_dot_lane = inline(fragments.row_dot_lane)
_dot_base = inline(fragments.row_dot_base)


def dot_rows(unpack, fetch=None, keep=None, exact=None):
    """rows(do, o, delta, extra): delta[r] = rowsum(dO_r o O_r) in float32
    from 16-bit pairs (rows, d_v / 2), for each row; `unpack` is the
    kind's pair-widening intrinsic. The lanes of a row
    (fragments.row_dot_lanes) each take 16 bytes with ld.global.nc.v4, so
    a warp's load is 512 contiguous bytes (four-byte loads ran at half
    the copy speed); DOT_UNROLL rows' loads are in flight before the
    first sum, and a row's lanes meet by shuffles. The warps take turns
    over the rows until none is left (fragments.row_dot_place).

    Work of a row's own beside its sum, by the lane that stores it:
    fetch(r, extra), a float32 loaded with the row's pieces; keep(r,
    value, extra) once the sum is stored, true where exact(r, extra) must
    follow, which runs after the turn's sums. (Done in the loop of sums,
    a load waited there, and larger work kept the loop from unrolling:
    the loaded pieces went to local memory.)"""
    fetch = fetch or _fetch_none
    keep = keep or _keep_none
    exact = exact or _exact_none

    @inline
    def pair_dot(a, c):
        a0, a1 = unpack(a)
        c0, c1 = unpack(c)
        return a0 * c0 + a1 * c1

    @inline
    def rows_of(do, o, delta, extra):
        rows, words = do.shape
        quads = words // 4  # a row's 16-byte pieces
        lanes = 1
        while lanes < quads:
            lanes *= 2
        lane = cuda.threadIdx.x % 32
        warp = (cuda.blockIdx.x * cuda.blockDim.x
                + cuda.threadIdx.x) // 32
        warps = cuda.gridDim.x * cuda.blockDim.x // 32
        a = cuda.local.array((DOT_UNROLL, 4), int32)  # dO's words
        c = cuda.local.array((DOT_UNROLL, 4), int32)  # O's words
        got = cuda.local.array(DOT_UNROLL, float32)  # fetch's values
        # fragments.row_dot_place in parts: the lane's row of a load and
        # piece once (divisions by `lanes`, a power of two the compiler
        # cannot see, had been in every load's place)
        own, x = _dot_lane(lane, lanes)
        per_load = 32 // lanes
        turn = 0
        base = _dot_base(warp, turn, lanes, warps)
        # the same test for every lane of the warp: its first row
        while base < rows:
            for u in range(DOT_UNROLL):
                r = base + u * per_load + own
                if r < rows and x < quads:
                    a[u, 0], a[u, 1], a[u, 2], a[u, 3] = ld_global_nc_v4(
                        do, (r, 4 * x))
                    c[u, 0], c[u, 1], c[u, 2], c[u, 3] = ld_global_nc_v4(
                        o, (r, 4 * x))
                else:  # no piece of a row: adds 0 to the shuffles
                    for e in range(4):
                        a[u, e], c[u, e] = 0, 0
                got[u] = F0
                if x == 0 and r < rows:
                    got[u] = fetch(r, extra)
            more = 0  # bit u: row u's exact work
            for u in range(DOT_UNROLL):
                total = F0
                for e in range(4):
                    total += pair_dot(a[u, e], c[u, e])
                width = lanes // 2
                while width > 0:  # every lane: a full-mask shuffle
                    total += cuda.shfl_xor_sync(FULL_MASK, total, width)
                    width //= 2
                r = base + u * per_load + own
                if x == 0 and r < rows:
                    delta[r] = total
                    if keep(r, got[u], extra):
                        more |= 1 << u
            if more:
                for u in range(DOT_UNROLL):
                    if (more >> u) & 1:
                        exact(base + u * per_load + own, extra)
            turn += 1
            base = _dot_base(warp, turn, lanes, warps)

    return rows_of


@inline
def _fetch_none(r, extra):
    return F0


@inline
def _keep_none(r, value, extra):
    return False


@inline
def _exact_none(r, extra):
    pass


def _row_dot16(unpack):
    """row_dot16 for one 16-bit kind (its pair-widening intrinsic)."""
    rows_of = dot_rows(unpack)

    @cuda.jit
    def row_dot16(do, o, delta):
        """delta[r] = rowsum(dO_r o O_r) in float32 from 16-bit pairs
        (rows, d_v / 2), the backward's D (`dot_rows`)."""
        rows_of(do, o, delta, ())

    return row_dot16


row_dot_bf16 = _row_dot16(unpack_bf16x2)
row_dot_f16 = _row_dot16(unpack_f16x2)
