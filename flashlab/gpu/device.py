"""Device functions and tile layouts that the GPU kernels share.

Everything here is float32 (every constant is a float32, so no float64
instruction reaches the PTX). The per-row algebra is `merge.row_step`,
the mask rules `masks.pair_allowed`, the dropout hash `dropout.keep_bits`:
the same Python functions the CPU kernels compile. `rules` is the
`kernel_args.KernelRules` record of the call. See chapter 9.
"""

import math
from typing import NamedTuple

import numpy as np
from numba import config, cuda, float32, int32, uint32, uint64

from flashlab import dropout, masks, merge, nonfinite
from flashlab.gpu.intrinsics import (
    ld_global_nc_v4,
    pack_bf16x2,
    pack_f16x2,
    unpack_bf16x2,
    unpack_f16x2,
)

THREADS = 128  # threads per block of v1, v3, v4 and the blocked backward
F0 = np.float32(0)
F1 = np.float32(1)
NEG_INF = np.float32(-np.inf)
NAN = np.float32(np.nan)

row_step = cuda.jit(device=True)(merge.row_step)
row_probability = cuda.jit(device=True)(merge.row_probability)
tile_skipped = cuda.jit(device=True)(masks.tile_skipped)
tile_full = cuda.jit(device=True)(masks.tile_full)
mark_bad = cuda.jit(device=True)(nonfinite.mark_bad)
finish_row = cuda.jit(device=True)(nonfinite.finish_row)
_pair_allowed = cuda.jit(device=True)(masks.pair_allowed)
_keep_bits = cuda.jit(device=True)(dropout.keep_bits)


def inline(fn):
    """A device function inlined into its callers, so that the register
    arrays it indexes stay registers (the simulator has no such option)."""
    if config.ENABLE_CUDASIM:
        return cuda.jit(device=True)(fn)
    return cuda.jit(device=True, forceinline=True)(fn)


def jit(max_registers):
    """cuda.jit capped at max_registers per thread (the simulator has no
    registers, and no such option, so it gets plain cuda.jit)."""
    if config.ENABLE_CUDASIM:
        return cuda.jit
    return cuda.jit(max_registers=max_registers)


class Tiles(NamedTuple):
    """The register-blocked layout of v3 and v4 for head dims (d, d_v).

    A block of THREADS threads owns BR query rows; each K/V tile has BC
    keys. Thread t = ty * TX + tx holds an RM x CN piece of S_ij and RM
    rows of the output, every TX-th of its OC columns.
    """

    BR: int  # query rows per block
    BC: int  # keys per tile
    RM: int  # rows of S and O per thread
    TX: int  # threads along a row
    CN: int  # columns of S per thread
    OC: int  # columns of O per thread (strided by TX)
    DP: int  # padded SRAM row of Q and K: column reads hit distinct banks
    BCP: int  # padded SRAM row of P


def tiles(d, d_v):
    """The `Tiles` of v3/v4: 64 x 32 up to d = 64, else 32 x 16 (48 KiB)."""
    br, bc = (64, 32) if max(d, d_v) <= 64 else (32, 16)
    rm = 4
    tx = THREADS // (br // rm)
    return Tiles(BR=br, BC=bc, RM=rm, TX=tx, CN=bc // tx, OC=d_v // tx,
                 DP=d + 1, BCP=bc + 1)


@cuda.jit(device=True)
def allowed(b, i, j, nq, nk, rules, kv_len, mask):
    """Pair (i, j) of batch element b is in range and allowed."""
    if i >= nq or j >= nk:
        return False
    ok = _pair_allowed(i, j, rules, kv_len[b])
    if ok and rules.use_mask:
        ok = mask[b, i, j] != 0
    return ok


@cuda.jit(device=True)
def dropout_weight(b, i, j, rules):
    """1 / (1 - p) for a kept pair, 0 for a dropped one, 1 without dropout."""
    if not rules.use_dropout:
        return rules.drop_scale
    if _keep_bits(rules.seed, uint64(b), uint64(i),
                  uint64(j)) < rules.threshold:
        return F0
    return rules.drop_scale


@cuda.jit(device=True)
def place(rows, tx_n, n):
    """(t, ty, tx, b, r0, r1): this thread, its row and column in a grid of
    tx_n threads per row, its batch element, and the rows r0..r1 - 1 of n
    that its block owns (blocks of `rows` along blockIdx.x)."""
    t = cuda.threadIdx.x
    r0 = cuda.blockIdx.x * rows
    return t, t // tx_n, t % tx_n, cuda.blockIdx.y, r0, min(r0 + rows, n)


@cuda.jit(device=True)
def fill(a, value, rows, cols):
    """a[:rows, :cols] = value for a register array (constant sizes)."""
    for r in range(rows):
        for c in range(cols):
            a[r, c] = value


@cuda.jit(device=True)
def pair_grads(b, i, j, nq, nk, s, dp, shift_i, norm_i, d_i, rules, kv_len,
               mask):
    """(P_ij Z_ij, dS_ij) for one pair, recomputed; (0, 0) if masked.

    P = exp(S - shift) norm from the row's statistics (`row_statistics`:
    the saved lse and 1 where that is exact), Z the dropout weight, and
    dS = P (dP Z - D_i) with D_i = rowsum(dO_i * O_i). See chapter 8.
    """
    if not allowed(b, i, j, nq, nk, rules, kv_len, mask):
        return F0, F0
    p = row_probability(s, shift_i, rules.lowest) * norm_i
    z = dropout_weight(b, i, j, rules)
    return p * z, p * (dp * z - d_i)


@cuda.jit(device=True)
def stage(dst, src, b, r0, rows, cols, scale, t, nthreads):
    """HBM -> SRAM: rows r0.. of src[b], times scale, into dst[:rows].

    Called by every thread of the block with its own t; rows past the end
    of src are zero-filled, so ragged tiles need no special case.
    """
    n = src.shape[1]
    for e in range(t, rows * cols, nthreads):
        r = e // cols
        x = e - r * cols
        dst[r, x] = src[b, r0 + r, x] * scale if r0 + r < n else F0


@cuda.jit(device=True)
def row_norm(stats, bh, b, i):
    """norm_i of row i of query head b (of bh): the second half of stats
    where the caller passed `row_statistics`' (2 BH, Nq), else 1 (stats
    is then the saved lse itself, (BH, Nq))."""
    return stats[bh + b, i] if stats.shape[0] > bh else F1


@cuda.jit(device=True)
def stage_stats(sh_s, nm_s, dl_s, stats, delta, b, i0, rows, t):
    """HBM -> SRAM: shift_i, norm_i and D_i of rows i0..i0 + rows - 1
    (threads t < rows); -inf, 0 and 0 past the end, so rows past Nq
    contribute 0."""
    if t < rows:
        inside = i0 + t < delta.shape[1]
        sh_s[t] = stats[b, i0 + t] if inside else NEG_INF
        nm_s[t] = row_norm(stats, delta.shape[0], b, i0 + t) if inside \
            else F0
        dl_s[t] = delta[b, i0 + t] if inside else F0


@cuda.jit(device=True)
def score_piece(s, qa, q_s, k_s, r0, c0, rm, cn, d):
    """s[:rm, :cn] = rows r0.. of Q_i (SRAM) times cols c0.. of K_j^T.

    Each value loaded from SRAM feeds rm or cn multiply-adds: the point
    of register blocking. rm, cn, d are compile-time constants of the
    caller, so the loops unroll and s, qa stay in registers.
    """
    for a in range(rm):
        for c in range(cn):
            s[a, c] = F0
    for x in range(d):
        for a in range(rm):
            qa[a] = q_s[r0 + a, x]
        for c in range(cn):
            kc = k_s[c0 + c, x]
            for a in range(rm):
                s[a, c] += qa[a] * kc


@cuda.jit(device=True)
def output_piece(acc, pv, vv, al, p_s, v_s, r0, tx, rm, oc, bc, tx_n):
    """acc = al * acc + P_ij V_j for rows r0.. and columns tx, tx + tx_n..

    The tile's product is summed on its own first (a blocked sum: rounding
    grows with Bc + N / Bc rather than N), then added to the rescaled acc.
    """
    for a in range(rm):
        for c in range(oc):
            pv[a, c] = F0
    for col in range(bc):
        for c in range(oc):
            vv[c] = v_s[col, tx + tx_n * c]
        for a in range(rm):
            p = p_s[r0 + a, col]
            for c in range(oc):
                pv[a, c] += p * vv[c]
    for a in range(rm):
        for c in range(oc):
            acc[a, c] = al[a] * acc[a, c] + pv[a, c]


@cuda.jit(device=True)
def open_tile(s, qa, q_s, k_s, v_s, k, v, b, i0, i1, j0, nq, rules,
              kv_len, mask, t, bc, rm, cn, d, d_v):
    """Visit K/V tile j0 of a v3/v4 block; False if it is skipped.

    Otherwise K_j and V_j are in SRAM and s holds this thread's rm x cn
    piece of S_ij (rows ty * rm.., keys tx * cn..), -inf where masked.
    """
    nk = k.shape[1]
    j1 = min(j0 + bc, nk)
    kv = kv_len[b]
    if tile_skipped(i0, i1, j0, j1, rules, kv):
        return False  # uniform over the block: barriers stay aligned
    full = (not rules.use_mask and j1 - j0 == bc
            and tile_full(i0, i1, j0, j1, rules, kv))
    # HBM -> SRAM: K_j, V_j (Bc (d + d_v) floats) of query head b's K/V
    # head, used by all Br rows
    bk = b // rules.group
    stage(k_s, k, bk, j0, bc, d, F1, t, THREADS)
    stage(v_s, v, bk, j0, bc, d_v, F1, t, THREADS)
    cuda.syncthreads()  # K_j, V_j loaded before any thread reads them
    tx_n = bc // cn
    ty, tx = t // tx_n, t % tx_n
    # S_ij = Q_i K_j^T: an rm x cn piece per thread, in registers
    score_piece(s, qa, q_s, k_s, ty * rm, tx * cn, rm, cn, d)
    if not full:
        for a in range(rm):
            for c in range(cn):
                if not allowed(b, i0 + ty * rm + a, j0 + tx * cn + c, nq,
                               nk, rules, kv_len, mask):
                    s[a, c] = NEG_INF
    return True


@cuda.jit(device=True)
def store_row(o, lse, b, i, acc, m, l, d_v):
    """O_i = u / l and lse_i = m + log l; 0 and -inf for an empty row.

    Only l == 0 means "no key": a NaN l stays NaN (flashlab.nonfinite).
    """
    if l != F0:
        for x in range(d_v):
            o[b, i, x] = acc[x] / l
        lse[b, i] = m + math.log(l)
    else:
        for x in range(d_v):
            o[b, i, x] = F0
        lse[b, i] = NEG_INF


@cuda.jit
def combine_splits(o_parts, m_parts, l_parts, o, m_out, l_out, lowest):
    """Split-KV's partial results, S x BH rows, into o (BH rows).

    One thread per output element folds the S partial results of its row
    as `merge.combine` does, one after another with `merge.row_step`.
    Each split is the summary (m_s, l_s, l_s out_s): m_parts holds the
    row maxes and l_parts the sums, or, when l_parts is empty, m_parts
    holds lse_s and every l_s is 1. The row's own (m, l) go to m_out and
    l_out, or, when l_out is empty, its lse m + log l to m_out.
    """
    b = cuda.blockIdx.y
    e = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    bh, nq, d_v = o.shape
    if e >= nq * d_v:
        return
    i, x = e // d_v, e % d_v
    m, l, u = NEG_INF, F0, F0
    for s in range(o_parts.shape[0] // bh):
        m_s = m_parts[s * bh + b, i]
        m, shift, alpha = row_step(m, m_s, lowest)
        w = math.exp(m_s - shift)  # this split's weight: l_s = 1, or
        if l_parts.shape[0] != 0:  # its own sum (0 adds nothing)
            w *= l_parts[s * bh + b, i]
        l = alpha * l + w
        u = alpha * u + w * o_parts[s * bh + b, i, x]
    o[b, i, x] = u / l if l != F0 else F0  # an empty row stays 0
    if x == 0:
        if l_out.shape[0] != 0:
            m_out[b, i] = m if l != F0 else NEG_INF
            l_out[b, i] = l
        else:
            m_out[b, i] = m + math.log(l) if l != F0 else NEG_INF


def make_merge_halves(kind):
    """The kernel that merges the two halves of a split tail's keys
    (forward v8's pieces, flashlab.gpu.host) for 16-bit `kind` ("bf16"
    or "f16"): halves (2 BH, R, d_v / 2) 16-bit pairs and their lse
    (2 BH, R), each half's rows normalized by its own sum, into rows
    row0 .. row0 + R - 1 of o (BH, Nq, d_v / 2) pairs and lse (BH, Nq).

    Each half is the summary (lse_s, 1, out_s), folded as
    `combine_splits` folds splits (`merge.row_step`): one thread per
    pair of a row, blocks (ceil(R d_v / 2 / THREADS), BH)."""
    pack, unpack = {"bf16": (pack_bf16x2, unpack_bf16x2),
                    "f16": (pack_f16x2, unpack_f16x2)}[kind]

    @cuda.jit
    def merge_halves(halves, lse_halves, o, lse, row0, lowest):
        b = cuda.blockIdx.y
        e = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        bh, nq, pairs = o.shape
        rows = halves.shape[1]
        i, c = e // pairs, e % pairs
        if i >= rows or row0 + i >= nq:
            return
        m, l, u0, u1 = NEG_INF, F0, F0, F0
        for s in range(2):
            m_s = lse_halves[s * bh + b, i]
            m, shift, alpha = row_step(m, m_s, lowest)
            w = math.exp(m_s - shift)  # the half's weight, its l_s 1
            x0, x1 = unpack(halves[s * bh + b, i, c])
            l = alpha * l + w
            u0 = alpha * u0 + w * x0
            u1 = alpha * u1 + w * x1
        if l != F0:
            o[b, row0 + i, c] = pack(u0 / l, u1 / l)
        else:  # no key in either half: 0, as the kernel writes it
            o[b, row0 + i, c] = pack(F0, F0)
        if c == 0:
            lse[b, row0 + i] = m + math.log(l) if l != F0 else NEG_INF

    return merge_halves


merge_halves_bf16 = make_merge_halves("bf16")
merge_halves_f16 = make_merge_halves("f16")


@cuda.jit
def norms_from_sums(m, l, stats):
    """stats (2 BH, Nq) as `row_statistics` writes them (shifts, then
    norms) from rows' max m and sum l (BH, Nq); one thread per row."""
    b = cuda.blockIdx.y
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    bh, nq = m.shape
    if i < nq:
        stats[b, i] = m[b, i]
        stats[bh + b, i] = F1 / l[b, i] if l[b, i] != F0 else F1


@cuda.jit
def sums_from_norms(stats, m, l):
    """The inverse of `norms_from_sums`: a row with no key (shift -inf)
    has l = 0."""
    b = cuda.blockIdx.y
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    bh, nq = m.shape
    if i < nq:
        shift = stats[b, i]
        m[b, i] = shift
        l[b, i] = F1 / stats[bh + b, i] if shift != NEG_INF else F0


@cuda.jit
def row_dot(do, o, delta):
    """D_i = rowsum(dO_i * O_i), one thread per row."""
    b = cuda.blockIdx.y
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i < o.shape[1]:
        acc = F0
        for x in range(o.shape[2]):
            acc += do[b, i, x] * o[b, i, x]
        delta[b, i] = acc


# From this |lse| on, lse = m + log l keeps too few digits of log l for
# exp(S - lse) to be P (merge.lse_loses_l): the row needs its own m and l
LSE_EXACT = np.float32(merge.LSE_EXACT)


@cuda.jit(device=True)
def lse_loses_l(lse_i):
    """merge.lse_loses_l for one row's saved lse, in float32."""
    return math.isfinite(lse_i) and abs(lse_i) >= LSE_EXACT


@cuda.jit(device=True)
def _load32(q, b, i, x):
    """Element x of row i of q[b], float32 values."""
    return q[b, i, x]


def make_row_statistics(load=_load32, prescale=True):
    """(row_stats, saved_stats, exact_stats) for row i of q[b], q and k
    read through `load` (float32 values, or a 16-bit kind's element of
    int16 bits) and S formed as the backward does: tau Q K^T (prescale,
    float32 kernels) or tau (Q K^T) (the tensor-core kernels).

    row_stats(q, k, lse, stats, b, i, rules, kv_len, mask) writes the
    row's shift and norm into stats (2 BH, Nq). Where lse holds P exactly
    (every row, usually: one read, two writes) they are (lse, 1), which
    saved_stats(shift, stats, b, i) writes from the row's lse, returning
    False (stats may be any (2 R, C) view: the norm goes R rows down);
    where it does not (`lse_loses_l`: huge equal scores, scores near
    -finfo.max) it writes nothing and returns True, and exact_stats(q,
    k, b, i, rules, kv_len, mask) gives the row's own max and 1 / sum,
    found by a pass over its scores without V, as tiled.row_statistics
    does. See chapter 8.
    """

    @inline
    def saved_stats(shift, stats, b, i):
        if lse_loses_l(shift):
            return True
        stats[b, i] = shift
        stats[stats.shape[0] // 2 + b, i] = F1
        return False

    @inline
    def exact_stats(q, k, b, i, rules, kv_len, mask):
        nq, nk, d = q.shape[1], k.shape[1], k.shape[2]
        bk = b // rules.group  # the K/V head of query head b
        tau = rules.scale if prescale else F1
        m, l = NEG_INF, F0
        for j in range(nk):
            if allowed(b, i, j, nq, nk, rules, kv_len, mask):
                s = F0
                for x in range(d):  # q_i stays in L1: rare rows
                    s += load(q, b, i, x) * tau * load(k, bk, j, x)
                if not prescale:
                    s *= rules.scale
                # the row's merge, one key at a time
                m, sh, alpha = row_step(m, s, rules.lowest)
                l = alpha * l + float32(math.exp(s - sh))
        return m, F1 / l  # l >= 1: the max's own term

    @inline
    def row_stats(q, k, lse, stats, b, i, rules, kv_len, mask):
        if saved_stats(lse[b, i], stats, b, i):
            shift, norm = exact_stats(q, k, b, i, rules, kv_len, mask)
            stats[b, i] = shift
            stats[lse.shape[0] + b, i] = norm

    return row_stats, saved_stats, exact_stats


def statistics_kernel(load=_load32, prescale=True):
    """row_statistics: make_row_statistics' rows, one thread each."""
    row_stats = make_row_statistics(load, prescale)[0]

    @cuda.jit
    def row_statistics(q, k, lse, stats, rules, kv_len, mask):
        """stats (2 BH, Nq): shifts, then norms, with P = exp(S - shift)
        norm for the backward kernels (make_row_statistics). One thread
        per row of q (BH, Nq, d); lse (BH, Nq) as the forward saved it.
        """
        b = cuda.blockIdx.y
        i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        if i < lse.shape[1]:
            row_stats(q, k, lse, stats, b, i, rules, kv_len, mask)

    return row_statistics


row_statistics = statistics_kernel()


@cuda.jit
def find_bad_columns(v, bad):
    """bad[b, x] |= V[b, j, x] is NaN or inf; one thread per element.

    One coalesced pass over V at copy bandwidth; threads that find a bad
    value all store the same True, so no atomics are needed.
    """
    b = cuda.blockIdx.y
    e = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    d_v = v.shape[2]
    if e < v.shape[1] * d_v:
        mark_bad(v, bad, b, e // d_v, e % d_v)


@cuda.jit
def finish_rows(o, lse, bad, empty):
    """The rule of flashlab.nonfinite on every output row."""
    b = cuda.blockIdx.y
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i < o.shape[1]:
        finish_row(o, lse, bad, empty, b, i, NAN, NAN, NEG_INF)


# fewest rows of V per block of find_bad_parts: with 64, a block at
# d_v = 64 read 8 KB and starting blocks took much of the kernel's time
PART_ROWS = 128
MAX_PARTS = 16  # chunks of V's rows: the words an epilogue ORs
# blocks of find_bad_parts worth launching: with fewer chunks an epilogue
# reads fewer words, and past about this many blocks more chunks only
# add blocks to start (H200: at B16 H12 Nk 1024 d_v 64, 3 chunks took
# 6 µs and 8 took 8; at B8 H16 Nk 2048 d_v 128, 4 took 19 and 16 took
# 20; one or two chunks left the GPU without work: 36 and 23 µs)
FILL_BLOCKS = 512
PART_COLUMNS = 128  # widest V the parts kernels take (tensor-core d_v)
# a chunk's flags as one 32-bit word per place of a lane in its quad (a
# C fragment's four lanes share rows and split the columns): bit 2 n + e
# of word q is column 8 n + 2 q + e, the order the epilogue writes them
QUADS = 4
FIND_THREADS = 256  # per block of find_bad_parts (faster than 512, 1024)
# the bits of a value's exponent, all set in NaN and +-inf: float32's,
# bf16's, float16's, and e4m3's (which has no inf; 0x7F, 0xFF are NaN)
EXPONENT_BITS = {"float32": 0x7F800000, "bfloat16": 0x7F80,
                 "float16": 0x7C00, "float8_e4m3fn": 0x7F}
WIDTHS = {"float32": 32, "bfloat16": 16, "float16": 16,
          "float8_e4m3fn": 8}  # bits of a value


def bad_parts_shape(bh_kv, nk, d_v):
    """(BH_kv, chunks, QUADS) int32 words of find_bad_parts' flags for V
    (BH_kv, Nk, d_v <= PART_COLUMNS): as few chunks as give FILL_BLOCKS
    blocks, each of PART_ROWS rows or more, and at most MAX_PARTS, so an
    epilogue reads few words."""
    if d_v > PART_COLUMNS:
        raise ValueError(f"d_v: expected at most {PART_COLUMNS} for the "
                         f"bad-column words, got {d_v}")
    most = min(MAX_PARTS, math.ceil(nk / PART_ROWS))
    chunks = max(1, min(most, math.ceil(FILL_BLOCKS / max(bh_kv, 1))))
    return bh_kv, chunks, QUADS


def quad_bit(x):
    """(word, bit) of column x in a chunk's QUADS words (see QUADS)."""
    return (x % 8) // 2, 2 * (x // 8) + x % 2


_quad_bit = inline(quad_bit)  # find_bad_parts' own


def _find_bad_parts(width):
    """find_bad_parts for values of `width` bits (32, 16 or 8)."""
    per = 32 // width  # values in a 32-bit word
    # each value's lowest and highest bit, in every place of a word
    low = np.uint32(sum(1 << (width * y) for y in range(per)))
    high = np.uint32(low << np.uint32(width - 1))

    @inline
    def bad_values(x, exponents):
        """The top bit of each value of word x whose `exponents` bits are
        all set: ~x & exponents is 0 in such a value only, and with the
        value's top bit set first (the exponent bits leave it clear),
        subtracting 1 borrows from that bit alone, never from the next
        value, so one subtraction tests every value of the word."""
        t = (~x & exponents) | high
        return ~(t - low) & high

    @cuda.jit
    def find_bad_parts(v, parts, exponent):
        """parts[b, c, q] bit quad_bit(x): V[b, j, x] is NaN or inf for a
        row j of chunk c.

        flashlab.nonfinite's column rule in one launch: V comes as int32
        words (BH_kv, Nk, d_v width / 32), values not finite when every
        `exponent` bit is set (EXPONENT_BITS). Block (c, b) reads chunk c
        of V[b]'s rows once: each thread keeps four word columns, read
        16 bytes at a time (ld_global_nc_v4: four-byte loads ran at half
        the copy speed), words / 4 threads a row, two rows' loads in
        flight, and ORs what it saw into its columns' shared words at
        the end (words a multiple of 4: d_v a multiple of 16); then a
        thread per column sets its bit in the chunk's QUADS words, which
        the first QUADS threads write, set or not, so no memset runs
        first.
        """
        seen = cuda.shared.array(PART_COLUMNS, uint32)  # bad values' tops
        quads = cuda.shared.array(QUADS, uint32)
        b, c, t = cuda.blockIdx.y, cuda.blockIdx.x, cuda.threadIdx.x
        nk, words = v.shape[1], v.shape[2]
        rows = (nk + parts.shape[1] - 1) // parts.shape[1]
        r0 = c * rows
        r1 = min(nk, r0 + rows)
        exponents = uint32(exponent) * low  # in every place of a word
        for w in range(t, words, cuda.blockDim.x):
            seen[w] = 0
        if t < QUADS:
            quads[t] = 0
        cuda.syncthreads()  # every word cleared before a thread ORs one
        across = words // 4  # threads a row: 16 bytes, four words each
        step = cuda.blockDim.x // across  # rows a pass of the block reads
        if t < step * across:
            w = 4 * (t % across)  # the thread's first word column
            bits0 = bits1 = bits2 = bits3 = uint32(0)
            r = r0 + t // across
            while r + step < r1:  # two rows' loads, then the tests
                x0, x1, x2, x3 = ld_global_nc_v4(v, (b, r, w))
                y0, y1, y2, y3 = ld_global_nc_v4(v, (b, r + step, w))
                bits0 |= (bad_values(uint32(x0), exponents)
                          | bad_values(uint32(y0), exponents))
                bits1 |= (bad_values(uint32(x1), exponents)
                          | bad_values(uint32(y1), exponents))
                bits2 |= (bad_values(uint32(x2), exponents)
                          | bad_values(uint32(y2), exponents))
                bits3 |= (bad_values(uint32(x3), exponents)
                          | bad_values(uint32(y3), exponents))
                r += 2 * step
            if r < r1:
                x0, x1, x2, x3 = ld_global_nc_v4(v, (b, r, w))
                bits0 |= bad_values(uint32(x0), exponents)
                bits1 |= bad_values(uint32(x1), exponents)
                bits2 |= bad_values(uint32(x2), exponents)
                bits3 |= bad_values(uint32(x3), exponents)
            if bits0 | bits1 | bits2 | bits3:
                cuda.atomic.or_(seen, w, bits0)
                cuda.atomic.or_(seen, w + 1, bits1)
                cuda.atomic.or_(seen, w + 2, bits2)
                cuda.atomic.or_(seen, w + 3, bits3)
        cuda.syncthreads()  # the chunk's words complete before the bits
        if t < words * per and (seen[t // per] >> uint32(
                width * (t % per) + width - 1)) & 1:
            q, bit = _quad_bit(t)  # column t
            cuda.atomic.or_(quads, q, uint32(1) << uint32(bit))
        cuda.syncthreads()
        if t < QUADS:  # word t, from every column
            parts[b, c, t] = int32(quads[t])

    return find_bad_parts


find_bad_parts32 = _find_bad_parts(32)
find_bad_parts16 = _find_bad_parts(16)
find_bad_parts8 = _find_bad_parts(8)


@inline
def bad_bits(parts, bk, q):
    """Bit 2n + e: column 8n + 2q + e of V[bk] holds a NaN or inf (the
    columns lane q of its quad writes in a tensor-core epilogue): the OR
    of the chunks' words q. A constant trip count with the chunk test
    inside keeps the loads independent, one wait for all of them (a flag
    a column, read one by one, cost 3 to 15% of v8's forward)."""
    chunks = parts.shape[1]
    bits = int32(0)
    for c in range(MAX_PARTS):
        if c < chunks:
            bits |= parts[bk, c, q]
    return uint32(bits)
