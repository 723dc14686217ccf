"""flashlab attention as a torch.autograd.Function a model can call.

CPU tensors (float32, float64) run the tiled numpy path, CUDA tensors the
numba.cuda kernels of flashlab.gpu in place through
__cuda_array_interface__: float32 on the default version, bf16 and
float16 on the tensor cores (v5). The
forward saves q, k, v, o and the row log-sum-exp only; the backward
recomputes score tiles from them, so no (Nq, Nk) tensor lives between the
two passes. The backward is itself not differentiable: asking for a second
derivative raises instead of returning a wrong one. See chapters 8 and 9.
"""

import numpy as np
import torch

from flashlab import tiled
from flashlab._validate import check_flag

_DTYPES = {"cpu": (torch.float32, torch.float64),
           "cuda": (torch.float32, torch.bfloat16, torch.float16)}


class Attention(torch.autograd.Function):
    """Autograd wrapper around the forward and backward of a backend."""

    @staticmethod
    def forward(ctx, q, k, v, options, num_splits):
        if q.is_cuda:
            from flashlab import gpu

            o, lse = gpu.attention(q, k, v, return_lse=True,
                                   num_splits=num_splits, **options)
        else:
            o, lse = tiled.attention(*_numpy(q, k, v), return_lse=True,
                                     num_splits=num_splits, **options)
            o, lse = torch.from_numpy(o), torch.from_numpy(lse)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.options = options
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        if torch.is_grad_enabled():  # create_graph=True: a 2nd derivative
            raise RuntimeError(
                "flashlab.torch.attention is differentiable once: its "
                "backward has no derivative of its own, so create_graph="
                "True (double backward, gradient penalties) is refused "
                "rather than answered without the second-order term")
        q, k, v, o, lse = ctx.saved_tensors
        if q.is_cuda:
            from flashlab import gpu

            # the backward kernels run float32: 16-bit tensors are
            # widened for them and the gradients rounded back
            wide = [x.float() for x in (q, k, v, o, lse, do.contiguous())]
            grads = gpu.attention_backward(*wide, **ctx.options)
            return (*(g.to(q.dtype) for g in grads), None, None)
        grads = tiled.attention_backward(*_numpy(q, k, v, o, lse, do),
                                         **ctx.options)
        return (*(torch.from_numpy(g) for g in grads), None, None)


def attention(q, k, v, *, block_q=None, block_k=None, scale=None,
              causal=False, mask=None, window=None, kv_lengths=None,
              dropout_p=0.0, seed=None, return_lse=False, order="fa2",
              num_splits=1):
    """Differentiable attention: q (..., Nq, d), k, v -> o (..., Nq, dv).

    Keywords and semantics as tiled.attention; mask is a bool tensor or
    array, True = may attend. With return_lse, also the row log-sum-exp
    (..., Nq), which carries no gradient. With dropout_p > 0 and no seed,
    a seed is drawn from torch's generator, so torch.manual_seed makes
    runs repeatable.
    """
    return_lse = check_flag("return_lse", return_lse)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got "
                            f"{type(x).__name__}")
        if x.device.type not in _DTYPES:
            raise ValueError(f"{name}: expected a CPU or CUDA tensor, got "
                             f"one on {x.device} (no data to compute on)")
        if x.dtype not in _DTYPES[x.device.type]:
            raise TypeError(
                f"{name}: expected a dtype in {_DTYPES[x.device.type]} on "
                f"{x.device.type}, got {x.dtype}")
        if x.device != q.device:
            raise ValueError(f"{name}: expected device {q.device} like q, "
                             f"got {x.device}")
    if isinstance(mask, torch.Tensor):
        mask = mask.detach().cpu().numpy()
    if isinstance(kv_lengths, torch.Tensor):
        kv_lengths = kv_lengths.detach().cpu().numpy()
    if dropout_p and seed is None:
        seed = int(torch.randint(0, 2**62, ()).item())
    options = dict(block_q=block_q, block_k=block_k, scale=scale,
                   causal=causal, mask=mask, window=window,
                   kv_lengths=kv_lengths, dropout_p=dropout_p, seed=seed,
                   order=order)
    o, lse = Attention.apply(q, k, v, options, num_splits)
    return (o, lse) if return_lse else o


def saved_shapes(fn, *args):
    """Shapes of every tensor autograd saves for the backward of fn(*args)."""
    shapes = []

    def keep(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        fn(*args)
    return shapes


def _numpy(*tensors):
    """Detached CPU numpy views of tensors (no copies for CPU tensors)."""
    return [np.asarray(t.detach().cpu().numpy()) for t in tensors]
