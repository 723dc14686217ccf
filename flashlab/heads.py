"""Grouped-query and multi-query attention: fewer K/V heads than Q heads.

Heads are the axis before (N, d). When q has H_q heads and k, v have
H_kv heads with H_q = g H_kv, query head h reads K/V head h // g (as
torch's enable_gqa and flash-attn do); H_kv = 1 is multi-query attention.
`split` views q as (..., H_kv, g, N, d) and k, v as (..., H_kv, 1, N, d),
so ordinary broadcasting pairs every query head with its K/V head and no
K/V head is ever copied. The backward sums dK and dV over the g query
heads of a group (`sum_to`). Masks and key lengths given per query head
are viewed the same way (`split_batch`). See chapter 7.
"""

import numpy as np


def group_size(q_shape, k_shape, v_shape):
    """g = H_q / H_kv; 1 when the leading dims of q, k and v broadcast
    together, aligned from the right as numpy and torch's SDPA align them
    (equal ones, fewer dims, or multi-query attention's single K/V head).
    """
    if _broadcasts(q_shape[:-2], k_shape[:-2], v_shape[:-2]):
        return 1
    for name, shape in (("k", k_shape), ("v", v_shape)):
        if shape[:-2] != k_shape[:-2] or len(shape) < 3 or len(
                shape) != len(q_shape) or (
                shape[:-3] != q_shape[:-3]) or len(q_shape) < 3 or (
                shape[-3] == 0 or q_shape[-3] == 0) or (
                q_shape[-3] % shape[-3]):
            raise ValueError(
                f"{name}: expected leading dims {tuple(q_shape[:-2])} to "
                f"match q, or the same with a number of heads (dim -3) "
                f"dividing q's {q_shape[-3] if len(q_shape) > 2 else None} "
                f"(grouped-query attention), got {tuple(shape[:-2])}")
    return q_shape[-3] // k_shape[-3]


def split(x, g, kv=False):
    """(..., H, N, d) viewed as (..., H/g, g, N, d), or (..., H, 1, N, d)
    for K/V (kv=True): no copy."""
    if kv:
        return x[..., None, :, :]
    return x.reshape(*x.shape[:-3], x.shape[-3] // g, g, *x.shape[-2:])


def join(x):
    """(..., H_kv, g, N, d) back to (..., H_kv g, N, d)."""
    # the heads' count spelled out: -1 is ambiguous for an empty batch
    return x.reshape(*x.shape[:-4], x.shape[-4] * x.shape[-3],
                     *x.shape[-2:])


def broadcast(*xs):
    """Arrays (..., N, d) viewed with their leading dims broadcast
    together, aligned from the right (SDPA's rule); no copy."""
    lead = np.broadcast_shapes(*(np.shape(x)[:-2] for x in xs))
    # an array already that shape stays itself: broadcast_to would give
    # its length-1 axes stride 0, which BLAS refuses as a leading dim
    return [x if np.shape(x)[:-2] == lead else np.broadcast_to(
        x, (*lead, *np.shape(x)[-2:])) for x in xs]


def split_batch(a, batch_shape, g, trailing):
    """A per-query-head array (mask, key lengths) viewed on the grouped
    batch: a broadcasts against (*batch_shape, *trailing dims), batch_shape
    ending in H_q; returned broadcastable to (..., H_kv, g, *trailing)."""
    if a is None or g == 1:
        return a
    a = np.asarray(a)
    full = len(batch_shape) + trailing
    if a.ndim < full:  # dims broadcast in front: give the heads dim its 1
        a = a.reshape((1,) * (full - a.ndim) + a.shape)
    head = a.ndim - trailing - 1
    if a.shape[head] == 1:
        return np.expand_dims(a, head)
    return a.reshape(*a.shape[:head], a.shape[head] // g, g,
                     *a.shape[head + 1:])


def sum_to(x, shape):
    """x summed over the axes where `shape` has 1 and x more, and over
    the leading axes `shape` lacks: the gradient of a broadcast (dK, dV
    summed over a group's heads, or back to a caller's fewer dims)."""
    if x.ndim > len(shape):
        x = x.sum(axis=tuple(range(x.ndim - len(shape))))
    axes = tuple(i for i, (a, b) in enumerate(zip(x.shape, shape))
                 if b == 1 and a != 1)
    return x.sum(axis=axes, keepdims=True) if axes else x


def _broadcasts(*shapes):
    """The shapes broadcast together."""
    try:
        np.broadcast_shapes(*shapes)
    except ValueError:
        return False
    return True
