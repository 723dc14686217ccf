"""Attention on e4m3 inputs: FlashAttention-3's fp8 forward, host side.

Q, K and V come as torch.float8_e4m3fn CUDA tensors, each with one
per-tensor descale (the value a code stands for is code x descale;
`quantize` makes both from a wider tensor). The kernel is v8 built for
e4m3 (forward_v8.make_e4m3): S = Q K^T and O += P V on 8-bit wgmma, at
twice the rate of 16-bit inputs, with P rounded to e4m3 and O stored in
bf16. Q's and K's descales multiply tau once here; V's multiplies the
finished sum in the kernel. An 8-bit wgmma reads B K-major only, so V
goes in transposed (forward_v8.transpose_keys8: one pass over V per
call, in the key order that makes packing P free).

Every semantic of the 16-bit forwards holds (masks, causal and window
with both alignments, padding, dropout, grouped heads, lse and the
non-finite rule: a NaN code in V makes its column NaN). Head dims are
128 (d = d_v). There is no e4m3 backward: training keeps bf16. See
chapter 12.
"""

import math
import numbers

import numpy as np

from flashlab import fp8
from flashlab._validate import check_flag
from flashlab.gpu import device, forward_v8, host, launch, traits
from flashlab.gpu.adapters import device_view, is_torch, stream_reader
from flashlab.gpu.build import kernel

NAME = "forward_v8_e4m3"
F32_MAX = float(np.finfo(np.float32).max)  # what the packed scales hold


def quantize(x):
    """(x8, descale): torch tensor x as float8_e4m3fn codes times one
    float descale = amax / 448 over x's finite entries (1.0 where none is
    nonzero), x / descale rounded to nearest even (in float32 first, so
    a value next to a tie may land one code from flashlab.fp8.quantize);
    NaN and +-inf become NaN codes, never a saturated number (e4m3 has no
    infinity). Reads amax back to the host: one synchronization."""
    import torch

    if not is_torch(x) or not x.is_floating_point():
        raise TypeError(f"x: expected a floating-point torch tensor, got "
                        f"{getattr(x, 'dtype', type(x).__name__)}")
    wide = x.detach().float()
    finite = torch.isfinite(wide)
    amax = float(torch.where(finite, wide.abs(), 0.0).amax()) \
        if wide.numel() else 0.0
    descale = amax / fp8.E4M3_MAX if amax > 0 else 1.0
    # the division can round one ulp past 448: clamp, as satfinite would
    scaled = (wide / descale).clamp(-fp8.E4M3_MAX, fp8.E4M3_MAX)
    scaled = torch.where(finite, scaled, float("nan"))
    return scaled.to(torch.float8_e4m3fn), descale


def attention_fp8(q, k, v, *, descale_q=1.0, descale_k=1.0, descale_v=1.0,
                  scale=None, causal=False, mask=None, window=None,
                  kv_lengths=None, dropout_p=0.0, seed=None, align=None,
                  return_lse=False):
    """GPU attention of e4m3 q (..., Nq, 128), k (..., Nk, 128), v (...,
    Nk, 128) torch CUDA tensors whose values are their codes times
    descale_q, descale_k, descale_v (Python floats > 0). Keywords as
    flashlab.gpu.attention; the output is bf16, lse float32. Runs on a
    compute capability 9.0 GPU (sm_90a)."""
    import torch

    descales = [_check_descale(name, x) for name, x in (
        ("descale_q", descale_q), ("descale_k", descale_k),
        ("descale_v", descale_v))]
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not is_torch(x) or x.dtype != torch.float8_e4m3fn:
            raise TypeError(
                f"{name}: expected a torch.float8_e4m3fn tensor, got "
                f"{getattr(x, 'dtype', type(x).__name__)}")
        if x.ndim < 2 or x.shape[-1] not in forward_v8.E4M3_DIMS:
            raise ValueError(
                f"{name}: expected shape (..., N, d) with d in "
                f"{forward_v8.E4M3_DIMS}, got {tuple(x.shape)}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.device.type != "cuda":
            raise ValueError(f"{name}: expected a CUDA tensor, got one on "
                             f"{x.device}")
    return_lse = check_flag("return_lse", return_lse)
    options = dict(scale=scale, causal=causal, mask=mask, window=window,
                   kv_lengths=kv_lengths, dropout_p=dropout_p, seed=seed,
                   align=align)
    key = _plan_key(q, k, v, options)
    plan = _plans.get(key) if key is not None else None
    if plan is None:
        host._refuse_simulator("attention_fp8")
        if not host._device_runs(NAME):
            raise RuntimeError(
                f"attention_fp8 runs 8-bit wgmma, which only compute "
                f"capability 9.0 (sm_90a) has; this GPU is "
                f"{launch.device_cc()}")
        plan = _Plan(q, k, v, options)
        if key is not None:
            if len(_plans) >= host.PLANS:  # as flashlab.gpu's own
                _plans.clear()
            _plans[key] = plan
    o, lse = plan(q, k, v, descales, seed)
    return (o, lse) if return_lse else o


# one plan per (shapes, devices, options) without mask or padding arrays
_plans = {}


def _plan_key(q, k, v, options):
    """The key of a call's reusable plan, or None: a mask or kv_lengths
    (their values are part of a plan) or an unhashable option get a plan
    of their own."""
    if options["mask"] is not None or options["kv_lengths"] is not None:
        return None
    window = options["window"]
    try:
        key = (*(tuple(x.shape) for x in (q, k, v)),
               *(x.device.index for x in (q, k, v)),
               None if window is None else tuple(window),
               *(options[n] for n in ("scale", "causal", "dropout_p",
                                      "align")))
        hash(key)
    except TypeError:
        return None
    return key


class _Plan:
    """The three launches of one (shapes, options), packed once (as
    host._ForwardPlan packs the 16-bit forward's): V^T
    (transpose_keys8), V's bad parts (find_bad_parts8) and the forward.
    A call allocates the outputs, points the packed arguments at its
    tensors, writes its descales (and seed) and launches: no checks of
    shapes or options and no numba dispatch."""

    def __init__(self, q, k, v, options):
        import torch

        call = host._Call(q, k, v, options)
        d, d_v = q.shape[-1], v.shape[-1]
        tr = traits.traits(NAME, d, d_v)
        self.threads = tr.threads
        self.transpose_threads = traits.traits("transpose_keys8", 0,
                                               0).threads
        self.grid = host.launch_grid(tr, call.nq, call.nk, call.bh,
                                     call.args[0])
        self.shapes = ((call.bh, call.nq, d), (call.bh_kv, call.nk, d),
                       (call.bh_kv, call.nk, d_v))
        self.keys = max(1, -(-call.nk // 32)) * 32  # V^T's columns
        self.o_shape = (*call.heads, call.nq, d_v)
        self.lse_shape = (*call.heads, call.nq)
        self.bad_shape = device.bad_parts_shape(call.bh_kv, call.nk, d_v)
        self.rules = call.args[0]
        self.tau = float(self.rules.scale)
        self.empty = not (call.bh and call.nq)
        self.device = q.device  # read once: each reading makes an object
        self.stream_of = stream_reader(q)
        if self.empty:
            return
        q8, k8, v8 = (_bytes(x, s) for x, s in zip((q, k, v), self.shapes))
        (o, lse), (bad, v_t) = self._outputs(), self._of_v()
        self.transpose = kernel("transpose_keys8", 0, 0).pack(
            *(x.view(torch.uint32) for x in (v8, v_t)))
        self.find = kernel("find_bad_parts8", 0, 0).pack(
            host.words(v8), bad, device.EXPONENT_BITS["float8_e4m3fn"])
        self.main = kernel(NAME, d, d_v).pack(
            q8, k8, v_t, host._pairs(o.view(call.bh, call.nq, d_v)),
            lse.view(call.bh, call.nq), bad, self.rules, *call.args[1:],
            np.float32(1))

    def _outputs(self):
        """Fresh o and lse on the plan's device."""
        import torch

        o = torch.empty(self.o_shape, dtype=torch.bfloat16,
                        device=self.device)
        lse = torch.empty(self.lse_shape, dtype=torch.float32,
                          device=self.device)
        if host._poisoned():
            o.fill_(float("nan"))
            lse.fill_(float("nan"))
        return o, lse

    def _of_v(self):
        """Fresh room for V's bad-part flags and V^T."""
        import torch

        bad = torch.empty(self.bad_shape, dtype=torch.int32,
                          device=self.device)
        v_t = torch.empty((self.shapes[2][0], self.shapes[2][2],
                           self.keys), dtype=torch.uint8,
                          device=self.device)
        return bad, v_t

    def __call__(self, q, k, v, descales, seed):
        if self.empty:
            return self._outputs()
        # tau and Q's and K's scales: one float32 rounding of the product
        scale = self.tau * descales[0] * descales[1]
        if not scale < F32_MAX:
            raise ValueError(f"descale_q, descale_k: tau times their "
                             f"product must be a finite float32, got "
                             f"{scale!r}")
        if not descales[2] < F32_MAX:
            raise ValueError(f"descale_v: expected a finite float32, got "
                             f"{descales[2]!r}")
        if self.rules.use_dropout:
            host._check_seed(seed)
        # V's two launches first: the GPU runs them while the host
        # allocates o and lse and packs the forward
        v8 = _aligned(v)
        bad, v_t = self._of_v()
        stream = self.stream_of()
        self.transpose.point(0, v8.data_ptr())
        self.transpose.point(1, v_t.data_ptr())
        self.transpose.launch((self.keys // 32, self.shapes[2][0]),
                              self.transpose_threads, stream)
        self.find.point(0, v8.data_ptr())
        self.find.point(1, bad.data_ptr())
        self.find.launch(self.bad_shape[1::-1], device.FIND_THREADS,
                         stream)
        q8, k8 = _aligned(q), _aligned(k)
        o, lse = self._outputs()
        main = self.main
        for arg, x in enumerate((q8, k8, v_t, o, lse, bad)):
            main.point(arg, x.data_ptr())
        fields = self.rules._fields
        main.put(6, fields.index("scale"), "f", scale)
        main.put(9, 0, "f", descales[2])
        if self.rules.use_dropout:
            main.put(6, fields.index("seed"), "Q", int(seed))
        main.launch(self.grid, self.threads, stream)
        return o, lse


def _check_descale(name, x):
    """A descale as a positive finite Python float."""
    if isinstance(x, bool) or not isinstance(x, numbers.Real) or not (
            math.isfinite(x) and x > 0):
        raise ValueError(f"{name}: expected a positive finite number, got "
                         f"{x!r}")
    return float(x)


def _bytes(x, shape):
    """e4m3 tensor x as a device view of contiguous uint8 (shape), for
    packing a launch (`_aligned`)."""
    import torch

    return device_view(_aligned(x).view(torch.uint8).view(shape))


def _aligned(x):
    """e4m3 tensor x contiguous and 16-byte aligned for TMA (a copy where
    x is strided or an offset view): a call needs only its address, and
    a device view of it would cost more than the launches."""
    x = x.detach().contiguous()
    return x.clone() if x.data_ptr() % 16 else x
