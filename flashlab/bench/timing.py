"""Timers: each takes a suite's calls and a case, gives {name: ms}.

GPU kernels are timed by CUDA events (median of case.reps after
warm-up), CPU code by the wall clock, interleaved rep by rep so that
drift hits every impl alike; host time per call by the wall clock over
a loop of calls with one synchronize at its end, as a model pays it.
Timings are never asserted anywhere: they are measurements.
"""

import statistics
import time


def gpu_time(fn, reps, before=None):
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


def _sync(device):
    """Wait for the device's queued work (nothing to wait for on a CPU)."""
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def wall_time(fn, reps, device="cpu"):
    """Median milliseconds of fn() by the wall clock, after one warm-up,
    the device synchronized after each call."""
    fn()
    _sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def events(calls, case):
    """Each call alone by CUDA events, case.reps times."""
    return {name: gpu_time(fn, case.reps) for name, fn in calls.items()}


def on(device):
    """CUDA events on a GPU, the wall clock on a CPU."""
    if device == "cuda":
        return events
    return lambda calls, case: {name: wall_time(fn, case.reps)
                                for name, fn in calls.items()}


def interleaved(calls, case):
    """The wall clock, the calls interleaved rep by rep after one
    warm-up each (compiles numba kernels): drift hits all alike."""
    for fn in calls.values():
        fn()
    times = {name: [] for name in calls}
    for _ in range(case.reps):
        for name, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(ts) for name, ts in times.items()}


def host_loop(device, loops=5, warm=10):
    """Host time per call: `warm` calls of each, then `loops` rounds in
    which each call runs a loop of case.reps calls, timed by the wall
    clock with one synchronize at its end; the median loop's
    milliseconds per call. The loops of the calls alternate round by
    round, so a drift of the host's speed hits every call alike."""
    def timer(calls, case):
        for fn in calls.values():
            for _ in range(warm):
                fn()
        _sync(device)
        per_call = {name: [] for name in calls}
        for _ in range(loops):
            for name, fn in calls.items():
                t0 = time.perf_counter()
                for _ in range(case.reps):
                    fn()
                _sync(device)
                per_call[name].append((time.perf_counter() - t0) * 1e3
                                      / case.reps)
        return {name: statistics.median(ts)
                for name, ts in per_call.items()}
    return timer


def steps(device, warm=3):
    """Training steps: `warm` steps, then case.reps steps, each by the
    wall clock between two synchronizes; the median step's ms. Every
    impl runs the same number of steps, so each sees the same batches."""
    def timer(calls, case):
        out = {}
        for name, fn in calls.items():
            for _ in range(warm):
                fn()
            times = []
            for _ in range(case.reps):
                _sync(device)
                t0 = time.perf_counter()
                fn()
                _sync(device)
                times.append((time.perf_counter() - t0) * 1e3)
            out[name] = statistics.median(times)
        return out
    return timer
