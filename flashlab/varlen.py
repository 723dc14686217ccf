"""Packed variable-length batches: sequences laid end to end, no padding.

flash-attn's varlen layout: q (total_q, H, d), k (total_k, H_kv, d), v
(total_k, H_kv, d_v), and cu_seqlens_q, cu_seqlens_k (B + 1,) the
cumulative lengths, so sequence b holds rows cu[b]:cu[b + 1]. Each
sequence is attended on its own, with its own lengths: causal masks and
windows align within it (`align`, as everywhere in flashlab), never on a
padded length, and no sequence is padded to the longest. Works with any
backend module that has `attention` and `attention_backward` (tiled,
cpu, gpu); `flashlab.torch.varlen_attention` is the autograd form. See
chapter 7.
"""

import numpy as np

from flashlab import tiled

REFUSED = ("mask", "kv_lengths", "num_splits")  # whole-batch arguments


def attention(q, k, v, cu_seqlens_q, cu_seqlens_k, *, backend=tiled,
              return_lse=False, **options):
    """o (total_q, H, d_v) of every sequence; lse (total_q, H) too if
    return_lse. options: the keywords of `tiled.attention` but mask and
    kv_lengths; dropout draws an independent stream per sequence."""
    q, k, v = _arrays(q, k, v)
    spans = check_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, options)
    # a sequence without keys has rows without keys: 0, lse -inf
    o = np.zeros((q.shape[0], q.shape[1], v.shape[-1]), dtype=q.dtype)
    lse = np.full(q.shape[:2], -np.inf, dtype=q.dtype)
    for b, (rq, rk) in enumerate(spans):
        if rq.stop > rq.start and rk.stop > rk.start:
            o_b, lse_b = backend.attention(
                *_heads_first(q[rq], k[rk], v[rk]), return_lse=True,
                **sequence_options(options, b))
            o[rq], lse[rq] = np.swapaxes(o_b, 0, 1), lse_b.T
    return (o, lse) if return_lse else o


def attention_backward(q, k, v, o, lse, do, cu_seqlens_q, cu_seqlens_k, *,
                       backend=tiled, **options):
    """(dq, dk, dv) in the packed layout; dK, dV summed over a group's
    query heads when k and v have fewer heads."""
    q, k, v, o, lse, do = _arrays(q, k, v, o, lse, do)
    spans = check_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, options)
    dq, dk, dv = (np.zeros_like(x) for x in (q, k, v))
    for b, (rq, rk) in enumerate(spans):
        if rq.stop == rq.start or rk.stop == rk.start:
            continue  # no pair: no gradient
        g = backend.attention_backward(
            *_heads_first(q[rq], k[rk], v[rk], o[rq]), lse[rq].T,
            np.swapaxes(do[rq], 0, 1), **sequence_options(options, b))
        dq[rq], dk[rk], dv[rk] = (np.swapaxes(x, 0, 1) for x in g)
    return dq, dk, dv


def _arrays(*xs):
    """Nested lists as numpy arrays; arrays of any kind (numpy, device,
    torch) as they are, for the backend."""
    return [x if hasattr(x, "shape") else np.asarray(x) for x in xs]


def spans(cu_seqlens, total, name):
    """Validated row slices of each sequence from cumulative lengths."""
    cu = np.asarray(cu_seqlens)
    if cu.ndim != 1 or cu.size < 2 or cu.dtype.kind not in "iu":
        raise ValueError(f"{name}: expected a 1-d integer array of B + 1 "
                         f"cumulative lengths, got {cu.dtype} shape "
                         f"{cu.shape}")
    if cu[0] != 0 or cu[-1] != total or np.any(np.diff(cu) < 0):
        raise ValueError(f"{name}: expected 0 = cu[0] <= cu[1] <= ... <= "
                         f"cu[-1] = {total} rows, got {cu.tolist()}")
    return [slice(int(a), int(b)) for a, b in zip(cu[:-1], cu[1:])]


def check_packed(q, k, v, cu_q, cu_k, options):
    """(query rows, key rows) per sequence, after the checks."""
    for name in REFUSED:
        value = options.get(name)
        if value is not None and not (name == "num_splits" and value == 1):
            raise ValueError(f"{name}: not taken by a packed batch (each "
                             f"sequence is its own call); got a value")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if np.ndim(x) != 3:
            raise ValueError(f"{name}: expected (total, heads, d), got "
                             f"shape {np.shape(x)}")
    sq, sk = np.shape(q), np.shape(k)  # nested lists have shapes too
    for name, x in (("k", k), ("v", v)):
        sx = np.shape(x)
        if sx[1] != sk[1] or sx[1] == 0 or sq[1] % sx[1]:
            raise ValueError(f"{name}: expected a number of heads (dim 1) "
                             f"dividing q's {sq[1]}, got shape {sx}")
    rq = spans(cu_q, sq[0], "cu_seqlens_q")
    rk = spans(cu_k, sk[0], "cu_seqlens_k")
    if len(rq) != len(rk):
        raise ValueError(f"cu_seqlens_k: expected {len(rq)} sequences like "
                         f"cu_seqlens_q, got {len(rk)}")
    return list(zip(rq, rk))


def _heads_first(*xs):
    """(n, H, d) rows of one sequence as (H, n, d) views."""
    return [np.swapaxes(x, 0, 1) for x in xs]


def sequence_options(options, b):
    """A sequence's options: its own dropout stream from the seed."""
    seed = options.get("seed")
    if seed is None or not options.get("dropout_p"):
        return options
    stream = np.random.SeedSequence([int(seed), b]).generate_state(
        2, np.uint32)
    return {**options, "seed": int(stream[0]) << 32 | int(stream[1])}
