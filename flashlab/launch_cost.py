"""What one launch costs the host, each way a kernel can be started.

The ladder, on one small kernel (`find_bad_columns` over a (1, 16, 64)
V, one element a thread, so the GPU's own time stays below the host's):
numba's dispatcher given a torch tensor (it wraps it in a device array
every call), the dispatcher given a device array it has seen,
flashlab's driver launch packing every parameter per call, the same
with the buffer packed once (only data pointers written), and one
replay of a CUDA graph holding the launch. Host microseconds per
launch, median of several loops, the stream synchronized once per loop.
A measurement, never a test; see chapter 10.

`main` adds what a model sees: host microseconds per call of
flashlab.torch.attention and of torch's SDPA, in one process, on the
shapes of the launch-path issue, the GPU time of training steps against
SDPA's flash and cuDNN backends, and the cold start of a new process
with and without the disk cache:

    python -m flashlab.launch_cost --out DIR   # writes launch.json
"""

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

STEPS = ("numba, torch tensor", "numba, device array", "driver, packed "
         "per call", "driver, packed once", "CUDA graph replay")


def _per_call(fn, calls, loops=5):
    """Median host microseconds of fn() over `loops` loops of `calls`."""
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(loops):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


def ladder(calls=2000):
    """{step: host microseconds per launch} for the steps of STEPS."""
    import torch
    from numba import cuda

    from flashlab.gpu import build, device

    v = torch.randn(1, 16, 64, device="cuda")
    bad = torch.zeros(1, 64, dtype=torch.bool, device="cuda")
    grid, block = (8, 1), device.THREADS
    raw = torch.cuda.current_stream().cuda_stream
    stream = cuda.external_stream(raw)
    numba_kernel = device.find_bad_columns
    arrays = [cuda.as_cuda_array(x, sync=False) for x in (v, bad)]
    driver = build.kernel("find_bad_columns", 0, 0)
    packed = driver.pack(v, bad)

    def numba_tensor():
        numba_kernel[grid, block, stream](
            *(cuda.as_cuda_array(x, sync=False) for x in (v, bad)))

    def numba_array():
        numba_kernel[grid, block, stream](*arrays)

    def driver_per_call():
        driver[grid, block, raw](v, bad)

    def driver_once():
        for arg, x in enumerate((v, bad)):
            packed.point(arg, x.data_ptr())
        packed.launch(grid, block, torch.cuda.current_stream().cuda_stream)

    side = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        driver_once()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=side):
            driver_once()
    steps = (numba_tensor, numba_array, driver_per_call, driver_once,
             graph.replay)
    return {name: _per_call(fn, calls) for name, fn in zip(STEPS, steps)}


def host_per_call(calls=200):
    """{case: {"flashlab", "sdpa"}} host microseconds per call at (1, 4,
    128, 64) bf16 causal: the forward without and with autograd, and a
    forward+backward step; the GPU's own time is far below these."""
    import torch
    import torch.nn.functional as F

    from flashlab import torch as fl_torch

    q, k, v = (torch.randn(1, 4, 128, 64, device="cuda",
                           dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    do = torch.randn_like(q)
    impls = {"flashlab": fl_torch.attention,
             "sdpa": F.scaled_dot_product_attention}
    out = {}
    for case in ("forward, no grad", "forward", "forward+backward"):
        out[case] = {}
        for name, fn in impls.items():
            def call(fn=fn, case=case):
                if case == "forward, no grad":
                    with torch.no_grad():
                        fn(q, k, v, is_causal=True)
                elif case == "forward":
                    fn(q, k, v, is_causal=True)
                else:
                    fn(q, k, v, is_causal=True).backward(do)

            out[case][name] = round(_per_call(call, calls), 1)
    return out


def _gpu_ms(fn, reps=20):
    """Median milliseconds of fn() by CUDA events, after warm-up."""
    import torch

    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, stop = (torch.cuda.Event(enable_timing=True)
                       for _ in range(2))
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


CASES = ((2, 8, 1024, 64, False, False), (16, 12, 1024, 64, True, True),
         (2, 8, 4096, 64, False, False), (2, 8, 16384, 128, False, False),
         (2, 8, 16384, 64, True, False), (8, 16, 2048, 128, True, True))


def _step(backend, q, k, v, do, causal, train):
    """One forward (and backward) through flashlab (backend None) or
    torch's SDPA restricted to `backend`."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    from flashlab import torch as fl_torch

    if backend is None:
        o = fl_torch.attention(q, k, v, is_causal=causal)
    else:
        with sdpa_kernel(backend):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    if train:
        o.backward(do)


def steps(cases=CASES):
    """[{B, H, N, d, causal, pass, flashlab, flash, cudnn}]: ms of a bf16
    forward or forward+backward step, as a user calls each, by CUDA
    events (host gaps included, as a model pays them)."""
    import torch
    from torch.nn.attention import SDPBackend

    rows = []
    for b, h, n, d, causal, train in cases:
        q, k, v = (torch.randn(b, h, n, d, device="cuda",
                               dtype=torch.bfloat16, requires_grad=train)
                   for _ in range(3))
        do = torch.randn_like(q)
        row = dict(B=b, H=h, N=n, d=d, causal=causal,
                   **{"pass": "fwd+bwd" if train else "fwd"})
        for name, backend in (("flashlab", None),
                              ("flash", SDPBackend.FLASH_ATTENTION),
                              ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            run = functools.partial(_step, backend, q, k, v, do, causal,
                                    train)
            with torch.set_grad_enabled(train):
                try:
                    row[name] = round(_gpu_ms(run), 4)
                except RuntimeError:  # a backend this build lacks
                    row[name] = None
        rows.append(row)
        print(row, flush=True)
    return rows


def cold_start():
    """Seconds from `import flashlab` to a first bf16 forward's result
    in a new process: with an empty PTX cache, then with it filled."""
    code = ("import time; t = time.perf_counter(); import torch; "
            "from flashlab import torch as ft; "
            "q = torch.randn(1, 2, 64, 64, device='cuda', "
            "dtype=torch.bfloat16); ft.attention(q, q, q); "
            "torch.cuda.synchronize(); print(time.perf_counter() - t)")
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, FLASHLAB_CACHE_DIR=cache)
        times = [float(subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True,
            text=True, check=True).stdout.split()[-1]) for _ in range(2)]
    return {"empty cache": round(times[0], 2),
            "filled cache": round(times[1], 2)}


def main(argv=None):
    """Measure everything above; write DIR/launch.json, print a table."""
    from flashlab import bench

    parser = argparse.ArgumentParser(prog="python -m flashlab.launch_cost")
    parser.add_argument("--out", default="bench_results")
    args = parser.parse_args(argv)
    found = {"machine": bench.machine(), "ladder": ladder(),
             "host_us": host_per_call(), "cold_start_s": cold_start(),
             "steps": steps()}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "launch.json"), "w") as f:
        json.dump(found, f, indent=1)
    for step, us in found["ladder"].items():
        print(f"{step:<28} {us:8.1f} us per launch")
    for case, us in found["host_us"].items():
        print(f"{case:<28} flashlab {us['flashlab']:7.1f} us, sdpa "
              f"{us['sdpa']:6.1f} us, ratio "
              f"{us['sdpa'] / us['flashlab']:.2f}")
    for row in found["steps"]:
        ratio = row["flash"] / row["flashlab"]
        print(f"B{row['B']} H{row['H']} N{row['N']} d{row['d']} "
              f"{'causal' if row['causal'] else 'full'} {row['pass']}: "
              f"{row['flashlab']:.3f} ms, flash {row['flash']:.3f} ms "
              f"({ratio:.2f}x flash)")
    print("cold start", found["cold_start_s"])


if __name__ == "__main__":
    main()
