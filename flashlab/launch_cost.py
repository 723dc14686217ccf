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
"""

import statistics
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
