"""The tensor-core roof as numba sees it: a loop of mma.sync, no memory.

Every warp runs two independent chains of mmas on values in registers,
so the loop measures the instruction's throughput from numba and nothing
else: the most any kernel built on `intrinsics` could reach. See chapter
10 and `python -m flashlab.bench --tensor-cores`.
"""

import numpy as np
from numba import cuda

from flashlab.gpu.intrinsics import mma_bf16, mma_tf32, pack_bf16x2

# FLOPs of one mma: 2 m n k
FLOPS = {"bf16": 2 * 16 * 8 * 16, "tf32": 2 * 16 * 8 * 8}


@cuda.jit(device=True)
def _bf16_operand(x):
    return pack_bf16x2(x, np.float32(1e-3))


@cuda.jit(device=True)
def _tf32_operand(x):
    return x


def loop(kind):
    """(kernel, flops per mma): kernel[blocks, threads](sink, iters)."""
    mma = mma_bf16 if kind == "bf16" else mma_tf32
    operand = _bf16_operand if kind == "bf16" else _tf32_operand

    @cuda.jit
    def mma_loop(sink, iters):
        x = operand(np.float32(cuda.threadIdx.x % 32) * np.float32(1e-3))
        c0 = c1 = c2 = c3 = np.float32(0)
        e0 = e1 = e2 = e3 = np.float32(0)
        for _ in range(iters):  # two chains: one mma's latency hidden
            c0, c1, c2, c3 = mma(x, x, x, x, x, x, c0, c1, c2, c3)
            e0, e1, e2, e3 = mma(x, x, x, x, x, x, e0, e1, e2, e3)
        # one store per thread keeps the loop from being optimized away
        sink[cuda.grid(1)] = c0 + c1 + c2 + c3 + e0 + e1 + e2 + e3

    return mma_loop, 2 * FLOPS[kind]
