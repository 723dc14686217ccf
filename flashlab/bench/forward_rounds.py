"""The bf16 forward at the Hopper targets' shapes, in alternating rounds.

    python -m flashlab.bench --forward-rounds

B2 H8 at N = 16384 and 4096, d = 64 and 128, full and causal:
flashlab.torch.attention and SDPA's cuDNN and flash backends, called in
turn, one round of calls each, a CUDA event pair around each round; each
implementation's median round (`per_call_ms`). Taking turns round by
round lets a change of clock or heat during the run reach all three
alike. Writes forward_rounds.json: TFLOP/s of each, and flashlab's speed
over cuDNN's and flash's. See chapter 12.
"""

import json
import os
import statistics

from flashlab import costs

IMPLS = ("flashlab", "cudnn", "flash")
SHAPES = tuple((2, 8, n, d, causal) for n in (16384, 4096)
               for d in (64, 128) for causal in (False, True))


def per_call_ms(rounds_ms, per_round):
    """{impl: ms a call}: each impl's median round of `per_round` calls
    ({impl: [ms of each round]}), over per_round."""
    if per_round < 1:
        raise ValueError(f"per_round: expected at least 1, got "
                         f"{per_round}")
    if not rounds_ms or not all(rounds_ms.values()):
        raise ValueError(f"rounds_ms: expected rounds of each "
                         f"implementation, got {rounds_ms!r}")
    return {name: statistics.median(ms) / per_round
            for name, ms in rounds_ms.items()}


def row(shape, ms):
    """One result: the shape, TFLOP/s of each impl of `ms` ({impl: ms a
    call}), and flashlab's speed over cuDNN's and over flash's."""
    b, h, n, d, causal = shape
    flop = b * h * costs.flops(n, n, d, causal=causal)
    out = dict(B=b, H=h, N=n, d=d, causal=causal)
    for name, t in ms.items():
        out[f"{name}_tflops"] = round(flop / (t * 1e-3) / 1e12, 1)
    for other in ("cudnn", "flash"):
        out[f"x_{other}"] = round(ms[other] / ms["flashlab"], 3)
    return out


def forwards():
    """{impl: attend(q, k, v, is_causal)} of the three implementations."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashlab import torch as fl_torch

    def sdpa(backend):
        def attend(q, k, v, is_causal):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v,
                                                      is_causal=is_causal)
        return attend

    return {"flashlab": fl_torch.attention,
            "cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
            "flash": sdpa(SDPBackend.FLASH_ATTENTION)}


def measure(shapes=SHAPES, rounds=7, warm=3):
    """One row per shape (`row`): rounds of 10 calls at N >= 16384, of
    50 below, the implementations taking turns."""
    import torch

    impls = forwards()
    out = []
    for shape in shapes:
        b, h, n, d, causal = shape
        gen = torch.Generator(device="cuda").manual_seed(n + d)
        q, k, v = (torch.randn(b, h, n, d, device="cuda",
                               dtype=torch.bfloat16, generator=gen)
                   for _ in range(3))
        per_round = 10 if n >= 16384 else 50
        times = {name: [] for name in impls}
        with torch.no_grad():
            for attend in impls.values():
                for _ in range(warm):
                    attend(q, k, v, is_causal=causal)
            for _ in range(rounds):
                for name, attend in impls.items():
                    start, end = (torch.cuda.Event(enable_timing=True)
                                  for _ in range(2))
                    torch.cuda.synchronize()
                    start.record()
                    for _ in range(per_round):
                        attend(q, k, v, is_causal=causal)
                    end.record()
                    torch.cuda.synchronize()
                    times[name].append(start.elapsed_time(end))
        found = row(shape, per_call_ms(times, per_round))
        out.append(found)
        print(f"B{b} H{h} N{n} d{d} {'causal' if causal else 'full':<6} "
              + " ".join(f"{x} {found[x + '_tflops']:6.1f}" for x in impls)
              + f" TFLOP/s; x cuDNN {found['x_cudnn']:.3f}, x flash "
              f"{found['x_flash']:.3f}", flush=True)
    return out


def main(out, machine):
    """Measure, write forward_rounds.json under `out`, return the rows."""
    found = measure()
    with open(os.path.join(out, "forward_rounds.json"), "w",
              encoding="utf-8") as f:
        json.dump(dict(machine=machine, rows=found), f, indent=1)
    return found
