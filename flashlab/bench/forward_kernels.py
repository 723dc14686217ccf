"""The forward's kernels at the training shapes, flashlab against cuDNN.

    python -m flashlab.bench --forward-kernels

bf16, no grad, at each (B, H, N, d, causal) of SHAPES: flashlab.torch's
attention and SDPA's cuDNN backend, 5 calls each to warm up, then
`calls` calls under torch.profiler with CUDA activity only, a
synchronize after each (step_gaps.device_events); each kernel's device
time a call by name (step_gaps.by_name), their sum, and cuDNN's sum over
flashlab's. Kernel time alone: a call's host time and the gaps between
calls are left out. Writes forward_kernels.json. See chapter 12, "Where
a short block's time goes".
"""

import functools
import json
import os

from flashlab.bench import step_gaps

SHAPES = ((16, 12, 1024, 64, True), (8, 16, 2048, 128, True),
          (8, 16, 2048, 128, False), (2, 8, 4096, 128, True))
IMPLS = ("flashlab", "cudnn")


def row(shape, kernels):
    """One result: the shape, each impl's {kernel: µs a call}, their sums
    (`total_us`) and cuDNN's sum over flashlab's (`x_cudnn`)."""
    if set(kernels) != set(IMPLS) or not all(kernels.values()):
        raise ValueError(f"kernels: expected kernel times of {IMPLS}, got "
                         f"{kernels!r}")
    b, h, n, d, causal = shape
    total = {impl: round(sum(kernels[impl].values()), 1) for impl in IMPLS}
    return dict(B=b, H=h, N=n, d=d, causal=causal, kernels=kernels,
                total_us=total,
                x_cudnn=round(total["cudnn"] / total["flashlab"], 3))


def forwards():
    """{impl: attend(q, k, v, is_causal)} of the two implementations."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashlab import torch as fl_torch

    def cudnn(q, k, v, is_causal):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v,
                                                  is_causal=is_causal)

    return {"flashlab": fl_torch.attention, "cudnn": cudnn}


def measure(shapes=SHAPES, calls=10, warm=5):
    """One row per shape (`row`), printed as it is measured."""
    import torch

    impls = forwards()
    out = []
    for shape in shapes:
        b, h, n, d, causal = shape
        gen = torch.Generator(device="cuda").manual_seed(n + d)
        q, k, v = (torch.randn(b, h, n, d, device="cuda",
                               dtype=torch.bfloat16, generator=gen)
                   for _ in range(3))
        kernels = {}
        with torch.no_grad():
            for name, attend in impls.items():
                call = functools.partial(attend, q, k, v, is_causal=causal)
                for _ in range(warm):
                    call()
                torch.cuda.synchronize()
                events = step_gaps.device_events(call, calls)
                kernels[name] = step_gaps.by_name(
                    [(e[2], e[1]) for e in events], calls)
        found = row(shape, kernels)
        out.append(found)
        parts = ", ".join(f"{k} {t}" for k, t in kernels["flashlab"].items())
        print(f"B{b} H{h} N{n} d{d} {'causal' if causal else 'full':<6} "
              f"flashlab {found['total_us']['flashlab']:7.1f} µs ({parts}); "
              f"cuDNN {found['total_us']['cudnn']:7.1f} µs; x cuDNN "
              f"{found['x_cudnn']:.3f}", flush=True)
    return out


def main(out, machine):
    """Measure, write forward_kernels.json under `out`, return the rows."""
    found = measure()
    with open(os.path.join(out, "forward_kernels.json"), "w",
              encoding="utf-8") as f:
        json.dump(dict(machine=machine, rows=found), f, indent=1)
    return found
