"""Tiled attention in the FlashAttention-2 order, one score tile at a time.

Query blocks Q_i (Br rows) form the outer loop; each streams every K/V
block (Bc rows) past its running row summaries and divides once at the
end. No more than one (..., Br, Bc) score tile exists at any moment. The
rescaling of the running state is `flashlab.merge.merge`. See chapter 5.
"""

from typing import NamedTuple

import numpy as np

from flashlab import masks, merge
from flashlab._validate import check_block, check_mask, check_qkv, check_scale


class Tile(NamedTuple):
    """One visited tile: its rows and cols, S_ij and the state before/after."""

    rows: range
    cols: range
    scores: np.ndarray  # S_ij (..., Br, Bc), -inf where masked
    before: merge.Summary  # running state of rows before this tile
    after: merge.Summary  # ... and after merging it in


def attention(q, k, v, *, block_q=64, block_k=64, scale=None, causal=False,
              mask=None, return_lse=False):
    """Tiled exact attention. q (..., Nq, d), k (..., Nk, d), v (..., Nk, dv).

    Returns o (..., Nq, dv), and lse (..., Nq) if return_lse. Rows with no
    allowed key give 0 and lse = -inf.
    """
    o, lse = _run(q, k, v, block_q, block_k, scale, causal, mask, None)
    return (o, lse) if return_lse else o


def trace(q, k, v, *, block_q=64, block_k=64, scale=None, causal=False,
          mask=None):
    """Every tile the loop visits, in order, as a list of `Tile`."""
    tiles = []
    _run(q, k, v, block_q, block_k, scale, causal, mask, tiles.append)
    return tiles


def _run(q, k, v, block_q, block_k, scale, causal, mask, on_tile):
    """The FA2 loop; calls on_tile(Tile) for each visited tile if given."""
    q, k, v = check_qkv(q, k, v)
    block_q = check_block("block_q", block_q)
    block_k = check_block("block_k", block_k)
    batch, (nq, d), (nk, dv) = q.shape[:-2], q.shape[-2:], v.shape[-2:]
    scale = check_scale(scale, d)
    mask = check_mask(mask, batch, nq, nk)
    offset = masks.causal_offset(causal, nq, nk)
    dtype = q.dtype
    kt = np.swapaxes(k, -1, -2)  # (..., d, Nk)

    o = np.empty((*batch, nq, dv), dtype=dtype)
    lse = np.empty((*batch, nq), dtype=dtype)
    for i0 in range(0, nq, block_q):
        rows = range(i0, min(i0 + block_q, nq))
        q_i = q[..., i0:rows.stop, :] * dtype.type(scale)  # (..., Br, d)
        state = merge.empty((*batch, len(rows)), dv, dtype)
        for j0 in range(0, nk, block_k):
            cols = range(j0, min(j0 + block_k, nk))
            keep = masks.allowed(rows, cols, offset, mask)
            if not masks.visits(keep):
                continue  # no allowed pair in this tile: skip its work
            s_ij = q_i @ kt[..., j0:cols.stop]  # (..., Br, Bc)
            if keep is not None:
                s_ij = np.where(keep, s_ij, -np.inf)
            v_j = v[..., j0:cols.stop, :]  # (..., Bc, dv)
            before = state
            state = merge.merge(state, merge.summarize(s_ij, v_j))
            if on_tile is not None:
                on_tile(Tile(rows, cols, s_ij, before, state))
        o[..., i0:rows.stop, :] = state.output()  # the one division
        lse[..., i0:rows.stop] = state.lse()
    return o, lse
