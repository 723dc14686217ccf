"""How kernels are built, compiled and loaded, and their PTX without a GPU.

Each kernel comes from a factory `make(D, D_V)` (flashlab.gpu.registry)
that fixes the head dims as compile-time constants, so local arrays
unroll into registers. On a GPU, `kernel` compiles it to PTX for the
device's own architecture and loads it through the driver
(flashlab.gpu.launch); on numba's simulator it is numba's dispatcher.
`compile_ptx` compiles any kernel for any compute capability on a
machine with no GPU. See chapters 9 and 10.
"""

import contextlib

from flashlab.gpu import launch, registry, traits

# name -> factory, for readers of the kernels (registry holds the facts)
FACTORIES = {k.name: k.make for k in registry.KERNELS}
_cache = {}


def kernel(name, d, d_v):
    """Kernel `name` for head dims d, d_v, ready to launch (built once):
    k[grid, block, stream](*args) on a GPU or the simulator alike."""
    key = (name, d, d_v)
    if key not in _cache:
        from numba import config

        if config.ENABLE_CUDASIM:
            _cache[key] = registry.get(name).make(d, d_v)
        else:
            _cache[key] = load(name, d, d_v)
    return _cache[key]


def load(name, d, d_v, cc=None):
    """Kernel `name` compiled for the current device (or cc) and loaded
    by the driver: a launch.DriverKernel."""
    cc = launch.target(cc or launch.device_cc())
    spec = registry.get(name)
    if not spec.runs_on(cc):
        raise ValueError(
            f"name: {name} needs compute capability {spec.min_cc} or "
            f"newer; this device has {cc[:2]}")
    def module(fresh):
        return launch.cached_module(
            name, d, d_v, cc, lambda: compile_ptx(name, d, d_v, cc),
            spec.registers(d, d_v), fresh)

    try:
        loaded = launch.load(*module(False), name, signature(name))
    except RuntimeError:
        # a stored image the driver refuses (damaged, or not this
        # kernel's) would fail every later process too: compiled again,
        # it replaces the stored one
        loaded = launch.load(*module(True), name, signature(name))
    dynamic = traits.traits(name, d, d_v).dynamic_shared
    if dynamic:
        loaded.use_shared(dynamic)
    if spec.derived is not None:
        loaded.derived = spec.derived(d, d_v)
    return loaded


def kernel_names():
    """Every attention kernel flashlab.gpu can launch (not the helpers)."""
    return tuple(k.name for k in registry.KERNELS if not k.helper)


def supports(name, d, d_v):
    """Whether kernel `name` is built for head dims d, d_v."""
    return registry.get(name).takes(d, d_v)


def signature(name):
    """Argument types of a kernel (numba types), for compiling and for
    packing its launches."""
    return registry.argument_types(registry.get(name).args)


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
        compute_capability=tuple(cc)[:2])
    try:
        yield
    finally:
        dispatcher.get_current_device = real


def compile_ptx(name, d, d_v, cc=(9, 0)):
    """PTX of kernel `name` for head dims d, d_v and target cc (a
    compute capability, or (9, 0, "a") for Hopper's own instructions);
    needs no GPU. A register cap is the assembler's option (`load`)."""
    from numba import cuda

    built = registry.get(name).make(d, d_v)
    with compiling_without_gpu(cc):
        ptx, _ = cuda.compile_ptx(built.py_func, signature(name),
                                  cc=tuple(cc))
    return ptx
