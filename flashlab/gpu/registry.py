"""Every kernel flashlab.gpu launches, described once.

A `Kernel` says what a kernel is: its factory, what it takes, the head
dims and compute capabilities it runs on, its threads and register cap.
Version choice, `supports`, signatures, the launch path, the ptxas table
of the tests and the benchmarks read these records; nothing else matches
kernel names. `ARCHITECTURES` is the table of GPUs the course names, and
`best_version` picks the forward a device runs. See chapters 9 and 10.
"""

import functools
from typing import Callable, NamedTuple

from flashlab.gpu import (
    _numpy_compat,  # noqa: F401  (before compiling)
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
    warp,
)

SCALAR_DIMS = tuple(range(16, 129, 16))  # head dims of the float32 kernels
TENSOR_DIMS = (64, 128)  # of the tensor-core kernels (swizzled rows)
# (compute capability, a GPU of it, what a hosted runtime calls it)
ARCHITECTURES = (((7, 5), "T4"), ((8, 0), "A100"), ((8, 6), "RTX 3090"),
                 ((8, 9), "L4"), ((9, 0), "H100 / H200"))
MMA_CC = (8, 0)  # mma.sync m16n8k16 bf16/f16, m16n8k8 tf32, cp.async


class Kernel(NamedTuple):
    """What one kernel is; `make(D, D_V)` builds it (numba, not compiled
    until launched or compiled to PTX)."""

    name: str
    make: Callable
    args: str  # key of its argument list in `argument_types`
    dtypes: tuple  # input dtypes it takes
    head_dims: tuple  # values d and d_v may take
    min_cc: tuple  # the oldest compute capability that runs it
    threads: int  # per block (None: set by the head dims, see traits)
    # the assembler's cap per thread, kept by the driver load: a number,
    # or a function of (d, d_v) where it follows the head dims
    max_registers: object = None
    version: int = None  # forward version number, for forwards
    max_dim: int = 128  # max(d, d_v) it is built for
    helper: bool = False  # an element-wise step around the attention
    max_cc: tuple = None  # the newest one, for architecture-specific PTX
    shared: Callable = None  # dynamic shared bytes per block of (d, d_v)
    derived: Callable = None  # launch.Derived of (d, d_v): own arguments
    # a backward whose gradients leave as 16-bit pairs in the inputs'
    # type, dK and dV per K/V head (else float32, per query head)
    grads16: bool = False
    # its blocks find their head and rank by flashlab.order.place: the
    # grid is order.grid's (heads together, ranks, groups), not (ranks,
    # heads)
    placed: bool = False
    # built for d = d_v only (its tests cover no other)
    same_dims: bool = False

    def runs_on(self, cc):
        """Whether a device of compute capability cc runs this kernel."""
        cc = tuple(cc)[:2]
        return cc >= self.min_cc and (self.max_cc is None
                                      or cc <= self.max_cc)

    def registers(self, d, d_v):
        """The register cap per thread at head dims d, d_v (None: no
        cap)."""
        cap = self.max_registers
        return cap(d, d_v) if callable(cap) else cap

    def takes(self, d, d_v):
        """Whether it is built for head dims d, d_v."""
        return (d in self.head_dims and d_v in self.head_dims
                and max(d, d_v) <= self.max_dim
                and (d == d_v or not self.same_dims))


def _fixed(kernel):
    """A factory for a kernel that does not depend on the head dims."""
    return lambda d, d_v: kernel


_F32 = ("float32",)
_HALF = ("bfloat16", "float16")
E4M3 = "float8_e4m3fn"  # torch's name of the e4m3 dtype
_BASE = dict(head_dims=SCALAR_DIMS, min_cc=(7, 5))
_HELPER = dict(_BASE, threads=device.THREADS, helper=True)
KERNELS = (
    Kernel("forward_v1", forward_v1.make, "forward", _F32,
           threads=forward_v1.ROWS, version=1, **_BASE),
    Kernel("forward_v2", forward_v2.make, "forward", _F32,
           threads=forward_v2.ROWS, version=2, **_BASE),
    Kernel("forward_v3", forward_v3.make, "forward", _F32,
           threads=device.THREADS, version=3,
           max_registers=forward_v3.MAX_REGISTERS, **_BASE),
    Kernel("forward_v4", forward_v4.make, "forward", _F32,
           threads=device.THREADS, version=4, **_BASE),
    *(Kernel(f"forward_v5_{kind}",
             functools.partial(forward_v5.make, kind=kind), "forward16",
             (dtype,), TENSOR_DIMS, MMA_CC, warp.THREADS, version=5)
      for kind, dtype in (("bf16", "bfloat16"), ("f16", "float16"))),
    *(Kernel(f"forward_v6_{precision}",
             functools.partial(forward_v6.make, precision=precision),
             "forward_bad", _F32, TENSOR_DIMS, MMA_CC, warp.THREADS,
             version=6)
      for precision in forward_v6.PRECISIONS),
    # wgmma, setmaxnreg: sm_90a PTX, which runs on compute capability
    # 9.0 only (not on later GPUs, as plain PTX would)
    *(Kernel(f"forward_v7_{kind}",
             functools.partial(forward_v7.make, kind=kind), "forward16",
             (dtype,), TENSOR_DIMS, (9, 0), forward_v7.THREADS, version=7,
             max_cc=(9, 0), shared=forward_v7.shared_bytes, placed=True)
      for kind, dtype in (("bf16", "bfloat16"), ("f16", "float16"))),
    *(Kernel(f"forward_v8_{kind}",
             functools.partial(forward_v8.make, kind=kind), "forward16_tma",
             (dtype,), TENSOR_DIMS, (9, 0), None,
             max_registers=forward_v8.max_registers, version=8,
             max_cc=(9, 0), shared=forward_v8.shared_bytes,
             derived=forward_v8.derived, placed=True)
      for kind, dtype in (("bf16", "bfloat16"), ("f16", "float16"))),
    # e4m3 inputs, a bf16 output: flashlab.gpu.attention_fp8
    Kernel("forward_v8_e4m3", forward_v8.make_e4m3, "forward8_tma",
           (E4M3,), forward_v8.E4M3_DIMS, (9, 0),
           forward_v8.threads(128, 128),
           max_registers=forward_v8.max_registers, version=8,
           max_cc=(9, 0),
           shared=functools.partial(forward_v8.shared_bytes, size=1),
           derived=forward_v8.derived_e4m3, placed=True),
    # one thread per own row: 64 or 32 by the head dims (backward.sizes)
    Kernel("backward_kv", backward.make_kv, "backward_kv", _F32,
           threads=None, **_BASE),
    Kernel("backward_q", backward.make_q, "backward_q", _F32,
           threads=None, **_BASE),
    Kernel("backward_kv_blocked", backward.make_kv_blocked, "backward_kv",
           _F32, threads=device.THREADS, max_dim=backward.BLOCKED_MAX_DIM,
           **_BASE),
    Kernel("backward_q_blocked", backward.make_q_blocked, "backward_q",
           _F32, threads=device.THREADS, max_dim=backward.BLOCKED_MAX_DIM,
           **_BASE),
    *(Kernel(f"backward_v5_{part}_{kind}",
             functools.partial(make, kind=kind), f"backward16_{part}",
             (dtype,), TENSOR_DIMS, MMA_CC, warp.THREADS)
      for part, make in (("dq", backward_v5.make_dq),
                         ("dkv", backward_v5.make_dkv))
      for kind, dtype in (("bf16", "bfloat16"), ("f16", "float16"))),
    # gradients as 16-bit pairs, dK and dV per K/V head
    *(Kernel(f"backward_v7_{part}_{kind}",
             functools.partial(make, kind=kind), f"backward16_{part}_pairs",
             (dtype,), TENSOR_DIMS, (9, 0), backward_v7.threads(part),
             max_cc=(9, 0),
             shared=functools.partial(backward_v7.shared_bytes, part),
             grads16=True, placed=True)
      for part, make in (("dq", backward_v7.make_dq),
                         ("dkv", backward_v7.make_dkv),
                         ("fused", backward_v7.make_fused))
      for kind, dtype in (("bf16", "bfloat16"), ("f16", "float16"))),
    # v7's dK/dV kernel warp-specialized (TMA, setmaxnreg); its dQ is
    # v7's
    *(Kernel(f"backward_v8_dkv_{kind}",
             functools.partial(backward_v8.make_dkv, kind=kind),
             "backward16_dkv_tma", (dtype,), backward_v8.HEAD_DIMS, (9, 0),
             backward_v8.threads(), max_registers=backward_v8.max_registers,
             max_cc=(9, 0), shared=backward_v8.shared_bytes,
             derived=backward_v8.derived, grads16=True, placed=True)
      for kind, dtype in (("bf16", "bfloat16"), ("f16", "float16"))),
    # and with dQ in the same pass, added by TMA's reductions
    *(Kernel(f"backward_v8_fused_{kind}",
             functools.partial(backward_v8.make_fused, kind=kind),
             "backward16_fused_tma", (dtype,), backward_v8.FUSED_HEAD_DIMS,
             (9, 0), backward_v8.threads(),
             max_registers=backward_v8.max_registers, max_cc=(9, 0),
             shared=functools.partial(backward_v8.shared_bytes, fused=True),
             derived=backward_v8.derived_fused, grads16=True,
             placed=True, same_dims=True)
      for kind, dtype in (("bf16", "bfloat16"), ("f16", "float16"))),
    # backward version 9: that kernel with each dQ tile's additions in
    # the order of the key blocks, the same bits every run
    *(Kernel(f"backward_v9_fused_{kind}",
             functools.partial(backward_v8.make_ordered, kind=kind),
             "backward16_ordered_tma", (dtype,),
             backward_v8.FUSED_HEAD_DIMS, (9, 0), backward_v8.threads(),
             max_registers=backward_v8.max_registers, max_cc=(9, 0),
             shared=functools.partial(backward_v8.shared_bytes, fused=True),
             derived=backward_v8.derived_ordered, grads16=True,
             placed=True, same_dims=True)
      for kind, dtype in (("bf16", "bfloat16"), ("f16", "float16"))),
    # element-wise helpers around the attention kernels
    Kernel("combine_splits", _fixed(device.combine_splits), "combine",
           _F32, **_HELPER),
    Kernel("row_dot", _fixed(device.row_dot), "row_dot", _F32, **_HELPER),
    # forward v8's split tail: its pieces' two halves into o and lse
    *(Kernel(f"merge_halves_{kind}",
             _fixed(getattr(device, f"merge_halves_{kind}")),
             "merge_halves", (dtype,), **dict(_HELPER, min_cc=MMA_CC))
      for kind, dtype in (("bf16", "bfloat16"), ("f16", "float16"))),
    # rows' (m, l) <-> the backward's (shift, norm)
    Kernel("norms_from_sums", _fixed(device.norms_from_sums), "norms",
           _F32, **_HELPER),
    Kernel("sums_from_norms", _fixed(device.sums_from_norms), "sums",
           _F32, **_HELPER),
    Kernel("find_bad_columns", _fixed(device.find_bad_columns),
           "find_bad", _F32, **_HELPER),
    # V's bad parts, V read as int32 words of values of 32, 16, 8 bits
    *(Kernel(f"find_bad_parts{width}",
             _fixed(getattr(device, f"find_bad_parts{width}")),
             "find_parts", dtypes,
             **dict(_HELPER, threads=device.FIND_THREADS))
      for width, dtypes in ((32, _F32), (16, _HALF), (8, (E4M3,)))),
    # e4m3 V -> V^T in the key order of P's packed fragments (8 threads
    # a word of a V row, at the e4m3 head dims)
    Kernel("transpose_keys8", _fixed(forward_v8.transpose_keys8),
           "transpose8", (E4M3,),
           **dict(_HELPER, threads=forward_v8.transpose_threads(
               max(forward_v8.E4M3_DIMS)))),
    # 16 bytes a lane, warp.dot_lanes a row, a grid-stride loop; capped
    # so that an SM holds warp.DOT_BLOCKS_PER_SM blocks
    *(Kernel(f"row_dot_{kind}", _fixed(getattr(warp, f"row_dot_{kind}")),
             "row_dot16", (dtype,), max_registers=warp.DOT_REGISTERS,
             **dict(_HELPER, threads=warp.THREADS))
      for kind, dtype in (("bf16", "bfloat16"), ("f16", "float16"))),
    # the 16-bit backward's one preparation: row_dot16's D, and beside
    # each row's sum its statistics and the ordered kernel's counts
    *(Kernel(f"prepare_{kind}", _fixed(getattr(backward_v5,
                                                f"prepare_{kind}")),
             "prepare16", (dtype,), max_registers=warp.PREPARE_REGISTERS,
             **dict(_HELPER, threads=warp.THREADS))
      for kind, dtype in (("bf16", "bfloat16"), ("f16", "float16"))),
    Kernel("finish_rows", _fixed(device.finish_rows), "finish", _F32,
           **_HELPER),
    # the backward's row statistics (shift, norm of P; exact where lse
    # lost log l), one per backward's way of forming S
    Kernel("row_statistics", _fixed(device.row_statistics),
           "row_statistics", _F32, **_HELPER),
    *(Kernel(f"row_statistics_{kind}",
             _fixed(getattr(backward_v5, f"row_statistics_{kind}")),
             "row_statistics16", (dtype,), **_HELPER)
      for kind, dtype in (("bf16", "bfloat16"), ("f16", "float16"))),
)
BY_NAME = {k.name: k for k in KERNELS}


def get(name):
    """The description of kernel `name`."""
    if name not in BY_NAME:
        raise ValueError(f"name: expected one of {tuple(BY_NAME)}, got "
                         f"{name!r}")
    return BY_NAME[name]


def forwards(version):
    """The forward kernels of one version (one per dtype or precision)."""
    return tuple(k for k in KERNELS if k.version == version)


def versions():
    """Every forward version, in order."""
    return tuple(sorted({k.version for k in KERNELS if k.version}))


def versions_for(dtype, d, d_v, cc=None):
    """Forward versions that take `dtype` at head dims d, d_v and run on
    compute capability cc (any, when cc is None)."""
    return tuple(v for v in versions() if any(
        dtype in k.dtypes and k.takes(d, d_v)
        and (cc is None or k.runs_on(cc)) for k in forwards(v)))


def best_version(dtype, d, d_v, cc, simulator=False):
    """The forward `version=None` runs: the fastest one as accurate as
    float32 arithmetic that the device runs. 16-bit inputs: v8 (wgmma,
    TMA, warp-specialized) on Hopper, v5 from compute capability 8.0 on;
    float32: v6 (3xTF32) there, else v3.
    None where no kernel takes `dtype` on this device (16-bit inputs on a
    T4: the caller widens them to float32). The simulator runs no inline
    PTX, so it always gets v3."""
    if simulator:
        return 3 if dtype == "float32" else None
    for version in (8, 5, 6, 3):
        if version in versions_for(dtype, d, d_v, cc):
            return version
    return None


def backward_version(dtype, d, d_v, cc, nk=None):
    """The 16-bit backward `version=None` runs at nk keys: 9 (one
    warp-specialized pass, dQ's additions in a fixed order) on Hopper at
    d = d_v where `ordered_pays`, else 8 (v7's kernels with a
    warp-specialized dK/dV) where it takes d, d_v, else 7 (wgmma) there,
    5 (mma.sync) from compute capability 8.0 on; None where none runs
    (the caller widens to float32)."""
    for version in BACKWARD_VERSIONS:
        spec = BY_NAME[backward_names(version, "bf16")[0]]
        skip = version == 9 and not ordered_pays(nk)
        if dtype in _HALF and spec.takes(d, d_v) and spec.runs_on(cc) \
                and not skip:
            return version
    return None


def ordered_pays(nk):
    """Whether backward v9 is the default at nk keys (unknown: None):
    from ORDERED_MIN_KEYS keys on, whatever the heads."""
    return nk is None or nk >= ORDERED_MIN_KEYS


BACKWARD_VERSIONS = (9, 8, 7, 5)  # of the 16-bit backward, newest first
# where version None runs backward v9: measured on the H200 (chapter 12,
# hopper_v9_default_h200.json), a training step's kernels took less time
# with v9 than with v8's two kernels, or as long, at every shape from
# 2048 keys tried (16 to 128 query heads, d = 64 and 128); at 1024 keys
# too, but there the host sets a step's pace, and v9's plan launches two
# more kernels (its counts' zeroing, dQ's rounding). Earlier builds of v9
# were slower with few heads (hopper_whole_tiles_h200.csv)
ORDERED_MIN_KEYS = 2048


def backward_names(version, kind):
    """(dK/dV, dQ) kernel names of 16-bit backward `version` on `kind`
    inputs: v8's dQ kernel is v7's; v9 is one kernel, (fused, None)."""
    if version == 9:
        return f"backward_v9_fused_{kind}", None
    return (f"backward_v{version}_dkv_{kind}",
            f"backward_v{min(version, 7)}_dq_{kind}")


def argument_types(args):
    """numba argument types of argument list `args` (see Kernel.args)."""
    from numba import (
        boolean,
        float32,
        int16,
        int32,
        int64,
        typeof,
        uint8,
        uint32,
        uint64,
    )

    from flashlab.kernel_args import KernelRules

    a3, a2 = float32[:, :, ::1], float32[:, ::1]
    h3, b2 = int16[:, :, ::1], boolean[:, ::1]
    parts = int32[:, :, ::1]  # device.find_bad_parts' words
    bytes3 = uint8[:, :, ::1]  # e4m3 values
    f = float32(0)
    rules = typeof(KernelRules(f, False, 0, -1, -1, False, uint64(0),
                               uint64(0), False, f, f, 1))
    common = (rules, int64[::1], uint8[:, :, ::1])
    lists = {
        "forward": (a3, a3, a3, a3, a2, *common),
        "forward_bad": (a3, a3, a3, a3, a2, parts, *common),
        "forward16": (h3, h3, h3, int32[:, :, ::1], a2, parts, *common),
        # and the TMA tensor maps of q, k, v (forward_v8.tensor_maps)
        "forward16_tma": (h3, h3, h3, int32[:, :, ::1], a2, parts, *common,
                          uint64[::1]),
        # e4m3 q, k, V^T bytes, bf16 pairs out, descale_v, the maps
        "forward8_tma": (bytes3, bytes3, bytes3, int32[:, :, ::1], a2, parts,
                         *common, float32, uint64[::1]),
        "backward_kv": (a3, a3, a3, a3, a2, a2, a3, a3, *common),
        "backward_q": (a3, a3, a3, a3, a2, a2, a3, *common),
        "backward16_dq": (h3, h3, h3, h3, a2, a2, a3, *common),
        "backward16_dkv": (h3, h3, h3, h3, a2, a2, a3, a3, *common),
        # 16-bit pairs out; dK, dV per K/V head (backward_v7)
        "backward16_dq_pairs": (h3, h3, h3, h3, a2, a2, int32[:, :, ::1],
                                *common),
        "backward16_dkv_pairs": (h3, h3, h3, h3, a2, a2, int32[:, :, ::1],
                                 int32[:, :, ::1], *common),
        # and the TMA tensor maps of q, k, v, dO (backward_v8)
        "backward16_dkv_tma": (h3, h3, h3, h3, a2, a2, int32[:, :, ::1],
                               int32[:, :, ::1], *common, uint64[::1]),
        # and dQ, float32, summed into by atomics (backward_v7.make_fused)
        "backward16_fused_pairs": (h3, h3, h3, h3, a2, a2,
                                   int32[:, :, ::1], int32[:, :, ::1], a3,
                                   *common),
        # and the tensor maps of q, k, v, dO, dQ (backward_v8.make_fused)
        "backward16_fused_tma": (h3, h3, h3, h3, a2, a2, int32[:, :, ::1],
                                 int32[:, :, ::1], a3, *common,
                                 uint64[::1]),
        # and the int32 counts of the additions made to each dQ tile
        # (backward_v8.make_ordered)
        "backward16_ordered_tma": (h3, h3, h3, h3, a2, a2,
                                   int32[:, :, ::1], int32[:, :, ::1], a3,
                                   int32[:, ::1], *common, uint64[::1]),
        "combine": (a3, a2, a2, a3, a2, a2, float32),
        "merge_halves": (int32[:, :, ::1], a2, int32[:, :, ::1], a2, int64,
                         float32),
        "row_dot": (a3, a3, a2),
        "norms": (a2, a2, a2),
        "sums": (a2, a2, a2),
        # dO, O as (rows, d_v / 2) pairs, D (rows,)
        "row_dot16": (int32[:, ::1], int32[:, ::1], float32[::1]),
        "find_bad": (a3, b2),
        "find_parts": (int32[:, :, ::1], parts, int64),  # V as words
        "transpose8": (uint32[:, :, ::1], uint32[:, :, ::1]),
        "finish": (a3, a2, b2, b2),
        "row_statistics": (a3, a3, a2, a2, *common),
        "row_statistics16": (h3, h3, a2, a2, *common),
        # row_dot16's, then q, k, and lse, the statistics and the counts
        # by row (BH Nq), (2, BH Nq), (any)
        "prepare16": (int32[:, ::1], int32[:, ::1], float32[::1], h3, h3,
                      float32[::1], a2, int32[::1], *common),
    }
    return lists[args]
