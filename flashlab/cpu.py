"""Tiled attention compiled for the CPU with numba: forward and backward.

Same arguments and semantics as `flashlab.tiled`, float32 and float64.
Query blocks (forward, dQ pass) and key blocks (dK/dV pass) of every
batch element run in parallel threads; nothing is shared between
threads, so results do not depend on the thread count. Every tile
product is one call of numpy's OpenBLAS (`flashlab.blas`), on one thread
inside numba's; the softmax between them runs in vectorized loops
(`flashlab.vector`: exp2, a NaN-aware max). Scores stay in natural
units and log2(e) multiplies S - m inside the exponent, never the scale:
tau log2(e) S would overflow float32 for finite scores above 2.36e38.
The per-row algebra is `merge.row_step`, the mask rules
`masks.pair_allowed`, the dropout hash `dropout.keep_bits`, compiled here
as they are. A float mask that adds to the scores (ALiBi biases, -1e9 or
finfo.min fills) is added to tau S row by row, as `tiled.score_tile`
adds it, in the pass that finds the row max. See chapter 9.
"""

import math

import numba
import numpy as np
from numba import njit, prange, uint64

from flashlab import (
    blas,
    dropout,
    kernel_args,
    masks,
    merge,
    nonfinite,
    tiled,
    vector,
)
from flashlab._validate import check_flag

_row_step = njit(merge.row_step)
_pair_allowed = njit(masks.pair_allowed)
_tile_skipped = njit(masks.tile_skipped)
_tile_full = njit(masks.tile_full)
_keep_bits = njit(dropout.keep_bits)
# Let LLVM fuse multiply-adds and reorder sums so the loops vectorize; no
# flag that assumes finite values, since masked scores are -inf.
_FAST = {"contract", "reassoc"}


ORDERS = ("fa2",)  # the loop order these kernels run
# Default tiles: big enough that each BLAS call does real work (256 x 512
# measured best on the book's machine, chapter 9), small enough to stay
# in cache; block_q and block_k override them.
BLOCK_Q, BLOCK_K = 256, 512
_LOG2E = math.log2(math.e)


def attention(q, k, v, *, block_q=None, block_k=None, scale=None,
              causal=False, mask=None, window=None, kv_lengths=None,
              dropout_p=0.0, seed=None, return_lse=False, order="fa2",
              num_splits=1, align=None):
    """Numba CPU attention; keywords as tiled.attention: o (..., Nq, dv)."""
    tiled.check_order(order, ORDERS)
    tiled.check_splits(num_splits, supported=1)
    return_lse = check_flag("return_lse", return_lse)
    q3, k3, v3, batch, plan, a = kernel_args.flatten(q, k, v, dict(
        block_q=_default(block_q, BLOCK_Q), block_k=_default(block_k, BLOCK_K),
        scale=scale,
        causal=causal, mask=mask, window=window, kv_lengths=kv_lengths,
        dropout_p=dropout_p, seed=seed, align=align), added=True)
    bh, d_v = q3.shape[0], v3.shape[-1]
    o = np.empty((bh, plan.nq, d_v), dtype=q3.dtype)
    lse = np.empty((bh, plan.nq), dtype=q3.dtype)
    with blas.one_thread():  # numba's threads call it, one each
        _forward(*(np.ascontiguousarray(x) for x in (q3, k3, v3)), o, lse,
                 plan.block_q, plan.block_k, a.rules, a.kv_len, a.mask,
                 a.added, q3.dtype.type(_LOG2E))
    g = a.rules.group  # rows of query heads b: K/V head b // g
    if np.isneginf(lse).any() or not np.isfinite(v3).all():
        # else the rule changes nothing: no row is empty or unreached
        # (both have lse -inf here), no column of V is bad
        nonfinite.finish(o.reshape(-1, g, plan.nq, d_v), lse.reshape(
            -1, g, plan.nq), v3.reshape(-1, 1, plan.nk, d_v),
            plan.empty_rows(batch).reshape(-1, g, plan.nq))
    heads = np.shape(q)[:-2]  # the caller's leading dims
    o = o.reshape(*heads, plan.nq, d_v)
    lse = lse.reshape(*heads, plan.nq)
    return (o, lse) if return_lse else o


def attention_backward(q, k, v, o, lse, do, *, block_q=None, block_k=None,
                       scale=None, causal=False, mask=None, window=None,
                       kv_lengths=None, dropout_p=0.0, seed=None,
                       order="fa2", align=None):
    """Numba CPU gradients (dq, dk, dv); keywords as tiled's backward."""
    tiled.check_order(order)  # one backward loop follows either forward
    q3, k3, v3, batch, plan, a = kernel_args.flatten(q, k, v, dict(
        block_q=_default(block_q, BLOCK_Q), block_k=_default(block_k, BLOCK_K),
        scale=scale,
        causal=causal, mask=mask, window=window, kv_lengths=kv_lengths,
        dropout_p=dropout_p, seed=seed, align=align), added=True)
    o, lse, do = tiled.check_saved(q, v, o, lse, do)
    bh, d_v = q3.shape[0], v3.shape[-1]
    do3 = np.ascontiguousarray(do.reshape(bh, plan.nq, d_v))
    lse3 = np.ascontiguousarray(lse.reshape(bh, plan.nq))
    log2e = q3.dtype.type(_LOG2E)  # of the kernels' dtype
    delta = (do3 * o.reshape(bh, plan.nq, d_v)).sum(axis=-1)  # D_i (BH, Nq)
    # dK, dV per query head; a K/V head's is the sum over its group
    dq = np.empty(q3.shape, q3.dtype)  # q3 may be a stride-0 broadcast
    dk, dv = (np.empty((bh, *x.shape[1:]), x.dtype) for x in (k3, v3))
    q3, k3, v3 = (np.ascontiguousarray(x) for x in (q3, k3, v3))
    with blas.one_thread():
        shift, norm = _row_statistics(q3, k3, lse3, plan, a)
        if bh >= numba.get_num_threads():  # a head per thread: one pass
            _backward_heads(q3, k3, v3, do3, shift, norm, delta, dq, dk,
                            dv, plan.block_q, plan.block_k, a.rules,
                            a.kv_len, a.mask, a.added, log2e)
        else:  # too few heads to share out: key blocks, then query blocks
            _backward_kv(q3, k3, v3, do3, shift, norm, delta, dk, dv,
                         plan.block_q, plan.block_k, a.rules, a.kv_len,
                         a.mask, a.added, log2e)
            _backward_q(q3, k3, v3, do3, shift, norm, delta, dq,
                        plan.block_q, plan.block_k, a.rules, a.kv_len,
                        a.mask, a.added, log2e)
    g = a.rules.group
    dk, dv = (x.reshape(-1, g, *x.shape[1:]).sum(axis=1) if g > 1 else x
              for x in (dk, dv))
    return (dq.reshape(np.shape(q)), dk.reshape(np.shape(k)),
            dv.reshape(np.shape(v)))


def unsupported(q_shape, k_shape, v_shape, *, mask=None, order="fa2",
                num_splits=1):
    """Why these kernels cannot run a call (a sentence), or None if they
    can: the callers that also have flashlab.tiled choose by it. Every
    mask runs here (boolean, or float: -inf refuses, other values add);
    `mask` is taken so that callers need not know that."""
    if order not in ORDERS:
        return f"order {order!r}: the kernels run the FA2 loop order only"
    if num_splits != 1:
        return "num_splits: the kernels run one pass over the keys"
    try:
        kernel_args.kernel_group(q_shape, k_shape, v_shape)
    except ValueError:
        return "k, v: a broadcast the kernels do not index"
    return None


def products_only(q, k, v, *, causal=False, block_q=None, block_k=None):
    """The forward's tile products alone, with no softmax between them:
    what the BLAS calls of `attention` cost by themselves (chapter 9)."""
    q3, k3, v3, _, plan, a = kernel_args.flatten(q, k, v, dict(
        block_q=_default(block_q, BLOCK_Q), block_k=_default(block_k, BLOCK_K),
        scale=None, causal=causal, mask=None, window=None, kv_lengths=None,
        dropout_p=0.0, seed=None))
    with blas.one_thread():
        _products(*(np.ascontiguousarray(x) for x in (q3, k3, v3)),
                  plan.block_q, plan.block_k, a.rules, a.kv_len)


@njit(parallel=True)
def _products(q, k, v, block_q, block_k, r, kv_len):
    bh, nq, d = q.shape
    nk, d_v = v.shape[1], v.shape[2]
    n_blocks = (nq + block_q - 1) // block_q
    for t in prange(bh * n_blocks):
        b = t // n_blocks
        bk = b // r.group  # the K/V head of query head b
        i0 = (t % n_blocks) * block_q
        br = min(block_q, nq - i0)
        acc = np.zeros((br, d_v), dtype=q.dtype)
        s = np.zeros((br, block_k), dtype=q.dtype)
        for j0 in range(0, nk, block_k):
            bc = min(block_k, nk - j0)
            if _tile_skipped(i0, i0 + br, j0, j0 + bc, r, kv_len[b]):
                continue
            blas.gemm(False, True, br, bc, d, r.scale, q[b, i0:i0 + br],
                      k[bk, j0:j0 + bc], 0, s)
            blas.gemm(False, False, br, d_v, bc, 1, s, v[bk, j0:j0 + bc], 1,
                      acc)


def _row_statistics(q, k, lse, plan, a):
    """(shift, norm) (BH, Nq) with P = exp(S - shift) norm: (lse, 1) where
    the saved lse holds P exactly, (m, 1 / l) of the row where it does
    not (`merge.lse_loses_l`: huge equal scores, scores near -finfo.max),
    found by one more pass over those rows' score tiles, without V, as
    `tiled.row_statistics` does."""
    norm = np.ones_like(lse)
    lossy = merge.lse_loses_l(lse)
    if not lossy.any():  # the usual case: the saved lse is enough
        return lse, norm
    n_blocks = -(-plan.nq // plan.block_q)
    padded = np.zeros((lse.shape[0], n_blocks * plan.block_q), bool)
    padded[:, :plan.nq] = lossy
    todo = np.flatnonzero(padded.reshape(-1, plan.block_q).any(axis=1))
    m = np.full_like(lse, -np.inf)
    l = np.zeros_like(lse)
    _statistics(q, k, m, l, todo, plan.block_q, plan.block_k, a.rules,
                a.kv_len, a.mask, a.added, q.dtype.type(_LOG2E))
    with np.errstate(divide="ignore"):  # l >= 1 on lossy rows
        return np.where(lossy, m, lse), np.where(lossy, 1 / l, norm)


@njit(parallel=True, fastmath=_FAST)
def _statistics(q, k, m, l, todo, block_q, block_k, r, kv_len, mask,
                added, log2e):
    """Row max m and sum l of exp(S - m) for the query blocks `todo`
    (numbered b * blocks per head + i0 / block_q): the forward's softmax
    with no V (d_v = 0)."""
    bh, nq, d = q.shape
    nk = k.shape[1]
    n_blocks = (nq + block_q - 1) // block_q
    for u in prange(todo.shape[0]):
        t = todo[u]
        b = t // n_blocks
        bk = b // r.group  # the K/V head of query head b
        i0 = (t % n_blocks) * block_q
        br = min(block_q, nq - i0)
        no_values = np.zeros((br, 0), dtype=q.dtype)
        s = np.empty((br, block_k), dtype=q.dtype)
        m_i, l_i = m[b, i0:i0 + br], l[b, i0:i0 + br]
        for j0 in range(0, nk, block_k):
            bc = min(block_k, nk - j0)
            if _tile_skipped(i0, i0 + br, j0, j0 + bc, r, kv_len[b]):
                continue
            blas.gemm(False, True, br, bc, d, r.scale, q[b, i0:i0 + br],
                      k[bk, j0:j0 + bc], 0, s)
            _softmax_rows(s, m_i, l_i, no_values, br, bc, r, b, i0, j0,
                          kv_len, mask, added, True, log2e)


def _default(block, size):
    """A block size as given, or the CPU default when None."""
    return size if block is None else block


@njit
def _allowed(r, b, i, j, kv_len, mask):
    """Pair (i, j) of batch element b is allowed by every rule."""
    ok = _pair_allowed(i, j, r, kv_len[b])
    if r.use_mask:
        ok = ok and mask[b, i, j]
    return ok


@njit
def _dropout_weight(r, b, i, j):
    """1 / (1 - p) for a kept pair, 0 for a dropped one, 1 without dropout."""
    if r.use_dropout and _keep_bits(r.seed, uint64(b), uint64(i),
                                    uint64(j)) < r.threshold:
        return r.drop_scale * 0
    return r.drop_scale


@njit
def _row_span(i, j0, bc, r, kv_len):
    """Columns [lo, hi) of the tile's row i that masks.pair_allowed lets
    query i attend (lo >= hi: none): causal, window and padding each bound
    a row to one range of keys, so a tile is masked by two fills."""
    diag = i + r.offset
    hi = kv_len
    if r.causal:
        hi = min(hi, diag + 1)
    if r.right >= 0:
        hi = min(hi, diag + r.right + 1)
    lo = 0
    if r.left >= 0:
        lo = max(lo, diag - r.left)
    return min(max(lo - j0, 0), bc), min(max(hi - j0, 0), bc)


@njit(fastmath=_FAST)
def _add_row(row, added, b, i, j, lowest):
    """row (S's row i from key j on) += batch element b's float mask
    values, and the row's max from lowest (the pass that adds finds it):
    a -inf value refuses the pair whatever the score (NaN, +inf from bad
    input), as masks.Rules.allowed does; a NaN value gives a NaN score,
    so the row shows it."""
    values = added.values[added.index[b]]  # (Nq or 1, Nk)
    add = values[min(i, values.shape[0] - 1), j:j + row.shape[0]]
    top = lowest
    for c in range(row.shape[0]):
        x = add[c]
        y = x if x < lowest else row[c] + x  # below finfo.min: -inf
        row[c] = y
        top = vector.maximum(top, y)
    return top


@njit(fastmath=_FAST)
def _softmax_rows(s, m, l, acc, br, bc, r, b, i0, j0, kv_len, mask,
                  added, ragged, log2e):
    """Rows of S_ij -> P_ij in place; m, l, acc updated. See chapter 9.

    One row at a time, while it sits in L1: the row max, then exp2 and
    the row sum, over the row's allowed span only (ragged tiles: causal
    diagonal, window edges, padding), the mask array's refused scores
    set to -inf first, a float mask's values added; the columns outside
    the span get P = 0 by slice fills, so a masked tile costs no pass
    of its own.
    """
    lowest = r.lowest
    for a in range(br):
        lo, hi = 0, bc
        if ragged:
            lo, hi = _row_span(i0 + a, j0, bc, r, kv_len[b])
            hi = max(hi, lo)
        row = s[a, lo:hi]
        # from lowest, not -inf: a row of -inf then shifts by lowest, as
        # row_step does anyway, and the loop needs no typed -inf
        tile_max = lowest
        if added.used:  # the float mask first: a refused pair stays -inf
            tile_max = _add_row(row, added, b, i0 + a, j0 + lo, lowest)
        if r.use_mask:
            keep = mask[b, i0 + a, j0 + lo:j0 + hi]
            for c in range(hi - lo):
                row[c] = row[c] if keep[c] else -np.inf
        if r.use_mask or not added.used:
            tile_max = lowest
            for c in range(hi - lo):
                tile_max = vector.maximum(tile_max, row[c])
        m[a], shift, alpha = _row_step(m[a], tile_max, lowest)
        row_sum = alpha * 0  # a zero of the array dtype
        for c in range(hi - lo):
            p = vector.exp2((row[c] - shift) * log2e)  # S - m <= 0
            row_sum += p
            row[c] = p
        if lo > 0 or hi < bc:  # a slice fill: numba's own loop, several
            s[a, :lo] = 0  # times faster here than an explicit loop
            s[a, hi:bc] = 0  # from a row-dependent start
        l[a] = alpha * l[a] + row_sum
        if alpha != 1:  # the row's max moved: rescale its numerator
            acc_a = acc[a]
            for x in range(acc_a.shape[0]):
                acc_a[x] *= alpha


@njit(parallel=True, fastmath=_FAST)
def _forward(q, k, v, o, lse, block_q, block_k, r, kv_len, mask, added,
             log2e):
    bh, nq, d = q.shape
    nk, d_v = v.shape[1], v.shape[2]
    n_blocks = (nq + block_q - 1) // block_q
    for t in prange(bh * n_blocks):
        b = t // n_blocks
        bk = b // r.group  # the K/V head of query head b
        i0 = (t % n_blocks) * block_q
        br = min(block_q, nq - i0)
        acc = np.zeros((br, d_v), dtype=q.dtype)  # u, on chip
        m = np.full(br, -np.inf, dtype=q.dtype)
        l = np.zeros(br, dtype=q.dtype)
        s = np.empty((br, block_k), dtype=q.dtype)  # the one score tile
        q_i = q[b, i0:i0 + br]
        for j0 in range(0, nk, block_k):
            bc = min(block_k, nk - j0)
            if _tile_skipped(i0, i0 + br, j0, j0 + bc, r, kv_len[b]):
                continue
            # S_ij = tau Q_i K_j^T: one BLAS call, (br, bc)
            blas.gemm(False, True, br, bc, d, r.scale, q_i,
                      k[bk, j0:j0 + bc], 0, s)
            ragged = r.use_mask or not _tile_full(i0, i0 + br, j0, j0 + bc,
                                                  r, kv_len[b])
            _softmax_rows(s, m, l, acc, br, bc, r, b, i0, j0, kv_len, mask,
                          added, ragged, log2e)
            if r.use_dropout:  # dropped pairs leave the numerator only
                for a in range(br):
                    for c in range(bc):
                        s[a, c] *= _dropout_weight(r, b, i0 + a, j0 + c)
            # acc += P_ij V_j: one BLAS call, (br, d_v)
            blas.gemm(False, False, br, d_v, bc, 1, s, v[bk, j0:j0 + bc], 1,
                      acc)
        for a in range(br):
            if l[a] != 0:  # NaN is not "no key": it stays NaN
                for x in range(d_v):
                    o[b, i0 + a, x] = acc[a, x] / l[a]
                lse[b, i0 + a] = m[a] + math.log(l[a])
            else:  # no allowed key: output 0, lse -inf
                for x in range(d_v):
                    o[b, i0 + a, x] = 0
                lse[b, i0 + a] = -np.inf


@njit(fastmath=_FAST)
def _ds_tile(s, dp, pz, q_b, k_b, do_b, v_b, shift_b, norm_b, delta_b, b,
             i0, br, j0, bc, r, kv_len, mask, added, log2e):
    """Recompute the tile: P_ij Z into pz, dS_ij = P(dP Z - D) into s.

    P = exp(S - shift) norm, row by row (see `_row_statistics`), with S
    holding a float mask's values as the forward's did.
    """
    d, d_v = q_b.shape[1], v_b.shape[1]
    # S_ij and dP_ij = dO_i V_j^T: two BLAS calls, (br, bc)
    blas.gemm(False, True, br, bc, d, r.scale, q_b[i0:i0 + br],
              k_b[j0:j0 + bc], 0, s)
    blas.gemm(False, True, br, bc, d_v, 1, do_b[i0:i0 + br],
              v_b[j0:j0 + bc], 0, dp)
    # no dropout: each row's keys allowed by the index rules are one span
    # (a mask array refuses inside it by selects)
    spans = not r.use_dropout
    full = _tile_full(i0, i0 + br, j0, j0 + bc, r, kv_len[b])
    for a in range(br):
        i = i0 + a
        shift = max(shift_b[i], r.lowest)  # row_probability's shift
        w = norm_b[i]  # 1, or 1 / l where lse lost l
        if spans:  # a vector loop over the span, zeros around it
            lo, hi = (0, bc) if full else _row_span(i, j0, bc, r, kv_len[b])
            hi = max(hi, lo)
            s_a, dp_a, pz_a = s[a, lo:hi], dp[a, lo:hi], pz[a, lo:hi]
            if added.used:
                _add_row(s_a, added, b, i, j0 + lo, r.lowest)
            if r.use_mask:  # refused: P = 0 and dS = 0, whatever dP is
                keep = mask[b, i, j0 + lo:j0 + hi]
                zero = r.drop_scale * 0  # a zero of the array dtype
                for c in range(hi - lo):
                    p = vector.exp2((s_a[c] - shift) * log2e) * w
                    pz_a[c] = p if keep[c] else zero
                    s_a[c] = p * (dp_a[c] - delta_b[i]) if keep[c] else zero
            else:
                for c in range(hi - lo):
                    p = vector.exp2((s_a[c] - shift) * log2e) * w
                    pz_a[c] = p
                    s_a[c] = p * (dp_a[c] - delta_b[i])
            if lo > 0 or hi < bc:  # slice fills, as in _softmax_rows
                s[a, :lo] = 0
                s[a, hi:bc] = 0
                pz[a, :lo] = 0
                pz[a, hi:bc] = 0
            continue
        s_a, dp_a, pz_a = s[a, :bc], dp[a, :bc], pz[a, :bc]
        if added.used:
            _add_row(s_a, added, b, i, j0, r.lowest)
        for c in range(bc):
            j = j0 + c
            if not _allowed(r, b, i, j, kv_len, mask):
                s_a[c] = 0
                pz_a[c] = 0
                continue
            p = vector.exp2((s_a[c] - shift) * log2e) * w
            z = _dropout_weight(r, b, i, j)
            pz_a[c] = p * z
            s_a[c] = p * (dp_a[c] * z - delta_b[i])


@njit(parallel=True, fastmath=_FAST)
def _backward_heads(q, k, v, do, shift, norm, delta, dq, dk, dv, block_q,
                    block_k, r, kv_len, mask, added, log2e):
    """All gradients of one batch element per thread, in one pass.

    The thread that owns a head owns its dQ too, so each tile's dS adds
    into dQ_i straight away: five tile products per tile where the two
    passes below need seven, and the order of every sum is the same as
    theirs (key blocks outer, query blocks inner).
    """
    bh, nq, d = q.shape
    nk, d_v = v.shape[1], v.shape[2]
    for b in prange(bh):
        bk = b // r.group  # the K/V head of query head b
        dq[b] = 0
        s = np.empty((block_q, block_k), dtype=q.dtype)
        dp = np.empty((block_q, block_k), dtype=q.dtype)
        pz = np.empty((block_q, block_k), dtype=q.dtype)
        for j0 in range(0, nk, block_k):
            bc = min(block_k, nk - j0)
            dk_j = np.zeros((bc, d), dtype=q.dtype)
            dv_j = np.zeros((bc, d_v), dtype=q.dtype)
            for i0 in range(0, nq, block_q):
                br = min(block_q, nq - i0)
                if _tile_skipped(i0, i0 + br, j0, j0 + bc, r, kv_len[b]):
                    continue
                _ds_tile(s, dp, pz, q[b], k[bk], do[b], v[bk], shift[b],
                         norm[b], delta[b], b, i0, br, j0, bc, r, kv_len,
                         mask, added, log2e)
                blas.gemm(True, False, bc, d_v, br, 1, pz,
                          do[b, i0:i0 + br], 1, dv_j)
                blas.gemm(True, False, bc, d, br, r.scale, s,
                          q[b, i0:i0 + br], 1, dk_j)
                blas.gemm(False, False, br, d, bc, r.scale, s,
                          k[bk, j0:j0 + bc], 1, dq[b, i0:i0 + br])
            dk[b, j0:j0 + bc, :] = dk_j
            dv[b, j0:j0 + bc, :] = dv_j


@njit(parallel=True, fastmath=_FAST)
def _backward_kv(q, k, v, do, shift, norm, delta, dk, dv, block_q, block_k,
                 r, kv_len, mask, added, log2e):
    bh, nq, d = q.shape
    nk, d_v = v.shape[1], v.shape[2]
    n_blocks = (nk + block_k - 1) // block_k
    for t in prange(bh * n_blocks):
        b = t // n_blocks
        bk = b // r.group  # the K/V head of query head b
        j0 = (t % n_blocks) * block_k
        bc = min(block_k, nk - j0)
        dk_j = np.zeros((bc, d), dtype=q.dtype)  # on chip for all Q_i
        dv_j = np.zeros((bc, d_v), dtype=q.dtype)
        s = np.empty((block_q, bc), dtype=q.dtype)
        dp = np.empty((block_q, bc), dtype=q.dtype)
        pz = np.empty((block_q, bc), dtype=q.dtype)
        for i0 in range(0, nq, block_q):
            br = min(block_q, nq - i0)
            if _tile_skipped(i0, i0 + br, j0, j0 + bc, r, kv_len[b]):
                continue
            _ds_tile(s, dp, pz, q[b], k[bk], do[b], v[bk], shift[b],
                     norm[b], delta[b], b, i0, br, j0, bc, r, kv_len, mask,
                     added, log2e)
            # dV_j += (P Z)^T dO_i and dK_j += tau dS^T Q_i: BLAS calls
            blas.gemm(True, False, bc, d_v, br, 1, pz, do[b, i0:i0 + br],
                      1, dv_j)
            blas.gemm(True, False, bc, d, br, r.scale, s, q[b, i0:i0 + br],
                      1, dk_j)
        dk[b, j0:j0 + bc, :] = dk_j
        dv[b, j0:j0 + bc, :] = dv_j


@njit(parallel=True, fastmath=_FAST)
def _backward_q(q, k, v, do, shift, norm, delta, dq, block_q, block_k, r,
                kv_len, mask, added, log2e):
    bh, nq, d = q.shape
    nk = k.shape[1]
    n_blocks = (nq + block_q - 1) // block_q
    for t in prange(bh * n_blocks):
        b = t // n_blocks
        bk = b // r.group  # the K/V head of query head b
        i0 = (t % n_blocks) * block_q
        br = min(block_q, nq - i0)
        dq_i = np.zeros((br, d), dtype=q.dtype)
        s = np.empty((br, block_k), dtype=q.dtype)
        dp = np.empty((br, block_k), dtype=q.dtype)
        pz = np.empty((br, block_k), dtype=q.dtype)
        for j0 in range(0, nk, block_k):
            bc = min(block_k, nk - j0)
            if _tile_skipped(i0, i0 + br, j0, j0 + bc, r, kv_len[b]):
                continue
            _ds_tile(s, dp, pz, q[b], k[bk], do[b], v[bk], shift[b],
                     norm[b], delta[b], b, i0, br, j0, bc, r, kv_len, mask,
                     added, log2e)
            # dQ_i += tau dS_ij K_j: one BLAS call
            blas.gemm(False, False, br, d, bc, r.scale, s, k[bk, j0:j0 + bc],
                      1, dq_i)
        dq[b, i0:i0 + br, :] = dq_i
