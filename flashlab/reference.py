"""Materialized attention: the N x N path, and the float64 ground truth.

`naive` is the textbook three-step computation in the input precision
(S = scale * Q K^T, P = softmax(S), O = P V), holding S and P whole. It is
what chapter 1 costs out and what the error budgets of faster code are
measured against. `attention` runs the same steps in float64 and is the
reference every test compares with.
"""

import numpy as np

from flashlab import dropout, heads, masks, nonfinite
from flashlab._validate import check_flag, check_qkv, check_scale


def softmax(s):
    """Row softmax of scores s (..., Nk); rows that are all -inf give 0."""
    m = s.max(axis=-1, keepdims=True)
    e = np.exp(s - np.where(np.isneginf(m), 0, m))  # masked -> exp(-inf) = 0
    total = e.sum(axis=-1, keepdims=True)
    # a NaN total (a NaN or +inf score) makes the whole row NaN
    return e / np.where((total > 0) | np.isnan(total), total, 1)


def logsumexp(s):
    """Row log-sum-exp of scores s (..., Nk); -inf for rows with no key."""
    m = s.max(axis=-1)
    safe = np.where(np.isneginf(m), 0, m)
    total = np.exp(s - safe[..., None]).sum(axis=-1)
    with np.errstate(divide="ignore"):  # log(0) = -inf for empty rows
        return safe + np.log(total)


def scores(q, k, *, scale=None, causal=False, mask=None, window=None,
           kv_lengths=None, align=None):
    """Masked score matrix S (..., Nq, Nk); disallowed pairs are -inf."""
    q, k, _ = check_qkv(q, k, k)
    g = heads.group_size(q.shape, k.shape, k.shape)
    if g > 1:  # grouped heads: the same on the grouped view
        return heads.join(scores(
            heads.split(q, g), heads.split(k, g, kv=True), scale=scale,
            causal=causal, window=window, align=align,
            mask=heads.split_batch(mask, q.shape[:-2], g, 2),
            kv_lengths=heads.split_batch(kv_lengths, q.shape[:-2], g, 0)))
    q, k = heads.broadcast(q, k)  # leading dims aligned from the right
    nq, nk = q.shape[-2], k.shape[-2]
    scale = check_scale(scale, q.shape[-1])
    rules = masks.rules(causal, window, kv_lengths, mask, q.shape[:-2],
                        nq, nk, align)
    s = scale * (q @ np.swapaxes(k, -1, -2))  # (..., Nq, Nk)
    bias = rules.added(range(nq), range(nk))
    if bias is not None:  # a float mask adds to the scores
        s = s + bias.astype(s.dtype)
    keep = rules.allowed(range(nq), range(nk))
    if keep is not None:
        s = np.where(keep, s, -np.inf)
    return s


def naive(q, k, v, *, scale=None, causal=False, mask=None, window=None,
          kv_lengths=None, dropout_p=0.0, seed=None, dropout_mask=None,
          return_lse=False, align=None):
    """Materialized attention in the input dtype. q (..., Nq, d) -> O.

    Holds the full S and P (..., Nq, Nk). See chapter 1.
    """
    q, k, v = check_qkv(q, k, v)
    return_lse = check_flag("return_lse", return_lse)
    g = heads.group_size(q.shape, k.shape, v.shape)
    if g > 1:  # grouped heads: the same on the grouped view
        o, lse = naive(
            heads.split(q, g), heads.split(k, g, kv=True),
            heads.split(v, g, kv=True), scale=scale, causal=causal,
            window=window, align=align, dropout_p=dropout_p, seed=seed,
            mask=heads.split_batch(mask, q.shape[:-2], g, 2),
            kv_lengths=heads.split_batch(kv_lengths, q.shape[:-2], g, 0),
            dropout_mask=heads.split_batch(dropout_mask, q.shape[:-2], g,
                                           2), return_lse=True)
        o, lse = heads.join(o), heads.join(lse[..., None])[..., 0]
        return (o, lse) if return_lse else o
    q, k, v = heads.broadcast(q, k, v)  # leading dims aligned from the right
    s = scores(q, k, scale=scale, causal=causal, mask=mask, window=window,
               kv_lengths=kv_lengths, align=align)
    keep = _dropout_keep(dropout_p, seed, dropout_mask, s.shape)
    with np.errstate(invalid="ignore"):  # inf - inf: NaN by the rule
        p = softmax(s)  # (..., Nq, Nk)
        if keep is not None:
            p = np.where(keep, p / (1 - dropout_p), 0)
        o = p @ v  # (..., Nq, dv)
        lse = logsumexp(s)
    # a row whose denominator is NaN is NaN whatever dropout keeps: P's
    # NaN entries may all be dropped, and a kernel's sum / l is NaN
    o[np.isnan(lse)] = np.nan
    empty = masks.rules(causal, window, kv_lengths, mask, q.shape[:-2],
                        q.shape[-2], k.shape[-2], align).empty_rows(
        q.shape[:-2], q.shape[-2], k.shape[-2])
    nonfinite.finish(o, lse, v, empty)
    return (o, lse) if return_lse else o


def _dropout_keep(dropout_p, seed, dropout_mask, shape):
    """The boolean keep mask of a call, or None without dropout."""
    made = dropout.make(dropout_p, 0 if dropout_mask is not None else seed,
                        shape[:-2])  # validates dropout_p (and seed)
    if dropout_mask is None:
        return None if made is None else made.keep(range(shape[-2]),
                                                   range(shape[-1]))
    if made is None:
        raise ValueError("dropout_mask: given, but dropout_p is 0")
    keep = np.asarray(dropout_mask)
    if keep.dtype != np.bool_:
        raise TypeError(f"dropout_mask: expected a boolean array (True = "
                        f"kept), got dtype {keep.dtype}")
    try:
        ok = np.broadcast_shapes(keep.shape, shape) == tuple(shape)
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"dropout_mask: expected a shape broadcastable to "
                         f"{tuple(shape)}, got {keep.shape}")
    return keep


def attention(q, k, v, *, scale=None, causal=False, mask=None, window=None,
              kv_lengths=None, dropout_p=0.0, seed=None, dropout_mask=None,
              return_lse=False, align=None):
    """Ground truth: materialized attention computed in float64.

    dropout_mask, if given, is the boolean keep mask (..., Nq, Nk) to use
    instead of the one `flashlab.dropout` derives from the seed.
    """
    q, k, v = check_qkv(q, k, v)
    return naive(
        q.astype(np.float64),
        k.astype(np.float64),
        v.astype(np.float64),
        scale=scale,
        causal=causal,
        mask=mask,
        window=window,
        kv_lengths=kv_lengths,
        dropout_p=dropout_p,
        seed=seed,
        dropout_mask=dropout_mask,
        return_lse=return_lse,
        align=align,
    )
