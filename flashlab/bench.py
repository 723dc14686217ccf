"""Benchmarks: flashlab against torch on the same inputs, in one run.

    python -m flashlab.bench [--cpu] [--no-gpu] [--quick] [--out DIR]
    python -m flashlab.bench --tensor-cores | --decode | --ring

GPU (float32, B=2, H=8, d=64, N = 1024, 4096, 16384, causal and not):
forward TFLOP/s of each flashlab.gpu version, of torch's memory-efficient
scaled_dot_product_attention and of materialized torch attention, and the
backward of flashlab.gpu against torch's memory-efficient backward; the
peak memory of a forward at N = 131072. CPU (2 threads, float32, N = 4096,
d = 64): flashlab.cpu against torch's scaled_dot_product_attention.
Times are medians over many runs after warm-up; FLOPs are 4 B H N^2 d for
the forward and 10 B H N^2 d for the backward, halved when causal.
Writes bench.csv and bench.png to --out and prints a table with ratios.
Timings are never asserted anywhere: this is a measurement, not a test.
"""

import argparse
import csv
import os
import platform
import statistics
import sys
import time

import numpy as np

from flashlab import costs

FIELDS = ("device", "impl", "pass", "causal", "B", "H", "N", "d", "ms",
          "tflops", "vs_torch")


def _progress(step, total, label):
    width = 24
    done = int(width * step / total)
    print(f"\r[{'#' * done}{'.' * (width - done)}] {step}/{total} {label:<40}",
          end="", file=sys.stderr, flush=True)


def _gpu_time(fn, reps, before=None):
    """Median milliseconds of fn() by CUDA events, after two warm-ups;
    before(), if given, runs ahead of each timed call, untimed."""
    import torch

    fn()
    fn()
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        start = torch.cuda.Event(enable_timing=True)
        stop = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def _cpu_time(fn, reps):
    """Median milliseconds of fn() by the wall clock, after one warm-up."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _flops(b, h, n, d, causal, backward=False):
    return b * h * costs.flops(n, n, d, causal=causal, backward=backward)


def gpu_rows(sizes, reps, versions):
    """Forward and backward measurements on the current CUDA device."""
    import torch

    plan = [(n, c) for n in sizes for c in (False, True)]
    counter = iter(range(1, len(plan) * (len(versions) + 4) + 1))
    rows = []
    for n, causal in plan:
        rows += _gpu_case(n, causal, reps(n), versions,
                          lambda label: _progress(next(counter),
                                                  len(plan) * (len(versions)
                                                               + 4), label))
        torch.cuda.empty_cache()
    print(file=sys.stderr)
    return rows


def _gpu_case(n, causal, reps, versions, tick, b=2, h=8, d=64):
    """All GPU measurements of one (N, causal) point."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashlab import gpu

    gen = torch.Generator(device="cuda").manual_seed(n)
    q, k, v, do = (torch.randn(b, h, n, d, device="cuda", generator=gen)
                   for _ in range(4))
    keep = torch.ones(n, n, dtype=torch.bool, device="cuda").tril()

    def flashlab_version(version):
        return lambda: gpu.attention(q, k, v, version=version, causal=causal)

    def efficient():
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def materialized():
        s = (q @ k.transpose(-1, -2)) * d**-0.5  # (B, H, N, N) in HBM
        if causal:
            s = s.masked_fill(~keep, float("-inf"))
        return torch.softmax(s, -1) @ v

    impls = {f"flashlab v{ver}": flashlab_version(ver) for ver in versions}
    impls["torch efficient"] = efficient
    impls["torch materialized"] = materialized
    measured = {}
    for name, fn in impls.items():
        tick(f"forward {name} N={n} causal={causal}")
        measured[name] = _gpu_time(fn, reps)
    base = measured["torch efficient"]
    rows = [_row("gpu", name, "forward", causal, b, h, n, d, ms,
                 _flops(b, h, n, d, causal), base / ms)
            for name, ms in measured.items()]

    # backward: flashlab's two kernels against torch's efficient path
    o, lse = gpu.attention(q, k, v, causal=causal, return_lse=True)
    tick(f"backward flashlab N={n} causal={causal}")
    ms_ours = _gpu_time(lambda: gpu.attention_backward(
        q, k, v, o, lse, do, causal=causal), reps)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
    tick(f"backward torch N={n} causal={causal}")
    ms_torch = _gpu_time(lambda: torch.autograd.grad(
        out, (qg, kg, vg), do, retain_graph=True), reps)
    for name, ms in (("flashlab", ms_ours), ("torch efficient", ms_torch)):
        rows.append(_row("gpu", name, "backward", causal, b, h, n, d, ms,
                         _flops(b, h, n, d, causal, True), ms_torch / ms))
    return rows


def gpu_ceilings(n=8192, reps=10):
    """Measured roofs: float32 matmul (no TF32) and device copy bandwidth."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    a, b = (torch.randn(n, n, device="cuda") for _ in range(2))
    ms = _gpu_time(lambda: a @ b, reps)
    x = torch.empty(2**30 // 4 * 4, device="cuda")  # 4 GiB of float32
    y = torch.empty_like(x)
    ms_copy = _gpu_time(lambda: y.copy_(x), reps)
    return dict(fp32_tflops=2 * n**3 / ms / 1e9,
                copy_tbps=2 * x.nbytes / ms_copy / 1e9)


def gpu_memory(n=131072, bh=16, d=64, dtype="float32", version=None):
    """Peak device memory of one forward against inputs + output + lse."""
    import torch

    from flashlab import gpu

    torch.cuda.empty_cache()
    q, k, v = (torch.randn(1, bh, n, d, device="cuda",
                           dtype=getattr(torch, dtype)) for _ in range(3))
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    o, lse = gpu.attention(q, k, v, causal=True, return_lse=True,
                           version=version)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    # the call's own peak: q, k, v and what it allocated on top of them;
    # tensors that earlier runs of the process left alive are not its
    peak = 3 * q.nbytes + torch.cuda.max_memory_allocated() - base
    need = 3 * q.nbytes + o.nbytes + lse.nbytes
    extra = peak - need
    return dict(n=n, bh=bh, d=d, dtype=dtype, version=version,
                peak_gib=peak / 2**30,
                need_gib=need / 2**30, ratio=peak / need,
                extra_bytes=extra, seconds=seconds)


def tensor_rows(sizes, reps, dims=(64, 128), b=2, h=8):
    """bf16 and float32 on the tensor cores against torch, per (d, N, causal).

    bf16: flashlab v5 against torch's FLASH_ATTENTION (the ratio) and
    CUDNN_ATTENTION backends, forward and backward (flashlab's backward:
    backward_v5 on the tensor cores). float32: v6 at 3xTF32
    and at tf32, and v3, against torch's memory-efficient kernel.
    """
    import torch

    plan = [(d, n, c) for d in dims for n in sizes for c in (False, True)]
    rows = []
    for step, (d, n, causal) in enumerate(plan, 1):
        _progress(step, len(plan), f"tensor cores d={d} N={n} "
                                   f"causal={causal}")
        rows += _tensor_case(d, n, causal, reps(n), b, h)
        torch.cuda.empty_cache()
    print(file=sys.stderr)
    return rows


def _tensor_case(d, n, causal, reps, b, h):
    """The measurements of `tensor_rows` at one point."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashlab import gpu

    gen = torch.Generator(device="cuda").manual_seed(n + d)
    q, k, v, do = (torch.randn(b, h, n, d, device="cuda", generator=gen)
                   for _ in range(4))
    half = [x.bfloat16() for x in (q, k, v, do)]

    def sdpa(backend, x):
        def run():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(*x[:3],
                                                      is_causal=causal)
        return run

    fwd = _flops(b, h, n, d, causal)
    rows = []
    timed = {"flashlab v5 bf16": lambda: gpu.attention(*half[:3],
                                                        causal=causal),
             "torch flash bf16": sdpa(SDPBackend.FLASH_ATTENTION, half),
             "torch cudnn bf16": sdpa(SDPBackend.CUDNN_ATTENTION, half)}
    ms = {name: _gpu_time(fn, reps) for name, fn in timed.items()}
    rows += [_row("gpu", name, "forward", causal, b, h, n, d, t, fwd,
                  ms["torch flash bf16"] / t) for name, t in ms.items()]

    rows += _backward_rows(half, causal, reps, b, h, n, d)
    timed = {"flashlab v6 3xtf32": lambda: gpu.attention(
                 q, k, v, version=6, causal=causal),
             "flashlab v6 tf32": lambda: gpu.attention(
                 q, k, v, version=6, precision="tf32", causal=causal),
             "flashlab v3": lambda: gpu.attention(q, k, v, version=3,
                                                  causal=causal),
             "torch efficient": sdpa(SDPBackend.EFFICIENT_ATTENTION,
                                     (q, k, v))}
    ms = {name: _gpu_time(fn, reps) for name, fn in timed.items()}
    rows += [_row("gpu", name, "forward", causal, b, h, n, d, t, fwd,
                  ms["torch efficient"] / t) for name, t in ms.items()]
    return rows


def _backward_rows(half, causal, reps, b, h, n, d):
    """bf16 backward of flashlab.torch (tensor cores: backward_v5) and of
    torch's flash kernel, autograd from a saved forward, timed alone."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashlab import torch as fl_torch

    def backward(fn):
        x = [t.clone().requires_grad_() for t in half[:3]]
        out = fn(x)
        return lambda: torch.autograd.grad(out, x, half[3],
                                           retain_graph=True)

    def flash(x):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(*x, is_causal=causal)

    bwd = _flops(b, h, n, d, causal, backward=True)
    ms = {"flashlab bf16": _gpu_time(backward(lambda x: fl_torch.attention(
              *x, causal=causal)), reps),
          "torch flash bf16": _gpu_time(backward(flash), reps)}
    return [_row("gpu", name, "backward", causal, b, h, n, d, t, bwd,
                 ms["torch flash bf16"] / t) for name, t in ms.items()]


def backward_rows(sizes=(1024, 4096, 16384), dims=(64, 128), b=2, h=8):
    """--tensor-cores --backward-only: the bf16 backward rows alone."""
    import torch

    rows = []
    for d in dims:
        for n in sizes:
            for causal in (False, True):
                gen = torch.Generator(device="cuda").manual_seed(n + d)
                half = [torch.randn(b, h, n, d, device="cuda",
                                    generator=gen).bfloat16()
                        for _ in range(4)]
                rows += _backward_rows(half, causal, 5 if n > 8192 else 20,
                                       b, h, n, d)
    return rows


def decode_rows(reps=20, b=2, h=8, d=64):
    """Split-KV for decoding shapes: v3 unsplit, v3 with choose_splits'
    count, and torch's memory-efficient kernel, float32, Nq = 1 and 16
    rows per sequence against Nk = 4K to 128K keys."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashlab import gpu

    rows = []
    plan = [(nq, nk) for nq in (1, 16) for nk in (4096, 32768, 131072)]
    for step, (nq, nk) in enumerate(plan, 1):
        _progress(step, len(plan), f"decode Nq={nq} Nk={nk}")
        gen = torch.Generator(device="cuda").manual_seed(nk + nq)
        q = torch.randn(b, h, nq, d, device="cuda", generator=gen)
        k, v = (torch.randn(b, h, nk, d, device="cuda", generator=gen)
                for _ in range(2))
        splits = gpu.choose_splits(nq, nk, b * h, d, d)

        def efficient(q=q, k=k, v=v):
            with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v)

        timed = {
            f"v3 nq={nq}": lambda q=q, k=k, v=v: gpu.attention(
                q, k, v, version=3),
            f"v3 nq={nq} {splits} splits": lambda q=q, k=k, v=v: (
                gpu.attention(q, k, v, version=3, num_splits="auto")),
            f"torch nq={nq}": efficient}
        ms = {name: _gpu_time(fn, reps) for name, fn in timed.items()}
        flops = b * h * costs.flops(nq, nk, d)
        base = ms[f"torch nq={nq}"]
        rows += [_row("gpu", name, "decode", False, b, h, nk, d, t, flops,
                      base / t) for name, t in ms.items()]
        del q, k, v
        torch.cuda.empty_cache()
    print(file=sys.stderr)
    return rows


def accuracy(n=4096, bh=4, d=64):
    """Max |O - O_64| of float32 ways of computing one attention.

    Against float64 on the same float32 inputs: naive float32 (torch's
    materialized math), v6 at 3xTF32 and at tf32, v3, torch's
    memory-efficient kernel, and v5 on bf16-rounded inputs against
    float64 on those same rounded inputs.
    """
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashlab import gpu

    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, bh, n, d, device="cuda", generator=gen)
               for _ in range(3))

    def math(x):
        s = x[0] @ x[1].transpose(-1, -2) * d**-0.5
        return torch.softmax(s, -1) @ x[2]

    want = math([x.double() for x in (q, k, v)])
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        eff = F.scaled_dot_product_attention(q, k, v)
    got = {"naive float32": math((q, k, v)),
           "v6 3xtf32": gpu.attention(q, k, v, version=6),
           "v6 tf32": gpu.attention(q, k, v, version=6, precision="tf32"),
           "v3": gpu.attention(q, k, v, version=3),
           "torch efficient": eff}
    errs = {name: float((o.double() - want).abs().max())
            for name, o in got.items()}
    half = [x.bfloat16() for x in (q, k, v)]
    want = math([x.double() for x in half])
    errs["v5 bf16"] = float((gpu.attention(*half).double() - want)
                            .abs().max())
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        flash = F.scaled_dot_product_attention(*half)
    errs["torch flash bf16"] = float((flash.double() - want).abs().max())
    return errs


def tensor_ceilings(reps=10):
    """TFLOP/s of a register-only mma.sync loop from numba, and of
    cuBLAS bf16 and tf32 matmuls: the roofs of chapter 10."""
    import torch
    from numba import cuda

    from flashlab.gpu import ceiling

    blocks, threads, iters = 132 * 8, 256, 4096
    sink = cuda.device_array(blocks * threads, np.float32)
    out = {}
    for kind in ("bf16", "tf32"):
        kernel, flop = ceiling.loop(kind)
        launch = kernel[blocks, threads]
        ms = _gpu_time(lambda: launch(sink, iters), reps)  # noqa: B023
        out[f"numba mma {kind}"] = (blocks * threads // 32 * iters * flop
                                    / ms / 1e9)
    n = 8192
    for kind, dtype in (("bf16", torch.bfloat16), ("tf32", torch.float32)):
        torch.backends.cuda.matmul.allow_tf32 = kind == "tf32"
        a, b = (torch.randn(n, n, device="cuda", dtype=dtype)
                for _ in range(2))
        ms = _gpu_time(lambda: a @ b, reps)  # noqa: B023
        out[f"cublas {kind}"] = 2 * n**3 / ms / 1e9
    torch.backends.cuda.matmul.allow_tf32 = False
    return out


def cpu_rows(reps=5, n=4096, b=1, h=4, d=64, threads=2):
    """flashlab.cpu against torch's CPU attention, float32, forward and
    backward, 4-D inputs, the two interleaved rep by rep in one process;
    plus flashlab.cpu with 64 x 64 tiles, and its tile products alone."""
    import numba
    import torch

    torch.set_num_threads(threads)
    numba.set_num_threads(threads)
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((b, h, n, d), dtype=np.float32)
              for _ in range(4)]
    rows = []
    for step, causal in enumerate((False, True), 1):
        _progress(step, 2, f"cpu N={n} causal={causal}")
        rows += _cpu_case(*arrays, causal, reps, threads)
    print(file=sys.stderr)
    return rows


def _cpu_case(q, k, v, do, causal, reps, threads):
    """The rows of `cpu_rows` at one causal setting."""
    import torch
    import torch.nn.functional as F

    from flashlab import cpu

    tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
    out = F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
    o, lse = cpu.attention(q, k, v, causal=causal, return_lse=True)
    fns = {
        ("forward", "torch sdpa"): lambda: F.scaled_dot_product_attention(
            tq, tk, tv, is_causal=causal),
        ("forward", "flashlab cpu"): lambda: cpu.attention(
            q, k, v, causal=causal),
        ("forward", "cpu 64x64 tiles"): lambda: cpu.attention(
            q, k, v, causal=causal, block_q=64, block_k=64),
        ("forward", "cpu products only"): lambda: cpu.products_only(
            q, k, v, causal=causal),
        ("backward", "torch sdpa"): lambda: torch.autograd.grad(
            out, (tq, tk, tv), torch.from_numpy(do), retain_graph=True),
        ("backward", "flashlab cpu"): lambda: cpu.attention_backward(
            q, k, v, o, lse, do, causal=causal),
    }
    times = {key: [] for key in fns}
    for fn in fns.values():
        fn()  # compile and warm up
    for _ in range(reps):  # interleaved: drift hits all alike
        for key, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[key].append((time.perf_counter() - t0) * 1e3)
    b, h, n, d = q.shape
    rows = []
    for (pass_, name), ts in times.items():
        ms = statistics.median(ts)
        base = statistics.median(times[(pass_, "torch sdpa")])
        rows.append(_row(f"cpu x{threads}", name, pass_, causal, b, h, n, d,
                         ms, _flops(b, h, n, d, causal, pass_ == "backward"),
                         base / ms))
    return rows


def cpu_settings():
    """One line: the CPU threads and BLAS kernels the CPU bench ran on."""
    import ctypes

    import numba
    import torch

    from flashlab import blas

    core = "none"
    if blas.available:
        name = blas._lib.scipy_openblas_get_corename64_
        name.restype = ctypes.c_char_p
        core = name().decode()
    return (f"threads: torch {torch.get_num_threads()}, numba "
            f"{numba.get_num_threads()} ({numba.threading_layer()}); "
            f"OpenBLAS {core} kernels, 1 thread inside numba's; "
            f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '')}")


def _row(device, impl, pass_, causal, b, h, n, d, ms, flops, ratio):
    return dict(device=device, impl=impl, **{"pass": pass_},
                causal=causal, B=b, H=h, N=n, d=d, ms=round(ms, 4),
                tflops=round(flops / ms / 1e9, 3), vs_torch=round(ratio, 3))


def table(rows):
    """The measurements as a fixed-width text table."""
    head = (f"{'device':<8} {'pass':<8} {'impl':<19} {'causal':<6} "
            f"{'d':>4} {'N':>6} {'ms':>10} {'TFLOP/s':>8} {'vs torch':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['device']:<8} {r['pass']:<8} {r['impl']:<19} "
            f"{str(r['causal']):<6} {r['d']:>4} {r['N']:>6} {r['ms']:>10.3f} "
            f"{r['tflops']:>8.2f} {r['vs_torch']:>7.2f}x")
    return "\n".join(lines)


def plot(rows):
    """Figure: forward TFLOP/s against N per GPU implementation (torch
    dashed), full and causal side by side. Chapter 9 draws it too."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    for ax, causal in zip(axes, (False, True)):
        sel = [r for r in rows if r["device"] == "gpu"
               and r["pass"] == "forward" and r["causal"] == causal]
        for impl in dict.fromkeys(r["impl"] for r in sel):
            pts = [(r["N"], r["tflops"]) for r in sel if r["impl"] == impl]
            style = "o--" if impl.startswith("torch") else "o-"
            ax.plot(*zip(*pts), style, label=impl)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("N")
        ax.set_title("causal" if causal else "full attention")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("forward TFLOP/s, float32")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    return fig


def machine():
    """One line naming the machine and the library versions."""
    parts = [platform.processor() or platform.machine(),
             f"{os.cpu_count()} cpus", f"python {platform.python_version()}",
             f"numpy {np.__version__}"]
    try:
        import torch

        parts.append(f"torch {torch.__version__}")
        if torch.cuda.is_available():
            parts.insert(0, torch.cuda.get_device_name())
    except ImportError:
        pass
    import numba

    parts.append(f"numba {numba.__version__}")
    return ", ".join(parts)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m flashlab.bench",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--no-gpu", action="store_true", help="skip the GPU")
    ap.add_argument("--cpu", action="store_true", help="run the CPU bench")
    ap.add_argument("--quick", action="store_true",
                    help="N = 1024 and 4096 only, fewer repetitions")
    ap.add_argument("--versions", default="1,2,3,4",
                    help="flashlab.gpu forward versions to time")
    ap.add_argument("--ceilings", action="store_true",
                    help="only measure the float32 and bandwidth roofs")
    ap.add_argument("--decode", action="store_true",
                    help="split-KV on decoding shapes (Nq 1, 16; Nk to "
                         "128K) against torch")
    ap.add_argument("--tensor-cores", action="store_true",
                    help="bf16 and 3xTF32 forward (d = 64, 128) against "
                         "torch's flash, cuDNN and efficient kernels, "
                         "with accuracy and the tensor-core roofs")
    ap.add_argument("--backward-only", action="store_true",
                    help="with --tensor-cores: the bf16 backward rows only")
    ap.add_argument("--ring", action="store_true",
                    help="ring attention over NCCL on every GPU here "
                         "against one GPU (see flashlab.bench_ring)")
    ap.add_argument("--out", default=".", help="folder for csv and png")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    print("machine:", machine())
    if args.ceilings:
        roofs = gpu_ceilings()
        print(f"ceilings: float32 matmul {roofs['fp32_tflops']:.1f} TFLOP/s,"
              f" device copy {roofs['copy_tbps']:.2f} TB/s")
        return roofs
    rows, memory = [], None
    if args.tensor_cores and args.backward_only:
        rows = backward_rows()
        with open(os.path.join(args.out, "tensor_backward.csv"), "w",
                  newline="") as f:
            writer = csv.DictWriter(f, fieldnames=FIELDS)
            writer.writeheader()
            writer.writerows(rows)
        print(table(rows))
        return rows
    if args.tensor_cores:
        return tensor_main(args)
    if args.ring:
        from flashlab import bench_ring

        return bench_ring.main(args.out, machine())
    if args.decode:
        rows = decode_rows()
        with open(os.path.join(args.out, "decode.csv"), "w",
                  newline="") as f:
            writer = csv.DictWriter(f, fieldnames=FIELDS)
            writer.writeheader()
            writer.writerows(rows)
        print(table(rows))
        return rows
    if not args.no_gpu:
        import torch

        if not torch.cuda.is_available():
            ap.error("no CUDA device: use --no-gpu --cpu")
        sizes = (1024, 4096) if args.quick else (1024, 4096, 16384)
        versions = [int(x) for x in args.versions.split(",")]
        rows += gpu_rows(sizes, lambda n: 5 if n > 8192 else 20, versions)
        if not args.quick:
            memory = gpu_memory()
    settings = None
    if args.cpu:
        rows += cpu_rows(reps=3 if args.quick else 5)
        settings = cpu_settings()
    with open(os.path.join(args.out, "bench.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    if any(r["device"] == "gpu" for r in rows):
        import matplotlib

        matplotlib.use("Agg")  # a file, not a window
        plot(rows).savefig(os.path.join(args.out, "bench.png"), dpi=120)
    print(table(rows))
    if settings:
        print(settings)
    if memory:
        print(f"memory: forward at N={memory['n']}, B*H={memory['bh']}, "
              f"d={memory['d']}, causal: peak {memory['peak_gib']:.3f} GiB "
              f"for {memory['need_gib']:.3f} GiB of inputs, output and lse "
              f"({memory['ratio']:.4f}x, {memory['seconds']:.1f} s)")
    return rows


def tensor_main(args):
    """--tensor-cores: tables of speed, accuracy, roofs and memory."""
    import json

    sizes = (1024, 4096) if args.quick else (1024, 4096, 16384)
    rows = tensor_rows(sizes, lambda n: 5 if n > 8192 else 20)
    errs = accuracy()
    roofs = tensor_ceilings()
    memory = [gpu_memory(dtype=dt, version=ver)
              for dt, ver in (("bfloat16", 5), ("float32", 6))]
    with open(os.path.join(args.out, "tensor.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    with open(os.path.join(args.out, "tensor.json"), "w") as f:
        json.dump(dict(machine=machine(), accuracy=errs, ceilings=roofs,
                       memory=memory), f, indent=1)
    print(table(rows))
    print("accuracy, max |O - O_float64| (N=4096, B*H=4, d=64):")
    for name, e in errs.items():
        print(f"  {name:<18} {e:.3e}")
    print("roofs, TFLOP/s:", ", ".join(f"{k} {v:.0f}"
                                        for k, v in roofs.items()))
    for m in memory:
        print(f"memory: {m['dtype']} v{m['version']} forward N={m['n']}: "
              f"{m['ratio']:.4f}x inputs + output + lse")
    return rows


if __name__ == "__main__":
    main()
