"""Chapter 9's CPU suite: flashlab.cpu against torch's CPU attention.

float32, 4-D inputs (1, 4, 4096, 64), 2 threads for both, forward and
backward, full and causal, the calls of a case interleaved rep by rep in
one process; plus flashlab.cpu with 64 x 64 tiles, and its tile products
alone. Its rows join bench.csv (--cpu).
"""

from flashlab.bench import report, timing
from flashlab.bench.runner import Case, Suite

FORWARD = ("torch sdpa", "flashlab cpu", "cpu 64x64 tiles",
           "cpu products only")
BACKWARD = ("torch sdpa", "flashlab cpu")


def suite(reps=5, n=4096, b=1, h=4, d=64, threads=2):
    """Forward and backward cases per causal setting, in row order."""
    cases = tuple(Case(pass_, b, h, n, d, causal, impls, "torch sdpa",
                       reps, params={"threads": threads})
                  for causal in (False, True)
                  for pass_, impls in (("forward", FORWARD),
                                       ("backward", BACKWARD)))
    impls = {
        ("forward", "torch sdpa"): _sdpa,
        ("forward", "flashlab cpu"): _cpu(),
        ("forward", "cpu 64x64 tiles"): _cpu(block_q=64, block_k=64),
        ("forward", "cpu products only"): _products,
        ("backward", "torch sdpa"): _sdpa_backward,
        ("backward", "flashlab cpu"): _cpu_backward,
    }
    return Suite("cpu", cases, _inputs, impls, timing.interleaved,
                 columns=report.FIELDS, shown=report.SHOWN,
                 device=f"cpu x{threads}", csv="bench.csv")


def _inputs(case):
    """q, k, v, dO: (B, H, N, d) float32 numpy arrays, seeded; torch and
    numba set to the case's threads."""
    import numba
    import numpy as np
    import torch

    torch.set_num_threads(case.params["threads"])
    numba.set_num_threads(case.params["threads"])
    rng = np.random.default_rng(0)
    return [rng.standard_normal((case.B, case.H, case.N, case.d),
                                dtype=np.float32) for _ in range(4)]


def _sdpa(case, x):
    import torch
    import torch.nn.functional as F

    q, k, v = (torch.from_numpy(t) for t in x[:3])
    return lambda: F.scaled_dot_product_attention(q, k, v,
                                                  is_causal=case.causal)


def _cpu(**blocks):
    def make(case, x):
        from flashlab import cpu

        return lambda: cpu.attention(*x[:3], causal=case.causal, **blocks)
    return make


def _products(case, x):
    from flashlab import cpu

    return lambda: cpu.products_only(*x[:3], causal=case.causal)


def _sdpa_backward(case, x):
    """torch's CPU backward, autograd from a saved forward."""
    import torch
    import torch.nn.functional as F

    leaves = [torch.from_numpy(t).requires_grad_() for t in x[:3]]
    out = F.scaled_dot_product_attention(*leaves, is_causal=case.causal)
    do = torch.from_numpy(x[3])
    return lambda: torch.autograd.grad(out, leaves, do, retain_graph=True)


def _cpu_backward(case, x):
    from flashlab import cpu

    q, k, v, do = x
    o, lse = cpu.attention(q, k, v, causal=case.causal, return_lse=True)
    return lambda: cpu.attention_backward(q, k, v, o, lse, do,
                                          causal=case.causal)
