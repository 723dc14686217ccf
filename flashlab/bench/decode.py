"""Chapter 11's decoding suite: split-KV against torch.

float32, B=2, H=8, d=64, Nq = 1 and 16 query rows per sequence against
Nk = 4K, 32K and 128K keys: v3 unsplit, v3 with choose_splits' count
and torch's memory-efficient kernel (the baseline). The N column holds
Nk. Writes decode.csv.
"""

from flashlab.bench import report, timing
from flashlab.bench.runner import Case, Suite

PLAN = tuple((nq, nk) for nq in (1, 16) for nk in (4096, 32768, 131072))


def suite(plan=PLAN, reps=20, b=2, h=8, d=64):
    """One decode case per (Nq, Nk)."""
    cases = tuple(Case("decode", b, h, nk, d, False,
                       ("v3", "v3 split", "torch"), "torch", reps, nq=nq)
                  for nq, nk in plan)
    impls = {("decode", "v3"): _v3(1), ("decode", "v3 split"): _v3("auto"),
             ("decode", "torch"): _efficient}
    return Suite("decode", cases, _inputs, impls, timing.events,
                 columns=report.FIELDS, shown=report.SHOWN,
                 csv="decode.csv", label=_label)


def _label(case, impl):
    """Row names that carry Nq and the split count choose_splits picks."""
    if impl == "v3 split":
        from flashlab import gpu

        splits = gpu.choose_splits(case.nq, case.N, case.B * case.H,
                                   case.d, case.d)
        return f"v3 nq={case.nq} {splits} splits"
    return f"{impl} nq={case.nq}"


def _inputs(case):
    """q: (B, H, Nq, d), k, v: (B, H, Nk, d), float32, seeded."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(case.N + case.nq)
    q = torch.randn(case.B, case.H, case.nq, case.d, device="cuda",
                    generator=gen)
    k, v = (torch.randn(case.B, case.H, case.N, case.d, device="cuda",
                        generator=gen) for _ in range(2))
    return q, k, v


def _v3(splits):
    def make(case, x):
        from flashlab import gpu

        return lambda: gpu.attention(*x, version=3, num_splits=splits)
    return make


def _efficient(case, x):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def call():
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            return F.scaled_dot_product_attention(*x)
    return call
