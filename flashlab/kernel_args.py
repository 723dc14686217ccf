"""What the numba kernels receive: arrays as (BH, N, d), rules as one record.

Both the CPU kernels (flashlab.cpu) and the CUDA kernels (flashlab.gpu)
work on (BH, N, d) arrays; with grouped heads k and v are (BH / g, N,
d). Every scalar rule of a call (scale, mask geometry, dropout, heads per
group) travels in one `KernelRules` record, a namedtuple that numba
passes to njit functions and CUDA kernels alike, so a new rule is a new
field here and nowhere else in the signatures. A float mask that adds to
the scores reaches the CPU kernels as one `AddedScores` record.
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
    # forward v8 only (flashlab.gpu.host's split tail): query blocks
    # before the launch's first, whose rows go out from block_shift Br
    # on; and key_half: each block runs one half of its key tiles, the
    # half blockIdx.x says, and writes 2 BH heads (blockIdx.x BH + b)
    block_shift: int = 0
    key_half: bool = False


class AddedScores(NamedTuple):
    """A float mask as the CPU kernels add it to tau S: batch element b
    adds values[index[b], i or 0, j] to score (i, j); -inf refuses."""

    values: np.ndarray  # (M, Nq or 1, Nk) in q's dtype, M bias heads
    index: np.ndarray  # (BH,) int64: which of the M each element adds
    used: bool  # False: (1, 1, 1) zeros stand in, nothing is added


class KernelArgs(NamedTuple):
    """The record and the two small arrays every kernel takes."""

    rules: KernelRules
    kv_len: np.ndarray  # (BH,) int64 valid keys per batch element
    mask: np.ndarray  # (BH, Nq, Nk) bool, or (1, 1, 1) when unused
    # the CPU kernels' float mask that adds (flatten(..., added=True))
    added: AddedScores | None = None


def proxy(x, dtype=None):
    """A numpy stand-in with x's shape and dtype (or `dtype`), no data.

    Lets device arrays and torch tensors go through the same checks as
    numpy arrays without copying them to the host.
    """
    dtype = np.dtype(dtype or str(x.dtype).removeprefix("torch."))
    return np.broadcast_to(np.zeros((), dtype=dtype), tuple(x.shape))


def flatten(q, k, v, options, added=False):
    """Validate; return (q, k, v) as (BH, N, d) arrays, batch, plan, args.

    options are the keyword arguments of `tiled.plan`. With added=True
    (the CPU kernels) a float mask that adds to the scores comes back as
    args.added, with no boolean mask (its -inf entries refuse); else
    such a mask is refused.
    """
    shapes = []  # as given, lists too (plan may broadcast them)
    for name, x in (("q", q), ("k", k), ("v", v)):
        try:
            shapes.append(tuple(np.shape(x)))
        except ValueError:  # numpy's words for ragged nested lists
            raise ValueError(f"{name}: expected an array of one shape, "
                             f"got ragged sequences") from None
    q, k, v, plan = tiled.plan(q, k, v, **options)
    group = kernel_group(*shapes)
    if group > 1 and plan.group == 1:  # one K/V head, broadcast by plan
        k, v = (x[..., :1, :, :] for x in (k, v))
    batch = q.shape[:-2]
    bh = int(np.prod(batch))
    masks = plan.rules
    adds = masks.bias is not None and bool(np.any(masks.mask & (
        masks.bias != 0)))  # else 0 / -inf: the boolean mask says it all
    if adds and added:  # the bias refuses its -inf pairs itself
        masks = masks._replace(mask=None)
    elif adds:
        raise ValueError(
            "mask: a float mask with values other than 0 and -inf adds to "
            "the scores, which the CUDA kernels do not; pass it to "
            "flashlab.cpu or flashlab.tiled (or flashlab.torch on the "
            "CPU), or a boolean mask here")
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
        added=(_added(masks.bias if adds else None, batch, plan.nk,
                      q.dtype) if added else None),
    )
    q = q.reshape(bh, *q.shape[-2:])
    k, v = (x.reshape(bh // group, *x.shape[-2:]) for x in (k, v))
    return q, k, v, batch, plan, args


def _added(bias, batch, nk, dtype):
    """`AddedScores` of a float mask broadcastable to (*batch, Nq, Nk),
    or the unused stand-in for None. Its batch dims are kept as given,
    not broadcast (an index says which one each element adds), so a
    (Nq, Nk) mask is not copied B H times; only a key axis of 1 is."""
    if bias is None:
        return AddedScores(np.zeros((1, 1, 1), dtype),
                           np.zeros(1, np.int64), False)
    bias = bias.reshape((1,) * (len(batch) + 2 - bias.ndim) + bias.shape)
    lead, rows = bias.shape[:-2], bias.shape[-2]
    index = np.broadcast_to(np.arange(int(np.prod(lead))).reshape(lead),
                            batch).reshape(-1)
    if bias.shape[-1] != nk:  # one value per row: spread over the keys
        bias = np.broadcast_to(bias, (*lead, rows, nk))
    values = np.ascontiguousarray(bias.reshape(-1, rows, nk), dtype=dtype)
    return AddedScores(values, np.ascontiguousarray(index, np.int64), True)


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
