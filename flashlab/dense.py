"""The materialized path as three kernels, with S and P in slow memory.

1. S = tau Q K^T, one query block at a time, written to HBM;
2. P = softmax(S) row block by row block, read from and written to HBM;
3. O = P V, one query block at a time.
Each kernel reads its inputs in tiles, so K and V are reread once per query
block, as a tiled matmul would. `flashlab.io` runs this loop on counting
arrays to measure its traffic. See chapter 6.
"""

import numpy as np

from flashlab import nonfinite, reference, tiled
from flashlab.tiled import blocks, load_kv, load_q, score_tile


def attention(q, k, v, *, block_q=None, block_k=None, scale=None,
              causal=False, mask=None, window=None, kv_lengths=None,
              return_lse=False, align=None):
    """Three-kernel materialized attention; same arguments as tiled."""
    q, k, v, plan = tiled.plan(q, k, v, block_q=block_q, block_k=block_k,
                               scale=scale, causal=causal, mask=mask,
                               window=window, kv_lengths=kv_lengths,
                               align=align)
    rows = (*q.shape[:-2], plan.nq)
    s = np.empty((*rows, plan.nk), dtype=q.dtype)  # (..., Nq, Nk) in HBM
    prob = np.empty_like(s)  # (..., Nq, Nk) in HBM
    o = np.empty((*rows, v.shape[-1]), dtype=q.dtype)
    lse = np.empty(rows, dtype=q.dtype)
    with np.errstate(invalid="ignore"):  # inf - inf: NaN by the rule
        forward(q, k, v, s, prob, o, lse, plan)
    nonfinite.finish(o, lse, v, plan.empty_rows(q.shape[:-2]))
    return (o, lse) if return_lse else o


def forward(q, k, v, s, prob, o, lse, plan):
    """Run the three kernels; lse may be None when it is not needed."""
    blocks_q = blocks(plan.nq, plan.block_q)
    blocks_k = blocks(plan.nk, plan.block_k)
    for rows in blocks_q:  # kernel 1: S = tau Q K^T
        q_i = load_q(q, rows, plan)
        for cols in blocks_k:
            k_j, _ = load_kv(k, None, cols)
            s[..., rows.start:rows.stop, cols.start:cols.stop] = score_tile(
                q_i, k_j, rows, cols, plan)
    for rows in blocks_q:  # kernel 2: P = softmax(S), whole rows
        s_i = s[..., rows.start:rows.stop, :]  # (..., Br, Nk)
        prob[..., rows.start:rows.stop, :] = reference.softmax(s_i)
        if lse is not None:
            lse[..., rows.start:rows.stop] = reference.logsumexp(s_i)
    for rows in blocks_q:  # kernel 3: O = P V
        o_i = 0
        for cols in blocks_k:
            _, v_j = load_kv(None, v, cols)
            p_ij = prob[..., rows.start:rows.stop, cols.start:cols.stop]
            o_i = o_i + p_ij @ v_j  # (..., Br, dv)
        o[..., rows.start:rows.stop, :] = o_i
