"""Forward v4: v3 with the row softmax spread over all threads.

In v3 one thread per row runs the max, exp and sum of a whole tile row
while the other threads of the block wait. Here every thread works on its
own RM x CN piece of S in registers: partial row maxima and sums meet in
shared memory, and each thread rescales and exponentiates its own piece.
"""

import math

from numba import cuda, float32

from flashlab.gpu.device import (
    F0,
    NEG_INF,
    THREADS,
    dropout_weight,
    open_tile,
    output_piece,
    row_step,
    stage,
    tiles,
)


def shape(d, d_v):
    """(Br, Bc, threads per block) for head dims d, d_v."""
    tl = tiles(d, d_v)
    return tl.BR, tl.BC, THREADS


def make(D, D_V):
    """The v4 kernel for head dims D, D_V (compile-time constants)."""
    BR, BC, RM, TX, CN, OC, DP, BCP = tiles(D, D_V)

    # No register cap, unlike v3: capped at 128, v4 spills to local memory;
    # a cap of 255 lets the compiler take so many that only 2 blocks fit
    # per SM. Left alone (resources_h200.txt) it was the fastest of the
    # three on the H200. See chapter 9.
    @cuda.jit
    def forward_v4(q, k, v, o, lse, rules, kv_len, mask):
        q_s = cuda.shared.array((BR, DP), float32)
        k_s = cuda.shared.array((BC, DP), float32)
        v_s = cuda.shared.array((BC, D_V), float32)
        p_s = cuda.shared.array((BR, BCP), float32)
        red_s = cuda.shared.array((BR, TX), float32)  # partial max or sum
        acc = cuda.local.array((RM, OC), float32)
        pv = cuda.local.array((RM, OC), float32)  # this tile's P_ij V_j
        al = cuda.local.array(RM, float32)  # each row's alpha
        s = cuda.local.array((RM, CN), float32)
        m = cuda.local.array(RM, float32)  # every thread of a row keeps
        l = cuda.local.array(RM, float32)  # the same m, and its share of l
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
        for a in range(RM):
            m[a] = NEG_INF
            l[a] = F0
            for c in range(OC):
                acc[a, c] = F0
        cuda.syncthreads()  # Q_i is in SRAM before tile 0
        for j0 in range(0, nk, BC):
            if not open_tile(s, qa, q_s, k_s, v_s, k, v, b, i0, i1, j0, nq,
                             rules, kv_len, mask, t, BC, RM, CN, D, D_V):
                continue
            for a in range(RM):  # this thread's share of the row maxima
                part = NEG_INF
                for c in range(CN):
                    part = max(part, s[a, c])
                red_s[ty * RM + a, tx] = part
            cuda.syncthreads()  # all partial maxima written
            for a in range(RM):
                r = ty * RM + a
                tile_max = red_s[r, 0]
                for c in range(1, TX):
                    tile_max = max(tile_max, red_s[r, c])
                m[a], shift, alpha = row_step(m[a], tile_max, rules.lowest)
                part = F0
                for c in range(CN):
                    p = math.exp(s[a, c] - shift)
                    part += p
                    p_s[r, tx * CN + c] = p * dropout_weight(
                        b, i0 + r, j0 + tx * CN + c, rules)
                l[a] = alpha * l[a] + part  # this thread's share of l
                al[a] = alpha
            cuda.syncthreads()  # P_ij and alpha ready for the O update
            # O_i = alpha O_i + P_ij V_j: RM rows x OC columns per thread
            output_piece(acc, pv, vv, al, p_s, v_s, ty * RM, tx, RM, OC, BC,
                         TX)
            cuda.syncthreads()  # K_j, V_j, P_ij, red_s free for reuse
        # l is split over the TX threads of a row: add the shares up
        for a in range(RM):
            red_s[ty * RM + a, tx] = l[a]
        cuda.syncthreads()  # every share of l written
        for a in range(RM):
            r = ty * RM + a
            total = F0
            for c in range(TX):
                total += red_s[r, c]
            if i0 + r < nq:  # only l == 0 means "no key"; NaN stays NaN
                for c in range(OC):
                    o[b, i0 + r, tx + TX * c] = (acc[a, c] / total
                                                 if total != F0 else F0)
                if tx == 0:
                    lse[b, i0 + r] = (m[a] + math.log(total)
                                      if total != F0 else NEG_INF)

    return forward_v4
