"""flashlab's own launch path: numba compiles, the CUDA driver launches.

numba's dispatcher types every argument of every launch and wraps each
torch tensor in a device array: 44-94 us of host time per launch on the
H200, more than a whole attention call of torch's. Here numba only turns
a kernel into PTX, for the device's exact architecture (sm_90a on
Hopper, so that wgmma, setmaxnreg and TMA assemble); the driver loads it
(`cuModuleLoadData`) and `cuLaunchKernel` starts it on torch's current
stream, from one packed parameter buffer. Three things make a call
cheap:

- `Layout`: numba's kernel ABI worked out once per signature. An array
  argument is (meminfo, parent, nitems, itemsize, data, shape...,
  strides...), a record is its fields in order, scalars keep their
  widths; `ptx_params` reads the same list back from the PTX, and the
  tests check one against the other for every kernel.
- `Packed`: a call's parameter buffer, built once for (kernel, shapes,
  strides, dtypes, rules); a later call of the same shape only writes
  its data pointers (and its dropout seed) into it.
- a disk cache of cubins (PTX assembled by nvJitLink, with the kernel's
  register cap, as numba's own linker does) keyed by the kernel, head
  dims, architecture, the sources it is compiled from and the
  toolchain's versions, so a new process loads modules without compiling
  or assembling anything.

The simulator has no driver: there, `kernel` hands back numba's own
dispatcher, launched the same way (`k[grid, block, stream](*args)`).
See chapter 10.
"""

import ctypes
import hashlib
import os
import re
import struct
import tempfile
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np

from flashlab import ptx as ptx_tool

# struct codes of numba's scalar parameters, by (kind, bytes)
_INT_CODES = {(True, 1): "b", (True, 2): "h", (True, 4): "i",
              (True, 8): "q", (False, 1): "B", (False, 2): "H",
              (False, 4): "I", (False, 8): "Q"}
_FLOAT_CODES = {4: "f", 8: "d"}
# PTX parameter type -> (float?, bytes)
_PTX_KINDS = {"u8": (False, 1), "s8": (False, 1), "b8": (False, 1),
              "u16": (False, 2), "s16": (False, 2), "b16": (False, 2),
              "u32": (False, 4), "s32": (False, 4), "b32": (False, 4),
              "u64": (False, 8), "s64": (False, 8), "b64": (False, 8),
              "f32": (True, 4), "f64": (True, 8)}
ARRAY_FIELDS = 5  # meminfo, parent, nitems, itemsize, data; then dims
DATA_FIELD = 4  # where an array's data pointer sits among its fields


def param_codes(argtypes):
    """struct codes of a kernel's parameters in numba's ABI, flattened:
    per argument a tuple of codes (an array's fields, a record's)."""
    from numba import types

    def flat(ty):
        if isinstance(ty, types.Array):
            return ("Q", "Q", "q", "q", "Q") + ("q",) * (2 * ty.ndim)
        if isinstance(ty, types.BaseTuple):
            return tuple(c for member in ty.types for c in flat(member))
        if isinstance(ty, types.Boolean):
            return ("B",)
        if isinstance(ty, types.Integer):
            return (_INT_CODES[(ty.signed, ty.bitwidth // 8)],)
        if isinstance(ty, types.Float):
            return (_FLOAT_CODES[ty.bitwidth // 8],)
        raise TypeError(f"argtypes: no launch ABI for {ty}")

    return tuple(flat(ty) for ty in argtypes)


def ptx_params(ptx):
    """[(float?, bytes)] of the first kernel entry's parameters in PTX."""
    head = re.search(r"\.entry\s+\S+\s*\((.*?)\)", ptx, re.S)
    if head is None:
        raise ValueError("ptx: expected a .entry (a kernel), found none")
    kinds = re.findall(r"\.param\s+\.(\w+)", head.group(1))
    return [_PTX_KINDS[k] for k in kinds]


def code_kinds(codes):
    """[(float?, bytes)] of flattened struct codes, to compare with PTX."""
    return [(c in "fd", struct.calcsize(c)) for arg in codes for c in arg]


def entry_name(ptx):
    """The mangled name of the first kernel entry in PTX."""
    return re.search(r"\.entry\s+(\S+?)\s*\(", ptx).group(1)


class Layout(NamedTuple):
    """Where every flattened parameter sits in the packed buffer."""

    codes: tuple  # per argument, its struct codes
    fmt: struct.Struct  # the whole buffer, padding included
    starts: tuple  # per argument, the index of its first value
    offsets: tuple  # per flattened value, its byte offset

    @classmethod
    def of(cls, argtypes):
        """The layout of a kernel taking `argtypes` (numba types)."""
        codes = param_codes(argtypes)
        fmt, offsets, starts, at = "<", [], [], 0
        for arg in codes:
            starts.append(len(offsets))
            for c in arg:
                size = struct.calcsize(c)
                pad = -at % size  # each parameter at its natural alignment
                fmt += "x" * pad + c
                at += pad
                offsets.append(at)
                at += size
        # no tail padding: the driver checks the buffer's size against
        # the kernel's parameters (324 bytes is not 328)
        return cls(codes, struct.Struct(fmt), tuple(starts), tuple(offsets))

    def offset(self, arg, field=0):
        """Byte offset of value `field` of argument `arg`."""
        return self.offsets[self.starts[arg] + field]


def array_values(x, ty, name):
    """numba's ABI values of device array x for array type ty, checked."""
    if hasattr(x, "data_ptr"):  # a torch tensor: no interface dict needed
        shape, itemsize = tuple(x.shape), x.element_size()
        strides = tuple(s * itemsize for s in x.stride())
        dtype, ptr = str(x.dtype).removeprefix("torch."), x.data_ptr()
        on_cuda = x.is_cuda
    else:
        face = getattr(x, "__cuda_array_interface__", None)
        if face is None:
            raise TypeError(f"{name}: expected a CUDA array (torch tensor "
                            f"or numba device array), got "
                            f"{type(x).__name__}")
        np_dtype = np.dtype(face["typestr"])
        shape, itemsize = tuple(face["shape"]), np_dtype.itemsize
        strides = face.get("strides") or _c_strides(shape, itemsize)
        dtype, ptr, on_cuda = np_dtype.name, face["data"][0], True
    want = "bool" if str(ty.dtype) == "boolean" else str(ty.dtype)
    if not on_cuda:
        raise ValueError(f"{name}: expected a CUDA array, got one on the "
                         f"host")
    if dtype != want or len(shape) != ty.ndim:
        raise TypeError(f"{name}: expected {ty.ndim}-d {want}, got "
                        f"{len(shape)}-d {dtype}")
    if ty.layout == "C" and strides != _c_strides(shape, itemsize) \
            and int(np.prod(shape)):
        raise ValueError(f"{name}: expected a C-contiguous array, got "
                         f"strides {strides} for shape {shape}")
    return (0, 0, int(np.prod(shape)), itemsize, ptr, *shape, *strides)


def _c_strides(shape, itemsize):
    """Byte strides of a C-contiguous array of `shape`."""
    strides, step = [], itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def flat_values(argtypes, args):
    """The flattened parameter values of one launch, checked."""
    from numba import types

    def flat(ty, x, name):
        if isinstance(ty, types.Array):
            return array_values(x, ty, name)
        if isinstance(ty, types.BaseTuple):
            return tuple(v for i, (t, m) in enumerate(zip(ty.types, x))
                         for v in flat(t, m, f"{name}[{i}]"))
        if isinstance(ty, types.Boolean):
            return (int(bool(x)),)
        if isinstance(ty, types.Integer):
            return (int(x),)
        return (float(x),)

    if len(args) != len(argtypes):
        raise TypeError(f"args: expected {len(argtypes)} kernel arguments,"
                        f" got {len(args)}")
    return tuple(v for i, (ty, x) in enumerate(zip(argtypes, args))
                 for v in flat(ty, x, f"argument {i}"))


class Packed:
    """One launch's parameters packed once; later calls of the same shape
    change only data pointers (`point`) and scalars (`put`).

    Everything a call would otherwise recompute is kept: each pointer's
    offset, the pointers last set, and cuLaunchKernel's leading
    arguments per (grid, block, shared). A call pays a few microseconds
    of Python around the driver's own cost (chapter 12)."""

    def __init__(self, kernel, args):
        self.kernel = kernel
        layout = kernel.layout
        self.buffer = ctypes.create_string_buffer(layout.fmt.size)
        layout.fmt.pack_into(self.buffer, 0,
                             *flat_values(kernel.argtypes, args))
        self._size = ctypes.c_size_t(layout.fmt.size)
        # CU_LAUNCH_PARAM_BUFFER_POINTER, buffer, _BUFFER_SIZE, size, END
        self.extra = (ctypes.c_void_p * 5)(
            1, ctypes.addressof(self.buffer), 2,
            ctypes.addressof(self._size), 0)
        # the buffer as 64-bit words: a data pointer sits at its natural
        # alignment, so writing one is a single store into one word
        self.words = (ctypes.c_uint64 * (layout.fmt.size // 8)).from_buffer(
            self.buffer)
        self._slots = {}  # argument -> the word of its data pointer
        self._configs = {}  # (grid, block, shared) -> leading arguments
        self.memo = {}  # what a Derived update keeps for this buffer

    def read(self, arg, field):
        """Value `field` of argument `arg` as packed (an int)."""
        code = self.kernel.layout.codes[arg][field]
        return struct.unpack_from("<" + code, self.buffer,
                                  self.kernel.layout.offset(arg, field))[0]

    def point(self, arg, ptr):
        """Set the data pointer of array argument `arg`."""
        at = self._slots.get(arg)
        if at is None:
            at = self._slots[arg] = self.slot(arg)
        self.words[at] = ptr

    def slot(self, arg):
        """The index in `words` of array argument `arg`'s data pointer:
        a plan writes `words[slot] = ptr` with no call in between."""
        at = self.kernel.layout.offset(arg, DATA_FIELD)
        if at % 8:  # numba's array fields are 8-byte: never, unless the
            # ABI changes under us
            raise ValueError(f"arg: {arg} is not an array argument")
        return at // 8

    def pointer(self, arg):
        """The data pointer of array argument `arg`, as packed."""
        at = self._slots.get(arg)
        if at is None:
            at = self._slots[arg] = self.slot(arg)
        return self.words[at]

    def put(self, arg, field, code, value):
        """Set value `field` (struct code `code`) of argument `arg`."""
        struct.pack_into("<" + code, self.buffer,
                         self.kernel.layout.offset(arg, field), value)

    def launch(self, grid, block, stream, shared=None):
        """cuLaunchKernel on `stream` (a CUstream handle as an int), with
        the kernel's dynamic shared memory unless `shared` says."""
        kernel = self.kernel
        shared = kernel.shared if shared is None else shared
        try:
            head = self._configs.get((grid, block, shared))
        except TypeError:  # a list for a grid or block: not a key
            grid = tuple(grid)
            block = block if isinstance(block, int) else tuple(block)
            head = self._configs.get((grid, block, shared))
        if head is None:
            gx, gy, gz = (tuple(grid) + (1, 1))[:3]
            bx, by, bz = (((block,) if isinstance(block, int) else
                           tuple(block)) + (1, 1))[:3]
            head = self._configs[(grid, block, shared)] = (
                kernel.handle, gx, gy, gz, bx, by, bz, shared)
        if kernel.derived is not None:
            kernel.derived.update(self, stream)
        err = _cuda().cuLaunchKernel(*head, stream, None, self.extra)
        if err:
            raise RuntimeError(f"cuLaunchKernel of {kernel.name}: "
                               f"{result_name(err)}")


def result_name(err):
    """A CUresult as its name and number ("CUDA_ERROR_OUT_OF_MEMORY
    (2)"), or "CUresult N" for a number cuda.bindings does not know: the
    name says which failure it was (a sticky fault of an earlier kernel,
    700, or memory a launch could not get, 2)."""
    try:
        from cuda.bindings import driver

        return f"{driver.CUresult(err).name} ({err})"
    except (ImportError, ValueError):
        return f"CUresult {err}"


class Derived(NamedTuple):
    """Trailing kernel arguments that the kernel's launches compute from
    the caller's (forward_v8's tensor maps, from q, k and v): callers
    pass the others, as to any kernel."""

    placeholders: Callable  # () -> values to pack until the first update
    update: Callable  # (packed, stream) -> None, before every launch


class DriverKernel:
    """A kernel loaded through the driver, launched like numba's:
    k[grid, block, stream](*args), or through a reused `Packed`."""

    def __init__(self, name, handle, argtypes, module):
        self.name, self.handle, self.module = name, handle, module
        self.argtypes = tuple(argtypes)
        self.layout = Layout.of(argtypes)
        self.shared = 0  # dynamic shared memory bytes per block
        self.derived = None  # a Derived: trailing arguments of its own

    def use_shared(self, nbytes):
        """Launch with nbytes of dynamic shared memory per block, allowed
        past the 48 KB default (cuFuncSetAttribute)."""
        from cuda.bindings import driver

        err, = driver.cuFuncSetAttribute(
            driver.CUfunction(self.handle),
            driver.CUfunction_attribute
            .CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes)
        if int(err):
            raise RuntimeError(f"{self.name} cannot have {nbytes} bytes "
                               f"of shared memory per block: {err}")
        self.shared = nbytes

    def pack(self, *args):
        """A `Packed` buffer for these arguments (and the derived ones)."""
        if self.derived is not None:
            args = (*args, *self.derived.placeholders())
        return Packed(self, args)

    def resources(self):
        """{"regs", "local", "shared"}: registers and local (spilled)
        bytes per thread, static shared bytes per block, as the driver
        assembled this kernel for the device."""
        from cuda.bindings import driver

        attribute = driver.CUfunction_attribute
        out = {}
        for key, which in (
                ("regs", attribute.CU_FUNC_ATTRIBUTE_NUM_REGS),
                ("local", attribute.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES),
                ("shared", attribute.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)):
            err, value = driver.cuFuncGetAttribute(
                which, driver.CUfunction(self.handle))
            out[key] = int(value)
        return out

    def __getitem__(self, config):
        grid, block, stream = (tuple(config) + (0,))[:3]
        handle = stream_handle(stream)

        def run(*args):
            self.pack(*args).launch(
                grid if isinstance(grid, tuple) else (grid,), block,
                handle)

        return run


def stream_handle(stream):
    """The CUstream of a numba stream, a torch stream, or an int."""
    if isinstance(stream, int):
        return stream
    for attribute in ("cuda_stream", "handle"):
        value = getattr(stream, attribute, None)
        if value is not None:
            return int(getattr(value, "value", value) or 0)
    return 0


_libcuda = None


def _cuda():
    """libcuda through ctypes: the hot call pays no wrapper's costs."""
    global _libcuda
    if _libcuda is None:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuLaunchKernel.restype = ctypes.c_int
        lib.cuLaunchKernel.argtypes = (
            ctypes.c_void_p, *(ctypes.c_uint,) * 7, ctypes.c_void_p,
            ctypes.c_void_p, ctypes.c_void_p)
        _libcuda = lib
    return _libcuda


def target(cc):
    """The compile target for compute capability cc: Hopper (9, 0) gets
    the architecture-specific (9, 0, "a"), whose PTX may hold wgmma and
    setmaxnreg; any other cc is itself."""
    cc = tuple(cc)
    return (9, 0, "a") if cc[:2] == (9, 0) else cc[:2]


def arch_name(cc):
    """sm_90a, sm_80, ... for a compile target."""
    return "sm_" + "".join(str(c) for c in cc)


_SOURCES = ("gpu", "merge.py", "masks.py", "dropout.py", "nonfinite.py",
            "fragments.py", "kernel_args.py", "ptx.py")


def source_hash():
    """Hash of every source a kernel is compiled from (flashlab.gpu and
    the modules whose functions it compiles) and of the toolchain."""
    import llvmlite
    import numba

    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for part in _SOURCES:
        path = root / part
        for f in sorted(path.glob("*.py")) if path.is_dir() else [path]:
            digest.update(f.name.encode() + f.read_bytes())
    versions = [numba.__version__, llvmlite.__version__,
                _version("numba-cuda"), _version("cuda-bindings"),
                _version("cuda-core"), _version("nvidia-nvjitlink"),
                _version("nvidia-cuda-nvcc")]
    digest.update(" ".join(versions).encode())
    return digest.hexdigest()[:16]


def _version(dist):
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "none"


def cache_dir():
    """Where assembled kernels are kept: $FLASHLAB_CACHE_DIR, else
    ~/.cache/flashlab/kernels."""
    base = os.environ.get("FLASHLAB_CACHE_DIR")
    if base:
        return Path(base)
    return Path.home() / ".cache" / "flashlab" / "kernels"


WHOLE_PROGRAM = True  # sm_90a by ptxas; False: nvJitLink (for comparison)


def assemble(ptx, cc, max_registers=None):
    """A cubin of PTX text for target cc, registers capped at
    max_registers: by nvJitLink (cuda.core's Linker, numba's own), and
    for an architecture-specific target (sm_90a) by ptxas itself.

    nvJitLink assembles PTX as relocatable code, and in relocatable code
    ptxas serializes every wgmma (it waits for each product at once, its
    warning C7509 says); assembled whole, the products stay asynchronous.
    """
    if len(cc) > 2 and WHOLE_PROGRAM and ptx_tool.ptxas() is not None:
        return ptx_tool.cubin(ptx, cc, max_registers)[0]
    from cuda.core import Linker, LinkerOptions, ObjectCode

    options = LinkerOptions(arch=arch_name(cc),
                            max_register_count=max_registers)
    return bytes(Linker(ObjectCode.from_ptx(ptx.encode()),
                        options=options).link("cubin").code)


def cached_module(name, d, d_v, cc, compile_fn, max_registers=None,
                  fresh=False):
    """(cubin, entry name) of (name, d, d_v) for target cc from the disk
    cache; on a miss, or `fresh`, compile_fn() gives the PTX, assembled
    and stored.

    Entry and cubin are one file: numba's mangled names differ from one
    process to the next, and two files, each replaced on its own by
    processes compiling at once (pytest -n), could pair one process's
    cubin with another's entry name."""
    key = (f"{name}-{d}-{d_v}-{arch_name(cc)}-{max_registers}-"
           f"{source_hash()}")
    path = cache_dir() / f"{key}.kernel"
    if path.exists() and not fresh:
        entry, _, cubin = path.read_bytes().partition(b"\n")
        if cubin:
            return cubin, entry.decode()
    ptx = compile_fn()
    found = assemble(ptx, cc, max_registers), entry_name(ptx)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, delete=False,
                                         suffix=".tmp") as tmp:
            tmp.write(found[1].encode() + b"\n" + found[0])
        os.replace(tmp.name, path)  # atomic: no one sees half of it
    except OSError:
        pass  # a read-only home only costs the next process a compile
    return found


def load(image, entry, name, argtypes):
    """A DriverKernel from a cubin (or PTX text) and its entry's name,
    loaded into the current context."""
    from cuda.bindings import driver

    _ensure_context()
    if isinstance(image, str):
        image = image.encode() + b"\0"
    err, module = driver.cuModuleLoadData(image)
    if int(err):
        raise RuntimeError(f"cuModuleLoadData of {name}: {err}")
    err, fn = driver.cuModuleGetFunction(module, entry.encode())
    if int(err):
        raise RuntimeError(f"cuModuleGetFunction of {name}: {err}")
    return DriverKernel(name, int(fn), argtypes, module)


def _ensure_context():
    """Make the primary context current (torch's, numba's: the same)."""
    from numba import cuda

    cuda.current_context()


def device_cc():
    """Compute capability of the current device."""
    from numba import cuda

    return tuple(cuda.get_current_device().compute_capability)
