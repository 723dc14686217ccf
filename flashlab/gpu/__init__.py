"""Attention kernels for NVIDIA GPUs in numba.cuda: forward and backward.

Any N and the mask, padding, window, dropout and non-finite semantics of
`flashlab.tiled`. v1-v4 and the backward compute on the float32 units
(head dims 16-128 in multiples of 16); v5 (bf16, float16) and v6
(float32 by 3xTF32) on the tensor cores (head dims 64 and 128), v7 and
v8 on Hopper's warpgroup MMA. The
package, in the order chapters 9 and 10 read it:

- `device`: tile layouts and the device functions every kernel shares;
- `forward_v1` ... `forward_v4`: one module per forward version, each a
  small change of the one before (chapter 9 shows them as diffs);
- `intrinsics`, `warp`, `forward_v5`, `forward_v6`: mma.sync, ldmatrix
  and cp.async from numba, and the warp-level kernels built on them;
- `backward`: dK/dV and dQ kernels, deterministic, no atomics;
  `backward_v5` on mma.sync and `backward_v7` on Hopper's wgmma, the
  same two kernels for bf16 and float16, and `backward_v8`, v7's dK/dV
  kernel warp-specialized (d = 64), and in one pass with dQ added by
  TMA's reductions where atomics are allowed;
- `wgmma`, `tma`, `forward_v7`, `forward_v8`: Hopper's warpgroup MMA,
  tensor-memory copies and mbarriers, and the forwards built on them
  (chapter 12);
- `registry`: every kernel described once (dtypes, head dims, compute
  capabilities), and the version a device runs;
- `launch`, `build`: numba compiles, the driver loads and launches
  (sm_90a on Hopper); PTX for any target without a GPU;
- `traits`: each kernel's tile constants at one (d, d_v);
- `adapters`: one per kind of array taken (torch, numpy, numba);
- `host`: the entry points `attention`, `attention_backward`,
  `attention_statistics` and `combine`, with the keywords of
  `tiled.attention`, which this module re-exports;
- `fp8`: `attention_fp8` on e4m3 inputs with per-tensor scales (v8's
  8-bit form) and `quantize`, which makes them.
"""

# the modules, as flashlab.gpu.forward_v1 etc. (chapters show them)
from flashlab.gpu import (  # noqa: F401
    _numpy_compat,  # before any kernel
    adapters,
    backward,
    backward_v5,
    backward_v7,
    backward_v8,
    device,
    forward_v1,
    forward_v2,
    forward_v3,
    forward_v4,
    forward_v5,
    forward_v6,
    forward_v7,
    forward_v8,
    launch,
    registry,
    traits,
    warp,
)
from flashlab.gpu.build import (  # noqa: F401
    compile_ptx,
    kernel,
    kernel_names,
    supports,
)
from flashlab.gpu.fp8 import attention_fp8, quantize

# the host entry points and their tables (private names: tests and plans)
from flashlab.gpu.host import (  # noqa: F401
    DEFAULT_VERSION,
    FLOAT32_VERSIONS,
    FORWARDS,
    HALF_BITS,
    HALF_VERSIONS,
    ORDERS,
    PRECISIONS,
    SPLIT_VERSIONS,
    TENSOR_CORE_VERSIONS,
    VERSIONS,
    _BackwardPlan,
    _Call,
    _check_version,
    _ForwardPlan,
    _plans,
    attention,
    attention_backward,
    attention_statistics,
    choose_splits,
    combine,
    tile_shape,
)

__all__ = ["attention", "attention_backward", "attention_fp8", "quantize",
           "compile_ptx", "kernel_names",
           "supports", "tile_shape", "DEFAULT_VERSION", "VERSIONS",
           "FLOAT32_VERSIONS", "HALF_VERSIONS", "TENSOR_CORE_VERSIONS",
           "PRECISIONS", "SPLIT_VERSIONS", "choose_splits", "combine",
           "attention_statistics"]

# Tests set this to fill every output with NaN before a kernel runs, so an
# element a kernel fails to write cannot pass for a right answer.
POISON_OUTPUTS = False
