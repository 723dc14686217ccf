"""flashlab.gpu.adapters: each kind of array makes the round trip to a
kernel's view and back with its shape, dtype and values, outputs come in
the caller's kind, and what no adapter takes is refused by name."""

import numpy as np
import pytest
from conftest import SIMULATOR

from flashlab import gpu, reference
from flashlab.gpu import adapters


def host(x):
    """A device or host array's values on the host."""
    return x if isinstance(x, np.ndarray) else x.copy_to_host()


@pytest.fixture(params=["numpy", "numba"])
def kind(request):
    """Make numpy arrays into arrays of one kind."""
    from numba import cuda

    if request.param == "numpy":
        return lambda x: x
    return lambda x: cuda.to_device(np.ascontiguousarray(x))


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_round_trip_keeps_shape_dtype_and_values(rng, kind, dtype):
    # a strided view (heads transposed out of one array) where the kind
    # allows one: the kernel gets it contiguous, 16-bit values as bits
    x = rng.standard_normal((2, 7, 3, 16)).astype(dtype).transpose(0, 2, 1,
                                                                   3)
    arrays = adapters.of("q", kind(x))
    assert arrays.kind == ("numpy" if isinstance(kind(x), np.ndarray)
                           else "numba")
    view = arrays.to_kernel(kind(x), (6, 7, 16))
    assert view.shape == (6, 7, 16)
    assert view.dtype == (np.int16 if dtype == np.float16 else np.float32)
    size = view.dtype.itemsize
    assert host(view).strides == (7 * 16 * size, 16 * size, size)
    back = host(arrays.result(view, x.shape))
    assert back.shape == x.shape and back.dtype == dtype
    assert back.flags.c_contiguous
    assert np.array_equal(back, x)  # bits, not values near them


@pytest.mark.parametrize("dtype", ["float32", "float16", "uint8", "int32"])
def test_outputs_are_of_the_callers_kind(rng, kind, dtype):
    like = kind(rng.standard_normal((2, 3)).astype(np.float32))
    arrays = adapters.of("q", like)
    out, view = arrays.empty((4, 5), dtype)
    width = {"float32": np.float32, "float16": np.int16, "uint8": np.uint8,
             "int32": np.int32}
    assert view.shape == (4, 5) and view.dtype == width[dtype]
    poisoned = arrays.empty((4, 5), dtype, poison=True)[0]
    result = host(arrays.result(poisoned, (2, 10)))
    assert result.shape == (2, 10)
    if dtype not in adapters.FLAGS:  # written whole by their kernel
        assert result.dtype == np.dtype(dtype) and np.isnan(result).all()
    flags = arrays.zeros_bool((3, 8))
    assert host(flags).dtype == np.bool_ and not host(flags).any()


def test_group_sum_and_repeat_rows_match_numpy(rng, kind):
    from numba import cuda

    arrays = adapters.of("q", kind(np.zeros((1, 1), np.float32)))
    grad = rng.standard_normal((6, 5, 4)).astype(np.float32)
    total = host(arrays.group_sum(cuda.to_device(grad), 2, 3))
    want = grad.reshape(2, 3, 5, 4).sum(1)
    # float32 sums of 3 terms in either order: within 2 roundings
    assert np.max(np.abs(total - want)) <= 2 * np.finfo(np.float32).eps * (
        np.abs(grad).reshape(2, 3, 5, 4).sum(1).max())
    flags = rng.random((2, 8)) < 0.5
    rows = host(arrays.repeat_rows(cuda.to_device(flags), 3))
    assert np.array_equal(rows, np.repeat(flags, 3, 0))


def test_widening_is_offered_where_the_kind_converts(rng):
    x = rng.standard_normal((3, 4)).astype(np.float16)
    numpy_kind = adapters.kind_of("q", x)
    wide = numpy_kind.widen(x)
    assert wide.dtype == np.float32 and np.array_equal(wide, x)
    assert numpy_kind.narrow(wide, x).dtype == np.float16
    from numba import cuda

    device_kind = adapters.kind_of("q", cuda.to_device(x))
    with pytest.raises(TypeError, match="q: expected torch tensors or "
                                        "numpy arrays"):
        device_kind.widen(cuda.to_device(x))


def test_what_no_adapter_takes_is_refused_by_name(rng):
    import torch

    with pytest.raises(TypeError, match="k: expected a torch CUDA tensor, "
                                        "a numba device array or a numpy "
                                        "array, got list"):
        adapters.of("k", [[1.0]])
    with pytest.raises(ValueError, match="v: expected a CUDA tensor for "
                                         "flashlab.gpu, got one on cpu"):
        adapters.of("v", torch.zeros(2, 3))
    q = rng.standard_normal((1, 9, 16)).astype(np.float32)
    from numba import cuda

    with pytest.raises(TypeError, match="k: expected numpy arrays as q, "
                                        "got DeviceNDArray|k: expected "
                                        "numpy arrays as q, got Fake"):
        gpu.attention(q, cuda.to_device(q), q)


@pytest.mark.skipif(not SIMULATOR, reason="simulator sizes; see -m gpu")
def test_a_call_chooses_its_adapter_once(rng, monkeypatch):
    # numpy inputs: the simulator's device arrays take no negative index
    # into their shape, which the host's checks use (q.shape[-1])
    chosen = []
    real = adapters.of
    monkeypatch.setattr(adapters, "of",
                        lambda name, x: chosen.append(name) or real(name, x))
    q, k, v = (rng.standard_normal((1, 2, 9, 16)).astype(np.float32)
               for _ in range(3))
    o = gpu.attention(q, k, v, version=3)
    assert chosen == ["q"]
    want = reference.attention(*(x.astype(np.float64) for x in (q, k, v)))
    # float32 kernel against float64: a few roundings of values below 4
    assert np.max(np.abs(host(o) - want)) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torch_round_trip_in_place_and_aligned(dtype):
    import torch

    x = torch.randn(2, 3, 33, 64, device="cuda").to(getattr(torch, dtype))
    arrays = adapters.of("q", x)
    assert arrays.kind == "torch" and arrays.device == x.device
    view = arrays.to_kernel(x, (6, 33, 64))
    assert tuple(view.shape) == (6, 33, 64)
    if dtype == "float32":  # a view of x itself, no copy
        assert view.data_ptr() == x.data_ptr()
    else:  # its bits, as int16
        assert view.dtype == torch.int16
        assert torch.equal(view.view(x.dtype).view(x.shape), x)
    # a view starting 2 bytes in: copied to a 16-byte-aligned start
    offset = x.reshape(-1)[1:1 + 6 * (33 * 64 - 64)].view(6, 33 * 64 - 64)
    if dtype == "bfloat16":
        assert arrays.to_kernel(offset, offset.shape).data_ptr() % 16 == 0
    out, out_view = arrays.empty((6, 33, 64), dtype, poison=True)
    assert out.dtype == x.dtype and torch.isnan(out).all()
    back = arrays.result(out, (2, 3, 33, 64))
    assert tuple(back.shape) == (2, 3, 33, 64) and back.is_contiguous()
    assert back.data_ptr() == out.data_ptr()  # in place


def test_a_stream_reader_keeps_no_tensor_alive():
    # a plan keeps its reader as long as it lives: holding the first
    # call's tensor would keep its memory too
    import gc
    import weakref

    torch = pytest.importorskip("torch")
    device = "cuda" if torch.cuda.is_available() and not SIMULATOR \
        else "cpu"
    x = torch.zeros(4, device=device)
    gone = weakref.ref(x)
    reader = adapters.stream_reader(x)
    if device == "cuda":  # torch's stream, as a raw handle
        assert reader() == adapters.torch_stream(x)
    del x
    gc.collect()
    assert gone() is None
    assert callable(reader)
