"""What the numba kernels receive: arrays as (BH, N, d), rules as one record.

Both the CPU kernels (flashlab.cpu) and the CUDA kernels (flashlab.gpu)
work on (BH, N, d) arrays; with grouped heads k and v are (BH / g, N,
d). Every scalar rule of a call (scale, mask geometry, dropout, heads per
group) travels in one `KernelRules` record, a namedtuple that numba
passes to njit functions and CUDA kernels alike, so a new rule is a new
field here and nowhere else in the signatures.
"""

from typing import NamedTuple

import numpy as np

from flashlab import dropout, tiled


class KernelRules(NamedTuple):
    """The scalar rules of one call, typed for the kernels' float dtype."""

    scale: np.floating  # tau, multiplies Q
    causal: bool
    offset: int  # diagonal offset: 0 or Nk - Nq (see flashlab.masks)
    left: int  # window sides, -1 = unbounded
    right: int
    use_mask: bool  # a boolean mask array is given
    seed: np.uint64
    threshold: np.uint64  # keep a pair when keep_bits >= threshold
    use_dropout: bool
    drop_scale: np.floating  # 1 / (1 - dropout_p)
    lowest: np.floating  # most negative finite value of the dtype
    group: int  # query heads per K/V head: K/V head of b is b // group


class KernelArgs(NamedTuple):
    """The record and the two small arrays every kernel takes."""

    rules: KernelRules
    kv_len: np.ndarray  # (BH,) int64 valid keys per batch element
    mask: np.ndarray  # (BH, Nq, Nk) bool, or (1, 1, 1) when unused


def proxy(x, dtype=None):
    """A numpy stand-in with x's shape and dtype (or `dtype`), no data.

    Lets device arrays and torch tensors go through the same checks as
    numpy arrays without copying them to the host.
    """
    dtype = np.dtype(dtype or str(x.dtype).removeprefix("torch."))
    return np.broadcast_to(np.zeros((), dtype=dtype), tuple(x.shape))


def flatten(q, k, v, options):
    """Validate; return (q, k, v) as (BH, N, d) arrays, batch, plan, args.

    options are the keyword arguments of `tiled.plan`.
    """
    shapes = [tuple(x.shape) for x in (q, k, v)]
    q, k, v, plan = tiled.plan(q, k, v, **options)
    group = kernel_group(*shapes)
    if group > 1 and plan.group == 1:  # one K/V head, broadcast by plan
        k, v = (x[..., :1, :, :] for x in (k, v))
    batch = q.shape[:-2]
    bh = int(np.prod(batch))
    masks = plan.rules
    if masks.bias is not None and np.any(masks.mask & (masks.bias != 0)):
        raise ValueError(
            "mask: a float mask with values other than 0 and -inf adds to "
            "the scores, which the numba kernels do not; pass it to "
            "flashlab.tiled (or flashlab.torch on the CPU), or a boolean "
            "mask here")
    if np.ndim(masks.offset):  # a diagonal per element: as a mask
        masks = masks._replace(causal=False, offset=0, window=None,
                               mask=masks.allowed(range(plan.nq),
                                                  range(plan.nk)))
    left, right = (-1 if w is None else w
                   for w in (masks.window or (None, None)))
    kv_len = np.full(batch, plan.nk, dtype=np.int64)
    if masks.kv_lengths is not None:
        kv_len = np.broadcast_to(masks.kv_lengths[..., 0, 0], batch)
    if masks.mask is not None:
        mask = np.broadcast_to(masks.mask, (*batch, plan.nq, plan.nk))
        mask = np.ascontiguousarray(mask.reshape(bh, plan.nq, plan.nk))
    else:
        mask = np.ones((1, 1, 1), dtype=np.bool_)
    drop = plan.dropout
    real = q.dtype.type
    rules = KernelRules(
        scale=real(plan.scale),
        causal=masks.causal,
        offset=masks.offset,
        left=left,
        right=right,
        use_mask=masks.mask is not None,
        seed=np.uint64(drop.seed if drop else 0),
        threshold=dropout.threshold(drop.rate if drop else 0.0),
        use_dropout=drop is not None,
        drop_scale=real(1.0 / (1.0 - drop.rate) if drop else 1.0),
        lowest=real(np.finfo(q.dtype).min),
        group=group,
    )
    args = KernelArgs(
        rules=rules,
        kv_len=np.ascontiguousarray(kv_len.reshape(bh), dtype=np.int64),
        mask=mask,
    )
    q = q.reshape(bh, *q.shape[-2:])
    k, v = (x.reshape(bh // group, *x.shape[-2:]) for x in (k, v))
    return q, k, v, batch, plan, args


def kernel_group(q_shape, k_shape, v_shape):
    """Query heads per K/V head as the kernels index them: k and v with
    q's leading dims, or with heads (dim -3) dividing q's."""
    if k_shape[:-2] == q_shape[:-2] and v_shape[:-2] == q_shape[:-2]:
        return 1
    if (len(q_shape) >= 3 and len(k_shape) == len(q_shape)
            and k_shape[:-2] == v_shape[:-2]
            and k_shape[:-3] == q_shape[:-3]
            and q_shape[-3] % k_shape[-3] == 0):
        return q_shape[-3] // k_shape[-3]
    raise ValueError(
        f"k: expected leading dims {q_shape[:-2]} like q, or fewer heads "
        f"(dim -3) dividing q's, for the numba kernels; got "
        f"{k_shape[:-2]} (k) and {v_shape[:-2]} (v): other broadcasts run"
        f" on flashlab.tiled and flashlab.torch")
