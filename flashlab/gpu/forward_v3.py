"""Forward v3: register-blocked score tiles, one thread per row softmax.

A block of THREADS threads owns BR query rows and walks over K/V tiles of
BC keys (`device.tiles`). Each thread computes an RM x CN piece of
S_ij = Q_i K_j^T in registers, so every value it loads from SRAM feeds
several multiply-adds, and keeps RM rows of the output. The tile goes to
SRAM, where one thread per row finds the maximum, exponentiates and sums.

Split-KV: a grid with gridDim.z = S splits the keys into S ranges of
whole tiles; block z writes the partial output of its range to row block
z of o (S x BH rows) and its rows' max and sum to lse, given twice as
many rows (the maxes, then the sums: m + log l would round log l away
at large |m|), and `device.combine_splits` joins them. With S = 1 and
lse of o's rows this is the plain kernel. See chapter 11.
"""

import math

from numba import cuda, float32

from flashlab.gpu.device import (
    F0,
    NEG_INF,
    THREADS,
    dropout_weight,
    jit,
    open_tile,
    output_piece,
    row_step,
    stage,
    tiles,
)

# 4 blocks of THREADS threads per SM need <= 128 registers per thread
# (64K registers per SM); left alone, the compiler takes more and one
# block in four no longer fits. At d = 128 the cap costs nothing; at
# d <= 64 today's assembler spills a little to keep under it (local
# bytes in flashlab/data/resources_h200.txt; bench_h200 was measured
# with an older one that did not).
MAX_REGISTERS = 128
BLOCKS_PER_SM = 4  # what that cap buys (65536 / (128 x THREADS))


def shape(d, d_v):
    """(Br, Bc, threads per block) for head dims d, d_v."""
    tl = tiles(d, d_v)
    return tl.BR, tl.BC, THREADS


def make(D, D_V):
    """The v3 kernel for head dims D, D_V (compile-time constants)."""
    BR, BC, RM, TX, CN, OC, DP, BCP = tiles(D, D_V)

    @jit(max_registers=MAX_REGISTERS)
    def forward_v3(q, k, v, o, lse, rules, kv_len, mask):
        q_s = cuda.shared.array((BR, DP), float32)
        k_s = cuda.shared.array((BC, DP), float32)
        v_s = cuda.shared.array((BC, D_V), float32)
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
        # HBM -> SRAM once: Q_i scaled by tau (Br d floats)
        stage(q_s, q, b, i0, BR, D, rules.scale, t, THREADS)
        if t < BR:
            m_s[t] = NEG_INF
            l_s[t] = F0
        for a in range(RM):
            for c in range(OC):
                acc[a, c] = F0
        cuda.syncthreads()  # Q_i and the row state exist before tile 0
        # this block's key range: whole tiles, split z of gridDim.z
        per = (nk + BC * cuda.gridDim.z - 1) // (BC * cuda.gridDim.z) * BC
        out = cuda.blockIdx.z * q.shape[0] + b  # its row block of o, lse
        for j0 in range(cuda.blockIdx.z * per,
                        min(nk, (cuda.blockIdx.z + 1) * per), BC):
            if not open_tile(s, qa, q_s, k_s, v_s, k, v, b, i0, i1, j0, nq,
                             rules, kv_len, mask, t, BC, RM, CN, D, D_V):
                continue
            for a in range(RM):
                for c in range(CN):
                    p_s[ty * RM + a, tx * CN + c] = s[a, c]
            cuda.syncthreads()  # all of S_ij in SRAM before row statistics
            if t < BR:  # one thread per row: max, exp, l, alpha
                tile_max = NEG_INF
                for c in range(BC):
                    tile_max = max(tile_max, p_s[t, c])
                m_new, shift, alpha = row_step(m_s[t], tile_max,
                                               rules.lowest)
                row_sum = F0
                for c in range(BC):
                    p = math.exp(p_s[t, c] - shift)
                    row_sum += p
                    p_s[t, c] = p * dropout_weight(b, i0 + t, j0 + c, rules)
                l_s[t] = alpha * l_s[t] + row_sum
                m_s[t] = m_new
                a_s[t] = alpha
            cuda.syncthreads()  # P_ij and alpha ready for the O update
            # O_i = alpha O_i + P_ij V_j: RM rows x OC columns per thread
            for a in range(RM):
                al[a] = a_s[ty * RM + a]
            output_piece(acc, pv, vv, al, p_s, v_s, ty * RM, tx, RM, OC, BC,
                         TX)
            cuda.syncthreads()  # K_j, V_j, P_ij consumed before reuse
        for a in range(RM):
            r = ty * RM + a
            if i0 + r < nq:
                l = l_s[r]  # only l == 0 means "no key"; NaN stays NaN
                for c in range(OC):
                    o[out, i0 + r, tx + TX * c] = (acc[a, c] / l
                                                   if l != F0 else F0)
        if t < BR and i0 + t < nq:
            l = l_s[t]
            if lse.shape[0] > o.shape[0]:  # split-KV's (m, l)
                lse[out, i0 + t] = m_s[t] if l != F0 else NEG_INF
                lse[o.shape[0] + out, i0 + t] = l
            else:
                lse[out, i0 + t] = (m_s[t] + math.log(l) if l != F0
                                    else NEG_INF)

    return forward_v3
