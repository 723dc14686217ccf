"""The launch path without a GPU: the packed parameters against each
kernel's PTX, the per-architecture table against ptxas, the disk cache,
and the version a device of each compute capability gets."""

import itertools
import struct

import numpy as np
import pytest

from flashlab import gpu, ptx
from flashlab.gpu import build, launch, registry


class FakeDeviceArray:
    """Just enough of a device array for the packer: its interface."""

    def __init__(self, shape, dtype, ptr, strides=None):
        self.__cuda_array_interface__ = {
            "shape": shape, "typestr": np.dtype(dtype).str,
            "data": (ptr, False), "strides": strides, "version": 3}


@pytest.fixture(scope="module")
def arch():
    return ptx.run_report(what="--arch")


def test_every_kernel_packs_as_its_ptx_declares():
    report = ptx.run_report(only=("forward_v5_bf16", "forward_v3",
                                  "backward_v5_dkv_f16", "combine"))
    assert report and all(r["abi"] for k, r in report.items()
                          if not k.startswith("demo")), report


def test_arch_table_is_what_ptxas_assembles(arch):
    # every kernel the registry says a GPU runs assembles for it, and
    # every one it refuses does not: the tensor-core kernels need 8.0
    for spec in registry.KERNELS:
        for cc, _ in registry.ARCHITECTURES:
            assert arch[spec.name][f"{cc[0]}.{cc[1]}"] == spec.runs_on(cc), (
                spec.name, cc)
    assert not arch["forward_v5_bf16"]["7.5"]
    assert arch["forward_v5_bf16"]["9.0"]


@pytest.mark.parametrize("cc, dtype, d, want", [
    ((7, 5), "float32", 64, 3), ((7, 5), "bfloat16", 64, None),
    ((8, 0), "float32", 64, 6), ((8, 0), "float32", 96, 3),
    ((8, 6), "float16", 128, 5), ((8, 9), "bfloat16", 64, 5),
    ((9, 0), "bfloat16", 128, 8), ((9, 0), "float16", 64, 8),
    ((9, 0), "float32", 64, 6), ((9, 0), "bfloat16", 32, None),
])
def test_best_version_per_gpu(cc, dtype, d, want):
    assert registry.best_version(dtype, d, d, cc) == want


def test_explicit_version_the_gpu_cannot_run_is_refused(monkeypatch):
    from numba import config

    monkeypatch.setattr(config, "ENABLE_CUDASIM", False)
    monkeypatch.setattr(launch, "device_cc", lambda: (7, 5))
    with pytest.raises(ValueError, match=r"version: v5 needs compute "
                                         r"capability 8\.0 .* 7\.5"):
        gpu._check_version(5, "bfloat16", 64, 64)
    assert gpu._check_version(3, "float32", 64, 64) == 3
    # 16-bit inputs on a T4: None, which attention widens to float32
    assert gpu._check_version(None, "bfloat16", 64, 64) is None


def test_hopper_compiles_for_sm90a():
    assert launch.target((9, 0)) == (9, 0, "a")
    assert launch.target((8, 6)) == (8, 6)
    assert launch.arch_name((9, 0, "a")) == "sm_90a"


def test_layout_aligns_every_parameter():
    from numba import boolean, float32, int16, int64, uint8

    layout = launch.Layout.of((int16[:, ::1], boolean, float32, int64,
                               uint8))
    # array: 5 fields and 2 + 2 dims, 8-byte values from offset 0
    assert layout.offsets[:9] == tuple(range(0, 72, 8))
    bool_at, f32_at, i64_at, u8_at = layout.offsets[9:]
    assert (bool_at, f32_at, i64_at, u8_at) == (72, 76, 80, 88)
    assert layout.fmt.size == 89  # no tail padding: the driver checks


def test_packed_buffer_holds_numba_abi_and_points_only_data(rng):
    from numba import float32, int64

    argtypes = (float32[:, :, ::1], int64, float32)
    kernel = launch.DriverKernel("k", 0, argtypes, None)
    x = FakeDeviceArray((2, 3, 4), np.float32, 0xABC0)
    packed = kernel.pack(x, 7, np.float32(0.5))
    raw = kernel.layout.fmt.unpack(packed.buffer.raw)
    assert raw == (0, 0, 24, 4, 0xABC0, 2, 3, 4, 48, 16, 4, 7, 0.5)
    packed.point(0, 0xDEF0)
    again = kernel.layout.fmt.unpack(packed.buffer.raw)
    assert again == raw[:4] + (0xDEF0,) + raw[5:]
    packed.put(1, 0, "q", -3)
    assert kernel.layout.fmt.unpack(packed.buffer.raw)[11] == -3


def test_packer_refuses_wrong_arrays_by_name():
    from numba import float32

    kernel = launch.DriverKernel("k", 0, (float32[:, ::1],), None)
    with pytest.raises(TypeError, match="argument 0: expected 2-d "
                                        "float32, got 2-d int16"):
        kernel.pack(FakeDeviceArray((2, 2), np.int16, 16))
    with pytest.raises(ValueError, match="argument 0: expected a "
                                         "C-contiguous array"):
        kernel.pack(FakeDeviceArray((2, 2), np.float32, 16, (4, 8)))
    with pytest.raises(TypeError, match="args: expected 1 kernel"):
        kernel.pack()
    with pytest.raises(TypeError, match="argument 0: expected a CUDA "
                                        "array"):
        kernel.pack(np.zeros((2, 2), np.float32))


def test_register_cap_is_the_assemblers():
    # v3's cap reaches nvJitLink, as numba's own launches pass it: the
    # cubins with and without a cap differ
    assert registry.get("forward_v3").max_registers == 128
    ptx = ptx_in_fresh_process("forward_v3", 128, 128, "9.0a")
    capped = launch.assemble(ptx, (9, 0, "a"), 96)
    free = launch.assemble(ptx, (9, 0, "a"))
    assert capped[:4] == free[:4] == b"\x7fELF" and capped != free


def ptx_in_fresh_process(name, d, d_v, arch):
    """PTX of a kernel compiled without the simulator (a new process:
    numba reads NUMBA_ENABLE_CUDASIM once)."""
    import os
    import subprocess
    import sys

    cc = "(9, 0, 'a')" if arch == "9.0a" else arch
    code = ("from flashlab.gpu import build; print(build.compile_ptx("
            f"{name!r}, {d}, {d_v}, {cc}))")
    env = {k: v for k, v in os.environ.items()
           if k != "NUMBA_ENABLE_CUDASIM"}
    return subprocess.run([sys.executable, "-c", code], env=env,
                          capture_output=True, text=True,
                          check=True).stdout


def test_disk_cache_holds_cubins_keyed_by_target(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHLAB_CACHE_DIR", str(tmp_path))
    ptx = ptx_in_fresh_process("row_dot", 0, 0, "9.0a")
    made = []

    def compile_once():
        made.append(1)
        return ptx

    for _ in range(2):
        cubin, entry = launch.cached_module("row_dot", 0, 0, (9, 0, "a"),
                                            compile_once)
    assert cubin[:4] == b"\x7fELF" and entry == launch.entry_name(ptx)
    ptx = ptx_in_fresh_process("row_dot", 0, 0, "(8, 0)")
    launch.cached_module("row_dot", 0, 0, (8, 0), compile_once)
    assert len(made) == 2  # once per target, then read back
    names = sorted(p.name for p in tmp_path.iterdir())
    assert any("sm_90a" in n for n in names) and any(
        "sm_80" in n for n in names)
    assert all(launch.source_hash() in n for n in names)


def test_disk_cache_never_pairs_one_compile_with_another(tmp_path,
                                                        monkeypatch):
    # processes that miss the cache at once each compile and store the
    # kernel, and numba's mangled entry names differ between them: what
    # any of them reads back is one compile's cubin with its own entry
    import threading

    monkeypatch.setenv("FLASHLAB_CACHE_DIR", str(tmp_path))
    writers = 8
    together = threading.Barrier(writers)

    def assemble(ptx, cc, max_registers=None):
        together.wait()  # every writer has missed before any stores
        return f"cubin of {launch.entry_name(ptx)}".encode() * 1000

    monkeypatch.setattr(launch, "assemble", assemble)
    got = []

    def compile_and_store(n):
        got.append(launch.cached_module(
            "row_dot", 0, 0, (9, 0, "a"),
            lambda: f".entry _Z7row_dot{n}$ (\n"))

    threads = [threading.Thread(target=compile_and_store, args=(n,))
               for n in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got.append(launch.cached_module("row_dot", 0, 0, (9, 0, "a"),
                                    lambda: pytest.fail("compiled again")))
    assert len(got) == writers + 1
    for cubin, entry in got:
        assert cubin == f"cubin of {entry}".encode() * 1000
    assert len({entry for _, entry in got[:-1]}) == writers
    assert [p.suffix for p in tmp_path.iterdir()] == [".kernel"]


def test_a_stored_kernel_the_driver_refuses_is_compiled_again(
        tmp_path, monkeypatch):
    # a damaged or foreign image in the cache: build.load compiles the
    # kernel again and replaces it, rather than failing in every process
    monkeypatch.setenv("FLASHLAB_CACHE_DIR", str(tmp_path))
    made = []

    def compile_ptx(name, d, d_v, cc):
        made.append(name)
        return f".entry _Z{len(made)}{name} (\n"

    def assemble(ptx, cc, max_registers=None):
        return f"cubin of {launch.entry_name(ptx)}".encode()

    def load(cubin, entry, name, argtypes):
        if cubin != f"cubin of {entry}".encode():
            raise RuntimeError(f"cuModuleGetFunction of {name}")
        return launch.DriverKernel(name, 1, argtypes, None)

    monkeypatch.setattr(build, "compile_ptx", compile_ptx)
    monkeypatch.setattr(launch, "assemble", assemble)
    monkeypatch.setattr(launch, "load", load)
    cc = (9, 0, "a")
    build.load("row_dot", 0, 0, cc)  # compiled and stored
    (path,) = tmp_path.iterdir()
    path.write_bytes(b"_Zother\n" + b"cubin of _Z1row_dot")  # torn
    build.load("row_dot", 0, 0, cc)  # refused, so compiled again
    assert len(made) == 2
    entry, _, cubin = path.read_bytes().partition(b"\n")
    assert cubin == b"cubin of " + entry  # the stored pair replaced
    build.load("row_dot", 0, 0, cc)  # and read back as it is
    assert len(made) == 2


def test_registry_is_the_one_list():
    assert set(build.FACTORIES) == set(registry.BY_NAME)
    assert set(gpu.kernel_names()) == {k.name for k in registry.KERNELS
                                       if not k.helper}
    assert gpu.VERSIONS == registry.versions()
    assert gpu.HALF_VERSIONS == (5, 7, 8) and 6 in gpu.FLOAT32_VERSIONS
    with pytest.raises(ValueError, match="name: expected one of"):
        registry.get("forward_v9")


def test_ptx_params_reads_the_entry():
    text = (".visible .entry k(\n .param .u64 a,\n .param .u8 b,\n"
            " .param .f32 c\n)\n{")
    assert launch.ptx_params(text) == [(False, 8), (False, 1), (True, 4)]
    assert launch.code_kinds((("Q", "B"), ("f",))) == [
        (False, 8), (False, 1), (True, 4)]
    assert struct.calcsize("<Q") == 8


def test_plan_keys_hold_what_the_checks_read(monkeypatch):
    # host._fast_key on CPU tensors (the properties it reads are the same
    # as on CUDA ones), as off the simulator: equal calls share a key,
    # any difference in shape, dtype, choice or option gives another, and
    # what a plan cannot run gets none
    import torch

    from flashlab.gpu import host

    monkeypatch.setattr(host.config, "ENABLE_CUDASIM", False)

    def options(**kw):
        return dict(dict(block_q=None, block_k=None, scale=None,
                         causal=False, mask=None, window=None,
                         kv_lengths=None, dropout_p=0.0, align=None), **kw)

    def tensors(n=128, dtype=torch.bfloat16):
        return [torch.zeros(1, 4, n, 64, dtype=dtype) for _ in range(3)]

    q, k, v = tensors()
    key = host._fast_key(q, k, v, ("forward",), options())
    assert key is not None and hash(key) is not None
    assert host._fast_key(*tensors(), ("forward",), options()) == key
    different = [
        host._fast_key(*tensors(n=129), ("forward",), options()),
        host._fast_key(*tensors(dtype=torch.float16), ("forward",),
                       options()),
        host._fast_key(q, k, v, ("backward",), options()),
        host._fast_key(q, k, v, ("forward",), options(causal=True)),
        host._fast_key(q, k, v, ("forward",), options(window=[8, 0])),
        host._fast_key(q, k, v, ("forward",), options(scale=0.5)),
        host._fast_key(q, k, v, ("forward",), options(dropout_p=0.1)),
        host._fast_key(q, k, v, ("backward",), options(),
                       saved=(q, q[..., 0].float(), q)),
    ]
    assert None not in different
    assert len({key, *different}) == len(different) + 1
    # a strided view has a plan (copied per call); a misaligned
    # contiguous one, an empty one, a mask, padding, numpy input or an
    # unhashable option have none
    strided = q.transpose(1, 2)
    assert host._fast_key(strided, strided, strided, ("f",),
                          options()) is not None
    odd = torch.zeros(1 + q.numel(), dtype=q.dtype)[1:].view(q.shape)
    assert odd.is_contiguous() and odd.data_ptr() % 16
    empty = q[:, :, :0]
    mask = np.ones((128, 128), bool)
    for args, opts in (((odd, k, v), options()), ((q, empty, v), options()),
                       ((q, k, v), options(mask=mask)),
                       ((q, k, v), options(kv_lengths=np.ones(4))),
                       ((q, k, np.zeros(v.shape, np.float32)), options()),
                       ((q, k, v), options(scale=[0.5]))):
        assert host._fast_key(*args, ("f",), opts) is None
    assert host._fast_key(q, k, v, ("f",), options(),
                          saved=(np.zeros(3),)) is None


def test_ordered_backward_skips_zeros_only_where_each_tile_is_reached():
    # backward v9 stores each dQ tile at its first turn: the host may
    # leave dQ unzeroed only when every query tile has a key block. That
    # is so exactly when some row of each tile may attend to some key
    # (masks.Rules.empty_rows, row by row from the same rules)
    from flashlab import masks
    from flashlab.gpu import host, traits

    tr = traits.traits("backward_v9_fused_bf16", 64, 64)
    seen = set()
    for (nq, nk), causal, window in itertools.product(
            ((1, 1), (64, 64), (130, 1), (300, 700), (700, 300),
             (1000, 129), (64, 1000)), (False, True),
            (None, (0, 0), (20, None), (None, 0), (200, 3))):
        for offset in (0, nk - nq):
            rules = masks.Rules(causal, offset, window, None, None)
            empty = rules.empty_rows((), nq, nk)
            want = not any(empty[i0:i0 + tr.bc].all()
                           for i0 in range(0, nq, tr.bc))
            got = host._stores_every_tile(tr, nq, nk, rules.index())
            assert got == want, (nq, nk, causal, window, offset)
            seen.add(got)
    assert seen == {True, False}  # both answers come up
