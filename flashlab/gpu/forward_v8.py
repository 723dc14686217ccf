"""Forward v8: v7 with FlashAttention-3's warp specialization.

bf16 or float16, sm_90a only. A block is three warpgroups. The first is
the producer: one of its threads moves Q_i and every K_j, V_j tile from
global to shared memory with TMA (cp.async.bulk.tensor, 128-byte
swizzled as v7's tiles), two stages per tensor, and hands each over on
an mbarrier that counts its bytes (flashlab.gpu.tma). The other two are
v7's consumer warpgroups, 64 query rows each, running v7's pipeline (S
of the next tile and P V of this one in flight, the softmax under P V)
but issuing no copies: they wait for a tile's "full" barrier and arrive
on its "empty" one once their products have read it. No block barrier
is left in the loop, so neither warpgroup waits for the other, and
`setmaxnreg` gives the producer's registers to the consumers (24 and
240 a thread where the kernel is built with 168).

The host encodes one tensor map per tensor (`tensor_maps`) and passes
them as the last argument; DriverKernel calls `prepare` before every
launch, so flashlab.gpu's callers pass v5's arguments. See chapter 12.
"""

import ctypes
import struct

import numpy as np
from numba import cuda, float32, int16, int32, uint32, uint64

from flashlab import fragments
from flashlab.gpu import tma
from flashlab.gpu.device import F0, NEG_INF
from flashlab.gpu.forward_v7 import (
    ALIGN,
    BLOCK_K,
    CC,
    HEAD_DIMS,
    descriptor_128b,
    k_steps_128b,
    make_to_a,
)
from flashlab.gpu.intrinsics import (
    global_address,
    pack_bf16x2,
    pack_f16x2,
    shared_address,
)
from flashlab.gpu.warp import (
    make_store_rows16,
    rescale,
    tile_range,
    tile_softmax,
)
from flashlab.gpu.wgmma import mma_rs, mma_ss, wait_for

__all__ = ["CC", "HEAD_DIMS", "make", "shape", "shared_bytes"]

GROUPS = 2  # consumer warpgroups per block
CONSUMERS = 128 * GROUPS  # consumer threads
THREADS = CONSUMERS + 128  # and the producer warpgroup
BR = 64 * GROUPS  # query rows per block: 64 per consumer warpgroup
MAX_REGISTERS = 168  # 65536 registers / 384 threads, a multiple of 8
PRODUCER_REGISTERS = 24  # what setmaxnreg leaves the producer
CONSUMER_REGISTERS = 240  # and gives each consumer thread
BARRIERS = 1024  # bytes before the tiles: the mbarriers, tiles aligned
# mbarrier numbers: Q full, K full (2 stages), V full, K empty, V empty
Q_FULL, K_FULL, V_FULL, K_EMPTY, V_EMPTY = 0, 1, 3, 5, 7
PANEL = 64  # columns of one TMA box: 128 bytes, the swizzle's width

release = tma.release_registers[PRODUCER_REGISTERS]
take = tma.take_registers[CONSUMER_REGISTERS]


def shape(d, d_v):
    """(Br, Bc, threads per block) for head dims d, d_v."""
    return BR, BLOCK_K[d], THREADS


def shared_bytes(d, d_v):
    """Dynamic shared memory per block: the barriers, Q_i and two stages
    of K_j, V_j, and room to align them to 1024 bytes."""
    bc = BLOCK_K[d]
    return BARRIERS + 2 * (BR * d + 2 * bc * d + 2 * bc * d_v) + ALIGN


def make(D, D_V, kind="bf16"):
    """The v8 kernel for head dims D, D_V and 16-bit `kind` (bf16, f16)."""
    pack = {"bf16": pack_bf16x2, "f16": pack_f16x2}[kind]
    BC = BLOCK_K[D]
    KD, KP = D // 16, BC // 16  # k-steps of S = Q K^T and of O += P V
    NS, NO = BC // 8, D_V // 8  # 8-column groups of S and of O
    Q_S, K_S, V_S = BR * D, BC * D, BC * D_V  # SRAM tiles (16-bit values)
    store_rows = make_store_rows16(pack, NO)  # the epilogue
    to_a = make_to_a(pack, KP)
    lbo_k, sbo_k, _, _ = fragments.k_major_128b(BR)
    lbo_v, sbo_v, step_v = fragments.mn_major_128b(BC)
    s_issue = mma_ss(BC, KD, k_steps_128b(BR, KD), k_steps_128b(BC, KD),
                     kind, wait=False)
    o_issue = mma_rs(D_V, KP, step_v, kind, wait=False)
    s_wait_one = wait_for(1, NS * 4)  # S in; O += P V may still fly
    s_wait = wait_for(0, NS * 4)
    o_wait = wait_for(0, NO * 4, KP * 4)  # O, and P (its A operand)

    @cuda.jit
    def forward_v8(q, k, v, o, lse, bad, rules, kv_len, mask, maps):
        # q, k, v: (BH, N, d) 16-bit bits; o: (BH, Nq, d_v / 2) pairs;
        # maps: the tensor maps of q, k, v, 16 words each
        tiles = cuda.shared.array(0, int16)
        sf = cuda.local.array((NS, 4), float32)  # S_ij, then P_ij
        pf = cuda.local.array((KP, 4), int32)  # P_ij: A of each k-step
        of = cuda.local.array((NO, 4), float32)  # O_i, unnormalized
        m = cuda.local.array(2, float32)  # rows g and g + 8
        l = cuda.local.array(2, float32)
        al = cuda.local.array(2, float32)
        seen = cuda.local.array(2, int32)  # met an allowed key yet
        t = cuda.threadIdx.x
        w, lane = t // 32, t % 32
        b = cuda.blockIdx.y
        bk = b // rules.group  # the K/V head of query head b
        # the last query blocks first: under a causal mask they visit the
        # most tiles, and started early they do not leave a ragged tail
        i0 = (cuda.gridDim.x - 1 - cuda.blockIdx.x) * BR
        nq, nk = q.shape[1], k.shape[1]
        i1 = min(i0 + BR, nq)
        first, last = tile_range(i0, i1, nk, BC, rules, kv_len[b])
        at = shared_address(tiles, 0)
        bars = uint32(at + (ALIGN - at % ALIGN) % ALIGN)
        q_at = bars + uint32(BARRIERS)
        k_at = q_at + uint32(2 * Q_S)  # stage s at + 2 K_S s bytes
        v_at = k_at + uint32(4 * K_S)
        if t == 0:
            for x in range(9):  # full: the producer's one arrival (and
                # the bytes); empty: every consumer thread's
                tma.mbarrier_init(bars + uint32(8 * x),
                                  uint32(1 if x < K_EMPTY else CONSUMERS))
            tma.fence_mbarrier_init()
        cuda.syncthreads()
        if w < 4:  # the producer warpgroup
            release()
            if t == 0 and first <= last:
                maps_at = global_address(maps, 0)
                tma.arrive_expect_tx(bars + uint32(8 * Q_FULL),
                                     uint32(2 * Q_S))
                for p in range(D // PANEL):
                    tma.load_3d(q_at + uint32(p * BR * 128), maps_at,
                                int32(p * PANEL), int32(i0), int32(b),
                                bars + uint32(8 * Q_FULL))
                for jt in range(first, last + 1):
                    n = jt - first
                    s, phase = n % 2, (n // 2) % 2
                    # a stage is free once both warpgroups are done with
                    # it; the first pass finds every stage free
                    tma.wait(bars + uint32(8 * (K_EMPTY + s)),
                             uint32(1 - phase))
                    full = bars + uint32(8 * (K_FULL + s))
                    tma.arrive_expect_tx(full, uint32(2 * K_S))
                    for p in range(D // PANEL):
                        tma.load_3d(k_at + uint32(2 * K_S * s + p * BC * 128),
                                    maps_at + uint64(128), int32(p * PANEL),
                                    int32(jt * BC), int32(bk), full)
                    tma.wait(bars + uint32(8 * (V_EMPTY + s)),
                             uint32(1 - phase))
                    full = bars + uint32(8 * (V_FULL + s))
                    tma.arrive_expect_tx(full, uint32(2 * V_S))
                    for p in range(D_V // PANEL):
                        tma.load_3d(v_at + uint32(2 * V_S * s + p * BC * 128),
                                    maps_at + uint64(256), int32(p * PANEL),
                                    int32(jt * BC), int32(bk), full)
            return
        take()
        row = i0 + 16 * (w - 4) + lane // 4  # this lane's first row (g)
        q_desc = uint64(descriptor_128b(
            q_at + uint32(64 * 128 * ((w - 4) // 4)), lbo_k, sbo_k))
        k_desc = uint64(descriptor_128b(k_at, lbo_k, sbo_k))
        v_desc = uint64(descriptor_128b(v_at, lbo_v, sbo_v))
        k_next = uint64(2 * K_S >> 4)  # descriptor step to the other stage
        v_next = uint64(2 * V_S >> 4)
        for h in range(2):
            m[h] = NEG_INF
            l[h] = F0
            seen[h] = 0
        for n in range(NO):
            for x in range(4):
                of[n, x] = F0
        if first <= last:
            tma.wait(bars + uint32(8 * Q_FULL), uint32(0))
            tma.wait(bars + uint32(8 * K_FULL), uint32(0))
            s_issue(sf, q_desc, k_desc)  # S = Q_i K_first^T
            s_wait(sf)
            tma.arrive(bars + uint32(8 * K_EMPTY))
            tile_softmax(sf, m, l, al, seen, NS, BC, b, row, i0, i1,
                         first * BC, nq, nk, rules, kv_len, mask)
            to_a(pf, sf)
        for jt in range(first + 1, last + 1):
            n = jt - first
            s, phase = n % 2, (n // 2) % 2
            ps, p_phase = (n - 1) % 2, ((n - 1) // 2) % 2  # tile jt - 1
            tma.wait(bars + uint32(8 * (K_FULL + s)), uint32(phase))
            s_issue(sf, q_desc, k_desc + k_next * uint64(s))  # S_{i,j}
            tma.wait(bars + uint32(8 * (V_FULL + ps)), uint32(p_phase))
            o_issue(of, pf, v_desc + v_next * uint64(ps))  # += P V_{j-1}
            s_wait_one(sf)
            tma.arrive(bars + uint32(8 * (K_EMPTY + s)))
            # the softmax of tile jt while P V of tile jt - 1 runs
            tile_softmax(sf, m, l, al, seen, NS, BC, b, row, i0, i1,
                         jt * BC, nq, nk, rules, kv_len, mask)
            o_wait(of, pf)
            tma.arrive(bars + uint32(8 * (V_EMPTY + ps)))
            rescale(of, al, NO)
            to_a(pf, sf)
        if first <= last:  # O_i += P V of the last tile
            n = last - first
            tma.wait(bars + uint32(8 * (V_FULL + n % 2)),
                     uint32((n // 2) % 2))
            o_issue(of, pf, v_desc + v_next * uint64(n % 2))
            o_wait(of, pf)
        store_rows(o, lse, of, m, l, seen, bad, bk, b, row, lane, nq)

    return forward_v8


def compile_ptx(d, d_v, kind="bf16"):
    """PTX of v8 for sm_90a; needs no GPU."""
    from numba import cuda

    from flashlab.gpu import build, registry

    with build.compiling_without_gpu(CC[:2]):
        ptx, _ = cuda.compile_ptx(make(d, d_v, kind).py_func,
                                  registry.argument_types("forward16_tma"),
                                  cc=CC)
    return ptx


# the host's side: tensor maps --------------------------------------------

def encode(address, rows, heads, cols, box_rows):
    """The 128-byte TMA tensor map (16 uint64 words) of a (heads, rows,
    cols) array of 16-bit values at `address`: boxes of 64 columns x
    box_rows rows of one head, 128-byte swizzled, rows past the end read
    as zeros."""
    from cuda.bindings import driver

    u64, u32 = driver.cuuint64_t, driver.cuuint32_t
    err, tmap = driver.cuTensorMapEncodeTiled(
        driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT16,
        u32(3), address, [u64(cols), u64(rows), u64(heads)],
        [u64(cols * 2), u64(rows * cols * 2)],
        [u32(PANEL), u32(box_rows), u32(1)], [u32(1), u32(1), u32(1)],
        driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if int(err):
        raise RuntimeError(f"cuTensorMapEncodeTiled: {err}")
    return np.frombuffer(ctypes.string_at(tmap.getPtr(), 128),
                         np.uint64).copy()


def tensor_maps(q_at, k_at, v_at, bh, nq, bh_kv, nk, d, d_v):
    """The three tensor maps (48 uint64 words) of (bh, nq, d) q at q_at
    and (bh_kv, nk, d / d_v) k and v: Q_i boxes of Br rows, K_j and V_j
    boxes of Bc rows, 64 columns each."""
    bc = BLOCK_K[d]
    return np.concatenate([encode(q_at, nq, bh, d, BR),
                           encode(k_at, nk, bh_kv, d, bc),
                           encode(v_at, nk, bh_kv, d_v, bc)])


class _Slots:
    """Tensor maps in device memory: a ring of SLOTS sets, each copied on
    its launch's stream from a pinned host row that stays as it is until
    the copy has run. A set is made once per pointers and shapes (a
    training loop's tensors come back at the same addresses), and its
    slot is reused SLOTS sets later, after its copy has finished. A CUDA
    graph that captured a launch reads the slot it was given: replay it
    before SLOTS other sets have been made."""

    SLOTS = 256

    def __init__(self):
        from numba import cuda

        self.host = cuda.pinned_array((self.SLOTS, 48), np.uint64)
        self.device = cuda.device_array((self.SLOTS, 48), np.uint64)
        self.copied = [None] * self.SLOTS  # each slot's copy event
        self.keys = [None] * self.SLOTS
        self.slot_of = {}
        self.next = 0

    def address(self, key, make, stream):
        """Device address of the maps of `key`; make() gives their words
        when they are not here yet."""
        slot = self.slot_of.get(key)
        if slot is None:
            from numba import cuda

            slot, self.next = self.next, (self.next + 1) % self.SLOTS
            if self.copied[slot] is not None:
                self.copied[slot].synchronize()  # long done, as a rule
                del self.slot_of[self.keys[slot]]
            self.host[slot] = make()
            on = cuda.external_stream(stream)
            self.device[slot].copy_to_device(self.host[slot], stream=on)
            self.copied[slot] = cuda.event(timing=False)
            self.copied[slot].record(on)
            self.keys[slot], self.slot_of[key] = key, slot
        return (self.device.__cuda_array_interface__["data"][0]
                + slot * 48 * 8)


_SLOTS = []  # the one _Slots, made at the first launch


_FIELDS = struct.Struct("<Q3q")  # an array's data pointer and three dims


def _maps_for(packed, stream):
    """The device address of the tensor maps of the q, k, v packed in
    `packed` (arguments 0, 1, 2)."""
    from flashlab.gpu.launch import DATA_FIELD

    offset = packed.kernel.layout.offset
    (q_at, bh, nq, d), (k_at, bh_kv, nk, _), (v_at, _, _, d_v) = (
        _FIELDS.unpack_from(packed.buffer, offset(arg, DATA_FIELD))
        for arg in range(3))
    if not _SLOTS:
        _SLOTS.append(_Slots())
    return _SLOTS[0].address(
        (q_at, k_at, v_at, bh, nq, bh_kv, nk, d, d_v),
        lambda: tensor_maps(q_at, k_at, v_at, bh, nq, bh_kv, nk, d, d_v),
        stream)


def derived(d, d_v):
    """launch.Derived of v8's last argument, the tensor maps."""
    from flashlab.gpu.launch import Derived

    def placeholders():
        return (cuda.device_array(48, np.uint64),)

    def update(packed, stream):
        packed.point(9, _maps_for(packed, stream))

    return Derived(placeholders, update)
