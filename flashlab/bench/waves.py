"""How full the forward's waves are: the bf16 forward against the heads.

    python -m flashlab.bench --waves

Forward v8 without a mask at N = 16384 for 1 batch of HEADS heads (the
targets' B2 H8 is 16): flashlab.torch.attention, SDPA's cuDNN and flash
in alternating rounds (`forward_rounds.measure`). At d = 64 a block is
192 query rows, three consumer warpgroups of 64: B2 H8 makes 1376
blocks on 132 SMs, 10.4 waves. Then what a block costs by the
warpgroups that have rows (`parts`): 264 query heads of 64, 128 or 192
rows on 4 K/V heads (so K and V stay in L2), two waves; a block
of all three parts is 1.0. With those costs `flashlab.order.wave_fill`
models each launch's fill, printed beside it. Then the same launches
with the split tail that flashlab.gpu.host's model chooses (the last
ranks of each head as halves of their keys, in a launch after the
whole blocks'). Writes waves.json; see chapter 12, "Waves".
"""

import json
import os
import statistics

from flashlab import order

N = 16384
HEADS = (8, 12, 16, 20, 23, 24, 32)
PART_HEADS, PART_KV_HEADS = 264, 4


def costs(us):
    """{parts: cost}: each block's µs ({parts: µs}) over a whole block's
    (three parts)."""
    if 3 not in us or min(us.values()) <= 0:
        raise ValueError(f"us: expected positive µs with 3 parts, got "
                         f"{us}")
    return {p: round(t / us[3], 3) for p, t in sorted(us.items())}


def modeled(row, cost, sms):
    """row (forward_rounds.row) with the modeled fill of its launch
    (`order.wave_fill`) at 192-row blocks: its blocks, waves of work and
    share / finish."""
    blocks = len(order.block_parts(row["N"], 192)) * row["B"] * row["H"]
    end, share = order.wave_fill(row["N"], row["B"] * row["H"], 192, cost,
                                 sms)
    return dict(row, blocks=blocks, waves=round(share, 2),
                modeled_end=round(end, 2), modeled_fill=round(share / end,
                                                             3))


def part_us(d=64, rounds=5, calls=10):
    """{parts: µs a call}: flashlab's forward of PART_HEADS query heads of
    64 parts rows each on PART_KV_HEADS K/V heads of N keys, the median
    of `rounds` rounds of `calls`."""
    import torch

    from flashlab import torch as fl

    gen = torch.Generator(device="cuda").manual_seed(d)
    k, v = (torch.randn(1, PART_KV_HEADS, N, d, device="cuda",
                        dtype=torch.bfloat16, generator=gen)
            for _ in range(2))
    out = {}
    for parts in (1, 2, 3):
        q = torch.randn(1, PART_HEADS, 64 * parts, d, device="cuda",
                        dtype=torch.bfloat16, generator=gen)
        for _ in range(3):
            fl.attention(q, k, v, enable_gqa=True)
        times = []
        for _ in range(rounds):
            start, end = (torch.cuda.Event(enable_timing=True)
                          for _ in range(2))
            torch.cuda.synchronize()
            start.record()
            for _ in range(calls):
                fl.attention(q, k, v, enable_gqa=True)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / calls)
        out[parts] = round(statistics.median(times), 1)
    return out


def plain_rules():
    """The kernels' rules of a bf16 call at d = 64 without a mask,
    causal, window or dropout (what host.split_tail reads)."""
    import numpy as np

    from flashlab.kernel_args import KernelRules

    return KernelRules(np.float32(0.125), False, 0, -1, -1, False,
                       np.uint64(0), np.uint64(0), False, np.float32(1),
                       np.float32(-3.3895314e38), 1)


def rounds(tail):
    """forward_rounds' rows at HEADS with host.SPLIT_TAIL = tail (0: no
    split tail; None: the model's), plans made afresh."""
    from flashlab import torch as fl_torch
    from flashlab.bench import forward_rounds
    from flashlab.gpu import host

    before = host.SPLIT_TAIL
    host.SPLIT_TAIL = tail
    fl_torch.forget_plans()
    try:
        return forward_rounds.measure(tuple((1, h, N, 64, False)
                                            for h in HEADS), rounds=5)
    finally:
        host.SPLIT_TAIL = before
        fl_torch.forget_plans()


def main(out, machine):
    """Measure, write waves.json under `out`, return its record: rows
    without a split tail, and `split_rows` with the model's (the tail
    it chose in each)."""
    import torch

    from flashlab.gpu import host

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    us = part_us()
    cost = costs(us)
    print(f"a block's µs by its parts {us}: cost {cost}", flush=True)
    rows = [modeled(r, cost, sms) for r in rounds(0)]
    for r in rows:
        print(f"H{r['H']}: {r['blocks']} blocks, {r['waves']} waves of "
              f"work, modeled fill {r['modeled_fill']:.3f}; x cuDNN "
              f"{r['x_cudnn']:.3f}", flush=True)
    split = rounds(None)
    for r in split:
        r["tail"] = host.split_tail("forward_v8_bf16", 192, N,
                                    r["B"] * r["H"], plain_rules(), sms)
        print(f"H{r['H']} split tail {r['tail']}: x cuDNN "
              f"{r['x_cudnn']:.3f}", flush=True)
    record = dict(machine=machine, sms=sms, part_us=us, cost=cost,
                  rows=rows, split_rows=split)
    with open(os.path.join(out, "waves.json"), "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)
    return record
