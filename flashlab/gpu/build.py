"""Which kernels exist, how they are compiled, and their PTX without a GPU.

Each kernel comes from a factory `make(D, D_V)` that fixes the head dims
as compile-time constants (so local arrays unroll into registers); built
kernels are cached per (name, D, D_V). `compile_ptx` compiles any of them
for a compute capability on a machine with no GPU. See chapter 9.
"""

import contextlib
import functools

from flashlab.gpu import (
    _numpy_compat,  # noqa: F401  (before compiling)
    backward,
    backward_v5,
    forward_v1,
    forward_v2,
    forward_v3,
    forward_v4,
    forward_v5,
    forward_v6,
)

FACTORIES = {
    "forward_v1": forward_v1.make,
    "forward_v2": forward_v2.make,
    "forward_v3": forward_v3.make,
    "forward_v4": forward_v4.make,
    "forward_v5_bf16": functools.partial(forward_v5.make, kind="bf16"),
    "forward_v5_f16": functools.partial(forward_v5.make, kind="f16"),
    "forward_v6_3xtf32": functools.partial(forward_v6.make,
                                           precision="3xtf32"),
    "forward_v6_tf32": functools.partial(forward_v6.make,
                                         precision="tf32"),
    "backward_kv": backward.make_kv,
    "backward_q": backward.make_q,
    "backward_kv_blocked": backward.make_kv_blocked,
    "backward_q_blocked": backward.make_q_blocked,
    "backward_v5_dq_bf16": functools.partial(backward_v5.make_dq,
                                             kind="bf16"),
    "backward_v5_dq_f16": functools.partial(backward_v5.make_dq, kind="f16"),
    "backward_v5_dkv_bf16": functools.partial(backward_v5.make_dkv,
                                              kind="bf16"),
    "backward_v5_dkv_f16": functools.partial(backward_v5.make_dkv,
                                             kind="f16"),
}
_cache = {}


def kernel(name, d, d_v):
    """The compiled kernel `name` for head dims d, d_v (built once)."""
    key = (name, d, d_v)
    if key not in _cache:
        _cache[key] = FACTORIES[name](d, d_v)
    return _cache[key]


def kernel_names():
    """Every kernel flashlab.gpu can launch."""
    return tuple(FACTORIES)


def supports(name, d, d_v):
    """Whether kernel `name` is built for head dims d, d_v."""
    if name.startswith(("forward_v5", "forward_v6")):
        return d in forward_v5.HEAD_DIMS and d_v in forward_v5.HEAD_DIMS
    if name.startswith("backward_v5"):
        return d in backward_v5.HEAD_DIMS and d_v in backward_v5.HEAD_DIMS
    return (not name.endswith("_blocked")
            or max(d, d_v) <= backward.BLOCKED_MAX_DIM)


def signature(name):
    """Argument types of a kernel, for compiling without a GPU."""
    from numba import (
        boolean,
        float32,
        int16,
        int32,
        int64,
        typeof,
        uint8,
        uint64,
    )

    from flashlab.kernel_args import KernelRules

    a3 = float32[:, :, ::1]
    a2 = float32[:, ::1]
    f = float32(0)
    rules = typeof(KernelRules(f, False, 0, -1, -1, False, uint64(0),
                               uint64(0), False, f, f, 1))
    arrays = {
        "backward_kv": (a3, a3, a3, a3, a2, a2, a3, a3),
        "backward_q": (a3, a3, a3, a3, a2, a2, a3),
    }.get(name.removesuffix("_blocked"), (a3, a3, a3, a3, a2))
    if name.startswith("forward_v5"):  # 16-bit bits in, pairs out
        arrays = (*(int16[:, :, ::1],) * 3, int32[:, :, ::1], a2)
    if name.startswith(("forward_v5", "forward_v6")):  # + bad columns
        arrays = (*arrays, boolean[:, ::1])
    if name.startswith("backward_v5"):  # 16-bit q, k, v, dO in
        grads = (a3,) if "_dq_" in name else (a3, a3)
        arrays = (*(int16[:, :, ::1],) * 4, a2, a2, *grads)
    return (*arrays, rules, int64[::1], uint8[:, :, ::1])


@contextlib.contextmanager
def compiling_without_gpu(cc):
    """Let numba-cuda compile device functions with no GPU present.

    It asks the current device for its compute capability when it
    compiles a device function; a machine without a GPU has none, so for
    the duration it is told `cc` instead.
    """
    from types import SimpleNamespace

    from numba.cuda import dispatcher

    real = dispatcher.get_current_device
    dispatcher.get_current_device = lambda: SimpleNamespace(
        compute_capability=cc)
    try:
        yield
    finally:
        dispatcher.get_current_device = real


def compile_ptx(name, d, d_v, cc=(9, 0)):
    """PTX of kernel `name` for head dims d, d_v; needs no GPU."""
    from numba import cuda

    built = FACTORIES[name](d, d_v)
    with compiling_without_gpu(cc):
        ptx, _ = cuda.compile_ptx(built.py_func, signature(name), cc=cc)
    return ptx
