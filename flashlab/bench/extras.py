"""Measurements that are not suites: roofs, peak memory, accuracy and
the CPU settings, printed beside the suites' tables (chapters 9, 10)."""

import os
import time

import numpy as np

from flashlab.bench import timing


def gpu_ceilings(n=8192, reps=10):
    """Measured roofs: float32 matmul (no TF32) and device copy bandwidth."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    a, b = (torch.randn(n, n, device="cuda") for _ in range(2))
    ms = timing.gpu_time(lambda: a @ b, reps)
    x = torch.empty(2**30 // 4 * 4, device="cuda")  # 4 GiB of float32
    y = torch.empty_like(x)
    ms_copy = timing.gpu_time(lambda: y.copy_(x), reps)
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
        ms = timing.gpu_time(lambda: launch(sink, iters), reps)  # noqa: B023
        out[f"numba mma {kind}"] = (blocks * threads // 32 * iters * flop
                                    / ms / 1e9)
    n = 8192
    for kind, dtype in (("bf16", torch.bfloat16), ("tf32", torch.float32)):
        torch.backends.cuda.matmul.allow_tf32 = kind == "tf32"
        a, b = (torch.randn(n, n, device="cuda", dtype=dtype)
                for _ in range(2))
        ms = timing.gpu_time(lambda: a @ b, reps)  # noqa: B023
        out[f"cublas {kind}"] = 2 * n**3 / ms / 1e9
    torch.backends.cuda.matmul.allow_tf32 = False
    return out


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
