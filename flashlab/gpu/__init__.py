"""Attention kernels for NVIDIA GPUs in numba.cuda: forward and backward.

float32 storage and arithmetic, head dims 16-128 in multiples of 16, any
N, and the mask, padding, window, dropout and non-finite semantics of
`flashlab.tiled`. The package, in the order chapter 9 reads it:

- `device`: tile layouts and the device functions every kernel shares;
- `forward_v1` ... `forward_v4`: one module per forward version, each a
  small change of the one before (the chapter shows them as diffs);
- `backward`: dK/dV and dQ kernels, deterministic, no atomics;
- `build`: the kernel registry, compile cache and PTX without a GPU;
- this module: the host entry points `attention` and
  `attention_backward`, with the keywords of `tiled.attention`.
"""

import math

import numpy as np

from flashlab import kernel_args, tiled
from flashlab._validate import check_flag
from flashlab.gpu import (
    _numpy_compat,  # noqa: F401  (before any kernel)
    backward,
    device,
    forward_v1,
    forward_v2,
    forward_v3,
    forward_v4,
)
from flashlab.gpu.build import compile_ptx, kernel, kernel_names, supports

__all__ = ["attention", "attention_backward", "compile_ptx", "kernel_names",
           "supports", "tile_shape", "DEFAULT_VERSION", "VERSIONS"]

FORWARDS = {1: forward_v1, 2: forward_v2, 3: forward_v3, 4: forward_v4}
VERSIONS = tuple(FORWARDS)
DEFAULT_VERSION = 3  # the fastest on the H200 (flashlab/data/bench_h200)
ORDERS = ("fa2",)  # the loop order the forward kernels run
# Tests set this to fill every output with NaN before a kernel runs, so an
# element a kernel fails to write cannot pass for a right answer.
POISON_OUTPUTS = False


def tile_shape(version, d, d_v):
    """(Br, Bc) of forward `version` for head dims d, d_v."""
    return FORWARDS[_check_version(version)].shape(d, d_v)[:2]


def attention(q, k, v, *, block_q=None, block_k=None, scale=None,
              causal=False, mask=None, window=None, kv_lengths=None,
              dropout_p=0.0, seed=None, return_lse=False, order="fa2",
              num_splits=1, version=DEFAULT_VERSION):
    """GPU attention. q (..., Nq, d), k (..., Nk, d), v (..., Nk, dv).

    Keywords as tiled.attention. Arrays may be torch CUDA tensors (used in
    place), numba device arrays, or numpy arrays (copied over and back);
    the result is of the same kind. Each version fixes its tile sizes
    (`tile_shape`): block_q and block_k may only restate them.
    """
    version = _check_version(version)
    tiled.check_order(order, ORDERS)
    tiled.check_splits(num_splits, supported=1)
    return_lse = check_flag("return_lse", return_lse)
    d, d_v = _check_device_inputs((("q", q), ("k", k), ("v", v)))
    br, bc, threads = FORWARDS[version].shape(d, d_v)
    _check_fixed_blocks(f"v{version}", block_q, br, block_k, bc)
    call = _Call(q, k, v, dict(scale=scale, causal=causal, mask=mask,
                               window=window, kv_lengths=kv_lengths,
                               dropout_p=dropout_p, seed=seed))
    o, o_k = call.empty((call.bh, call.nq, d_v))
    lse, lse_k = call.empty((call.bh, call.nq))
    vk = call.to_kernel(v, (call.bh, call.nk, d_v))
    kernel(f"forward_v{version}", d, d_v)[
        (math.ceil(call.nq / br), call.bh), threads, call.stream](
        call.to_kernel(q, (call.bh, call.nq, d)),
        call.to_kernel(k, (call.bh, call.nk, d)), vk, o_k, lse_k,
        *call.args)
    call.finish(o_k, lse_k, vk)
    o = call.result(o, (*call.batch, call.nq, d_v))
    return ((o, call.result(lse, (*call.batch, call.nq))) if return_lse
            else o)


def attention_backward(q, k, v, o, lse, do, *, block_q=None, block_k=None,
                       scale=None, causal=False, mask=None, window=None,
                       kv_lengths=None, dropout_p=0.0, seed=None,
                       order="fa2"):
    """GPU gradients (dq, dk, dv); deterministic. Keywords as the forward."""
    tiled.check_order(order)  # one backward loop follows either forward
    d, d_v = _check_device_inputs((("q", q), ("k", k), ("v", v)))
    blocked = max(d, d_v) <= backward.BLOCKED_MAX_DIM
    nt, rows = ((device.THREADS, backward.BLOCK_BWD) if blocked
                else (backward.sizes(d, d_v)[0],) * 2)
    _check_fixed_blocks("backward", block_q, rows, block_k, rows)
    tiled.check_saved(*(kernel_args.proxy(x) for x in (q, v, o, lse, do)))
    call = _Call(q, k, v, dict(scale=scale, causal=causal, mask=mask,
                               window=window, kv_lengths=kv_lengths,
                               dropout_p=dropout_p, seed=seed))
    bh, nq, nk = call.bh, call.nq, call.nk
    qk = call.to_kernel(q, (bh, nq, d))
    kk = call.to_kernel(k, (bh, nk, d))
    vk = call.to_kernel(v, (bh, nk, d_v))
    ok = call.to_kernel(o, (bh, nq, d_v))
    dok = call.to_kernel(do, (bh, nq, d_v))
    lsek = call.to_kernel(lse, (bh, nq))
    delta, delta_k = call.empty((bh, nq))
    device.row_dot[(math.ceil(nq / device.THREADS), bh), device.THREADS,
                   call.stream](dok, ok, delta_k)
    dq, dq_k = call.empty((bh, nq, d))
    dk, dk_k = call.empty((bh, nk, d))
    dv, dv_k = call.empty((bh, nk, d_v))
    suffix = "_blocked" if blocked else ""
    kernel("backward_kv" + suffix, d, d_v)[
        (math.ceil(nk / rows), bh), nt, call.stream](
        qk, kk, vk, dok, lsek, delta_k, dk_k, dv_k, *call.args)
    kernel("backward_q" + suffix, d, d_v)[
        (math.ceil(nq / rows), bh), nt, call.stream](
        qk, kk, vk, dok, lsek, delta_k, dq_k, *call.args)
    return (call.result(dq, (*call.batch, nq, d)),
            call.result(dk, (*call.batch, nk, d)),
            call.result(dv, (*call.batch, nk, d_v)))


def _check_version(version):
    if isinstance(version, bool) or version not in FORWARDS:
        raise ValueError(f"version: expected one of {VERSIONS}, got "
                         f"{version!r}")
    return version


def _check_fixed_blocks(what, block_q, br, block_k, bc):
    """block_q/block_k may be None or restate the kernel's own tiles."""
    for name, given, fixed in (("block_q", block_q, br),
                               ("block_k", block_k, bc)):
        if given is not None and given != fixed:
            raise ValueError(
                f"{name}: flashlab.gpu {what} runs tiles of {fixed} for "
                f"these head dims; pass None or {fixed}, got {given!r}")


def _check_device_inputs(named):
    """Arrays of float32 with head dims 16..128 in steps of 16: (d, d_v)."""
    for name, x in named:
        if not all(hasattr(x, a) for a in ("shape", "dtype", "ndim")):
            raise TypeError(
                f"{name}: expected a torch CUDA tensor, a numba device "
                f"array or a numpy array, got {type(x).__name__}")
        if type(x).__module__.startswith("torch") and x.device.type != \
                "cuda":
            raise ValueError(
                f"{name}: expected a CUDA tensor for flashlab.gpu, got one "
                f"on {x.device}")
        if str(x.dtype).removeprefix("torch.") != "float32":
            raise TypeError(
                f"{name}: flashlab.gpu computes in float32, got dtype "
                f"{x.dtype}")
        if x.ndim < 2:
            raise ValueError(f"{name}: expected at least 2 dims (..., N, "
                             f"d), got shape {tuple(x.shape)}")
    d, d_v = named[0][1].shape[-1], named[2][1].shape[-1]
    for name, size in (("q", d), ("v", d_v)):
        if size % 16 or not 16 <= size <= 128:
            raise ValueError(
                f"{name}: expected a head dim in 16, 32, ..., 128 for "
                f"flashlab.gpu, got {size}")
    return d, d_v


class _Call:
    """One call's arrays of one kind (numpy, numba device, torch)."""

    def __init__(self, q, k, v, options):
        _, _, _, self.batch, plan, a = kernel_args.flatten(
            *(kernel_args.proxy(x) for x in (q, k, v)), options)
        self.bh = int(np.prod(self.batch))
        self.nq, self.nk = plan.nq, plan.nk
        self.empty_rows = plan.empty_rows(self.batch)
        self.torch = type(q).__module__.startswith("torch")
        self.numpy = isinstance(q, np.ndarray)
        self.device = q.device if self.torch else None
        self.stream = 0
        if self.torch:  # launch on torch's stream: ordered, no syncs
            import torch
            from numba import cuda

            self.stream = cuda.external_stream(
                torch.cuda.current_stream(q.device).cuda_stream)
        default_lengths = options["kv_lengths"] is None
        self.args = (a.rules, _on_device(a.kv_len, default_lengths),
                     _on_device(a.mask.astype(np.uint8), not
                                a.rules.use_mask))

    def to_kernel(self, x, shape):
        """A device view (or copy, for numpy) of x with the given shape."""
        from numba import cuda

        if self.torch:
            return cuda.as_cuda_array(x.detach().contiguous().view(shape),
                                      sync=False)
        if self.numpy:
            return cuda.to_device(np.ascontiguousarray(x).reshape(shape))
        return x.reshape(shape)

    def empty(self, shape):
        """An uninitialized float32 output and its device view."""
        from numba import cuda

        if self.torch:
            import torch

            out = torch.empty(shape, dtype=torch.float32,
                              device=self.device)
            if POISON_OUTPUTS:
                out.fill_(float("nan"))
            return out, cuda.as_cuda_array(out, sync=False)
        if POISON_OUTPUTS:
            dev = cuda.to_device(np.full(shape, np.nan, dtype=np.float32))
        else:
            dev = cuda.device_array(shape, dtype=np.float32)
        return dev, dev

    def zeros_bool(self, shape):
        """A device array of False (small: one flag per column)."""
        from numba import cuda

        if self.torch:
            import torch

            return cuda.as_cuda_array(torch.zeros(
                shape, dtype=torch.bool, device=self.device), sync=False)
        return cuda.to_device(np.zeros(shape, dtype=np.bool_),
                              stream=self.stream)

    def finish(self, o_k, lse_k, v_k):
        """Apply flashlab.nonfinite's rule to the forward's output."""
        from numba import cuda

        nk, d_v = v_k.shape[1:]
        bad = self.zeros_bool((self.bh, d_v))
        device.find_bad_columns[
            (math.ceil(nk * d_v / device.THREADS), self.bh), device.THREADS,
            self.stream](v_k, bad)
        empty = self.empty_rows.reshape(self.bh, self.nq)
        empty_k = _on_device(np.zeros((1, 1), np.bool_), True)
        if empty.any():  # else a (1, 1) stand-in: no row is empty
            empty_k = cuda.to_device(np.ascontiguousarray(empty))
        device.finish_rows[(math.ceil(self.nq / device.THREADS), self.bh),
                           device.THREADS, self.stream](o_k, lse_k, bad,
                                                        empty_k)

    def result(self, out, shape):
        """The output in the caller's kind, with the caller's shape."""
        if self.torch:
            return out.view(shape)
        if self.numpy:
            return out.copy_to_host().reshape(shape)
        return out.reshape(shape)


_constants = {}


def _on_device(x, constant):
    """x on the device; copied once and kept when it is a default value.

    The kv_len of unpadded batches, the unused mask and the "no empty
    row" flag are the same for every call of a shape, so only the first
    call pays for the copy.
    """
    from numba import cuda

    if not constant:
        return cuda.to_device(x)
    key = (x.dtype.str, x.shape, x.tobytes())
    if key not in _constants:
        _constants[key] = cuda.to_device(x)
    return _constants[key]
