"""Where a training step leaves the GPU idle: kernel times from CUPTI.

One bf16 causal step (forward and backward by autograd) of
flashlab.torch.attention (as it is, deterministic, and with
deterministic=False, "flashlab atomic") and of SDPA's cuDNN backend, at
each of SHAPES:
5 steps to warm up, then `steps` steps under torch.profiler with CUDA
activity only (kernel times on the GPU's clock, and no host events to
slow the host), a synchronize after each. Per step: the kernels' total
time, the span from the first kernel's start to the last one's end, and
the idle time between each kernel and the next, in launch order; the
medians over the steps. "wait" is the idle time between the forward's
kernel and the backward's first. Also each kernel's (and memset's) time
a step by name, the mean over the steps (`by_name`). Then the step as a
user times it: the three in alternating rounds of 10 steps between CUDA
events, the median round (`user_steps`). Writes step_gaps.json. See
chapter 12, "The GPU's wait between the forward and the backward" and
"dQ without a zeroed sum".
"""

import json
import os
import statistics
import tempfile

SHAPES = ((16, 12, 1024, 64), (8, 16, 2048, 128))  # (B, H, N, d)
# where the forward's own kernel is among a step's kernels: flashlab's
# comes after V's bad-column flags (find_bad_parts), cuDNN's first
FORWARD_AT = {"flashlab": 1, "flashlab atomic": 1, "cudnn": 0}


def summarize(kernels, steps, forward_at):
    """Medians over `steps` steps of kernels (start_us, duration_us) in
    launch order, each step the same number of them: kernel_us,
    first_to_last_us, idle_us, wait_us (after the kernel at
    `forward_at`) and gaps_us (after each kernel but the last)."""
    per, extra = divmod(len(kernels), steps)
    if steps < 1 or per < 2 or extra:
        raise ValueError(f"kernels: expected the same number (at least 2) "
                         f"in each of {steps} steps, got {len(kernels)}")
    if not 0 <= forward_at < per - 1:
        raise ValueError(f"forward_at: expected 0 to {per - 2}, got "
                         f"{forward_at}")
    rows = []
    for s in range(steps):
        one = kernels[s * per:(s + 1) * per]
        gaps = [b[0] - a[0] - a[1] for a, b in zip(one, one[1:])]
        busy = sum(d for _, d in one)
        span = one[-1][0] + one[-1][1] - one[0][0]
        rows.append((busy, span, span - busy, gaps[forward_at], gaps))
    med = statistics.median
    return dict(kernel_us=round(med(r[0] for r in rows), 1),
                first_to_last_us=round(med(r[1] for r in rows), 1),
                idle_us=round(med(r[2] for r in rows), 1),
                wait_us=round(med(r[3] for r in rows), 1),
                gaps_us=[round(med(g), 1)
                         for g in zip(*(r[4] for r in rows))])


NAME_CHARS = 60  # of a name from outside flashlab


def short_name(name):
    """A kernel's name without its namespaces and arguments where it is
    one of flashlab's (numba's mangled `a::b::f[abi:...]`, f its
    function's name), else its first NAME_CHARS characters."""
    if name.startswith("flashlab::"):
        return name.split("[", 1)[0].rsplit("::", 1)[-1]
    return name[:NAME_CHARS]


def by_name(events, steps):
    """{short_name: µs a step} of (name, duration_us) events over
    `steps` steps, the longest first, rounded to 0.1 µs."""
    if steps < 1:
        raise ValueError(f"steps: expected at least 1, got {steps}")
    total = {}
    for name, dur in events:
        key = short_name(name)
        total[key] = total.get(key, 0.0) + dur
    return {key: round(us / steps, 1) for key, us in
            sorted(total.items(), key=lambda item: -item[1])}


def device_events(step, steps):
    """(start_us, duration_us, name, is_kernel) of every kernel and
    memset that `steps` calls of step() run, each followed by a
    synchronize, in the order they started."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path, encoding="utf-8") as f:
            events = json.load(f)["traceEvents"]
    return sorted((e["ts"], e["dur"], e["name"], e["cat"] == "kernel")
                  for e in events if e.get("ph") == "X"
                  and e.get("cat") in ("kernel", "gpu_memset"))


def training_steps(shapes=SHAPES):
    """For each (B, H, N, d) of `shapes`: that shape and {impl: step}, a
    function of no arguments that runs one bf16 causal step of impl
    (forward, then autograd's backward from a fixed dO) on the same
    tensors, for impl flashlab, flashlab atomic (deterministic=False)
    and cudnn (SDPA's cuDNN backend)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashlab import torch as fl_torch

    def atomic(*args, **kw):
        return fl_torch.attention(*args, deterministic=False, **kw)

    def cudnn(*args, **kw):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(*args, **kw)

    for b, h, n, d in shapes:
        gen = torch.Generator(device="cuda").manual_seed(n + d)
        q, k, v, do = (torch.randn(b, h, n, d, device="cuda",
                                   dtype=torch.bfloat16, generator=gen)
                       for _ in range(4))
        leaves = [x.requires_grad_(True) for x in (q, k, v)]
        steps = {}
        for name, attend in (("flashlab", fl_torch.attention),
                             ("flashlab atomic", atomic),
                             ("cudnn", cudnn)):
            def step(attend=attend, leaves=leaves, do=do):
                return torch.autograd.grad(attend(*leaves, is_causal=True),
                                           leaves, do)

            steps[name] = step
        yield (b, h, n, d), steps


def rows(shapes=SHAPES, steps=20, warm=5):
    """One row per (shape, implementation): `summarize`'s medians."""
    import torch

    out = []
    for (b, h, n, d), impls in training_steps(shapes):
        for name, step in impls.items():
            for _ in range(warm):
                step()
            torch.cuda.synchronize()
            events = device_events(step, steps)
            found = summarize([(t, dur) for t, dur, _, kernel in events
                               if kernel], steps, FORWARD_AT[name])
            names = by_name([(x, dur) for _, dur, x, _ in events], steps)
            out.append(dict(impl=name, B=b, H=h, N=n, d=d, **found,
                            by_name_us=names))
            print(f"B{b} H{h} N{n} d{d} {name:<15} kernels "
                  f"{found['kernel_us']:8.1f} us, span "
                  f"{found['first_to_last_us']:8.1f}, idle "
                  f"{found['idle_us']:6.1f}, wait {found['wait_us']:6.1f}",
                  flush=True)
            for key, us in names.items():
                print(f"    {us:8.1f}  {key}", flush=True)
    return out


def median_rounds(rounds_ms, per_round):
    """{"us", "cudnn_us", "x_cudnn"} from each implementation's ms per
    round of `per_round` steps ({"flashlab": [...], "cudnn": [...]}):
    the median round's µs a step, and cuDNN's over flashlab's; with
    "flashlab atomic" rounds too, "atomic_us" and "x_cudnn_atomic"."""
    if not all(rounds_ms.get(x) for x in ("flashlab", "cudnn")):
        raise ValueError(f"rounds_ms: expected rounds of flashlab and "
                         f"cudnn, got {rounds_ms!r}")
    if per_round < 1:
        raise ValueError(f"per_round: expected at least 1, got "
                         f"{per_round}")

    def us(x):  # the median round's µs a step
        return 1000 * statistics.median(rounds_ms[x]) / per_round

    fl, cu = us("flashlab"), us("cudnn")
    out = dict(us=round(fl, 1), cudnn_us=round(cu, 1),
               x_cudnn=round(cu / fl, 3))
    if rounds_ms.get("flashlab atomic"):
        at = us("flashlab atomic")
        out.update(atomic_us=round(at, 1), x_cudnn_atomic=round(cu / at, 3))
    return out


def user_steps(shapes=SHAPES, rounds=6, per_round=10, warm=5):
    """One row per shape: a step as a user times it (`median_rounds`),
    training_steps' implementations in alternating rounds, a CUDA event
    pair around each round of `per_round` steps and a synchronize before
    it."""
    import torch

    out = []
    for (b, h, n, d), impls in training_steps(shapes):
        for step in impls.values():
            for _ in range(warm):
                step()
        times = {name: [] for name in impls}
        for _ in range(rounds):
            for name, step in impls.items():
                start, end = (torch.cuda.Event(enable_timing=True)
                              for _ in range(2))
                torch.cuda.synchronize()
                start.record()
                for _ in range(per_round):
                    step()
                end.record()
                torch.cuda.synchronize()
                times[name].append(start.elapsed_time(end))
        found = median_rounds(times, per_round)
        out.append(dict(B=b, H=h, N=n, d=d, **found))
        print(f"B{b} H{h} N{n} d{d} a step as timed: flashlab "
              f"{found['us']:8.1f} us, cuDNN {found['cudnn_us']:8.1f} us, "
              f"{found['x_cudnn']:.2f}x cuDNN; deterministic=False "
              f"{found['atomic_us']:8.1f} us, "
              f"{found['x_cudnn_atomic']:.2f}x cuDNN", flush=True)
    return out


def main(out, machine):
    """Measure, write step_gaps.json under `out` (`rows` and the steps as
    timed, `user_steps`), return the rows."""
    found = rows()
    steps = user_steps()
    with open(os.path.join(out, "step_gaps.json"), "w",
              encoding="utf-8") as f:
        json.dump(dict(machine=machine, rows=found, steps=steps), f,
                  indent=1)
    return found
