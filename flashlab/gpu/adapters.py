"""One adapter per kind of array flashlab.gpu takes, chosen once a call.

torch CUDA tensors are used in place, on torch's current stream; numpy
arrays are copied to the device and their results back; numba device
arrays stay where they are. An adapter makes a caller's array into what
a kernel takes (contiguous, (BH, N, d), 16-bit values as int16 bits),
allocates outputs of the caller's kind, and turns a kernel's output back
into the caller's kind and shape; the host code (`flashlab.gpu.host`)
asks it instead of testing types. See chapter 9.
"""

import numpy as np

# 16-bit storage: (exponent bits, a NaN's bits) per dtype name
HALF_BITS = {"bfloat16": (0x7F80, 0x7FC0), "float16": (0x7C00, 0x7E00)}
# outputs whose kernel writes every entry: never poisoned (no NaN fits)
FLAGS = ("uint8", "int32")


def is_torch(x):
    """Whether x is a torch tensor (without importing torch)."""
    return type(x).__module__.startswith("torch")


def dtype_name(x):
    """x's dtype as one name for every kind: "float32", "bfloat16", ..."""
    return str(x.dtype).removeprefix("torch.")


def device_view(tensor):
    """A torch CUDA tensor as a kernel argument: itself for the driver's
    launch path, a numba device array for numba's own launches."""
    from numba import config, cuda

    if config.ENABLE_CUDASIM:
        return cuda.as_cuda_array(tensor, sync=False)
    return tensor


def torch_stream(tensor):
    """torch's current stream on tensor's device, as the kernels take it:
    a raw CUstream for the driver, a numba stream on the simulator."""
    import torch
    from numba import config, cuda

    if config.ENABLE_CUDASIM:
        return cuda.external_stream(
            torch.cuda.current_stream(tensor.device).cuda_stream)
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is None:  # a torch without the fast accessor
        return torch.cuda.current_stream(tensor.device).cuda_stream
    return raw(tensor.device.index)


def stream_reader(tensor):
    """A function of no arguments giving torch_stream(tensor) for any
    tensor on tensor's device: what a prepared call asks each time,
    without the lookups (torch's raw accessor bound to the index)."""
    import torch
    from numba import config, cuda

    device = tensor.device  # not the tensor: the reader outlives it
    if config.ENABLE_CUDASIM:
        return lambda: cuda.external_stream(
            torch.cuda.current_stream(device).cuda_stream)
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is None:  # a torch without the fast accessor
        return lambda: torch.cuda.current_stream(device).cuda_stream
    index = device.index
    return lambda: raw(index)


class TorchArrays:
    """torch CUDA tensors: views in place, outputs on the same device."""

    kind = "torch"

    @staticmethod
    def takes(x):
        """Whether x is of this kind."""
        return is_torch(x)

    @staticmethod
    def check(name, x):
        """Refuse what the kernels cannot read: a tensor not on a GPU."""
        if x.device.type != "cuda":
            raise ValueError(
                f"{name}: expected a CUDA tensor for flashlab.gpu, got one "
                f"on {x.device}")

    def __init__(self, like):
        self.device = like.device
        self.stream = torch_stream(like)

    def to_kernel(self, x, shape):
        """x as (shape), contiguous, 16-bit values as int16 bits, 16-byte
        aligned for cp.async (a view where x allows one)."""
        import torch

        x = x.detach().contiguous().view(shape)
        if dtype_name(x) in HALF_BITS:
            x = x.view(torch.int16)
            if x.data_ptr() % 16:  # an offset view: copy it aligned
                x = x.clone()
        return device_view(x)

    def empty(self, shape, dtype, poison=False):
        """(output, its kernel view): uninitialized, or NaN when poison;
        int16 bits for a 16-bit dtype."""
        import torch

        out = torch.empty(shape, dtype=getattr(torch, dtype),
                          device=self.device)
        if dtype in FLAGS:  # every entry written by its kernel
            return out, device_view(out)
        if poison:
            out.fill_(float("nan"))
        view = out.view(torch.int16) if dtype in HALF_BITS else out
        return out, device_view(view)

    def zeros(self, shape):
        """float32 zeros, which kernels add to (in place: the tensor is
        its own kernel view)."""
        import torch

        return torch.zeros(shape, dtype=torch.float32, device=self.device)

    def counts(self, shape):
        """int32 zeros, counters a kernel adds one to in turn."""
        import torch

        return torch.zeros(shape, dtype=torch.int32, device=self.device)

    def zeros_bool(self, shape):
        """A kernel view of False flags (small: one per column)."""
        import torch

        return device_view(torch.zeros(shape, dtype=torch.bool,
                                       device=self.device))

    def repeat_rows(self, flags, times):
        """Each row of (R, C) kernel flags `times` times: (R times, C)."""
        import torch

        return device_view(torch.as_tensor(
            flags, device=self.device).repeat_interleave(times, 0))

    def group_sum(self, grad, groups, size):
        """(groups size, ...) summed over each run of `size` rows."""
        return grad.view(groups, size, *grad.shape[1:]).sum(1)

    def result(self, out, shape):
        """An output of `empty` in the caller's shape."""
        return out.view(shape)

    @staticmethod
    def widen(x):
        """A float32 copy of x."""
        return x.float()

    @staticmethod
    def narrow(x, like):
        """x in the dtype of `like`."""
        return x.to(like.dtype)


class DeviceArrays:
    """numba device arrays (or others with the CUDA array interface): used
    where they are, outputs numba device arrays."""

    kind = "numba"
    stream = 0  # numba's default stream
    device = None

    @staticmethod
    def takes(x):
        """Whether x is of this kind."""
        return not isinstance(x, np.ndarray) and (
            hasattr(x, "__cuda_array_interface__")
            or hasattr(x, "copy_to_host"))  # the simulator's arrays

    @staticmethod
    def check(name, x):
        """A numba device array is on the device already."""

    def __init__(self, like):
        pass

    def to_kernel(self, x, shape):
        """x as (shape), 16-bit values as int16 bits (numba device arrays
        are contiguous)."""
        x = x.reshape(shape)
        return x.view(np.int16) if dtype_name(x) in HALF_BITS else x

    def empty(self, shape, dtype, poison=False):
        """(output, its kernel view), the same device array: int16 bits
        for a 16-bit dtype; filled with NaN when poison."""
        from numba import cuda

        if dtype in FLAGS:  # every entry written by its kernel
            dev = cuda.device_array(shape, dtype=np.dtype(dtype))
            return dev, dev
        half = dtype in HALF_BITS
        kind = np.int16 if half else np.float32
        if poison:
            fill = np.int16(HALF_BITS[dtype][1]) if half else np.nan
            dev = cuda.to_device(np.full(shape, fill, dtype=kind))
        else:
            dev = cuda.device_array(shape, dtype=kind)
        return dev, dev

    def zeros(self, shape):
        """A device array of float32 zeros, which kernels add to."""
        from numba import cuda

        return cuda.to_device(np.zeros(shape, dtype=np.float32),
                              stream=self.stream)

    def counts(self, shape):
        """A device array of int32 zeros, counters a kernel adds one to in
        turn."""
        from numba import cuda

        return cuda.to_device(np.zeros(shape, dtype=np.int32),
                              stream=self.stream)

    def zeros_bool(self, shape):
        """A device array of False flags (small: one per column)."""
        from numba import cuda

        return cuda.to_device(np.zeros(shape, dtype=np.bool_),
                              stream=self.stream)

    def repeat_rows(self, flags, times):
        """Each row of (R, C) device flags `times` times (a host copy)."""
        from numba import cuda

        return cuda.to_device(np.repeat(flags.copy_to_host(), times, 0))

    def group_sum(self, grad, groups, size):
        """(groups size, ...) summed over each run of `size` rows (on the
        host, then back)."""
        from numba import cuda

        host = grad.copy_to_host()
        return cuda.to_device(
            host.reshape(groups, size, *host.shape[1:]).sum(1))

    def result(self, out, shape):
        """A device output in the caller's shape, int16 bits as float16."""
        if out.dtype == np.int16:
            out = out.view(np.float16)
        return out.reshape(shape)

    @staticmethod
    def widen(x):
        """Not offered: numba device arrays have no dtype conversion."""
        raise TypeError(f"q: expected torch tensors or numpy arrays to "
                        f"widen 16-bit inputs, got {type(x).__name__}")

    @staticmethod
    def narrow(x, like):
        """Not offered, as `widen`."""
        DeviceArrays.widen(x)


class NumpyArrays(DeviceArrays):
    """numpy arrays: copied to the device, results copied back."""

    kind = "numpy"

    @staticmethod
    def takes(x):
        """Whether x is of this kind."""
        return isinstance(x, np.ndarray)

    def to_kernel(self, x, shape):
        """A device copy of x as (shape), 16-bit values as int16 bits."""
        from numba import cuda

        x = np.ascontiguousarray(x).reshape(shape)
        return cuda.to_device(x.view(np.int16) if dtype_name(x)
                              in HALF_BITS else x)

    def result(self, out, shape):
        """A device output copied to the host in the caller's shape."""
        host = out.copy_to_host()
        if host.dtype == np.int16:
            host = host.view(np.float16)
        return host.reshape(shape)

    @staticmethod
    def widen(x):
        """A float32 copy of x."""
        return x.astype(np.float32)

    @staticmethod
    def narrow(x, like):
        """x in the dtype of `like`."""
        return x.astype(like.dtype)


KINDS = (TorchArrays, NumpyArrays, DeviceArrays)


def kind_of(name, x):
    """The adapter class of array x, or a TypeError naming the argument."""
    for kind in KINDS:
        if kind.takes(x) and all(hasattr(x, a)
                                 for a in ("shape", "dtype", "ndim")):
            kind.check(name, x)
            return kind
    raise TypeError(
        f"{name}: expected a torch CUDA tensor, a numba device array or a "
        f"numpy array, got {type(x).__name__}")


def of(name, x):
    """The adapter of one call whose first array is x (argument `name`)."""
    return kind_of(name, x)(x)
