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

from flashlab import dropout, heads, masks, merge, nonfinite
from flashlab._validate import (
    as_float_array,
    check_block,
    check_count,
    check_flag,
    check_qkv,
    check_scale,
)

ORDERS = ("fa2", "fa1")
BLOCK = 64  # default Br and Bc of the numpy and CPU backends


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
    dropout: dropout.Dropout | None
    group: int = 1  # query heads per K/V head (flashlab.heads)

    def empty_rows(self, batch_shape):
        """Boolean (*batch, Nq): rows the masks leave without keys."""
        return self.rules.empty_rows(batch_shape, self.nq, self.nk)


def attention(q, k, v, *, block_q=None, block_k=None, scale=None,
              causal=False, mask=None, window=None, kv_lengths=None,
              dropout_p=0.0, seed=None, return_lse=False, order="fa2",
              num_splits=1, align=None):
    """Tiled exact attention. q (..., Nq, d), k (..., Nk, d), v (..., Nk, d_v).

    Returns o (..., Nq, d_v), and lse (..., Nq) if return_lse. Rows with no
    allowed key give 0 and lse = -inf; non-finite input gives NaN
    (`flashlab.nonfinite`). Masking rules: `flashlab.masks`; dropout (with
    an integer seed): `flashlab.dropout`. Block sizes default to BLOCK.
    num_splits > 1 splits the keys into that many ranges, each summarized
    on its own and combined (`forward_split`, split-KV). Every backend
    (cpu, gpu, torch) takes these same keywords.
    """
    return_lse = check_flag("return_lse", return_lse)
    o, lse = _run(q, k, v, order, None, num_splits, block_q=block_q,
                  block_k=block_k, scale=scale, causal=causal, mask=mask,
                  window=window, kv_lengths=kv_lengths, dropout_p=dropout_p,
                  seed=seed, align=align)
    return (o, lse) if return_lse else o


def trace(q, k, v, *, order="fa2", **options):
    """Every tile the loop visits, in order, as a list of `Tile`.

    Takes the keyword options of `attention`.
    """
    tiles = []
    _run(q, k, v, order, tiles.append, options.pop("num_splits", 1),
         **options)
    return tiles


def plan(q, k, v, *, block_q=None, block_k=None, scale=None, causal=False,
         mask=None, window=None, kv_lengths=None, dropout_p=0.0, seed=None,
         align=None):
    """Validate the arguments; return arrays and the `Plan` of the loops.

    Block sizes larger than the sequence are clamped to it. With fewer
    K/V heads than Q heads the arrays come back grouped (`heads.split`),
    and so do the mask and key lengths; otherwise their leading dims come
    back broadcast together (`heads.broadcast`, as SDPA aligns them).
    """
    q, k, v = check_qkv(q, k, v)
    nq, nk = q.shape[-2], k.shape[-2]
    g = heads.group_size(q.shape, k.shape, v.shape)
    if g > 1:
        mask = heads.split_batch(mask, q.shape[:-2], g, 2)
        kv_lengths = heads.split_batch(kv_lengths, q.shape[:-2], g, 0)
        q = heads.split(q, g)
        k, v = heads.split(k, g, kv=True), heads.split(v, g, kv=True)
    else:
        q, k, v = heads.broadcast(q, k, v)
    batch = q.shape[:-2]
    return q, k, v, Plan(
        nq=nq,
        nk=nk,
        block_q=min(check_block("block_q", block_q, BLOCK), nq),
        block_k=min(check_block("block_k", block_k, BLOCK), nk),
        scale=check_scale(scale, q.shape[-1], q.dtype),
        rules=masks.rules(causal, window, kv_lengths, mask, batch, nq, nk,
                          align),
        dropout=dropout.make(dropout_p, seed, batch),
        group=g,
    )


def check_order(order, supported=ORDERS):
    """Return the loop order, or raise naming what this backend runs."""
    if not isinstance(order, str) or order not in supported:
        raise ValueError(
            f"order: expected one of {supported}, got {order!r}")
    return order


def check_splits(num_splits, supported=None):
    """Return num_splits as an int >= 1, or raise (a backend that has no
    split-KV path passes supported=1)."""
    num_splits = check_count("num_splits", num_splits)
    if supported is not None and num_splits != supported:
        raise ValueError(f"num_splits: this backend has no split-KV path; "
                         f"pass {supported}, got {num_splits}")
    return num_splits


def _run(q, k, v, order, on_tile, num_splits=1, **options):
    order = check_order(order)
    num_splits = check_splits(num_splits)
    if num_splits > 1 and order != "fa2":
        raise ValueError("num_splits: split-KV runs the 'fa2' order; got "
                         f"order={order!r}")
    q, k, v, plan_ = plan(q, k, v, **options)
    rows = (*q.shape[:-2], plan_.nq)
    o = np.empty((*rows, v.shape[-1]), dtype=q.dtype)
    # inf - inf in a row with an overflowing score is NaN by design
    with np.errstate(invalid="ignore"):
        if order == "fa2":
            lse = np.empty(rows, dtype=q.dtype)
            forward_split(q, k, v, o, lse, plan_, num_splits, on_tile)
        else:
            m = np.empty(rows, dtype=q.dtype)
            l = np.empty(rows, dtype=q.dtype)
            forward_fa1(q, k, v, o, l, m, plan_, on_tile)
            lse = merge.Summary(m, l, o).lse()
        nonfinite.finish(o, lse, v, plan_.empty_rows(q.shape[:-2]))
    if plan_.group > 1:
        o, lse = heads.join(o), heads.join(lse[..., None])[..., 0]
    return o, lse


def blocks(n, size):
    """Consecutive ranges of `size` indices covering 0..n; the last ragged."""
    return [range(s, min(s + size, n)) for s in range(0, n, size)]


def score_tile(q_i, k_j, rows, cols, plan):
    """S_ij = tau Q_i K_j^T (..., Br, Bc) (plus a float mask's tile),
    with masked pairs at -inf."""
    s_ij = q_i @ np.swapaxes(k_j, -1, -2)  # (..., Br, Bc)
    bias = plan.rules.added(rows, cols)
    if bias is not None:
        s_ij = s_ij + bias.astype(s_ij.dtype)
    keep = plan.rules.allowed(rows, cols)
    return s_ij if keep is None else np.where(keep, s_ij, -np.inf)


def load_kv(k, v, cols):
    """K_j (..., Bc, d), V_j (..., Bc, d_v): HBM -> chip. None skips one."""
    span = slice(cols.start, cols.stop)
    return (None if k is None else k[..., span, :],
            None if v is None else v[..., span, :])


def summarize_tile(s_ij, v_j, rows, cols, plan):
    """The tile's row summaries, with dropout applied to the numerator."""
    weights = None
    if plan.dropout is not None:
        weights = plan.dropout.weights(rows, cols, s_ij.dtype)
    return merge.summarize(s_ij, v_j, weights)


def load_q(q, rows, plan):
    """Q_i scaled by tau (..., Br, d): scaling Q once saves a pass over S."""
    return q[..., rows.start:rows.stop, :] * q.dtype.type(plan.scale)


def forward_split(q, k, v, o, lse, plan, num_splits, on_tile=None):
    """Split-KV: the key blocks in num_splits contiguous ranges, each run
    as its own FA2 pass to a partial (out, lse), joined by merge.combine.

    The partial results are what parallel thread blocks (or devices) would
    write; with num_splits = 1 this is forward_fa2 itself.
    """
    cols = blocks(plan.nk, plan.block_k)
    if num_splits == 1:
        return forward_fa2(q, k, v, o, lse, plan, on_tile)
    groups = [g for g in np.array_split(np.arange(len(cols)), num_splits)
              if len(g)]
    outs = np.empty((len(groups), *o.shape), dtype=o.dtype)  # workspace
    # each split's row max and sum, not m + log l: at large |m| that sum
    # rounds to m and the splits could no longer be weighed
    ms = np.empty((len(groups), *o.shape[:-1]), dtype=o.dtype)
    ls = np.empty_like(ms)
    for s, group in enumerate(groups):
        forward_fa2(q, k, v, outs[s], ms[s], plan, on_tile,
                    key_blocks=[cols[j] for j in group], l=ls[s])
    o[...], m, l = merge.combine(outs, ms, ls)
    if lse is not None:
        lse[...] = merge.Summary(m, l, o).lse()


def forward_fa2(q, k, v, o, lse, plan, on_tile=None, key_blocks=None,
                l=None):
    """FlashAttention-2 order: query blocks outer, K/V blocks inner.

    lse may be None when the statistics are not needed (inference).
    key_blocks: the K/V blocks to visit (default: all of them). With l,
    lse receives each row's max m and l its sum l (merge.combine's form
    for splits).
    """
    d_v = v.shape[-1]
    if key_blocks is None:
        key_blocks = blocks(plan.nk, plan.block_k)
    for rows in blocks(plan.nq, plan.block_q):
        q_i = load_q(q, rows, plan)  # HBM -> chip once per query block
        state = merge.empty((*q_i.shape[:-2], len(rows)), d_v, q.dtype)
        for cols in key_blocks:
            if plan.rules.skips(rows, cols):
                continue  # no allowed pair: no loads, no arithmetic
            k_j, v_j = load_kv(k, v, cols)  # reloaded for every Q_i
            s_ij = score_tile(q_i, k_j, rows, cols, plan)
            before = state
            state = merge.merge(state, summarize_tile(s_ij, v_j, rows,
                                                      cols, plan))
            if on_tile is not None:
                on_tile(Tile(rows, cols, s_ij, before, state))
        o[..., rows.start:rows.stop, :] = state.output()  # one division
        if l is not None:  # a split's summary, for merge.combine
            lse[..., rows.start:rows.stop] = state.m
            l[..., rows.start:rows.stop] = state.l
        elif lse is not None:  # kept for the backward pass
            lse[..., rows.start:rows.stop] = state.lse()


def forward_fa1(q, k, v, o, l, m, plan, on_tile=None):
    """FlashAttention-1 order: K/V blocks outer, query blocks inner.

    o, l, m live in slow memory between visits: o is kept normalized
    (O = u / l), as in Algorithm 1 of the original paper.
    """
    o[...] = 0  # Algorithm 1 initializes O, l and m in HBM
    l[...] = 0
    m[...] = -np.inf
    for cols in blocks(plan.nk, plan.block_k):
        kv_j = None  # K_j, V_j: loaded once, kept on chip for all Q_i
        for rows in blocks(plan.nq, plan.block_q):
            if plan.rules.skips(rows, cols):
                continue
            if kv_j is None:
                kv_j = load_kv(k, v, cols)
            k_j, v_j = kv_j
            r = slice(rows.start, rows.stop)
            q_i = load_q(q, rows, plan)  # reloaded for every K/V block
            s_ij = score_tile(q_i, k_j, rows, cols, plan)
            l_i, m_i = l[..., r], m[..., r]  # HBM -> chip
            before = merge.Summary(m_i, l_i, l_i[..., None] * o[..., r, :])
            state = merge.merge(before, summarize_tile(s_ij, v_j, rows,
                                                       cols, plan))
            o[..., r, :] = state.output()  # chip -> HBM, normalized
            l[..., r] = state.l
            m[..., r] = state.m
            if on_tile is not None:
                on_tile(Tile(rows, cols, s_ij, before, state))


def attention_backward(q, k, v, o, lse, do, *, block_q=None, block_k=None,
                       scale=None, causal=False, mask=None, window=None,
                       kv_lengths=None, dropout_p=0.0, seed=None,
                       order="fa2", align=None, l=None):
    """Gradients (dq, dk, dv) of attention, recomputing tiles. See chapter 8.

    Needs only the forward's output o (..., Nq, d_v) and row log-sum-exp
    lse (..., Nq), plus the upstream gradient do (..., Nq, d_v); takes the
    keywords of `attention` (dropout with the same seed). Both forward
    orders have this one backward loop (K/V blocks outermost), so `order`
    only names the forward it follows.

    With l (..., Nq), lse holds each row's max m and l its sum (the form
    `merge.combine` returns given ls): P = exp(S - m) / l with no pass
    to recover them, exact at any size, and right where these keys are
    only part of the row's (ring attention's pieces).
    """
    check_order(order)
    shapes = [np.shape(x) for x in (q, k, v)]  # the gradients' shapes
    q, k, v, plan_ = plan(q, k, v, block_q=block_q, block_k=block_k,
                          scale=scale, causal=causal, mask=mask,
                          window=window, kv_lengths=kv_lengths,
                          dropout_p=dropout_p, seed=seed, align=align)
    if plan_.group > 1:  # checked against the callers' heads, then split
        g = plan_.group
        q_heads = np.broadcast_to(q.dtype.type(0), heads.join(q).shape)
        o, lse, do = check_saved(q_heads, v[..., 0, :, :], o, lse, do)
        l = check_norms(l, lse)
        o, do = heads.split(o, g), heads.split(do, g)
        lse = heads.split(lse[..., None], g)[..., 0]
        if l is not None:
            l = heads.split(l[..., None], g)[..., 0]
    else:
        o, lse, do = check_saved(q, v, o, lse, do)
        l = check_norms(l, lse)
    dq, dk, dv = np.zeros_like(q), np.empty_like(k), np.empty_like(v)
    backward(q, k, v, o, lse, do, dq, dk, dv, plan_, l)
    if plan_.group > 1:  # back to the callers' heads
        return heads.join(dq), dk[..., 0, :, :], dv[..., 0, :, :]
    # a broadcast input's gradient sums over the dims it was stretched on
    return tuple(heads.sum_to(x, s) for x, s in zip((dq, dk, dv), shapes))


def attention_statistics(q, k, v, lse, *, scale=None, causal=False,
                         mask=None, window=None, kv_lengths=None,
                         align=None):
    """(m, l) (..., Nq): each row's max and sum, P = exp(S - m) / l, from
    the forward's lse (..., Nq) and the keywords it ran with.

    (lse, 1) where lse holds P exactly (every row, usually); the row's own
    where it does not (`merge.lse_loses_l`), from one pass over its
    scores. With them a row's results over parts of its keys merge
    exactly at any size (`merge.combine` given ls), as ring attention's
    pieces do.
    """
    q, k, v, plan_ = plan(q, k, v, scale=scale, causal=causal, mask=mask,
                          window=window, kv_lengths=kv_lengths,
                          align=align)
    g = plan_.group
    rows = heads.join(q).shape[:-1] if g > 1 else q.shape[:-1]
    lse = as_float_array("lse", lse)
    if lse.shape != rows:
        raise ValueError(f"lse: expected shape {rows}, got {lse.shape}")
    if g > 1:  # to the grouped heads of q and back
        m, l = row_statistics(q, k, heads.split(
            lse[..., None], g)[..., 0].astype(q.dtype), plan_)
        return heads.join(m[..., None])[..., 0], \
            heads.join(l[..., None])[..., 0]
    return row_statistics(q, k, lse.astype(q.dtype), plan_)


def backward(q, k, v, o, lse, do, dq, dk, dv, plan, l=None):
    """FlashAttention-2 backward: K/V blocks outer, query blocks inner.

    dK_j, dV_j accumulate on chip; dQ_i accumulates in slow memory. With
    l, lse is the rows' max m (see `attention_backward`).
    """
    delta = (do * o).sum(axis=-1)  # D_i = rowsum(dO * O) (..., Nq)
    if l is None:
        m, l = row_statistics(q, k, lse, plan)  # P = exp(S - m) / l
    else:
        m = lse
    for cols in blocks(plan.nk, plan.block_k):
        k_j, v_j = load_kv(k, v, cols)  # (..., Bc, d), (..., Bc, d_v)
        dk_j = np.zeros_like(k_j)
        dv_j = np.zeros_like(v_j)
        for rows in blocks(plan.nq, plan.block_q):
            if plan.rules.skips(rows, cols):
                continue
            r = slice(rows.start, rows.stop)
            q_i = load_q(q, rows, plan)  # tau Q_i (..., Br, d)
            s_ij = score_tile(q_i, k_j, rows, cols, plan)  # recomputed
            p_ij = merge.probabilities(s_ij, m[..., r], l[..., r])
            dp_ij = do[..., r, :] @ np.swapaxes(v_j, -1, -2)  # (..., Br, Bc)
            pz_ij = p_ij
            if plan.dropout is not None:  # same decisions as the forward
                z = plan.dropout.weights(rows, cols, p_ij.dtype)
                pz_ij = p_ij * z
                dp_ij = dp_ij * z
            # a K/V head's gradient sums its group's query heads
            dv_j += heads.sum_to(np.swapaxes(pz_ij, -1, -2) @ do[..., r, :],
                                 dv_j.shape)
            ds_ij = p_ij * (dp_ij - delta[..., r, None])  # dS = P(dP - D)
            dq[..., r, :] += q.dtype.type(plan.scale) * (ds_ij @ k_j)
            dk_j += heads.sum_to(np.swapaxes(ds_ij, -1, -2) @ q_i,
                                 dk_j.shape)  # tau already in q_i
        dk[..., cols.start:cols.stop, :] = dk_j
        dv[..., cols.start:cols.stop, :] = dv_j


def row_statistics(q, k, lse, plan):
    """(m, l) (..., Nq) with P = exp(S - m) / l: (lse, 1) where lse holds
    P exactly, the rows' own max and sum where it does not
    (`merge.lse_loses_l`: huge equal scores, finfo.min masks), found by
    one more pass over those rows' score tiles, without V."""
    m, l = lse, np.ones_like(lse)
    lossy = merge.lse_loses_l(lse)
    if not lossy.any():  # the usual case: the saved lse is enough
        return m, l
    m = lse.copy()
    no_values = np.zeros((plan.block_k, 0), dtype=q.dtype)  # (Bc, 0)
    for rows in blocks(plan.nq, plan.block_q):
        r = slice(rows.start, rows.stop)
        if not lossy[..., r].any():
            continue
        q_i = load_q(q, rows, plan)
        state = merge.empty((*q_i.shape[:-2], len(rows)), 0, q.dtype)
        for cols in blocks(plan.nk, plan.block_k):
            if plan.rules.skips(rows, cols):
                continue
            k_j, _ = load_kv(k, None, cols)
            s_ij = score_tile(q_i, k_j, rows, cols, plan)
            state = merge.merge(state, merge.summarize(
                s_ij, no_values[:len(cols)]))
        m[..., r] = np.where(lossy[..., r], state.m, m[..., r])
        l[..., r] = np.where(lossy[..., r], state.l, l[..., r])
    return m, l


def check_norms(l, lse):
    """l as a float array of lse's shape and dtype (None stays None)."""
    if l is None:
        return None
    l = as_float_array("l", l)
    if l.shape != lse.shape:
        raise ValueError(f"l: expected shape {lse.shape} (one per row, as "
                         f"lse), got {l.shape}")
    if l.dtype != lse.dtype:
        raise TypeError(f"l: expected dtype {lse.dtype} to match lse, got "
                        f"{l.dtype}")
    return l


def check_saved(q, v, o, lse, do):
    """Validate o, lse and do against q and v."""
    out_shape = (*q.shape[:-1], v.shape[-1])
    checked = []
    for name, x, shape in (("o", o, out_shape), ("lse", lse, q.shape[:-1]),
                           ("do", do, out_shape)):
        x = as_float_array(name, x)
        if x.shape != shape:
            raise ValueError(
                f"{name}: expected shape {shape}, got {x.shape}"
            )
        if x.dtype != q.dtype:
            raise TypeError(
                f"{name}: expected dtype {q.dtype} to match q, got {x.dtype}"
            )
        checked.append(x)
    return checked
