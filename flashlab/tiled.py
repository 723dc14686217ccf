"""Tiled exact attention: one score tile at a time, in either loop order.

- order="fa2" (default), FlashAttention-2: query blocks Q_i (Br rows) are
  the outer loop; each streams every K/V block (Bc rows) past running row
  summaries held on chip and divides once at the end.
- order="fa1", FlashAttention-1 (Algorithm 1 of the original paper): K/V
  blocks are the outer loop; for each one, every query block reloads its
  normalized output O_i and its statistics m_i, l_i from slow memory,
  updates them and writes them back.

No more than one (..., Br, Bc) score tile exists at any moment. The
rescaling is `flashlab.merge.merge` in both orders. The loops touch q, k,
v, o and the statistics only through slices, so `flashlab.io` can run
these very loops on arrays that count their traffic. See chapters 5, 6.
"""

from typing import NamedTuple

import numpy as np

from flashlab import masks, merge
from flashlab._validate import check_block, check_qkv, check_scale

ORDERS = ("fa2", "fa1")


class Tile(NamedTuple):
    """One visited tile: its rows and cols, S_ij and the state before/after."""

    rows: range
    cols: range
    scores: np.ndarray  # S_ij (..., Br, Bc), -inf where masked
    before: merge.Summary  # running state of rows before this tile
    after: merge.Summary  # ... and after merging it in


class Plan(NamedTuple):
    """Everything a loop needs besides the arrays."""

    nq: int
    nk: int
    block_q: int
    block_k: int
    scale: float
    rules: masks.Rules


def attention(q, k, v, *, block_q=64, block_k=64, scale=None, causal=False,
              mask=None, window=None, kv_lengths=None, return_lse=False,
              order="fa2"):
    """Tiled exact attention. q (..., Nq, d), k (..., Nk, d), v (..., Nk, dv).

    Returns o (..., Nq, dv), and lse (..., Nq) if return_lse. Rows with no
    allowed key give 0 and lse = -inf. Masking rules: `flashlab.masks`.
    """
    o, lse = _run(q, k, v, block_q, block_k, scale, causal, mask, window,
                  kv_lengths, order, None)
    return (o, lse) if return_lse else o


def trace(q, k, v, *, block_q=64, block_k=64, scale=None, causal=False,
          mask=None, window=None, kv_lengths=None, order="fa2"):
    """Every tile the loop visits, in order, as a list of `Tile`."""
    tiles = []
    _run(q, k, v, block_q, block_k, scale, causal, mask, window, kv_lengths,
         order, tiles.append)
    return tiles


def plan(q, k, v, block_q, block_k, scale, causal, mask, window,
         kv_lengths):
    """Validate the arguments; return arrays and the `Plan` of the loops."""
    q, k, v = check_qkv(q, k, v)
    nq, nk = q.shape[-2], k.shape[-2]
    rules = masks.rules(causal, window, kv_lengths, mask, q.shape[:-2],
                        nq, nk)
    return q, k, v, Plan(
        nq=nq,
        nk=nk,
        block_q=check_block("block_q", block_q),
        block_k=check_block("block_k", block_k),
        scale=check_scale(scale, q.shape[-1]),
        rules=rules,
    )


def _run(q, k, v, block_q, block_k, scale, causal, mask, window, kv_lengths,
         order, on_tile):
    if order not in ORDERS:
        raise ValueError(f"order: expected one of {ORDERS}, got {order!r}")
    q, k, v, p = plan(q, k, v, block_q, block_k, scale, causal, mask,
                      window, kv_lengths)
    rows = (*q.shape[:-2], p.nq)
    o = np.empty((*rows, v.shape[-1]), dtype=q.dtype)
    if order == "fa2":
        lse = np.empty(rows, dtype=q.dtype)
        forward_fa2(q, k, v, o, lse, p, on_tile)
        return o, lse
    m = np.empty(rows, dtype=q.dtype)
    l = np.empty(rows, dtype=q.dtype)
    forward_fa1(q, k, v, o, l, m, p, on_tile)
    return o, merge.Summary(m, l, o).lse()


def blocks(n, size):
    """Consecutive ranges of `size` indices covering 0..n; the last ragged."""
    return [range(s, min(s + size, n)) for s in range(0, n, size)]


def score_tile(q_i, k_j, rows, cols, p):
    """S_ij = tau Q_i K_j^T (..., Br, Bc), with masked pairs at -inf."""
    s_ij = q_i @ np.swapaxes(k_j, -1, -2)  # (..., Br, Bc)
    keep = p.rules.allowed(rows, cols)
    return s_ij if keep is None else np.where(keep, s_ij, -np.inf)


def load_kv(k, v, cols):
    """K_j (..., Bc, d) and V_j (..., Bc, dv): HBM -> chip. None skips one."""
    span = slice(cols.start, cols.stop)
    return (None if k is None else k[..., span, :],
            None if v is None else v[..., span, :])


def load_q(q, rows, p):
    """Q_i scaled by tau (..., Br, d): scaling Q once saves a pass over S."""
    return q[..., rows.start:rows.stop, :] * q.dtype.type(p.scale)


def forward_fa2(q, k, v, o, lse, p, on_tile=None):
    """FlashAttention-2 order: query blocks outer, K/V blocks inner.

    lse may be None when the statistics are not needed (inference).
    """
    dv = v.shape[-1]
    for rows in blocks(p.nq, p.block_q):
        q_i = load_q(q, rows, p)  # HBM -> chip once per query block
        state = merge.empty((*q_i.shape[:-2], len(rows)), dv, q.dtype)
        for cols in blocks(p.nk, p.block_k):
            if p.rules.skips(rows, cols):
                continue  # no allowed pair: no loads, no arithmetic
            k_j, v_j = load_kv(k, v, cols)  # reloaded for every Q_i
            s_ij = score_tile(q_i, k_j, rows, cols, p)
            before = state
            state = merge.merge(state, merge.summarize(s_ij, v_j))
            if on_tile is not None:
                on_tile(Tile(rows, cols, s_ij, before, state))
        o[..., rows.start:rows.stop, :] = state.output()  # one division
        if lse is not None:  # kept for the backward pass
            lse[..., rows.start:rows.stop] = state.lse()


def forward_fa1(q, k, v, o, l, m, p, on_tile=None):
    """FlashAttention-1 order: K/V blocks outer, query blocks inner.

    o, l, m live in slow memory between visits: o is kept normalized
    (O = u / l), as in Algorithm 1 of the original paper.
    """
    o[...] = 0  # Algorithm 1 initializes O, l and m in HBM
    l[...] = 0
    m[...] = -np.inf
    for cols in blocks(p.nk, p.block_k):
        kv_j = None  # K_j, V_j: loaded once, kept on chip for all Q_i
        for rows in blocks(p.nq, p.block_q):
            if p.rules.skips(rows, cols):
                continue
            if kv_j is None:
                kv_j = load_kv(k, v, cols)
            k_j, v_j = kv_j
            r = slice(rows.start, rows.stop)
            q_i = load_q(q, rows, p)  # reloaded for every K/V block
            s_ij = score_tile(q_i, k_j, rows, cols, p)
            l_i, m_i = l[..., r], m[..., r]  # HBM -> chip
            before = merge.Summary(m_i, l_i, l_i[..., None] * o[..., r, :])
            state = merge.merge(before, merge.summarize(s_ij, v_j))
            o[..., r, :] = state.output()  # chip -> HBM, normalized
            l[..., r] = state.l
            m[..., r] = state.m
            if on_tile is not None:
                on_tile(Tile(rows, cols, s_ij, before, state))
