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

`main` adds what a model sees, through the bench's own suites (host
microseconds per call against torch's SDPA, training steps against its
flash and cuDNN backends) and the cold start of a new process with and
without the disk cache:

    python -m flashlab.launch_cost --out DIR   # writes launch.json
"""

import argparse
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


# the training-step shapes of chapter 10: (pass, B, H, N, d, causal)
STEP_SHAPES = (("forward", 2, 8, 1024, 64, False),
               ("fwd+bwd", 16, 12, 1024, 64, True),
               ("forward", 2, 8, 4096, 64, False),
               ("forward", 2, 8, 16384, 128, False),
               ("forward", 2, 8, 16384, 64, True),
               ("fwd+bwd", 8, 16, 2048, 128, True))


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
    """The ladder and the cold start, then the bench's host and training
    suites (flashlab.bench.host, .training) at STEP_SHAPES; writes
    DIR/launch.json and prints the tables."""
    from flashlab.bench import host, report, runner, training

    parser = argparse.ArgumentParser(prog="python -m flashlab.launch_cost")
    parser.add_argument("--out", default="bench_results")
    args = parser.parse_args(argv)
    found = {"machine": report.machine(), "ladder": ladder(),
             "cold_start_s": cold_start(),
             "host": runner.run(host.suite()),
             "steps": runner.run(training.suite(STEP_SHAPES))}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "launch.json"), "w") as f:
        json.dump(found, f, indent=1)
    for step, us in found["ladder"].items():
        print(f"{step:<28} {us:8.1f} us per launch")
    print("cold start", found["cold_start_s"])
    print(report.table(found["host"], host.SHOWN))
    print(report.table(found["steps"], training.SHOWN))


if __name__ == "__main__":
    main()
