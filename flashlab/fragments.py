"""A numpy model of the tensor-core fragments the GPU kernels use.

A warp's mma.sync spreads each operand over its 32 lanes: every lane
holds a few registers, each register one float32 or a pair of 16-bit
values, at places fixed by the PTX ISA. This module writes those places
down once (`a_places`, `b_places`, `c_places`), and models ldmatrix, the
mma itself, the shared-memory swizzle and the tf32 split, so that CI,
which has no GPU, checks the layouts the kernels in `flashlab.gpu` rely
on: fragments in, modelled mma, fragments out must be the matrix product.
Lane = 4 G + t throughout: G = lane // 4 is the lane group, t = lane % 4
the place in it (g is the grouped-heads ratio). See chapter 10.
"""

import numpy as np

LANES = np.arange(32)
G, T = LANES // 4, LANES % 4


def a_places(k=16):
    """(32, 4, k // 8, 2) row and column of every element of the A fragment.

    k = 16 (bf16, f16): register r of a lane holds a pair, [..., h, :] is
    half h of it. k = 8 (tf32): one element per register (h = 0 only).
    """
    if k == 16:
        rows = np.stack([G, G + 8, G, G + 8], 1)
        cols = np.stack([2 * T, 2 * T, 2 * T + 8, 2 * T + 8], 1)
        halves = np.arange(2)
        return np.stack(np.broadcast_arrays(
            rows[..., None], cols[..., None] + halves), -1)
    rows = np.stack([G, G + 8, G, G + 8], 1)[..., None]
    cols = np.stack([T, T, T + 4, T + 4], 1)[..., None]
    return np.stack(np.broadcast_arrays(rows, cols), -1)


def b_places(k=16):
    """(32, 2, k // 8, 2) (k, n) place of every element of the B fragment."""
    if k == 16:
        ks = np.stack([2 * T, 2 * T + 8], 1)[..., None] + np.arange(2)
    else:
        ks = np.stack([T, T + 4], 1)[..., None]
    return np.stack(np.broadcast_arrays(ks, G[:, None, None]), -1)


def c_places():
    """(32, 4, 2) row and column of each float32 of the C/D fragment."""
    rows = np.stack([G, G, G + 8, G + 8], 1)
    cols = np.stack([2 * T, 2 * T + 1, 2 * T, 2 * T + 1], 1)
    return np.stack([rows, cols], -1)


def gather(matrix, places):
    """The fragment of `matrix` at `places` (one value per place)."""
    return matrix[places[..., 0], places[..., 1]]


def scatter(fragment, places, shape):
    """The matrix whose fragment at `places` is `fragment` (inverse)."""
    out = np.full(shape, np.nan)
    out[places[..., 0], places[..., 1]] = fragment
    if np.isnan(out).any():
        raise ValueError("places: the fragment does not cover the matrix")
    return out


def mma(a, b, c, k=16):
    """Model of mma.sync m16n8k<k>: D fragment from A, B, C fragments.

    Computed in float64: the unit's products of bf16/f16/tf32 values are
    exact and its float32 sums are what the kernels' error budgets allow
    for.
    """
    a_m = scatter(a, a_places(k), (16, k))
    b_m = scatter(b, b_places(k), (k, 8))
    c_m = scatter(c, c_places(), (16, 8))
    return gather(a_m @ b_m + c_m, c_places())


def ldmatrix(shared, addresses, trans=False):
    """Model of ldmatrix.x4: (32, 4, 2) values the lanes receive.

    shared: 1-D array of 16-bit values; addresses: (32,) element index of
    the row that lane gives (lanes 8i..8i+7: rows 0..7 of matrix i).
    """
    rows = shared[addresses[:, None] + np.arange(8)]  # (32, 8)
    mats = rows.reshape(4, 8, 8)  # matrix i, row, column
    if trans:
        mats = mats.transpose(0, 2, 1)
    pairs = 2 * T[:, None] + np.arange(2)  # (32, 2)
    return mats[:, G[:, None], pairs].transpose(1, 0, 2)


def ldmatrix_a(lane, ks):
    """(row, chunk) whose address lane gives ldmatrix for A's k-step ks.

    Matrices 0-3 of ldmatrix_x4 are rows 0-7 / 8-15 of chunk 2 ks, then of
    chunk 2 ks + 1 (chunks of 8 columns): a0..a3 of a 16x16 A tile.
    """
    return lane % 16, 2 * ks + lane // 16


def ldmatrix_b(lane, pair, ks):
    """(row, chunk) for K^T's B fragments of n-tiles 2 pair, 2 pair + 1.

    K is stored row-major (a key per row), which is B = K^T column-major:
    matrices keys +0..7 x chunk 2 ks, keys +0..7 x chunk 2 ks + 1 (b0, b1
    of n-tile 2 pair), then keys +8..15 likewise (n-tile 2 pair + 1).
    """
    return 16 * pair + lane % 8 + 8 * (lane // 16), 2 * ks + lane // 8 % 2


def ldmatrix_b_trans(lane, kp, pair):
    """(row, chunk) for V's B fragments of n-tiles 2 pair, 2 pair + 1 at
    k-step kp (keys 16 kp..), read with ldmatrix_x4_trans.

    V is row-major (a key per row) and B = V needs pairs along k, so the
    matrices are transposed: keys +0..7 then +8..15 of chunk 2 pair (b0,
    b1 of n-tile 2 pair), then the same of chunk 2 pair + 1.
    """
    return 16 * kp + lane % 8 + 8 * (lane // 8 % 2), 2 * pair + lane // 16


def swizzled_offset(row, chunk, per_row):
    """Byte offset of 16-byte chunk `chunk` of `row` in a swizzled tile of
    per_row chunks per row (`swizzle`, written out so kernels compile it
    alone)."""
    return (row * per_row + (chunk ^ (row & 7))) * 16


def staged_chunk(k, lane, per_row):
    """(row, chunk) of a warp's 16 staged rows of per_row (8 or 16)
    16-byte chunks that `lane` reads back in step k (0 .. per_row / 2 -
    1): chunk lane + 32 k in row order, so the warp's 16-byte store
    writes 32 / per_row whole rows, and a lane keeps its chunk and moves
    down 32 / per_row rows a step."""
    return lane // per_row + (32 // per_row) * k, lane % per_row


def stage_place(u, wg, rows, staged):
    """Byte offset in a 128-byte-swizzled Q_i tile of `rows` rows (panels
    of 64 columns, each rows x 128 bytes) where warp u (0..3) of
    warpgroup wg stages its `staged` bytes of O_i (2048 or 4096): inside
    the 64 rows of each panel that wg's own products read, so a
    warpgroup that finishes first never writes over rows another still
    reads."""
    at = u * staged  # in the warpgroup's 8192 bytes of each panel
    return (at // 8192) * rows * 128 + wg * 8192 + at % 8192


def swizzle_base(row, chunk, r, per_row):
    """swizzled_offset(row, chunk + 2 r, per_row): base r (0..3) of the
    four a lane keeps per tile, row and chunk its place in `ldmatrix_a`,
    `ldmatrix_b` or `ldmatrix_b_trans` at step 0 (swizzled_offset,
    written out so kernels compile it alone)."""
    return (row * per_row + ((chunk + 2 * r) ^ (row & 7))) * 16


def swizzle_step(rows, chunks, per_row):
    """What to add to base (chunks % 8) // 2 to read `rows` (a multiple
    of 8) rows and `chunks` (even) chunks further on.

    The XOR of the swizzle touches only a chunk's low 3 bits and a row
    moved by 8 keeps its low 3 bits, so the rest of the move is a plain
    offset. In a kernel it is a constant, which the compiler folds into
    ldmatrix's address; the four bases are all a lane holds.
    """
    return (rows * per_row + chunks - chunks % 8) * 16


def columns_below(x, base, tiles):
    """How many of a lane's columns in a row of C fragments lie below
    column x: its columns are base + 8 n + e (n-tile n < tiles, element
    e < 2; base = the tile's first column + 2 (lane % 4)), in the order
    k = 2 n + e."""
    d = x - base
    if d <= 0:
        return 0
    n = d // 8
    return min(2 * n + min(d - 8 * n, 2), 2 * tiles)


def spread_pairs(run):
    """Bits 2 n, 2 n + 1 of run (32 bits) moved to 4 n, 4 n + 1: a lane's
    columns k = 2 n + e to the places 4 n + e of its C fragments'
    elements (the row-half's two are 4 n + 2 h + e)."""
    x = run
    x = (x | (x << 16)) & 0x0000FFFF0000FFFF
    x = (x | (x << 8)) & 0x00FF00FF00FF00FF
    x = (x | (x << 4)) & 0x0F0F0F0F0F0F0F0F
    return (x | (x << 2)) & 0x3333333333333333


def fragment_run(lo, hi, base, tiles):
    """The bits (places 4 n + e) of a lane's C-fragment half whose columns
    base + 8 n + e lie in lo..hi: one run k0 <= k < k1 of its columns,
    spread to their places."""
    k0, k1 = columns_below(lo, base, tiles), columns_below(hi + 1, base,
                                                            tiles)
    if k1 <= k0:
        return 0
    return spread_pairs(((1 << k1) - 1) ^ ((1 << k0) - 1))


def a_from_c(r):
    """(n-tile, element) of S's C fragments that A register r packs.

    P V takes P (16 x 16 keys) as its A operand. The C fragments of S's
    n-tiles 2 kp and 2 kp + 1 hold exactly A's pairs: register r is the
    pair (elements e, e + 1) of n-tile 2 kp + tile.
    """
    return r // 2, 2 * (r % 2)


def a_pair_offset(t, kp, r):
    """Byte offset, in a 128-byte-swizzled tile of one panel (rows of 64
    16-bit values), of the pair that A register r of k-step kp of thread t
    packs (`a_from_c`): warpgroup t // 128 owns rows 64 on, a row per C
    fragment row, the k-step's 16 columns at 16 kp. The backward keeps
    dS^T (keys x queries) so, for dQ = dS K to read it MN-major (written
    out, as swizzled_offset, so kernels compile it alone)."""
    warp, lane = t // 32, t % 32
    row = 64 * (warp // 4) + 16 * (warp % 4) + lane // 4 + 8 * (r % 2)
    chunk = 2 * kp + r // 2
    return (row * 8 + (chunk ^ (row & 7))) * 16 + 4 * (lane % 4)


def c_pair_offset32(t, n, h):
    """Byte offset of float32 C fragment pair (n, 2 h) and (n, 2 h + 1) of
    thread t of a warpgroup (wgmma_c_places: row 16 (t // 32) + lane // 4
    + 8 h, columns 8 n + 2 (lane % 4) on) in a float32 tile of 64 rows
    as TMA's boxes of 32 columns lie, one after another, each 128-byte
    swizzled (`tma_box`): where the backward stages dQ for TMA's
    reduction. A warp's pairs of one (n, h) fall on every bank twice."""
    warp, lane = t // 32, t % 32
    row = 16 * warp + lane // 4 + 8 * h
    col = 8 * (n % 4) + 2 * (lane % 4)  # in box n // 4
    return (n // 4) * 64 * 128 + row * 128 + \
        ((col // 4) ^ (row & 7)) * 16 + 4 * (col % 4)


def a8_from_c(r, y):
    """(n-tile, element) of S's C fragments that byte y of the 8-bit A
    register r packs.

    An e4m3 k-step is 32 keys, four n-tiles of S. A lane's A bytes are 4
    consecutive keys (wgmma_a8_places) where its C fragments hold pairs 8
    keys apart: rather than move bytes between lanes, register r takes
    the pairs of n-tiles 2 (r // 2) and 2 (r // 2) + 1 that the lane
    holds, and V's keys are stored in the matching order (KEY_ORDER_8BIT).
    """
    return 2 * (r // 2) + y // 2, 2 * (r % 2) + y % 2


def key_of_column8(k):
    """The key (0..31) that A column k of an e4m3 k-step holds when P is
    packed by a8_from_c: V^T's column k must hold V's row of that key.
    Column 16 h + 4 t + y is lane t's byte y of register 2 h (+ 1)."""
    half, lane, y = k // 16, (k % 16) // 4, k % 4
    return 16 * half + 8 * (y // 2) + 2 * lane + y % 2


def key_order_8bit():
    """(32,) key_of_column8 of every column."""
    return key_of_column8(np.arange(32))


def wgmma_a8_places():
    """(128, 4, 4, 2) place of each byte of the register A operand of an
    8-bit m64nNk32: byte y of register r of lane t holds row g (+ 8 for
    odd r), column 4 (t % 4) + y (+ 16 for r >= 2), in warp t // 32's 16
    rows (mma.sync m16n8k32's A fragment, stacked)."""
    warp, lane = np.arange(128) // 32, np.arange(128) % 32
    r, y = np.arange(4)[None, :, None], np.arange(4)[None, None, :]
    rows = (lane // 4 + 16 * warp)[:, None, None] + 8 * (r % 2)
    cols = 4 * (lane % 4)[:, None, None] + y + 16 * (r // 2)
    rows, cols = np.broadcast_arrays(rows, cols)
    return np.stack([rows, cols], -1)


def swizzle(row, chunk):
    """Stored place of 16-byte chunk `chunk` of tile row `row`.

    A tile row of 64 or 128 16-bit values is 8 or 16 chunks. ldmatrix reads
    one chunk from each of 8 rows at once; stored unswizzled those 8
    chunks sit in the same 4 of the 32 banks (an 8-way conflict). XOR with
    the row's low 3 bits spreads them over all 32. Chunks per row must be
    a multiple of 8.
    """
    return chunk ^ (row & 7)


def banks(byte_addresses):
    """The 4-byte bank (0..31) of each byte address in shared memory."""
    return (np.asarray(byte_addresses) // 4) % 32


def to_tf32(x):
    """Model of cvt.rna.tf32.f32: float32 x to 10 mantissa bits, ties
    away from zero; inf and nan unchanged."""
    x = np.asarray(x, dtype=np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x1000) & 0xFFFFE000).astype(np.uint32)
    out = rounded.view(np.float32)
    return np.where(np.isfinite(x), out, x).astype(np.float32)


def split_tf32(x):
    """(hi, lo): x = hi + lo + O(2**-22 |x|), both tf32 (3xTF32)."""
    x = np.asarray(x, dtype=np.float32)
    hi = to_tf32(x)
    return hi, to_tf32(x - hi)


def to_bf16(x):
    """float32 x rounded to bf16 (nearest even), returned as float32."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


# Hopper's warpgroup MMA (wgmma, chapter 12). A warpgroup is 4 warps,
# 128 threads; wgmma m64nNk16 multiplies a 64 x 16 A by a 16 x N B
# into a 64 x N float32 accumulator that the warpgroup holds as mma.sync's
# C fragments stacked: warp w holds rows 16 w.. (`wgmma_c_places`). B, and
# A unless it comes from registers, is read from shared memory through a
# 64-bit descriptor (`descriptor`) over 8 x 8 "core matrices" of 16-bit
# values.

CORE_BYTES = 128  # a core matrix: 8 rows of 16 bytes, stored contiguously


def core_offset(row, chunk, per_row):
    """Byte offset of 16-byte chunk `chunk` of tile row `row` in the
    unswizzled core-matrix layout of a tile with per_row chunks per row.

    Each 8-row block of the tile stores its per_row core matrices one
    after the other (128 bytes each); a core matrix is 8 rows x 1 chunk.
    """
    return ((row // 8) * per_row + chunk) * 128 + (row % 8) * 16


def core_copy_place(t, per_row, threads):
    """(row, chunk, rows per pass) of the first chunk thread t copies into a
    core_offset tile: its offset is 16 t, then 16 threads more per pass.

    Eight consecutive threads fill one core matrix (128 contiguous bytes,
    free of bank conflicts); threads // per_row is a multiple of 8, so a
    thread copies the same chunk, rows / pass further, in every pass.
    """
    block = t // 8  # the core matrix of this thread in pass 0
    return (block // per_row) * 8 + t % 8, block % per_row, \
        threads // per_row


ROW_DOT_UNROLL = 4  # rows a lane of row_dot16 loads before it sums any


def row_dot_lanes(d_v):
    """Lanes of row_dot16 that share a row of d_v 16-bit values: a lane
    reads 16 bytes, eight values, of dO and of O; a power of two, so the
    lanes of a row meet by shuffles."""
    if d_v % 8 or not 8 <= d_v <= 256:
        raise ValueError(f"d_v: expected a multiple of 8 in 8..256 for "
                         f"row_dot16, got {d_v}")
    lanes = 1
    while lanes < d_v // 8:
        lanes *= 2
    return lanes


def row_dot_lane(lane, lanes):
    """(row of a load, 16-byte piece of it) that `lane` of row_dot16
    takes in every load, rows shared by `lanes` lanes."""
    return lane // lanes, lane % lanes


def row_dot_base(warp, turn, lanes, warps):
    """The first row of turn `turn` of warp `warp` (of `warps` in the
    grid) of row_dot16, rows shared by `lanes` lanes: a warp's load
    covers 32 / lanes rows, its ROW_DOT_UNROLL loads the next ones, and
    the grid's warps then move on together."""
    return (turn * warps + warp) * (32 // lanes) * ROW_DOT_UNROLL


def row_dot_place(warp, turn, u, lane, lanes, warps):
    """(row, 16-byte piece of it) that `lane` of warp `warp` (of `warps`
    in the grid) loads in load u of its turn `turn` of row_dot16
    (`row_dot_base`, `row_dot_lane`)."""
    row, piece = row_dot_lane(lane, lanes)
    return (row_dot_base(warp, turn, lanes, warps) + u * (32 // lanes)
            + row, piece)


def descriptor(address, lbo, sbo):
    """wgmma's matrix descriptor (no swizzle) as an int: start address,
    leading (K-direction) and stride (M/N-direction) byte offsets between
    core matrices, each in 16-byte units: bits 0-13, 16-29 and 32-45."""
    return (((address & 0x3FFFF) >> 4) | ((lbo >> 4) << 16)
            | ((sbo >> 4) << 32))


def k_major(per_row):
    """(LBO, SBO, k-step) in bytes of a core_offset tile read K-major (K
    along the row: Q as A, K as B of S = Q K^T): the next 8 columns are
    the next core matrix, the next 8 rows a block of per_row further, and
    a k-step (16 columns) two core matrices."""
    return CORE_BYTES, per_row * CORE_BYTES, 2 * CORE_BYTES


def mn_major(per_row):
    """(LBO, SBO, k-step) in bytes of a core_offset tile read MN-major
    (transposed: K down the rows, as V, keys x d_v, is B of P V): the next
    8 rows (K) are a block further, the next 8 columns (N) one core
    matrix, and a k-step (16 rows) two blocks."""
    return per_row * CORE_BYTES, CORE_BYTES, 2 * per_row * CORE_BYTES


def descriptor_fields(desc):
    """(address, lbo, sbo) in bytes: `descriptor` read back."""
    desc = int(desc)
    return ((desc & 0x3FFF) << 4, ((desc >> 16) & 0x3FFF) << 4,
            ((desc >> 32) & 0x3FFF) << 4)


def wgmma_operand(shared, desc, mn, transposed):
    """Model of what wgmma reads through `desc` from `shared` (1-D 16-bit
    values, element e at byte 2 e): the (mn, 16) K-major operand, or the
    (16, mn) MN-major one if transposed. Unswizzled core matrices, or the
    128-byte swizzle where the descriptor's mode says so."""
    if int(desc) >> 62 == SWIZZLE_128B:
        return _operand_128b(shared, desc, mn, transposed)
    start, lbo, sbo = descriptor_fields(desc)
    m = np.arange(mn)[:, None]  # row in M/N
    k = np.arange(16)[None, :]
    if transposed:  # a core matrix row: 8 M/N values of one k
        at = start + (m // 8) * sbo + (k // 8) * lbo + (k % 8) * 16 \
            + (m % 8) * 2
        return shared[at.T // 2]
    at = start + (m // 8) * sbo + (k // 8) * lbo + (m % 8) * 16 + (k % 8) * 2
    return shared[at // 2]


def wgmma_c_places(n):
    """(128, n // 2, 2) row and column of accumulator register r of thread
    t for m64nN: mma.sync's C fragment of 8-column group r // 4, in warp
    t // 32's 16 rows."""
    warp, lane = np.arange(128) // 32, np.arange(128) % 32
    c = c_places()[lane]  # (128, 4, 2)
    rows = c[..., 0] + 16 * warp[:, None]
    cols = c[..., 1][:, None, :] + 8 * np.arange(n // 8)[None, :, None]
    rows = np.broadcast_to(rows[:, None, :], cols.shape)
    return np.stack([rows, cols], -1).reshape(128, n // 2, 2)


def wgmma_a_places():
    """(128, 4, 2, 2) place of each 16-bit value of the register A operand
    of m64nNk16: mma.sync's A fragment in warp t // 32's 16 rows."""
    warp, lane = np.arange(128) // 32, np.arange(128) % 32
    places = a_places(16)[lane].copy()
    places[..., 0] += 16 * warp[:, None, None]
    return places


def wgmma(a, b, c):
    """Model of wgmma m64nNk16: D registers (128, n // 2) = A B + C, with
    A (64, 16) and B (16, n) matrices (from `wgmma_operand`, or A from
    registers by `scatter` at wgmma_a_places) and C registers. Float64."""
    n = b.shape[1]
    c_m = scatter(c, wgmma_c_places(n), (64, n))
    return gather(a @ b + c_m, wgmma_c_places(n))


# The 128-byte swizzle for wgmma (not yet used by a kernel). A tile is
# stored in panels of 64 16-bit columns (rows of 128 bytes), each 8-row
# atom of a panel 1024 bytes, 1024-byte aligned; chunk c of row r lies at
# chunk c ^ (r % 8) of its row, as `swizzled_offset(r, c, 8)` places it
# and as TMA's 128-byte swizzle delivers it. wgmma applies the same XOR
# to the addresses of its canonical layout (`wgmma_operand`).

SWIZZLE_128B = 1  # descriptor bits 62-63: the 128-byte swizzle mode


def panel_offset(row, chunk, rows):
    """Byte offset of chunk `chunk` of `row` in a 128-byte-swizzled tile of
    `rows` rows: panel chunk // 8, then swizzled_offset in the panel."""
    return (chunk // 8) * rows * 128 + swizzled_offset(row, chunk % 8, 8)


def descriptor_128b(address, lbo, sbo):
    """`descriptor` with the 128-byte swizzle mode in bits 62-63."""
    return descriptor(address, lbo, sbo) | (SWIZZLE_128B << 62)


def k_major_128b(rows):
    """(LBO, SBO, k-step, panel) in bytes of a panel_offset tile read
    K-major: LBO unused (16), 8-row atoms 1024 bytes apart, a k-step 32
    bytes along the row, and 4 k-steps to a panel of rows x 128 bytes."""
    return 16, 1024, 32, rows * 128


def mn_major_128b(rows):
    """(LBO, SBO, k-step) in bytes of a panel_offset tile read MN-major
    (V, keys x d_v): panels of 64 columns (N) LBO = rows x 128 apart,
    8-row atoms (K) 1024 apart, a k-step (16 rows) 2048."""
    return rows * 128, 1024, 2048


def swizzle_address(address):
    """The 128-byte swizzle of a byte address: bits 4-6 (the 16-byte
    chunk) XOR bits 7-9 (the row within a 1024-byte atom)."""
    return address ^ (((address >> 7) & 7) << 4)


def wgmma_operand8(shared, desc, mn):
    """wgmma_operand for 8-bit values (shared: 1-D, element e at byte e):
    the (mn, 32) K-major operand of an e4m3 k-step, 32 bytes along each
    row, through a 128-byte-swizzled descriptor (8-bit operands have no
    MN-major form)."""
    if int(desc) >> 62 != SWIZZLE_128B:
        raise ValueError("desc: the 8-bit model reads 128-byte-swizzled "
                         "tiles only")
    start, _, sbo = descriptor_fields(desc)
    m = np.arange(mn)[:, None]
    k = np.arange(32)[None, :]
    return shared[swizzle_address(start + (m // 8) * sbo + (m % 8) * 128
                                  + k)]


def tma_box(matrix):
    """A (rows, 128) byte matrix as TMA's 128-byte swizzle lands it: 1-D
    bytes, row r's 16-byte chunk c at chunk c ^ (r % 8) of its row."""
    rows = matrix.shape[0]
    out = np.empty(rows * 128, matrix.dtype)
    out[swizzle_address(np.arange(rows * 128))] = matrix.reshape(-1)
    return out


def _operand_128b(shared, desc, mn, transposed):
    """wgmma_operand through a 128-byte-swizzled `desc`, shared's index 0
    at a 1024-byte-aligned address."""
    start, lbo, sbo = descriptor_fields(desc)
    m = np.arange(mn)[:, None]
    k = np.arange(16)[None, :]
    if transposed:  # a row of 64 M/N values per k, 8 rows to an atom
        at = start + (m // 64) * lbo + (m % 64) * 2 + (k // 8) * sbo \
            + (k % 8) * 128
        return shared[swizzle_address(at).T // 2]
    at = start + (m // 8) * sbo + (m % 8) * 128 + k * 2
    return shared[swizzle_address(at) // 2]
