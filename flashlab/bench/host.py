"""Host time per call: flashlab.torch.attention against torch's SDPA.

What a model pays per attention call on a small problem, where the GPU's
own time is far below the host's: (1, 4, 128, 64) bf16 causal, called
as a user calls each (SDPA with no backend forced), the median of 5
loops of 200 calls after warm-up, one synchronize at each loop's end,
the calls' loops taking turns (timing.host_loop).
The forward alone (inputs without gradients) and a forward+backward
step (autograd from a fixed random dO). Microseconds per call;
vs_torch = SDPA's / flashlab's. Writes host.csv; `parts` times the
pieces of such a call (host_parts.csv). See chapters 10 and 12.
"""

from flashlab.bench import as_user, timing
from flashlab.bench.runner import Case, Suite

SHAPE = (1, 4, 128, 64)  # (B, H, N, d)
IMPLS = ("flashlab", "torch sdpa")
COLUMNS = ("device", "impl", "pass", "causal", "dtype", "B", "H", "N",
           "d", "calls", "us", "vs_torch")
SHOWN = ("device", "pass", "impl", "causal", "dtype", "N", "d", "calls",
         "us", "vs_torch")


def suite(shape=SHAPE, calls=200, device="cuda", dtype="bfloat16",
          causal=True):
    """The forward and the forward+backward step at one shape."""
    cases = tuple(Case(pass_, *shape, causal, IMPLS, "torch sdpa", calls,
                       dtype=dtype) for pass_ in ("forward", "fwd+bwd"))
    impls = {(pass_, name): as_user.call(name)
             for pass_ in ("forward", "fwd+bwd") for name in IMPLS}
    return Suite("host", cases, as_user.tensors(device), impls,
                 timing.host_loop(device), columns=COLUMNS, shown=SHOWN,
                 flops=None, device="gpu" if device == "cuda" else "cpu",
                 csv="host.csv")


PART_COLUMNS = ("device", "part", "calls", "us")


def parts(shape=SHAPE, calls=300, device="cuda", dtype="bfloat16",
          causal=True):
    """Where a call's host time goes: the pieces of flashlab's call and
    SDPA's, each timed as `suite` times a call (microseconds, the median
    of 5 loops of `calls`). On a GPU also flashlab.gpu's prepared plans
    alone; autograd's own cost is timed on a one-op graph, through C++
    and through a Python autograd.Function as flashlab's is."""
    import torch
    import torch.nn.functional as F

    from flashlab import torch as fl_torch

    class Identity(torch.autograd.Function):
        """x -> x with a Python backward: autograd's cost of one."""

        @staticmethod
        def forward(ctx, x):
            return x * 1

        @staticmethod
        def backward(ctx, grad):
            return grad

    gen = torch.Generator(device=device).manual_seed(sum(shape))
    kind = getattr(torch, dtype)
    q, k, v, do = (torch.randn(shape, device=device, dtype=kind,
                               generator=gen) for _ in range(4))
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    small = torch.randn(8, device=device, requires_grad=True)
    g8 = torch.ones(8, device=device)

    def step(attend):
        return lambda: torch.autograd.grad(
            attend(*leaves, is_causal=causal), leaves, do)

    pieces = [
        ("torch.empty of o's shape",
         lambda: torch.empty(shape, device=device, dtype=kind)),
        ("autograd.grad of one C++ op",
         lambda: torch.autograd.grad(small * 1, (small,), g8)),
        ("autograd.grad of one Python Function",
         lambda: torch.autograd.grad(Identity.apply(small), (small,), g8)),
    ]
    if device == "cuda":
        from flashlab import gpu

        o, lse = gpu.attention(q, k, v, causal=causal, return_lse=True)
        pieces += [
            ("flashlab.gpu.attention (plan)",
             lambda: gpu.attention(q, k, v, causal=causal,
                                   return_lse=True)),
            ("flashlab.gpu.attention_backward (plan)",
             lambda: gpu.attention_backward(q, k, v, o, lse, do,
                                            causal=causal)),
        ]
    pieces += [
        ("flashlab forward, no grad",
         lambda: fl_torch.attention(q, k, v, is_causal=causal)),
        ("flashlab forward+backward", step(fl_torch.attention)),
        ("sdpa forward, no grad",
         lambda: F.scaled_dot_product_attention(q, k, v,
                                                is_causal=causal)),
        ("sdpa forward+backward", step(F.scaled_dot_product_attention)),
    ]
    case = Case("host parts", *shape, causal, (), "", calls, dtype=dtype)
    ms = timing.host_loop(device)(dict(pieces), case)
    where = "gpu" if device == "cuda" else "cpu"
    return [dict(device=where, part=name, calls=calls,
                 us=round(ms[name] * 1e3, 1)) for name, _ in pieces]
