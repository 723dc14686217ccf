"""Forward v2: v1 with K/V tiles staged in shared memory.

Still one thread per query row, but the ROWS threads of a block load each
tile of BC keys and values into SRAM together and all read it there: K
and V leave HBM once per block instead of once per row.
"""

import math

from numba import cuda, float32

from flashlab.gpu.device import (
    F0,
    F1,
    NEG_INF,
    allowed,
    dropout_weight,
    row_step,
    stage,
    store_row,
    tile_skipped,
)

ROWS = 64  # threads (= query rows) per block
BC = 32  # keys per shared tile: 2 * 32 * 128 * 4 B = 32 KiB at most


def shape(d, d_v):
    """(Br, Bc, threads per block): one row a thread, tiles of BC keys."""
    return ROWS, BC, ROWS


def make(D, D_V):
    """The v2 kernel for head dims D, D_V (compile-time constants)."""

    @cuda.jit
    def forward_v2(q, k, v, o, lse, rules, kv_len, mask):
        k_s = cuda.shared.array((BC, D), float32)
        v_s = cuda.shared.array((BC, D_V), float32)
        q_i = cuda.local.array(D, float32)
        acc = cuda.local.array(D_V, float32)
        pv = cuda.local.array(D_V, float32)  # this tile's P_ij V_j
        s = cuda.local.array(BC, float32)
        t = cuda.threadIdx.x
        rows = cuda.blockDim.x
        b = cuda.blockIdx.y
        bk = b // rules.group  # the K/V head of query head b
        i0 = cuda.blockIdx.x * rows
        i = i0 + t
        nq, nk = q.shape[1], k.shape[1]
        i1 = min(i0 + rows, nq)
        for x in range(D):
            q_i[x] = q[b, i, x] * rules.scale if i < nq else F0
        for x in range(D_V):
            acc[x] = F0
        m = NEG_INF
        l = F0
        for j0 in range(0, nk, BC):
            if tile_skipped(i0, i1, j0, min(j0 + BC, nk), rules, kv_len[b]):
                continue  # the same decision in every thread of the block
            # HBM -> SRAM: K_j, V_j (Bc (d + dv) floats), used by all rows
            stage(k_s, k, bk, j0, BC, D, F1, t, rows)
            stage(v_s, v, bk, j0, BC, D_V, F1, t, rows)
            cuda.syncthreads()  # K_j, V_j fully loaded before any read
            tile_max = NEG_INF
            for c in range(BC):
                if allowed(b, i, j0 + c, nq, nk, rules, kv_len, mask):
                    acc_s = F0
                    for x in range(D):
                        acc_s += q_i[x] * k_s[c, x]
                    s[c] = acc_s
                else:
                    s[c] = NEG_INF
                tile_max = max(tile_max, s[c])
            m, shift, alpha = row_step(m, tile_max, rules.lowest)
            # Sum the tile on its own, then add it: a blocked sum, whose
            # rounding grows with Bc + N / Bc instead of N.
            row_sum = F0
            for x in range(D_V):
                pv[x] = F0
            for c in range(BC):
                p = math.exp(s[c] - shift)
                row_sum += p
                p *= dropout_weight(b, i, j0 + c, rules)
                for x in range(D_V):
                    pv[x] += p * v_s[c, x]
            l = alpha * l + row_sum
            for x in range(D_V):
                acc[x] = alpha * acc[x] + pv[x]
            cuda.syncthreads()  # every row is done with K_j, V_j
        if i < nq:
            store_row(o, lse, b, i, acc, m, l, D_V)

    return forward_v2

