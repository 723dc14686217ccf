"""Attention kernels for NVIDIA GPUs in numba.cuda: forward and backward.

float32 storage and arithmetic (every constant is a float32, so no float64
instruction reaches the PTX), head dims 16-128 in multiples of 16, any N,
and the mask, padding, window and dropout semantics of `flashlab.tiled`.
The per-row algebra is `merge.row_step`, the mask rules
`masks.pair_allowed`, the dropout hash `dropout.keep_bits`: the same
functions the CPU kernels compile. See chapter 9.

The forward kernel exists in numbered versions that all stay correct:

- v1: one thread per query row, everything from global memory;
- v2: one thread per query row, K/V tiles staged in shared memory and
  shared by the whole block;
- v3: a 64 x 32 score tile per block of 128 threads, each thread holding
  a 4 x 4 piece of S and a 4-row slice of the output in registers;
- v4: v3 with the row softmax done by every thread on its own piece of
  S, partial maxima and sums meeting in shared memory.

The backward pass is two kernels without atomics, one for dK and dV over
key blocks and one for dQ over query blocks, so its gradients are bitwise
identical from run to run. For head dims up to 64 they are register
blocked like v4; larger head dims use one thread per key or query row.
"""

import contextlib
import math

import numpy as np
from numba import cuda, float32, uint64

from flashlab import dropout, kernel_args, masks, merge, tiled

if not hasattr(np, "row_stack"):  # numpy >= 2.5 removed it; numba-cuda
    np.row_stack = np.vstack  # 0.30 still calls it while compiling

VERSIONS = (1, 2, 3, 4)
# Tests set this to fill every output with NaN before a kernel runs, so an
# element a kernel fails to write cannot pass for a right answer.
POISON_OUTPUTS = False
THREADS = 128  # threads per block of v1 and v3
_F0 = np.float32(0)
_F1 = np.float32(1)
_NEG_INF = np.float32(-np.inf)
_LOWEST = np.float32(np.finfo(np.float32).min)

_row_step = cuda.jit(device=True)(merge.row_step)
_row_probability = cuda.jit(device=True)(merge.row_probability)
_pair_allowed = cuda.jit(device=True)(masks.pair_allowed)
_tile_skipped = cuda.jit(device=True)(masks.tile_skipped)
_tile_full = cuda.jit(device=True)(masks.tile_full)
_keep_bits = cuda.jit(device=True)(dropout.keep_bits)


@cuda.jit(device=True)
def _allowed(b, i, j, nq, nk, causal, offset, left, right, kv_len, mask,
             use_mask):
    """Pair (i, j) of batch element b is in range and allowed."""
    if i >= nq or j >= nk:
        return False
    ok = _pair_allowed(i, j, causal, offset, left, right, kv_len[b])
    if ok and use_mask:
        ok = mask[b, i, j] != 0
    return ok


@cuda.jit(device=True)
def _stage(dst, src, b, r0, rows, cols, scale, t, nthreads):
    """HBM -> SRAM: rows r0.. of src[b], times scale, into dst[:rows].

    Called by every thread of the block with its own t; rows past the end
    of src are zero-filled, so ragged tiles need no special case.
    """
    n = src.shape[1]
    for e in range(t, rows * cols, nthreads):
        r = e // cols
        x = e - r * cols
        dst[r, x] = src[b, r0 + r, x] * scale if r0 + r < n else _F0


@cuda.jit(device=True)
def _dropout_weight(b, i, j, seed, threshold, use_dropout, drop_scale):
    """1 / (1 - p) for a kept pair, 0 for a dropped one, 1 without dropout."""
    if not use_dropout:
        return drop_scale
    if _keep_bits(seed, uint64(b), uint64(i), uint64(j)) < threshold:
        return _F0
    return drop_scale


@cuda.jit(device=True)
def _score_piece(s, qa, q_s, k_s, r0, c0, rm, cn, d):
    """s[:rm, :cn] = rows r0.. of Q_i (SRAM) times cols c0.. of K_j^T.

    Each value loaded from SRAM feeds rm or cn multiply-adds: the point
    of register blocking. rm, cn, d are compile-time constants of the
    caller, so the loops unroll and s, qa stay in registers.
    """
    for a in range(rm):
        for c in range(cn):
            s[a, c] = _F0
    for x in range(d):
        for a in range(rm):
            qa[a] = q_s[r0 + a, x]
        for c in range(cn):
            kc = k_s[c0 + c, x]
            for a in range(rm):
                s[a, c] += qa[a] * kc


@cuda.jit(device=True)
def _output_piece(acc, pv, vv, al, p_s, v_s, r0, tx, rm, oc, bc, tx_n):
    """acc = al * acc + P_ij V_j for rows r0.. and columns tx, tx + tx_n..

    The tile's product is summed on its own first (a blocked sum: rounding
    grows with Bc + N / Bc rather than N), then added to the rescaled acc.
    """
    for a in range(rm):
        for c in range(oc):
            pv[a, c] = _F0
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


def _tiles(d, dv):
    """(Br, Bc) of v3 for head dims d, dv: fits 48 KiB of shared memory."""
    return (64, 32) if max(d, dv) <= 64 else (32, 16)


_cache = {}


def _kernel(name, d, dv):
    """The compiled kernel `name` for head dims d, dv (built once)."""
    key = (name, d, dv)
    if key not in _cache:
        _cache[key] = _FACTORIES[name](d, dv)
    return _cache[key]


def _make_v1(D, DV):
    """v1: one thread per query row; K and V read from global memory."""

    @cuda.jit
    def forward_v1(q, k, v, o, lse, scale, causal, offset, left, right,
                   kv_len, mask, use_mask, seed, threshold, use_dropout,
                   drop_scale):
        b = cuda.blockIdx.y
        i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        nq, nk = q.shape[1], k.shape[1]
        if i >= nq:
            return  # no barrier in this kernel, so early exit is safe
        q_i = cuda.local.array(D, float32)
        acc = cuda.local.array(DV, float32)
        for x in range(D):
            q_i[x] = q[b, i, x] * scale
        for x in range(DV):
            acc[x] = _F0
        m = _NEG_INF
        l = _F0
        for j in range(nk):  # online update, one key at a time
            if not _allowed(b, i, j, nq, nk, causal, offset, left, right,
                            kv_len, mask, use_mask):
                continue
            s = _F0
            for x in range(D):
                s += q_i[x] * k[b, j, x]
            m, shift, alpha = _row_step(m, s, _LOWEST)
            p = math.exp(s - shift)
            l = alpha * l + p
            p *= _dropout_weight(b, i, j, seed, threshold, use_dropout,
                                 drop_scale)
            for x in range(DV):
                acc[x] = alpha * acc[x] + p * v[b, j, x]
        _store_row(o, lse, b, i, acc, m, l, DV)

    return forward_v1


@cuda.jit(device=True)
def _store_row(o, lse, b, i, acc, m, l, dv):
    """O_i = u / l and lse_i = m + log l; 0 and -inf for an empty row."""
    if l > _F0:
        for x in range(dv):
            o[b, i, x] = acc[x] / l
        lse[b, i] = m + math.log(l)
    else:
        for x in range(dv):
            o[b, i, x] = _F0
        lse[b, i] = _NEG_INF


def _make_v2(D, DV):
    """v2: one thread per query row; K/V tiles shared through smem."""
    BC = 32  # keys per shared tile: 2 * 32 * 128 * 4 B = 32 KiB at most

    @cuda.jit
    def forward_v2(q, k, v, o, lse, scale, causal, offset, left, right,
                   kv_len, mask, use_mask, seed, threshold, use_dropout,
                   drop_scale):
        k_s = cuda.shared.array((BC, D), float32)
        v_s = cuda.shared.array((BC, DV), float32)
        q_i = cuda.local.array(D, float32)
        acc = cuda.local.array(DV, float32)
        pv = cuda.local.array(DV, float32)  # this tile's P_ij V_j
        s = cuda.local.array(BC, float32)
        t = cuda.threadIdx.x
        rows = cuda.blockDim.x
        b = cuda.blockIdx.y
        i0 = cuda.blockIdx.x * rows
        i = i0 + t
        nq, nk = q.shape[1], k.shape[1]
        i1 = min(i0 + rows, nq)
        for x in range(D):
            q_i[x] = q[b, i, x] * scale if i < nq else _F0
        for x in range(DV):
            acc[x] = _F0
        m = _NEG_INF
        l = _F0
        for j0 in range(0, nk, BC):
            if _tile_skipped(i0, i1, j0, min(j0 + BC, nk), causal, offset,
                             left, right, kv_len[b]):
                continue  # the same decision in every thread of the block
            # HBM -> SRAM: K_j, V_j (Bc (d + dv) floats), used by all rows
            _stage(k_s, k, b, j0, BC, D, _F1, t, rows)
            _stage(v_s, v, b, j0, BC, DV, _F1, t, rows)
            cuda.syncthreads()  # K_j, V_j fully loaded before any read
            tile_max = _NEG_INF
            for c in range(BC):
                if _allowed(b, i, j0 + c, nq, nk, causal, offset, left,
                            right, kv_len, mask, use_mask):
                    acc_s = _F0
                    for x in range(D):
                        acc_s += q_i[x] * k_s[c, x]
                    s[c] = acc_s
                else:
                    s[c] = _NEG_INF
                tile_max = max(tile_max, s[c])
            m, shift, alpha = _row_step(m, tile_max, _LOWEST)
            # Sum the tile on its own, then add it: a blocked sum, whose
            # rounding grows with Bc + N / Bc instead of N.
            row_sum = _F0
            for x in range(DV):
                pv[x] = _F0
            for c in range(BC):
                p = math.exp(s[c] - shift)
                row_sum += p
                p *= _dropout_weight(b, i, j0 + c, seed, threshold,
                                     use_dropout, drop_scale)
                for x in range(DV):
                    pv[x] += p * v_s[c, x]
            l = alpha * l + row_sum
            for x in range(DV):
                acc[x] = alpha * acc[x] + pv[x]
            cuda.syncthreads()  # every row is done with K_j, V_j
        if i < nq:
            _store_row(o, lse, b, i, acc, m, l, DV)

    return forward_v2


def _make_v3(D, DV):
    """v3: register-blocked tiles; see the module docstring."""
    BR, BC = _tiles(D, DV)
    RM = 4  # score and output rows per thread
    TY = BR // RM  # thread rows
    TX = THREADS // TY  # thread columns
    CN = BC // TX  # score columns per thread
    OC = DV // TX  # output columns per thread (strided by TX)
    DP = D + 1  # padded rows: column reads hit distinct banks
    BCP = BC + 1

    @cuda.jit
    def forward_v3(q, k, v, o, lse, scale, causal, offset, left, right,
                   kv_len, mask, use_mask, seed, threshold, use_dropout,
                   drop_scale):
        q_s = cuda.shared.array((BR, DP), float32)
        k_s = cuda.shared.array((BC, DP), float32)
        v_s = cuda.shared.array((BC, DV), float32)
        p_s = cuda.shared.array((BR, BCP), float32)
        m_s = cuda.shared.array(BR, float32)
        l_s = cuda.shared.array(BR, float32)
        a_s = cuda.shared.array(BR, float32)
        acc = cuda.local.array((RM, OC), float32)
        pv = cuda.local.array((RM, OC), float32)  # this tile's P_ij V_j
        al = cuda.local.array(RM, float32)  # each row's alpha
        s = cuda.local.array((RM, CN), float32)
        qa = cuda.local.array(RM, float32)
        vv = cuda.local.array(OC, float32)
        t = cuda.threadIdx.x
        ty, tx = t // TX, t % TX
        b = cuda.blockIdx.y
        i0 = cuda.blockIdx.x * BR
        nq, nk = q.shape[1], k.shape[1]
        i1 = min(i0 + BR, nq)
        kv = kv_len[b]
        # HBM -> SRAM once: Q_i scaled by tau (Br d floats)
        _stage(q_s, q, b, i0, BR, D, scale, t, THREADS)
        if t < BR:
            m_s[t] = _NEG_INF
            l_s[t] = _F0
        for a in range(RM):
            for c in range(OC):
                acc[a, c] = _F0
        cuda.syncthreads()  # Q_i and the row state exist before tile 0
        for j0 in range(0, nk, BC):
            j1 = min(j0 + BC, nk)
            if _tile_skipped(i0, i1, j0, j1, causal, offset, left, right,
                             kv):
                continue  # uniform over the block: barriers stay aligned
            full = (not use_mask and j1 - j0 == BC
                    and _tile_full(i0, i1, j0, j1, causal, offset, left,
                                   right, kv))
            # HBM -> SRAM: K_j, V_j (Bc (d + dv) floats), used by Br rows
            _stage(k_s, k, b, j0, BC, D, _F1, t, THREADS)
            _stage(v_s, v, b, j0, BC, DV, _F1, t, THREADS)
            cuda.syncthreads()  # K_j, V_j loaded before any thread reads
            # S_ij = Q_i K_j^T: a RM x CN piece per thread, in registers
            _score_piece(s, qa, q_s, k_s, ty * RM, tx * CN, RM, CN, D)
            for a in range(RM):
                r = ty * RM + a
                for c in range(CN):
                    col = tx * CN + c
                    if full or _allowed(b, i0 + r, j0 + col, nq, nk,
                                        causal, offset, left, right,
                                        kv_len, mask, use_mask):
                        p_s[r, col] = s[a, c]
                    else:
                        p_s[r, col] = _NEG_INF
            cuda.syncthreads()  # all of S_ij in SRAM before row statistics
            if t < BR:  # one thread per row: max, exp, l, alpha
                tile_max = _NEG_INF
                for c in range(BC):
                    tile_max = max(tile_max, p_s[t, c])
                m_new, shift, alpha = _row_step(m_s[t], tile_max, _LOWEST)
                row_sum = _F0
                for c in range(BC):
                    p = math.exp(p_s[t, c] - shift)
                    row_sum += p
                    p_s[t, c] = p * _dropout_weight(
                        b, i0 + t, j0 + c, seed, threshold, use_dropout,
                        drop_scale)
                l_s[t] = alpha * l_s[t] + row_sum
                m_s[t] = m_new
                a_s[t] = alpha
            cuda.syncthreads()  # P_ij and alpha ready for the O update
            # O_i = alpha O_i + P_ij V_j: RM rows x OC columns per thread
            for a in range(RM):
                al[a] = a_s[ty * RM + a]
            _output_piece(acc, pv, vv, al, p_s, v_s, ty * RM, tx, RM, OC,
                          BC, TX)
            cuda.syncthreads()  # K_j, V_j, P_ij consumed before reuse
        for a in range(RM):
            r = ty * RM + a
            if i0 + r < nq:
                l = l_s[r]
                for c in range(OC):
                    o[b, i0 + r, tx + TX * c] = (acc[a, c] / l if l > _F0
                                                 else _F0)
        if t < BR and i0 + t < nq:
            l = l_s[t]
            lse[b, i0 + t] = m_s[t] + math.log(l) if l > _F0 else _NEG_INF

    return forward_v3


def _make_v4(D, DV):
    """v4: v3 with the row softmax spread over all threads, in registers.

    In v3 one thread per row runs the max, exp and sum of a whole tile row
    while the other half of the block waits. Here every thread works on
    its own RM x CN piece of S: partial row maxima and sums meet in shared
    memory, and each thread rescales and exponentiates in registers.
    """
    BR, BC = _tiles(D, DV)
    RM = 4
    TY = BR // RM
    TX = THREADS // TY
    CN = BC // TX
    OC = DV // TX
    DP = D + 1
    BCP = BC + 1

    @cuda.jit
    def forward_v4(q, k, v, o, lse, scale, causal, offset, left, right,
                   kv_len, mask, use_mask, seed, threshold, use_dropout,
                   drop_scale):
        q_s = cuda.shared.array((BR, DP), float32)
        k_s = cuda.shared.array((BC, DP), float32)
        v_s = cuda.shared.array((BC, DV), float32)
        p_s = cuda.shared.array((BR, BCP), float32)
        red_s = cuda.shared.array((BR, TX), float32)  # partial maxima
        acc = cuda.local.array((RM, OC), float32)
        pv = cuda.local.array((RM, OC), float32)  # this tile's P_ij V_j
        al = cuda.local.array(RM, float32)  # each row's alpha
        s = cuda.local.array((RM, CN), float32)
        m = cuda.local.array(RM, float32)  # every thread of a row keeps
        l = cuda.local.array(RM, float32)  # the same m and l
        qa = cuda.local.array(RM, float32)
        vv = cuda.local.array(OC, float32)
        t = cuda.threadIdx.x
        ty, tx = t // TX, t % TX
        b = cuda.blockIdx.y
        i0 = cuda.blockIdx.x * BR
        nq, nk = q.shape[1], k.shape[1]
        i1 = min(i0 + BR, nq)
        kv = kv_len[b]
        _stage(q_s, q, b, i0, BR, D, scale, t, THREADS)
        for a in range(RM):
            m[a] = _NEG_INF
            l[a] = _F0
            for c in range(OC):
                acc[a, c] = _F0
        cuda.syncthreads()  # Q_i is in SRAM before tile 0
        for j0 in range(0, nk, BC):
            j1 = min(j0 + BC, nk)
            if _tile_skipped(i0, i1, j0, j1, causal, offset, left, right,
                             kv):
                continue  # uniform over the block: barriers stay aligned
            full = (not use_mask and j1 - j0 == BC
                    and _tile_full(i0, i1, j0, j1, causal, offset, left,
                                   right, kv))
            _stage(k_s, k, b, j0, BC, D, _F1, t, THREADS)
            _stage(v_s, v, b, j0, BC, DV, _F1, t, THREADS)
            cuda.syncthreads()  # K_j, V_j loaded before any thread reads
            _score_piece(s, qa, q_s, k_s, ty * RM, tx * CN, RM, CN, D)
            for a in range(RM):  # mask, and this thread's row maxima
                part = _NEG_INF
                for c in range(CN):
                    if not (full or _allowed(
                            b, i0 + ty * RM + a, j0 + tx * CN + c, nq, nk,
                            causal, offset, left, right, kv_len, mask,
                            use_mask)):
                        s[a, c] = _NEG_INF
                    part = max(part, s[a, c])
                red_s[ty * RM + a, tx] = part
            cuda.syncthreads()  # all partial maxima written
            for a in range(RM):
                r = ty * RM + a
                tile_max = red_s[r, 0]
                for c in range(1, TX):
                    tile_max = max(tile_max, red_s[r, c])
                m[a], shift, alpha = _row_step(m[a], tile_max, _LOWEST)
                part = _F0
                for c in range(CN):
                    p = math.exp(s[a, c] - shift)
                    part += p
                    p_s[r, tx * CN + c] = p * _dropout_weight(
                        b, i0 + r, j0 + tx * CN + c, seed, threshold,
                        use_dropout, drop_scale)
                l[a] = alpha * l[a] + part  # this thread's share of l
                al[a] = alpha
            cuda.syncthreads()  # P_ij complete before the O update
            _output_piece(acc, pv, vv, al, p_s, v_s, ty * RM, tx, RM, OC,
                          BC, TX)
            cuda.syncthreads()  # K_j, V_j, P_ij, red_s free for reuse
        # l is split over the TX threads of a row: add the shares up
        for a in range(RM):
            red_s[ty * RM + a, tx] = l[a]
        cuda.syncthreads()  # every share of l written
        for a in range(RM):
            r = ty * RM + a
            total = _F0
            for c in range(TX):
                total += red_s[r, c]
            if i0 + r < nq:
                for c in range(OC):
                    o[b, i0 + r, tx + TX * c] = (acc[a, c] / total
                                                 if total > _F0 else _F0)
                if tx == 0:
                    lse[b, i0 + r] = (m[a] + math.log(total)
                                      if total > _F0 else _NEG_INF)

    return forward_v4


def _backward_sizes(D, DV):
    """(threads per block, rows per staged chunk) of the backward kernels."""
    return (64, 16) if max(D, DV) <= 64 else (32, 8)


def _make_backward_kv(D, DV):
    """dK, dV: one thread per key row; query chunks staged in SRAM."""
    NT, CH = _backward_sizes(D, DV)
    DP, DVP = D + 1, DV + 1  # padded own rows: conflict-free reads

    @cuda.jit
    def backward_kv(q, k, v, do, lse, delta, dk, dv, scale, causal, offset,
                    left, right, kv_len, mask, use_mask, seed, threshold,
                    use_dropout, drop_scale):
        k_s = cuda.shared.array((NT, DP), float32)  # own rows, padded
        v_s = cuda.shared.array((NT, DVP), float32)
        q_s = cuda.shared.array((CH, D), float32)
        do_s = cuda.shared.array((CH, DV), float32)
        lse_s = cuda.shared.array(CH, float32)
        dl_s = cuda.shared.array(CH, float32)
        dk_j = cuda.local.array(D, float32)
        dv_j = cuda.local.array(DV, float32)
        pk = cuda.local.array(D, float32)  # this chunk's share, summed
        pvv = cuda.local.array(DV, float32)  # apart (a blocked sum)
        t = cuda.threadIdx.x
        b = cuda.blockIdx.y
        j0 = cuda.blockIdx.x * NT
        j = j0 + t
        nq, nk = q.shape[1], k.shape[1]
        j1 = min(j0 + NT, nk)
        for x in range(D):
            k_s[t, x] = k[b, j, x] if j < nk else _F0
            dk_j[x] = _F0
        for x in range(DV):
            v_s[t, x] = v[b, j, x] if j < nk else _F0
            dv_j[x] = _F0
        for i0 in range(0, nq, CH):
            if _tile_skipped(i0, min(i0 + CH, nq), j0, j1, causal, offset,
                             left, right, kv_len[b]):
                continue
            cuda.syncthreads()  # the previous chunk is no longer read
            _stage(q_s, q, b, i0, CH, D, scale, t, NT)
            _stage(do_s, do, b, i0, CH, DV, _F1, t, NT)
            if t < CH:
                inside = i0 + t < nq
                lse_s[t] = lse[b, i0 + t] if inside else _NEG_INF
                dl_s[t] = delta[b, i0 + t] if inside else _F0
            cuda.syncthreads()  # the chunk of Q, dO, lse, D is loaded
            for x in range(D):
                pk[x] = _F0
            for x in range(DV):
                pvv[x] = _F0
            for r in range(CH):
                if not _allowed(b, i0 + r, j, nq, nk, causal, offset, left,
                                right, kv_len, mask, use_mask):
                    continue
                s = _F0
                for x in range(D):
                    s += q_s[r, x] * k_s[t, x]
                p = _row_probability(s, lse_s[r], _LOWEST)
                dp = _F0
                for x in range(DV):
                    dp += do_s[r, x] * v_s[t, x]
                z = _dropout_weight(b, i0 + r, j, seed, threshold,
                                    use_dropout, drop_scale)
                pz = p * z
                ds = p * (dp * z - dl_s[r])
                for x in range(DV):
                    pvv[x] += pz * do_s[r, x]
                for x in range(D):
                    pk[x] += ds * q_s[r, x]  # q_s already holds tau Q
            for x in range(D):
                dk_j[x] += pk[x]
            for x in range(DV):
                dv_j[x] += pvv[x]
        if j < nk:
            for x in range(D):
                dk[b, j, x] = dk_j[x]
            for x in range(DV):
                dv[b, j, x] = dv_j[x]

    return backward_kv


def _make_backward_q(D, DV):
    """dQ: one thread per query row; key chunks staged in SRAM."""
    NT, CH = _backward_sizes(D, DV)
    DP, DVP = D + 1, DV + 1  # padded own rows: conflict-free reads

    @cuda.jit
    def backward_q(q, k, v, do, lse, delta, dq, scale, causal, offset, left,
                   right, kv_len, mask, use_mask, seed, threshold,
                   use_dropout, drop_scale):
        q_s = cuda.shared.array((NT, DP), float32)  # own rows, padded
        do_s = cuda.shared.array((NT, DVP), float32)
        k_s = cuda.shared.array((CH, D), float32)
        v_s = cuda.shared.array((CH, DV), float32)
        dq_i = cuda.local.array(D, float32)
        pq = cuda.local.array(D, float32)  # this chunk's share
        t = cuda.threadIdx.x
        b = cuda.blockIdx.y
        i0 = cuda.blockIdx.x * NT
        i = i0 + t
        nq, nk = q.shape[1], k.shape[1]
        i1 = min(i0 + NT, nq)
        for x in range(D):
            q_s[t, x] = q[b, i, x] * scale if i < nq else _F0
            dq_i[x] = _F0
        for x in range(DV):
            do_s[t, x] = do[b, i, x] if i < nq else _F0
        lse_i = lse[b, i] if i < nq else _NEG_INF
        d_i = delta[b, i] if i < nq else _F0
        for j0 in range(0, nk, CH):
            if _tile_skipped(i0, i1, j0, min(j0 + CH, nk), causal, offset,
                             left, right, kv_len[b]):
                continue
            cuda.syncthreads()  # the previous chunk is no longer read
            _stage(k_s, k, b, j0, CH, D, _F1, t, NT)
            _stage(v_s, v, b, j0, CH, DV, _F1, t, NT)
            cuda.syncthreads()  # the chunk of K and V is loaded
            for x in range(D):
                pq[x] = _F0
            for c in range(CH):
                if not _allowed(b, i, j0 + c, nq, nk, causal, offset, left,
                                right, kv_len, mask, use_mask):
                    continue
                s = _F0
                for x in range(D):
                    s += q_s[t, x] * k_s[c, x]
                p = _row_probability(s, lse_i, _LOWEST)
                dp = _F0
                for x in range(DV):
                    dp += do_s[t, x] * v_s[c, x]
                z = _dropout_weight(b, i, j0 + c, seed, threshold,
                                    use_dropout, drop_scale)
                ds = p * (dp * z - d_i) * scale
                for x in range(D):
                    pq[x] += ds * k_s[c, x]
            for x in range(D):
                dq_i[x] += pq[x]
        if i < nq:
            for x in range(D):
                dq[b, i, x] = dq_i[x]

    return backward_q


BLOCK_BWD = 32  # keys (dK/dV pass) or queries (dQ pass) per blocked tile
BLOCKED_MAX_DIM = 64  # larger head dims would overflow 48 KiB of SRAM


def _make_backward_kv_blocked(D, DV):
    """dK, dV with register blocking, for head dims up to 64.

    A block owns 32 keys and walks over chunks of 32 queries. Each of its
    128 threads computes a 4 x 2 piece of S^T = K_j Q_i^T and of
    dP^T = V_j dO_i^T in registers, then 4 rows of dV_j += (P Z)^T dO_i
    and dK_j += dS^T Q_i; no atomics, so the result is bitwise repeatable.
    """
    BK = BQ = BLOCK_BWD
    RM = 4
    TY = BK // RM
    TX = THREADS // TY
    CN = BQ // TX
    OK_, OV = D // TX, DV // TX
    DP, DVP, BQP = D + 1, DV + 1, BQ + 1

    @cuda.jit
    def backward_kv_blocked(q, k, v, do, lse, delta, dk, dv, scale, causal,
                            offset, left, right, kv_len, mask, use_mask,
                            seed, threshold, use_dropout, drop_scale):
        k_s = cuda.shared.array((BK, DP), float32)
        v_s = cuda.shared.array((BK, DVP), float32)
        q_s = cuda.shared.array((BQ, DP), float32)
        do_s = cuda.shared.array((BQ, DVP), float32)
        pt_s = cuda.shared.array((BK, BQP), float32)  # (P Z)^T
        dst_s = cuda.shared.array((BK, BQP), float32)  # dS^T
        lse_s = cuda.shared.array(BQ, float32)
        dl_s = cuda.shared.array(BQ, float32)
        s = cuda.local.array((RM, CN), float32)
        dp = cuda.local.array((RM, CN), float32)
        qa = cuda.local.array(RM, float32)
        ones = cuda.local.array(RM, float32)
        acc_k = cuda.local.array((RM, OK_), float32)
        acc_v = cuda.local.array((RM, OV), float32)
        pk = cuda.local.array((RM, OK_), float32)
        pvv = cuda.local.array((RM, OV), float32)
        vk = cuda.local.array(OK_, float32)
        vv = cuda.local.array(OV, float32)
        t = cuda.threadIdx.x
        ty, tx = t // TX, t % TX
        b = cuda.blockIdx.y
        j0 = cuda.blockIdx.x * BK
        nq, nk = q.shape[1], k.shape[1]
        j1 = min(j0 + BK, nk)
        kv = kv_len[b]
        for a in range(RM):
            ones[a] = _F1
            for c in range(OK_):
                acc_k[a, c] = _F0
            for c in range(OV):
                acc_v[a, c] = _F0
        # HBM -> SRAM once: K_j, V_j, used against every query chunk
        _stage(k_s, k, b, j0, BK, D, _F1, t, THREADS)
        _stage(v_s, v, b, j0, BK, DV, _F1, t, THREADS)
        for i0 in range(0, nq, BQ):
            i1 = min(i0 + BQ, nq)
            if _tile_skipped(i0, i1, j0, j1, causal, offset, left, right,
                             kv):
                continue  # uniform over the block: barriers stay aligned
            cuda.syncthreads()  # the previous chunk is no longer read
            _stage(q_s, q, b, i0, BQ, D, scale, t, THREADS)
            _stage(do_s, do, b, i0, BQ, DV, _F1, t, THREADS)
            if t < BQ:
                inside = i0 + t < nq
                lse_s[t] = lse[b, i0 + t] if inside else _NEG_INF
                dl_s[t] = delta[b, i0 + t] if inside else _F0
            cuda.syncthreads()  # K_j, V_j and this chunk are in SRAM
            _score_piece(s, qa, k_s, q_s, ty * RM, tx * CN, RM, CN, D)
            _score_piece(dp, qa, v_s, do_s, ty * RM, tx * CN, RM, CN, DV)
            for a in range(RM):
                r = ty * RM + a  # key row in the block
                for c in range(CN):
                    col = tx * CN + c  # query in the chunk
                    i, j = i0 + col, j0 + r
                    if _allowed(b, i, j, nq, nk, causal, offset, left,
                                right, kv_len, mask, use_mask):
                        p = _row_probability(s[a, c], lse_s[col], _LOWEST)
                        z = _dropout_weight(b, i, j, seed, threshold,
                                            use_dropout, drop_scale)
                        pt_s[r, col] = p * z
                        dst_s[r, col] = p * (dp[a, c] * z - dl_s[col])
                    else:
                        pt_s[r, col] = _F0
                        dst_s[r, col] = _F0
            cuda.syncthreads()  # (P Z)^T and dS^T complete
            _output_piece(acc_v, pvv, vv, ones, pt_s, do_s, ty * RM, tx, RM,
                          OV, BQ, TX)
            _output_piece(acc_k, pk, vk, ones, dst_s, q_s, ty * RM, tx, RM,
                          OK_, BQ, TX)  # q_s holds tau Q: dK = tau dS^T Q
        for a in range(RM):
            j = j0 + ty * RM + a
            if j < nk:
                for c in range(OK_):
                    dk[b, j, tx + TX * c] = acc_k[a, c]
                for c in range(OV):
                    dv[b, j, tx + TX * c] = acc_v[a, c]

    return backward_kv_blocked


def _make_backward_q_blocked(D, DV):
    """dQ with register blocking, for head dims up to 64.

    A block owns 32 queries and walks over chunks of 32 keys; each thread
    computes a 4 x 2 piece of S and dP, then 4 rows of dQ_i += tau dS K_j.
    """
    BQ = BK = BLOCK_BWD
    RM = 4
    TY = BQ // RM
    TX = THREADS // TY
    CN = BK // TX
    OQ = D // TX
    DP, DVP, BKP = D + 1, DV + 1, BK + 1

    @cuda.jit
    def backward_q_blocked(q, k, v, do, lse, delta, dq, scale, causal,
                           offset, left, right, kv_len, mask, use_mask,
                           seed, threshold, use_dropout, drop_scale):
        q_s = cuda.shared.array((BQ, DP), float32)
        do_s = cuda.shared.array((BQ, DVP), float32)
        k_s = cuda.shared.array((BK, DP), float32)
        v_s = cuda.shared.array((BK, DVP), float32)
        ds_s = cuda.shared.array((BQ, BKP), float32)
        lse_s = cuda.shared.array(BQ, float32)
        dl_s = cuda.shared.array(BQ, float32)
        s = cuda.local.array((RM, CN), float32)
        dp = cuda.local.array((RM, CN), float32)
        qa = cuda.local.array(RM, float32)
        ones = cuda.local.array(RM, float32)
        acc = cuda.local.array((RM, OQ), float32)
        pq = cuda.local.array((RM, OQ), float32)
        vq = cuda.local.array(OQ, float32)
        t = cuda.threadIdx.x
        ty, tx = t // TX, t % TX
        b = cuda.blockIdx.y
        i0 = cuda.blockIdx.x * BQ
        nq, nk = q.shape[1], k.shape[1]
        i1 = min(i0 + BQ, nq)
        kv = kv_len[b]
        for a in range(RM):
            ones[a] = _F1
            for c in range(OQ):
                acc[a, c] = _F0
        _stage(q_s, q, b, i0, BQ, D, scale, t, THREADS)
        _stage(do_s, do, b, i0, BQ, DV, _F1, t, THREADS)
        if t < BQ:
            inside = i0 + t < nq
            lse_s[t] = lse[b, i0 + t] if inside else _NEG_INF
            dl_s[t] = delta[b, i0 + t] if inside else _F0
        for j0 in range(0, nk, BK):
            j1 = min(j0 + BK, nk)
            if _tile_skipped(i0, i1, j0, j1, causal, offset, left, right,
                             kv):
                continue  # uniform over the block: barriers stay aligned
            cuda.syncthreads()  # the previous chunk is no longer read
            _stage(k_s, k, b, j0, BK, D, _F1, t, THREADS)
            _stage(v_s, v, b, j0, BK, DV, _F1, t, THREADS)
            cuda.syncthreads()  # Q_i, dO_i and this K/V chunk are in SRAM
            _score_piece(s, qa, q_s, k_s, ty * RM, tx * CN, RM, CN, D)
            _score_piece(dp, qa, do_s, v_s, ty * RM, tx * CN, RM, CN, DV)
            for a in range(RM):
                r = ty * RM + a  # query row in the block
                for c in range(CN):
                    col = tx * CN + c  # key in the chunk
                    i, j = i0 + r, j0 + col
                    if _allowed(b, i, j, nq, nk, causal, offset, left,
                                right, kv_len, mask, use_mask):
                        p = _row_probability(s[a, c], lse_s[r], _LOWEST)
                        z = _dropout_weight(b, i, j, seed, threshold,
                                            use_dropout, drop_scale)
                        ds_s[r, col] = p * (dp[a, c] * z - dl_s[r]) * scale
                    else:
                        ds_s[r, col] = _F0
            cuda.syncthreads()  # tau dS_ij complete
            _output_piece(acc, pq, vq, ones, ds_s, k_s, ty * RM, tx, RM, OQ,
                          BK, TX)
        for a in range(RM):
            i = i0 + ty * RM + a
            if i < nq:
                for c in range(OQ):
                    dq[b, i, tx + TX * c] = acc[a, c]

    return backward_q_blocked


_FACTORIES = {
    "forward_v1": _make_v1,
    "forward_v2": _make_v2,
    "forward_v3": _make_v3,
    "forward_v4": _make_v4,
    "backward_kv": _make_backward_kv,
    "backward_q": _make_backward_q,
    "backward_kv_blocked": _make_backward_kv_blocked,
    "backward_q_blocked": _make_backward_q_blocked,
}


def _launch_forward(version, d, dv, bh, nq):
    """(kernel, grid, block) of a forward version."""
    if version >= 3:
        br, _ = _tiles(d, dv)
        return (_kernel(f"forward_v{version}", d, dv),
                (math.ceil(nq / br), bh), THREADS)
    rows = THREADS if version == 1 else 64
    return (_kernel(f"forward_v{version}", d, dv),
            (math.ceil(nq / rows), bh), rows)


# ---------------------------------------------------------------- hosts

def _check_device_inputs(named):
    """float32, head dims 16..128 in steps of 16; returns dims (d, dv)."""
    for name, x in named:
        if str(x.dtype).removeprefix("torch.") != "float32":
            raise TypeError(
                f"{name}: flashlab.gpu computes in float32, got dtype "
                f"{x.dtype}"
            )
    d, dv = named[0][1].shape[-1], named[2][1].shape[-1]
    for name, size in (("q", d), ("v", dv)):
        if size % 16 or not 16 <= size <= 128:
            raise ValueError(
                f"{name}: expected a head dim in 16, 32, ..., 128 for "
                f"flashlab.gpu, got {size}"
            )
    return d, dv


class _Device:
    """Moves arrays of one kind (numpy, numba device, torch) to kernels."""

    def __init__(self, like):
        self.torch = type(like).__module__.startswith("torch")
        self.numpy = isinstance(like, np.ndarray)
        self.stream = 0
        if self.torch:  # launch on torch's stream: ordered, no syncs
            import torch

            self.stream = cuda.external_stream(
                torch.cuda.current_stream(like.device).cuda_stream)

    def to_kernel(self, x, shape):
        """A device view (or copy, for numpy) of x with the given shape."""
        if self.torch:
            return cuda.as_cuda_array(x.detach().contiguous().view(shape),
                                      sync=False)
        if self.numpy:
            return cuda.to_device(np.ascontiguousarray(x).reshape(shape))
        return x.reshape(shape)

    def empty(self, shape, like):
        """An uninitialized float32 output and its device view."""
        if self.torch:
            import torch

            out = torch.empty(shape, dtype=torch.float32, device=like.device)
            if POISON_OUTPUTS:
                out.fill_(float("nan"))
            return out, cuda.as_cuda_array(out, sync=False)
        if POISON_OUTPUTS:
            dev = cuda.to_device(np.full(shape, np.nan, dtype=np.float32))
        else:
            dev = cuda.device_array(shape, dtype=np.float32)
        return dev, dev

    def result(self, out, shape):
        """The output in the caller's kind, with the caller's shape."""
        if self.torch:
            return out.view(shape)
        if self.numpy:
            return out.copy_to_host().reshape(shape)
        return out.reshape(shape)


def _prepare(q, k, v, options):
    d, dv = _check_device_inputs((("q", q), ("k", k), ("v", v)))
    _, _, _, batch, p, a = kernel_args.flatten(
        *(kernel_args.proxy(x) for x in (q, k, v)), options)
    bh = int(np.prod(batch))
    scalars = (np.float32(a.scale), a.causal, a.offset, a.left, a.right,
               _on_device(a.kv_len, options.get("kv_lengths") is None),
               _on_device(a.mask.astype(np.uint8), not a.use_mask),
               a.use_mask, a.seed, a.threshold, a.use_dropout,
               np.float32(a.drop_scale))
    return d, dv, batch, bh, p, scalars


_constants = {}


def _on_device(x, constant):
    """x on the device; copied once and kept when it is a default value.

    The kv_len of unpadded batches and the unused mask are the same for
    every call of a shape, so only the first call pays for the copy.
    """
    if not constant:
        return cuda.to_device(x)
    key = (x.dtype.str, x.shape, x.tobytes())
    if key not in _constants:
        _constants[key] = cuda.to_device(x)
    return _constants[key]


def attention(q, k, v, *, version=4, return_lse=False, **options):
    """GPU attention. q (..., Nq, d), k (..., Nk, d), v (..., Nk, dv).

    Arrays may be torch CUDA tensors (used in place), numba device arrays,
    or numpy arrays (copied over and back); the result is of the same
    kind. Options as tiled.attention, without block sizes.
    """
    if version not in VERSIONS:
        raise ValueError(f"version: expected one of {VERSIONS}, got "
                         f"{version!r}")
    d, dv, batch, bh, p, scalars = _prepare(q, k, v, options)
    dev = _Device(q)
    qk = dev.to_kernel(q, (bh, p.nq, d))
    kk = dev.to_kernel(k, (bh, p.nk, d))
    vk = dev.to_kernel(v, (bh, p.nk, dv))
    o, o_k = dev.empty((bh, p.nq, dv), q)
    lse, lse_k = dev.empty((bh, p.nq), q)
    kernel, grid, block = _launch_forward(version, d, dv, bh, p.nq)
    kernel[grid, block, dev.stream](qk, kk, vk, o_k, lse_k, *scalars)
    o = dev.result(o, (*batch, p.nq, dv))
    return (o, dev.result(lse, (*batch, p.nq))) if return_lse else o


def attention_backward(q, k, v, o, lse, do, **options):
    """GPU gradients (dq, dk, dv); deterministic. Arguments as the forward."""
    d, dv, batch, bh, p, scalars = _prepare(q, k, v, options)
    tiled.check_saved(*(kernel_args.proxy(x) for x in (q, v, o, lse, do)))
    dev = _Device(q)
    qk = dev.to_kernel(q, (bh, p.nq, d))
    kk = dev.to_kernel(k, (bh, p.nk, d))
    vk = dev.to_kernel(v, (bh, p.nk, dv))
    ok = dev.to_kernel(o, (bh, p.nq, dv))
    dok = dev.to_kernel(do, (bh, p.nq, dv))
    lsek = dev.to_kernel(lse, (bh, p.nq))
    delta, delta_k = dev.empty((bh, p.nq), q)
    _row_dot[(math.ceil(p.nq / THREADS), bh), THREADS, dev.stream](
        dok, ok, delta_k)
    dq, dq_k = dev.empty((bh, p.nq, d), q)
    dk, dk_k = dev.empty((bh, p.nk, d), q)
    dvv, dv_k = dev.empty((bh, p.nk, dv), q)
    if max(d, dv) <= BLOCKED_MAX_DIM:
        suffix, nt, rows = "_blocked", THREADS, BLOCK_BWD
    else:
        suffix, (nt, _) = "", _backward_sizes(d, dv)
        rows = nt
    _kernel("backward_kv" + suffix, d, dv)[(math.ceil(p.nk / rows), bh), nt,
                                           dev.stream](
        qk, kk, vk, dok, lsek, delta_k, dk_k, dv_k, *scalars)
    _kernel("backward_q" + suffix, d, dv)[(math.ceil(p.nq / rows), bh), nt,
                                          dev.stream](
        qk, kk, vk, dok, lsek, delta_k, dq_k, *scalars)
    return (dev.result(dq, (*batch, p.nq, d)),
            dev.result(dk, (*batch, p.nk, d)),
            dev.result(dvv, (*batch, p.nk, dv)))


@cuda.jit
def _row_dot(do, o, delta):
    """D_i = rowsum(dO_i * O_i), one thread per row."""
    b = cuda.blockIdx.y
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i < o.shape[1]:
        acc = _F0
        for x in range(o.shape[2]):
            acc += do[b, i, x] * o[b, i, x]
        delta[b, i] = acc


# ------------------------------------------------------- compile checks

def _signature(name):
    """Argument types of a kernel, for compiling without a GPU."""
    from numba import boolean, int64, uint8

    a3 = float32[:, :, ::1]
    a2 = float32[:, ::1]
    rules = (float32, boolean, int64, int64, int64, int64[::1],
             uint8[:, :, ::1], boolean, uint64, uint64, boolean, float32)
    arrays = {
        "backward_kv": (a3, a3, a3, a3, a2, a2, a3, a3),
        "backward_q": (a3, a3, a3, a3, a2, a2, a3),
    }.get(name.removesuffix("_blocked"), (a3, a3, a3, a3, a2))
    return (*arrays, *rules)


def kernel_names():
    """Every kernel flashlab.gpu can launch."""
    return tuple(_FACTORIES)


def supports(name, d, dv):
    """Whether kernel `name` is built for head dims d, dv."""
    return not name.endswith("_blocked") or max(d, dv) <= BLOCKED_MAX_DIM


@contextlib.contextmanager
def _compiling_without_gpu(cc):
    """Let numba-cuda compile device functions with no GPU present.

    It asks the current device for its compute capability when it
    compiles a device function; a machine without a GPU has none, so for
    the duration it is told `cc` instead.
    """
    from types import SimpleNamespace

    from numba.cuda import dispatcher

    real = dispatcher.get_current_device
    dispatcher.get_current_device = lambda: SimpleNamespace(
        compute_capability=cc)
    try:
        yield
    finally:
        dispatcher.get_current_device = real


def compile_ptx(name, d, dv, cc=(9, 0)):
    """PTX of kernel `name` for head dims d, dv; needs no GPU."""
    kernel = _FACTORIES[name](d, dv)
    with _compiling_without_gpu(cc):
        ptx, _ = cuda.compile_ptx(kernel.py_func, _signature(name), cc=cc)
    return ptx
