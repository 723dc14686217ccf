"""Chapter 9's suite: flashlab.gpu's float32 versions against torch.

B=2, H=8, d=64, N = 1024, 4096, 16384, full and causal: the forward of
each version, of torch's memory-efficient SDPA (the baseline) and of
materialized torch attention; flashlab's backward against torch's
memory-efficient backward. Writes bench.csv (with the CPU suite).
"""

from flashlab.bench import report, timing
from flashlab.bench.runner import Case, Suite

SIZES = (1024, 4096, 16384)


def _reps(n):
    return 5 if n > 8192 else 20


def suite(sizes=SIZES, versions=(1, 2, 3, 4), b=2, h=8, d=64):
    """Forward and backward cases per (N, causal), in row order."""
    forward = tuple(f"flashlab v{v}" for v in versions) + (
        "torch efficient", "torch materialized")
    cases = []
    for n in sizes:
        for causal in (False, True):
            cases.append(Case("forward", b, h, n, d, causal, forward,
                              "torch efficient", _reps(n)))
            cases.append(Case("backward", b, h, n, d, causal,
                              ("flashlab", "torch efficient"),
                              "torch efficient", _reps(n)))
    impls = {("forward", f"flashlab v{v}"): _version(v) for v in versions}
    impls.update({("forward", "torch efficient"): _efficient,
                  ("forward", "torch materialized"): _materialized,
                  ("backward", "flashlab"): _flashlab_backward,
                  ("backward", "torch efficient"): _efficient_backward})
    return Suite("gpu", tuple(cases), _inputs, impls, timing.events,
                 columns=report.FIELDS, shown=report.SHOWN, csv="bench.csv")


def _inputs(case):
    """q, k, v, dO: (B, H, N, d) float32, seeded by N."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(case.N)
    return [torch.randn(case.B, case.H, case.N, case.d, device="cuda",
                        generator=gen) for _ in range(4)]


def _version(version):
    def make(case, x):
        from flashlab import gpu

        q, k, v, _ = x
        return lambda: gpu.attention(q, k, v, version=version,
                                     causal=case.causal)
    return make


def _efficient(case, x):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v, _ = x

    def call():
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v,
                                                  is_causal=case.causal)
    return call


def _materialized(case, x):
    import torch

    q, k, v, _ = x
    keep = torch.ones(case.N, case.N, dtype=torch.bool,
                      device="cuda").tril()

    def call():
        s = (q @ k.transpose(-1, -2)) * case.d**-0.5  # (B, H, N, N) in HBM
        if case.causal:
            s = s.masked_fill(~keep, float("-inf"))
        return torch.softmax(s, -1) @ v
    return call


def _flashlab_backward(case, x):
    """flashlab's two backward kernels from a saved forward."""
    from flashlab import gpu

    q, k, v, do = x
    o, lse = gpu.attention(q, k, v, causal=case.causal, return_lse=True)
    return lambda: gpu.attention_backward(q, k, v, o, lse, do,
                                          causal=case.causal)


def _efficient_backward(case, x):
    """torch's memory-efficient backward, autograd from a saved forward."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v, do = x
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        out = F.scaled_dot_product_attention(qg, kg, vg,
                                             is_causal=case.causal)
    return lambda: torch.autograd.grad(out, (qg, kg, vg), do,
                                       retain_graph=True)
