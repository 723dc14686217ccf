"""Flatten validated attention arguments into what the numba kernels take.

Both the CPU kernels (flashlab.cpu) and the CUDA kernels (flashlab.gpu)
work on (BH, N, d) arrays and scalar rules; this module turns the
arguments of `tiled.attention` into that form, once.
"""

from typing import NamedTuple

import numpy as np

from flashlab import dropout, tiled


class KernelArgs(NamedTuple):
    """Scalars and small arrays every kernel receives."""

    scale: float
    causal: bool
    offset: int
    left: int  # window sides, -1 = unbounded
    right: int
    kv_len: np.ndarray  # (BH,) int64 valid keys per batch element
    mask: np.ndarray  # (BH, Nq, Nk) bool, or (1, 1, 1) when unused
    use_mask: bool
    seed: np.uint64
    threshold: np.uint64  # keep pair when keep_bits >= threshold
    use_dropout: bool
    drop_scale: float  # 1 / (1 - p)


def proxy(x):
    """A numpy stand-in with x's shape and dtype that holds no data.

    Lets device arrays and torch tensors go through the same checks as
    numpy arrays without copying them to the host.
    """
    dtype = np.dtype(str(x.dtype).removeprefix("torch."))
    return np.broadcast_to(np.zeros((), dtype=dtype), tuple(x.shape))


def flatten(q, k, v, options):
    """Validate; return (q, k, v) as (BH, N, d) arrays, batch shape, args."""
    q, k, v, p = tiled.plan(q, k, v, **options)
    batch = q.shape[:-2]
    bh = int(np.prod(batch))
    rules = p.rules
    left, right = (-1 if w is None else w
                   for w in (rules.window or (None, None)))
    kv_len = np.full(batch, p.nk, dtype=np.int64)
    if rules.kv_lengths is not None:
        kv_len = np.broadcast_to(rules.kv_lengths[..., 0, 0], batch)
    if rules.mask is not None:
        mask = np.broadcast_to(rules.mask, (*batch, p.nq, p.nk))
        mask = np.ascontiguousarray(mask.reshape(bh, p.nq, p.nk))
    else:
        mask = np.ones((1, 1, 1), dtype=np.bool_)
    drop = p.dropout
    args = KernelArgs(
        scale=p.scale,
        causal=rules.causal,
        offset=rules.offset,
        left=left,
        right=right,
        kv_len=np.ascontiguousarray(kv_len.reshape(bh), dtype=np.int64),
        mask=mask,
        use_mask=rules.mask is not None,
        seed=np.uint64(drop.seed if drop else 0),
        threshold=dropout.threshold(drop.p if drop else 0.0),
        use_dropout=drop is not None,
        drop_scale=1.0 / (1.0 - drop.p) if drop else 1.0,
    )
    q, k, v = (x.reshape(bh, *x.shape[-2:]) for x in (q, k, v))
    return q, k, v, batch, p, args
