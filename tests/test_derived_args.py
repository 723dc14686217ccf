"""Kernel arguments a launch derives from the caller's (launch.Derived):
forward_v8's tensor maps, made from q, k and v before every launch, so
its callers pass v5's arguments, and backward_v8's, from q, k, v and dO.
No GPU: the driver call is recorded."""

import itertools

import numpy as np
import pytest
from test_launch import FakeDeviceArray

from flashlab.gpu import forward_v8, launch, registry


class FakeDriver:
    """launch._cuda() stand-in: records cuLaunchKernel's calls."""

    def __init__(self):
        self.calls = []

    def cuLaunchKernel(self, *args):
        self.calls.append(args)
        return 0


class FailingDriver:
    """launch._cuda() stand-in whose cuLaunchKernel returns `err`."""

    def __init__(self, err):
        self.err = err

    def cuLaunchKernel(self, *args):
        return self.err


@pytest.mark.parametrize("err, text", [
    (2, "CUDA_ERROR_OUT_OF_MEMORY (2)"),
    (700, "CUDA_ERROR_ILLEGAL_ADDRESS (700)"),
    (987654, "CUresult 987654")])
def test_a_failed_launch_names_the_kernel_and_the_failure(monkeypatch, err,
                                                         text):
    # the CUresult by its name where cuda.bindings knows it: an earlier
    # kernel's sticky fault (700) reads apart from memory a launch could
    # not get (2)
    from numba import float32

    pytest.importorskip("cuda.bindings")
    kernel = launch.DriverKernel("k_of_test", 0, (float32[:, ::1],), None)
    monkeypatch.setattr(launch, "_cuda", lambda: FailingDriver(err))
    packed = kernel.pack(FakeDeviceArray((5, 3), np.float32, 0x1000))
    with pytest.raises(RuntimeError) as caught:
        packed.launch((1,), 32, 0)
    assert str(caught.value) == f"cuLaunchKernel of k_of_test: {text}"


def test_derived_arguments_are_packed_and_updated_before_each_launch(
        monkeypatch):
    from numba import float32, uint64

    seen = []

    def update(packed, stream):
        # the caller's array, as packed: its pointer and first dim
        seen.append((packed.read(0, launch.DATA_FIELD),
                     packed.read(0, launch.DATA_FIELD + 1), stream))
        packed.point(1, 0x7700 + len(seen))

    kernel = launch.DriverKernel(
        "k", 0, (float32[:, ::1], uint64[::1]), None)
    kernel.derived = launch.Derived(
        lambda: (FakeDeviceArray((48,), np.uint64, 0),), update)
    driver = FakeDriver()
    monkeypatch.setattr(launch, "_cuda", lambda: driver)
    packed = kernel.pack(FakeDeviceArray((5, 3), np.float32, 0x1000))
    assert packed.read(1, launch.DATA_FIELD) == 0  # the placeholder
    packed.launch((1,), 32, 9)
    packed.point(0, 0x2000)  # a plan's next call: new data
    packed.launch((1,), 32, 9)
    assert seen == [(0x1000, 5, 9), (0x2000, 5, 9)]
    assert packed.read(1, launch.DATA_FIELD) == 0x7702
    assert len(driver.calls) == 2
    # callers pass one argument fewer than the kernel takes
    with pytest.raises(TypeError, match="args: expected 2 kernel"):
        kernel.pack(FakeDeviceArray((5, 3), np.float32, 0x1000),
                    FakeDeviceArray((48,), np.uint64, 0), 1)


def test_v8_is_registered_with_its_maps_derived():
    # callers pass v5's arguments; the kernel takes one more, the maps
    for kind in ("bf16", "f16"):
        spec = registry.get(f"forward_v8_{kind}")
        v5 = registry.argument_types(registry.get(f"forward_v5_{kind}").args)
        v8 = registry.argument_types(spec.args)
        assert v8[:-1] == v5 and str(v8[-1]) == "array(uint64, 1d, C)"
        assert spec.derived is not None
        assert [spec.registers(d, d) for d in (64, 128)] == [128, 168]
        assert spec.runs_on((9, 0)) and not spec.runs_on((8, 9))
    # registers the producer gives back cover what the consumers take:
    # setmaxnreg moves the block's own registers (its launch's cap a
    # thread), so a consumer's increase waits for ever on more
    for d, d_v in itertools.product(forward_v8.HEAD_DIMS, repeat=2):
        cap, keep, grow = forward_v8.REGISTERS[forward_v8.groups(d, d_v)]
        threads = forward_v8.threads(d, d_v)
        assert cap == forward_v8.max_registers(d, d_v) and cap % 8 == 0
        assert keep * 128 + grow * (threads - 128) <= cap * threads
        assert cap * threads <= 65536 < (cap + 8) * threads
    # Q_i, two stages of K and V, the barriers and the alignment fit
    for d in forward_v8.HEAD_DIMS:
        assert forward_v8.shared_bytes(d, d) <= 227 * 1024


def test_v8_maps_are_keyed_by_the_packed_pointers_and_shapes(monkeypatch):
    # what v8's update reads from a packed launch: each array's data
    # pointer and dims, as the caller packed them
    class Ring:
        base, words, made = 0x5000, 48, [0, 0]  # as forward_v8._Slots

        def address(self, key, make, stream):
            self.seen = key, stream
            return self.base + 48 * 8 * (key[1] == 0x2100)

    ring = Ring()
    monkeypatch.setattr(forward_v8, "_SLOTS", [ring])
    kernel = launch.DriverKernel(
        "k", 0, registry.argument_types("forward16_tma"), None)
    kernel.derived = launch.Derived(
        lambda: (FakeDeviceArray((48,), np.uint64, 0),),
        forward_v8.derived(64, 128).update)
    driver = FakeDriver()
    monkeypatch.setattr(launch, "_cuda", lambda: driver)
    from flashlab.kernel_args import KernelRules

    args = (FakeDeviceArray((6, 100, 64), np.int16, 0x1000),
            FakeDeviceArray((3, 130, 64), np.int16, 0x2000),
            FakeDeviceArray((3, 130, 128), np.int16, 0x3000),
            FakeDeviceArray((6, 100, 64), np.int32, 0x4000),
            FakeDeviceArray((6, 100), np.float32, 0x4800),
            FakeDeviceArray((3, 1, 4), np.int32, 0x4900),
            KernelRules(np.float32(0.1), False, 0, -1, -1, False,
                        np.uint64(0), np.uint64(0), False, np.float32(0),
                        np.float32(0), 2),
            FakeDeviceArray((6,), np.int64, 0x4A00),
            FakeDeviceArray((1, 1, 1), np.uint8, 0x4B00))
    packed = kernel.pack(*args)
    packed.launch((1, 6), 384, 7)
    dims = (6, 100, 64, 3, 130, 64, 3, 130, 128)  # (BH, N, d) of q, k, v
    assert ring.seen == ((0x1000, 0x2000, 0x3000, dims), 7)
    assert packed.read(9, launch.DATA_FIELD) == 0x5000
    # a later call's pointers (as a plan points them) make the key
    packed.point(1, 0x2100)
    packed.launch((1, 6), 384, 8)
    assert ring.seen == ((0x1000, 0x2100, 0x3000, dims), 8)
    assert packed.read(1, launch.DATA_FIELD) == 0x2100
    assert packed.read(9, launch.DATA_FIELD) == 0x5000 + 48 * 8
    # the same pointers again: the slot found last, without a look-up
    ring.seen = None
    packed.launch((1, 6), 384, 9)
    assert ring.seen is None
    assert packed.read(9, launch.DATA_FIELD) == 0x5000 + 48 * 8
    # unless that slot has since been given another set of maps
    ring.made[1] += 1
    packed.launch((1, 6), 384, 10)
    assert ring.seen == ((0x1000, 0x2100, 0x3000, dims), 10)


def test_backward_v8_is_registered_with_its_maps_derived():
    # callers pass backward_v7's dK/dV arguments; the kernel takes one
    # more, the maps of q, k, v and dO
    from flashlab.gpu import backward_v8

    for kind in ("bf16", "f16"):
        spec = registry.get(f"backward_v8_dkv_{kind}")
        v7 = registry.argument_types(
            registry.get(f"backward_v7_dkv_{kind}").args)
        v8 = registry.argument_types(spec.args)
        assert v8[:-1] == v7 and str(v8[-1]) == "array(uint64, 1d, C)"
        assert spec.derived is not None and spec.grads16
        assert spec.takes(64, 64) and spec.takes(128, 128)
        assert spec.takes(64, 128) and not spec.takes(96, 96)
        assert spec.runs_on((9, 0)) and not spec.runs_on((8, 9))
    # the producer's decrease covers the consumers' increase (else the
    # increase waits for ever), within the block's registers
    threads = backward_v8.threads()
    for cap, keep, grow in backward_v8.REGISTERS.values():
        assert cap == backward_v8.max_registers() and cap % 8 == 0
        assert keep * 128 + grow * (threads - 128) <= cap * threads
        assert cap * threads <= 65536 < (cap + 8) * threads
    # dynamic and static shared memory within the block's 227 KiB, at
    # either head dim, both kernels (the fused one in fewer stages at 128)
    for d in backward_v8.HEAD_DIMS:
        for fused in (False, True):
            assert (backward_v8.shared_bytes(d, d, fused)
                    + backward_v8.static_bytes(d, d, fused)) <= 227 * 1024
    assert backward_v8.stages(128, 128, True) < backward_v8.STAGES
    assert backward_v8.stages(64, 64, True) == backward_v8.STAGES
    # version None picks v9 on Hopper at d = d_v, v8 at mixed head dims
    assert registry.backward_version("bfloat16", 64, 64, (9, 0)) == 9
    assert registry.backward_version("bfloat16", 128, 128, (9, 0)) == 9
    assert registry.backward_version("bfloat16", 64, 128, (9, 0)) == 8
    # by keys: v9 from ORDERED_MIN_KEYS on, v8 below
    for nk, version in ((registry.ORDERED_MIN_KEYS, 9),
                        (registry.ORDERED_MIN_KEYS - 1, 8)):
        assert registry.backward_version("bfloat16", 128, 128, (9, 0),
                                         nk) == version
        assert registry.ordered_pays(nk) == (version == 9)
    # keys unknown: v9
    assert registry.ordered_pays(None)
    assert registry.backward_version("bfloat16", 128, 128, (8, 0)) == 5
    assert registry.backward_version("float16", 64, 64, (8, 0)) == 5
    assert registry.backward_names(8, "f16") == ("backward_v8_dkv_f16",
                                                 "backward_v7_dq_f16")
    # its fused kernel: the dK/dV kernel's arguments with the float32 dQ
    # (v7's fused kernel's) and a fifth map, dQ's
    for kind in ("bf16", "f16"):
        spec = registry.get(f"backward_v8_fused_{kind}")
        v7 = registry.argument_types(
            registry.get(f"backward_v7_fused_{kind}").args)
        fused = registry.argument_types(spec.args)
        assert fused[:-1] == v7 and str(fused[-1]) == "array(uint64, 1d, C)"
        assert spec.derived is not None and spec.grads16
        assert spec.takes(64, 64) and spec.takes(128, 128)
        assert not spec.takes(96, 96) and not spec.takes(64, 128)
        assert spec.threads == backward_v8.threads()
        assert spec.registers(64, 64) == backward_v8.max_registers()
        # backward v9: that kernel's arguments with the int32 counts of
        # each dQ tile's additions after dQ, at d = d_v only
        ordered = registry.get(f"backward_v9_fused_{kind}")
        types9 = registry.argument_types(ordered.args)
        assert types9[:9] == fused[:9] and types9[10:] == fused[9:]
        assert str(types9[9]) == "array(int32, 2d, C)"
        assert ordered.takes(128, 128) and not ordered.takes(128, 64)
        assert ordered.placed and ordered.grads16 and ordered.same_dims
    assert registry.backward_names(9, "bf16") == ("backward_v9_fused_bf16",
                                                  None)


@pytest.mark.parametrize("d, deterministic, names", [
    (64, True, ("backward_v8_dkv_bf16", "backward_v7_dq_bf16")),
    (64, False, ("backward_v8_fused_bf16", None)),
    (128, True, ("backward_v8_dkv_bf16", "backward_v7_dq_bf16")),
    (128, False, ("backward_v8_fused_bf16", None))])
def test_the_16bit_backward_runs_a_fused_kernel_only_without_determinism(
        d, deterministic, names):
    # on Hopper (what the simulator stands for here): v8 by number runs
    # its two kernels, fused only where atomics are allowed; version None
    # and v9 by number run v9's kernel, v8's fused one where atomics are
    # allowed; v7 by number runs its own, fused without determinism at
    # either head dim. At mixed head dims None runs v8's two kernels
    from numba import config

    from flashlab.gpu import host

    if not config.ENABLE_CUDASIM:
        pytest.skip("the simulator stands for a Hopper GPU here")
    assert host._backward16_names(8, "bfloat16", d, d,
                                  deterministic) == names
    v9 = ("backward_v9_fused_bf16", None) if deterministic else names
    for version in (None, 9):
        assert host._backward16_names(version, "bfloat16", d, d,
                                      deterministic) == v9
    # below ORDERED_MIN_KEYS keys None runs v8, and 9 by number still v9
    short = registry.ORDERED_MIN_KEYS // 2
    assert host._backward16_names(None, "bfloat16", d, d, deterministic,
                                  short) == names
    assert host._backward16_names(9, "bfloat16", d, d, deterministic,
                                  short) == v9
    v7 = ("backward_v7_dkv_bf16", "backward_v7_dq_bf16") if \
        deterministic else ("backward_v7_fused_bf16", None)
    assert host._backward16_names(7, "bfloat16", d, d, deterministic) == v7
    assert host._backward16_names(None, "bfloat16", d, 192 - d,
                                  deterministic) == (
        "backward_v8_dkv_bf16", "backward_v7_dq_bf16")


@pytest.mark.parametrize("fused, ordered", [(False, False), (True, False),
                                           (True, True)])
def test_backward_v8_maps_are_q_k_v_do_with_their_boxes(monkeypatch,
                                                        fused, ordered):
    # what its update reads from a packed launch: the data pointers and
    # dims of q, k, v, dO; Q_i and dO_i boxes of STREAMED rows, K_j and
    # V_j boxes of a block's keys; the fused kernel's also dQ's (float32,
    # boxes of STREAMED rows); the set keyed by all of them; the ordered
    # kernel's maps one argument later, after the counts
    from flashlab.gpu import backward_v7, backward_v8

    encoded = []
    monkeypatch.setattr(forward_v8, "encode", lambda *a: encoded.append(
        a) or np.full(16, len(encoded), np.uint64))

    words = 80 if fused else 64

    class Ring:  # as forward_v8._Slots: one slot here
        base, made = 0x6000, [0]

        def address(self, key, make, stream):
            self.seen, self.got = (key, stream), make()
            return 0x6000

    ring = Ring()
    ring.words = words
    monkeypatch.setattr(backward_v8, "_SLOTS", {words: ring})
    args_key = ("backward16_ordered_tma" if ordered else
                "backward16_fused_tma" if fused else "backward16_dkv_tma")
    kernel = launch.DriverKernel("k", 0, registry.argument_types(args_key),
                                 None)
    derived = (backward_v8.derived_ordered if ordered else
               backward_v8.derived_fused if fused else backward_v8.derived)
    kernel.derived = launch.Derived(
        lambda: (FakeDeviceArray((words,), np.uint64, 0),),
        derived(64, 64).update)
    driver = FakeDriver()
    monkeypatch.setattr(launch, "_cuda", lambda: driver)
    from flashlab.kernel_args import KernelRules

    args = (FakeDeviceArray((6, 100, 64), np.int16, 0x1000),
            FakeDeviceArray((3, 130, 64), np.int16, 0x2000),
            FakeDeviceArray((3, 130, 64), np.int16, 0x3000),
            FakeDeviceArray((6, 100, 64), np.int16, 0x4000),
            FakeDeviceArray((12, 100), np.float32, 0x4800),
            FakeDeviceArray((6, 100), np.float32, 0x4900),
            FakeDeviceArray((3, 130, 32), np.int32, 0x5000),
            FakeDeviceArray((3, 130, 32), np.int32, 0x5800),
            *([FakeDeviceArray((6, 100, 64), np.float32, 0x5C00)]
              if fused else []),
            *([FakeDeviceArray((6, 2), np.int32, 0x5D00)]
              if ordered else []),
            KernelRules(np.float32(0.1), False, 0, -1, -1, False,
                        np.uint64(0), np.uint64(0), False, np.float32(0),
                        np.float32(0), 2),
            FakeDeviceArray((6,), np.int64, 0x5A00),
            FakeDeviceArray((1, 1, 1), np.uint8, 0x5B00))
    packed = kernel.pack(*args)
    packed.launch((2, 3), backward_v8.threads(), 7)
    dq = 0x5C00 if fused else None
    assert ring.seen == ((0x1000, 0x2000, 0x3000, 0x4000, dq, 6, 100, 3,
                          130, 64, 64), 7)
    assert packed.read(backward_v8.MAPS_ARG + fused + ordered,
                       launch.DATA_FIELD) == 0x6000
    rows, keys = backward_v7.STREAMED, backward_v7.own("dkv")
    assert encoded == [(0x1000, 100, 6, 64, rows), (0x2000, 130, 3, 64, keys),
                       (0x3000, 130, 3, 64, keys), (0x4000, 100, 6, 64, rows)
                       ] + [(0x5C00, 100, 6, 64, rows, 4)] * fused
    assert list(ring.got) == sum(([m] * 16 for m in range(1, 5 + fused)),
                                 [])
    # the same pointers again (a training loop's next step): the slot
    # found last, without a look-up, unless the slot has since been given
    # another set; new pointers are looked up
    ring.seen = None
    packed.launch((2, 3), backward_v8.threads(), 8)
    assert ring.seen is None
    ring.made[0] += 1
    packed.launch((2, 3), backward_v8.threads(), 9)
    assert ring.seen[1] == 9
    ring.seen = None
    packed.point(3, 0x4400)
    packed.launch((2, 3), backward_v8.threads(), 10)
    assert ring.seen == ((0x1000, 0x2000, 0x3000, 0x4400, dq, 6, 100, 3,
                          130, 64, 64), 10)


def test_packed_launch_passes_each_grid_and_block_it_is_given(monkeypatch):
    # a Packed keeps cuLaunchKernel's leading arguments per (grid, block,
    # shared): each launch must still pass its own
    from numba import float32

    kernel = launch.DriverKernel("k", 0x99, (float32[::1],), None)
    kernel.shared = 512
    driver = FakeDriver()
    monkeypatch.setattr(launch, "_cuda", lambda: driver)
    packed = kernel.pack(FakeDeviceArray((8,), np.float32, 0x1000))
    packed.launch((2, 3), 128, 5)
    packed.launch((4,), (32, 2), 6, shared=0)
    packed.launch([5, 6], [64, 1, 1], 7)
    packed.launch((2, 3), 128, 8)
    assert [c[:9] for c in driver.calls] == [
        (0x99, 2, 3, 1, 128, 1, 1, 512, 5),
        (0x99, 4, 1, 1, 32, 2, 1, 0, 6),
        (0x99, 5, 6, 1, 64, 1, 1, 512, 7),
        (0x99, 2, 3, 1, 128, 1, 1, 512, 8)]
    assert all(c[10] is packed.extra for c in driver.calls)
