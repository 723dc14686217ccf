"""Chapter 10's suite: the tensor-core kernels against torch's.

Per (d, N, causal), B=2, H=8: bf16 forward of v5 (and v7, v8 on Hopper)
against torch's flash (the baseline) and cuDNN backends (rows left out
where a build has no cuDNN attention); the bf16 backward of flashlab.torch
(backward v9, v8 or v7 on Hopper, backward_v5 elsewhere) against torch's flash
backward; float32 forward of v6 at 3xTF32 and at tf32, and of v3,
against torch's memory-efficient kernel.
Writes tensor.csv (--backward-only: tensor_backward.csv).
"""

from flashlab.bench import report, timing
from flashlab.bench.runner import Case, Suite

SIZES = (1024, 4096, 16384)
DIMS = (64, 128)
BF16 = ("flashlab v5 bf16", "flashlab v7 bf16", "flashlab v8 bf16",
        "torch flash bf16", "torch cudnn bf16")
BACKWARD = ("flashlab bf16", "torch flash bf16")
FLOAT32 = ("flashlab v6 3xtf32", "flashlab v6 tf32", "flashlab v3",
           "torch efficient")


def _reps(n):
    return 5 if n > 8192 else 20


def suite(sizes=SIZES, dims=DIMS, b=2, h=8, backward_only=False):
    """Cases per (d, N, causal) in row order: bf16 forward, bf16
    backward, float32 forward; with backward_only the backward alone."""
    cases = []
    for d in dims:
        for n in sizes:
            for c in (False, True):
                r = _reps(n)
                if not backward_only:
                    cases.append(Case("forward", b, h, n, d, c, BF16,
                                      "torch flash bf16", r, dtype="bfloat16"))
                cases.append(Case("backward", b, h, n, d, c, BACKWARD,
                                  "torch flash bf16", r, dtype="bfloat16"))
                if not backward_only:
                    cases.append(Case("forward", b, h, n, d, c, FLOAT32,
                                      "torch efficient", r))
    impls = {
        ("forward", "flashlab v5 bf16"): _flashlab(version=5),
        ("forward", "flashlab v7 bf16"): _hopper(_flashlab(version=7)),
        ("forward", "flashlab v8 bf16"): _hopper(_flashlab(version=8)),
        ("forward", "torch flash bf16"): _sdpa("FLASH_ATTENTION"),
        ("forward", "torch cudnn bf16"): _sdpa("CUDNN_ATTENTION"),
        ("backward", "flashlab bf16"): _backward(None),
        ("backward", "torch flash bf16"): _backward("FLASH_ATTENTION"),
        ("forward", "flashlab v6 3xtf32"): _flashlab(version=6),
        ("forward", "flashlab v6 tf32"): _flashlab(version=6,
                                                   precision="tf32"),
        ("forward", "flashlab v3"): _flashlab(version=3),
        ("forward", "torch efficient"): _sdpa("EFFICIENT_ATTENTION"),
    }
    return Suite("tensor cores", tuple(cases), _inputs, impls,
                 timing.events, columns=report.FIELDS, shown=report.SHOWN,
                 csv="tensor_backward.csv" if backward_only else
                 "tensor.csv",
                 optional=("torch cudnn bf16", "flashlab v7 bf16",
                           "flashlab v8 bf16"))


def _inputs(case):
    """q, k, v, dO: (B, H, N, d), seeded by N + d, in the case's dtype
    (bf16 inputs are the float32 ones rounded)."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(case.N + case.d)
    x = [torch.randn(case.B, case.H, case.N, case.d, device="cuda",
                     generator=gen) for _ in range(4)]
    return [t.bfloat16() for t in x] if case.dtype == "bfloat16" else x


def _flashlab(**options):
    def make(case, x):
        from flashlab import gpu

        return lambda: gpu.attention(*x[:3], causal=case.causal, **options)
    return make


def _hopper(make_call):
    """make_call on Hopper; elsewhere a call that raises RuntimeError, so
    the runner drops the row (v7's and v8's wgmma exist on sm_90a only)."""
    def make(case, x):
        import torch

        if torch.cuda.get_device_capability() != (9, 0):
            def absent():
                raise RuntimeError("wgmma needs compute capability 9.0")
            return absent
        return make_call(case, x)
    return make


def _sdpa(backend):
    def make(case, x):
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def call():
            with sdpa_kernel(getattr(SDPBackend, backend)):
                return F.scaled_dot_product_attention(
                    *x[:3], is_causal=case.causal)
        return call
    return make


def _backward(backend):
    """Autograd from a saved forward, timed alone: flashlab.torch (the
    tensor cores' backward, v7 on Hopper) for None, else torch's
    `backend`."""
    def make(case, x):
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        from flashlab import torch as fl_torch

        leaves = [t.clone().requires_grad_() for t in x[:3]]
        if backend is None:
            out = fl_torch.attention(*leaves, causal=case.causal)
        else:
            with sdpa_kernel(getattr(SDPBackend, backend)):
                out = F.scaled_dot_product_attention(
                    *leaves, is_causal=case.causal)
        return lambda: torch.autograd.grad(out, leaves, x[3],
                                           retain_graph=True)
    return make
