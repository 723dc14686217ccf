"""Forward v1: one thread per query row, K and V read from global memory.

The online update of chapter 3 run once per row: no tiles, no sharing.
Every thread reads all of K and V from HBM on its own, so traffic is
N times that of one pass. The baseline the later versions improve on.
"""

import math

from numba import cuda, float32

from flashlab.gpu.device import (
    F0,
    NEG_INF,
    allowed,
    dropout_weight,
    row_step,
    store_row,
)

ROWS = 128  # threads (= query rows) per block


def shape(d, d_v):
    """(Br, Bc, threads per block): one key at a time, one row a thread."""
    return ROWS, 1, ROWS


def make(D, D_V):
    """The v1 kernel for head dims D, D_V (compile-time constants)."""

    @cuda.jit
    def forward_v1(q, k, v, o, lse, rules, kv_len, mask):
        b = cuda.blockIdx.y
        bk = b // rules.group  # the K/V head of query head b
        i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        nq, nk = q.shape[1], k.shape[1]
        if i >= nq:
            return  # no barrier in this kernel, so early exit is safe
        q_i = cuda.local.array(D, float32)
        acc = cuda.local.array(D_V, float32)
        for x in range(D):
            q_i[x] = q[b, i, x] * rules.scale
        for x in range(D_V):
            acc[x] = F0
        m = NEG_INF
        l = F0
        for j in range(nk):  # online update, one key at a time
            if not allowed(b, i, j, nq, nk, rules, kv_len, mask):
                continue
            s = F0
            for x in range(D):
                s += q_i[x] * k[bk, j, x]
            m, shift, alpha = row_step(m, s, rules.lowest)
            p = math.exp(s - shift)
            l = alpha * l + p
            p *= dropout_weight(b, i, j, rules)
            for x in range(D_V):
                acc[x] = alpha * acc[x] + p * v[bk, j, x]
        store_row(o, lse, b, i, acc, m, l, D_V)

    return forward_v1

