"""Kernels that only read, against torch's own reading of the same data.

    python -m flashlab.bench --reads

bf16 at the training shapes (B, H, N, d of SHAPES): torch's sum of V
(one read), then flashlab's readers: `row_dot16` and `prepare16` (the
backward's D, reading dO and O) and `find_bad_parts` (V's flags). Each
kernel alone under torch.profiler with CUDA activity only, the median of
`reps` launches, "cold" with 1 GB written elsewhere before each launch
(so its input is not in L2) and "warm" without; TB/s of what it reads,
and that rate over torch's sum's in the same state. A rate well under
torch's is the kernel's own cost; torch's sum is itself not the
memory's speed (chapter 12, "One preparation kernel"). Writes
reads.json.
"""

import json
import os
import statistics

SHAPES = ((8, 16, 2048, 128), (16, 12, 1024, 64))
KERNELS = ("torch sum of V", "row_dot16", "prepare16", "find_bad_parts")
FLUSH_BYTES = 1 << 30  # more than any GPU's L2


def reads_mb(kernel, b, h, n, d):
    """MB that `kernel` reads at shape (b, h, n, d), bf16: dO and O for
    the backward's D, V for the others."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel: expected one of {KERNELS}, got "
                         f"{kernel!r}")
    one = b * h * n * d * 2 / 1e6
    return 2 * one if kernel in ("row_dot16", "prepare16") else one


def rows(shape, times):
    """Rows of one shape from {(kernel, cold): µs}: µs, TB/s, and the
    rate over torch's sum's in the same state (`x_torch_read`)."""
    out = []
    for (kernel, cold), us in times.items():
        if us <= 0:
            raise ValueError(f"times: expected positive µs, got {us} for "
                             f"{kernel}")
        torch_us = times[("torch sum of V", cold)]
        rate = reads_mb(kernel, *shape) / us
        torch_rate = reads_mb("torch sum of V", *shape) / torch_us
        out.append(dict(B=shape[0], H=shape[1], N=shape[2], d=shape[3],
                        kernel=kernel, cold=cold, us=round(us, 2),
                        tb_s=round(rate, 2),
                        x_torch_read=round(rate / torch_rate, 3)))
    return out


def launchers(b, h, n, d):
    """{kernel: a function that launches it once} on fresh bf16 tensors
    of shape (b, h, n, d), as flashlab's plans launch them."""
    import torch

    from flashlab.gpu import build, device, host, warp

    heads = b * h
    q, k, do, o, v = (torch.randn(heads, n, d, device="cuda",
                                  dtype=torch.bfloat16) for _ in range(5))
    lse = torch.randn(heads, n, device="cuda") + 5
    options = dict(scale=None, causal=True, mask=None, window=None,
                   kv_lengths=None, dropout_p=0.0, seed=None, align=None)
    call = host._Call(q, k, v, options)
    stream = call.stream
    pairs = [x.view(torch.int32).view(heads * n, d // 2) for x in (do, o)]
    bits = [x.view(torch.int16) for x in (q, k)]
    delta = torch.empty(heads * n, device="cuda")
    stats = torch.empty(2, heads * n, device="cuda")
    counts = torch.empty(heads * n // 64, dtype=torch.int32, device="cuda")
    shape = device.bad_parts_shape(heads, n, d)
    bad = torch.empty(shape, dtype=torch.int32, device="cuda")
    dot = build.kernel("row_dot_bf16", 0, 0)
    prep = build.kernel("prepare_bf16", 0, 0)
    find = build.kernel(host.find_bad_name("bfloat16"), 0, 0)
    dot_grid = warp.dot_grid(heads * n, d, host._multiprocessors())
    prep_grid = warp.dot_grid(heads * n, d, host._multiprocessors(),
                              warp.PREPARE_BLOCKS_PER_SM)
    words = host.words(v.view(torch.int16))
    return {
        "torch sum of V": lambda: v.sum(dtype=torch.float32),
        "row_dot16": lambda: dot[dot_grid, warp.THREADS, stream](
            *pairs, delta),
        "prepare16": lambda: prep[prep_grid, warp.THREADS, stream](
            *pairs, delta, *bits, lse.view(-1), stats, counts,
            *call.args),
        "find_bad_parts": lambda: find[shape[1::-1], device.FIND_THREADS,
                                       stream](
            words, bad, device.EXPONENT_BITS["bfloat16"]),
    }


def kernel_us(launch, cold, reps, flush):
    """The median device µs of `reps` launches (the longest kernel of
    each, torch's reductions launching a memset too)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    launch()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        if cold:
            flush.zero_()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as p:
            launch()
            torch.cuda.synchronize()
        times.append(max(e.device_time for e in p.events()
                         if e.device_type.name == "CUDA"))
    return statistics.median(times)


def measure(shapes=SHAPES, reps=10):
    """Every shape's rows (`rows`), printed as they are measured."""
    import torch

    flush = torch.empty(FLUSH_BYTES // 4, device="cuda")
    out = []
    for shape in shapes:
        launch = launchers(*shape)
        times = {(name, cold): kernel_us(launch[name], cold, reps, flush)
                 for cold in (True, False) for name in KERNELS}
        for r in rows(shape, times):
            out.append(r)
            print(f"B{r['B']} H{r['H']} N{r['N']} d{r['d']} "
                  f"{'cold' if r['cold'] else 'warm'} {r['kernel']:<16}"
                  f"{r['us']:8.1f} us {r['tb_s']:6.2f} TB/s "
                  f"{r['x_torch_read']:6.2f}x torch's read", flush=True)
    return out


def main(out, machine):
    """Measure, write reads.json under `out`, return the rows."""
    found = measure()
    with open(os.path.join(out, "reads.json"), "w",
              encoding="utf-8") as f:
        json.dump(dict(machine=machine, rows=found), f, indent=1)
    return found
