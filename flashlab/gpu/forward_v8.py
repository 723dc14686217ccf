"""Forward v8: v7 with FlashAttention-3's warp specialization.

bf16 or float16, sm_90a only. A block is one producer warpgroup and
two consumer warpgroups (three where d = d_v = 64, `groups`). One of the
producer's threads moves Q_i and every K_j, V_j tile from global to
shared memory with TMA (cp.async.bulk.tensor, 128-byte swizzled as v7's
tiles), two stages per tensor, and hands each over on an mbarrier that
counts its bytes (flashlab.gpu.tma). The consumers are v7's warpgroups,
64 query rows each, running v7's pipeline (S of the next tile and P V of
this one in flight, the softmax under P V) but issuing no copies: they
wait for a tile's "full" barrier and arrive on its "empty" one once
their products have read it. No block barrier is left in the loop, so
no warpgroup waits for another, and `setmaxnreg` gives the producer's
registers to the consumers (`REGISTERS`: 24 and 240 a thread where two
consumers are built with 168; 32 and 160 where three are built with
128). At 160 a tile that needs a mask or dropout runs its softmax after
P V, whose operands hold the registers that work needs. The run of tiles
that need no mask is found once a warpgroup (`warp.full_run`), and a
tile's stage and phase are bits of its count: both had cost instructions
on each tile's path from one product to the next. Each warpgroup stops
at the last tile its own 64 rows reach (`masks.last_tile`) and hands
the block's later ones back unread (chapter 12).

Where a launch's last wave would run part full, the host splits a
tail (`host.split_tail`): the grid leaves out each head's last ranks,
and a second launch of the same kernel runs them as halves of their key
tiles (`rules.key_half`, rows from `rules.block_shift` Br on, into 2 BH
heads of halves that `device.make_merge_halves` merges).

The host encodes one tensor map per tensor (`tensor_maps`) and passes
them as the last argument; the launch's `derived` update points it at
them before every launch, so flashlab.gpu's callers pass v5's arguments.

`make_e4m3` builds the same kernel for e4m3 inputs (flashlab.gpu.fp8):
k32 products, P packed to e4m3 in each lane's own registers (`make_a8`),
and V given as V^T in the matching key order (`transpose_keys8`, whose
torch model is `to_v_t`). See chapter 12.
"""

import ctypes
import struct

import numpy as np
from numba import cuda, float32, int16, int32, uint32, uint64

from flashlab import fragments
from flashlab.gpu import tma
from flashlab.gpu.device import F0, NEG_INF, inline
from flashlab.gpu.forward_v7 import (
    ALIGN,
    CC,
    HEAD_DIMS,
    descriptor_128b,
    k_steps_128b,
    make_to_a,
)
from flashlab.gpu.intrinsics import (
    bar_arrive,
    bar_sync,
    global_address,
    opaque,
    pack_bf16x2,
    pack_e4m3x4,
    pack_f16x2,
    shared_address,
)
from flashlab.gpu.warp import (
    block_place,
    full_run,
    key_half_tiles,
    known_softmax,
    last_tile,
    make_store_rows16,
    make_store_rows_staged,
    plain_softmax,
    rescale,
    tile_range,
    tile_softmax,
    warp_uniform,
)
from flashlab.gpu.wgmma import K_STEP, mma_rs, mma_ss, wait_for

__all__ = ["CC", "HEAD_DIMS", "make", "make_e4m3", "shape", "shared_bytes"]

# consumer warpgroups per block, by max(d, d_v): at 64 a tile's products
# take half as long as at 128, and a third warpgroup gives each scheduler
# more softmax to run beside them (FlashAttention-3's 192-row blocks)
GROUPS = {64: 3, 128: 2}
# by consumer warpgroups: (the cap per thread the kernel is built with,
# 65536 registers over the block's threads, a multiple of 8; what
# setmaxnreg leaves the producer; and gives each consumer thread)
REGISTERS = {2: (168, 24, 240), 3: (128, 32, 160)}
# keys per K/V tile, by d: at d = 64, S (Bc / 2 registers a thread), P
# and O must fit the 160 registers of three consumer warpgroups
BLOCK_K = {64: 128, 128: 128}
# a lane holds 2 rows x Bc / 4 keys of S, and warp.mask_scores keeps
# their allowed bits in one int64: Bc is at most 128
MAX_BLOCK_K = 128
BARRIERS = 1024  # bytes before the tiles: the mbarriers, tiles aligned
# mbarrier numbers: Q full, K full (2 stages), V full, K empty, V empty
Q_FULL, K_FULL, V_FULL, K_EMPTY, V_EMPTY = 0, 1, 3, 5, 7
SWIZZLE_BYTES = 128  # a TMA box's row: the 128-byte swizzle's width
PANEL = SWIZZLE_BYTES // 2  # its columns of 16-bit values
BYTES = {"bf16": 2, "f16": 2, "e4m3": 1}  # bytes of an input value
# every POLY-th of a lane's terms takes its exponential on the FMA pipe
# (flashlab.exp2, warp.online_softmax), by (kind, max(d, d_v)); none
# elsewhere. e4m3's products take half of bf16's time, so a tile's
# exponentials are its longest wait: every sixth on the FMA pipe made it
# 6% faster at N = 16K on the H200 (every 3rd, 4th, 8th, 12th: less);
# at bf16, d = 64, whose FMA pipe is the busier, slower (chapter 12)
POLY = {("e4m3", 128): 6}
E4M3_DIMS = (128,)  # e4m3 head dims: a row of K is one 128-byte panel
# ping-pong (FlashAttention-3): the consumer warpgroups take turns to
# issue a tile's two products, so that one's softmax runs while another's
# products hold the tensor cores. Named barrier TURN + g is consumer g's
# turn (0 is syncthreads'). Off: on the H200 the turns measured level
# with none (chapter 12, the trials' record), and the warpgroups already
# fall into turns on their own, the tensor cores taking one product at a
# time; on, the kernel is built with them (tests/test_gpu_ptx.py)
PING_PONG = False
TURN = 1

a8_place = cuda.jit(device=True)(fragments.a8_from_c)
stage_place = cuda.jit(device=True)(fragments.stage_place)


def groups(d, d_v):
    """Consumer warpgroups per block at head dims d, d_v."""
    return GROUPS[max(d, d_v)]


def block_rows(d, d_v):
    """Br: query rows per block, 64 per consumer warpgroup."""
    return 64 * groups(d, d_v)


def threads(d, d_v):
    """Threads per block: the consumer warpgroups and the producer's."""
    return 128 * (groups(d, d_v) + 1)


def max_registers(d, d_v):
    """The registers per thread the kernel is built with at head dims d,
    d_v (setmaxnreg moves them from there)."""
    return REGISTERS[groups(d, d_v)][0]


def shape(d, d_v):
    """(Br, Bc, threads per block) for head dims d, d_v."""
    return block_rows(d, d_v), BLOCK_K[d], threads(d, d_v)


def shared_bytes(d, d_v, size=2):
    """Dynamic shared memory per block: the barriers, Q_i and two stages
    of K_j, V_j (values of `size` bytes), O_i's staging where Q_i's room
    is too small for it (`stage_bytes`), and room to align them to 1024
    bytes."""
    br, bc = block_rows(d, d_v), BLOCK_K[d]
    return BARRIERS + size * (br * d + 2 * bc * d + 2 * bc * d_v) \
        + stage_bytes(d, d_v, size) + ALIGN


def stage_bytes(d, d_v, size=2):
    """Bytes past the tiles for the epilogue's 16-bit O_i (Br x d_v): none
    where Q_i's tile (Br x d values of `size` bytes) holds it, as it does
    at d >= d_v in 16 bits, and a warp's rows of Q_i are free once its
    last product has read them."""
    br = block_rows(d, d_v)
    if size * d >= 2 * d_v:
        return 0
    return 2 * br * d_v


def make_a8(kp_steps):
    """to_a8(pf, sf): P_ij (float32 C fragments sf) rounded to e4m3, the
    A fragments pf of P V's kp_steps k-steps of 32 keys, packed without
    moving a value between lanes (fragments.a8_from_c: V^T's keys are
    stored in the matching order)."""

    @inline
    def to_a8(pf, sf):
        for kp in range(kp_steps):
            for r in range(4):
                n0, e0 = a8_place(r, 0)  # byte y: (n-tile, element)
                n1, e1 = a8_place(r, 1)
                n2, e2 = a8_place(r, 2)
                n3, e3 = a8_place(r, 3)
                pf[kp, r] = pack_e4m3x4(
                    sf[4 * kp + n0, e0], sf[4 * kp + n1, e1],
                    sf[4 * kp + n2, e2], sf[4 * kp + n3, e3])

    return to_a8


def make(D, D_V, kind="bf16"):
    """The v8 kernel for head dims D, D_V and `kind` of input (bf16, f16,
    or e4m3: see make_e4m3)."""
    size, eight = BYTES[kind], kind == "e4m3"
    pack = {"bf16": pack_bf16x2, "f16": pack_f16x2}.get(kind, pack_bf16x2)
    BR, BC = block_rows(D, D_V), BLOCK_K[D]
    if BC > MAX_BLOCK_K:
        raise ValueError(f"BLOCK_K: at most {MAX_BLOCK_K} keys a tile "
                         f"(a lane's mask bits are one int64), got {BC}")
    CONSUMERS = 128 * groups(D, D_V)  # consumer threads
    _, keep, grow = REGISTERS[groups(D, D_V)]
    # three warpgroups' 160 registers hold S, P and O but not a mask's or
    # dropout's work beside them: such tiles wait for P V first
    TIGHT = groups(D, D_V) == 3
    poly = POLY.get((kind, max(D, D_V)), 0)
    release = tma.release_registers[keep]  # the producer's setmaxnreg
    take = tma.take_registers[grow]  # and the consumers'
    KD, KP = D // K_STEP[kind], BC // K_STEP[kind]  # k-steps of S, P V
    NS, NO = BC // 8, D_V // 8  # 8-column groups of S and of O
    Q_B, K_B, V_B = (size * BR * D, size * BC * D,
                     size * BC * D_V)  # SRAM tiles, bytes
    box = SWIZZLE_BYTES // size  # columns of a TMA box
    # the epilogue: 16-bit O through shared memory, 2 D_V bytes a row, in
    # Q_i's tile or past V_j's stages (stage_bytes); but three
    # warpgroups' 160 registers do not hold the turns' counts beside the
    # staging's (ptxas spills 116 bytes): there, each pair as it is
    STAGE = not (TIGHT and PING_PONG)
    store_rows = make_store_rows_staged(pack, NO) if STAGE else \
        make_store_rows16(pack, NO)
    STAGED = 16 * 2 * D_V  # bytes a warp stages: 16 rows
    IN_Q = stage_bytes(D, D_V, size) == 0
    STAGE_AT = Q_B + 2 * (K_B + V_B)  # where not in Q_i's tile
    lbo_k, sbo_k, _, _ = fragments.k_major_128b(BR)
    s_issue = mma_ss(BC, KD, k_steps_128b(BR, KD), k_steps_128b(BC, KD),
                     kind, wait=False)
    if eight:  # V^T (d_v x keys), read K-major as K is
        to_a = make_a8(KP)
        lbo_v, sbo_v, _, _ = fragments.k_major_128b(D_V)
        o_issue = mma_rs(D_V, KP, k_steps_128b(D_V, KP), kind, trans_b=0,
                         wait=False)
        # a V^T box: `box` keys (x) of all d_v rows; boxes along the keys
        v_panels, v_rows, keys_x = BC // box, D_V, 1
    else:  # V (keys x d_v), read MN-major
        to_a = make_to_a(pack, KP)
        lbo_v, sbo_v, step_v = fragments.mn_major_128b(BC)
        o_issue = mma_rs(D_V, KP, step_v, kind, wait=False)
        # a V box: `box` columns (x) of Bc keys (y); boxes along x
        v_panels, v_rows, keys_x = D_V // box, BC, 0
    s_wait_one = wait_for(1, NS * 4)  # S in; O += P V may still fly
    s_wait = wait_for(0, NS * 4)
    o_wait = wait_for(0, NO * 4, KP * 4)  # O, and P (its A operand)
    GROUPS_HERE = groups(D, D_V)

    @inline
    def my_turn(g):
        """Wait until consumer warpgroup g may issue: its barrier
        completes with its own 128 threads and the previous one's
        arrival."""
        if PING_PONG:
            bar_sync(int32(TURN + g), int32(256))

    @inline
    def next_turn(g):
        """Hand the turn to the next consumer (round robin)."""
        if PING_PONG:
            bar_arrive(int32(TURN + (g + 1) % GROUPS_HERE), int32(256))

    @inline
    def run(q, k, v, o, lse, bad, rules, kv_len, mask, maps, out_scale):
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
        # rank 0, the last query block, starts first: under a causal mask
        # the last blocks visit the most tiles; the grid says how many
        # heads start together (flashlab.order)
        b, rank = block_place(cuda.blockIdx.x, cuda.blockIdx.y,
                              cuda.blockIdx.z, cuda.gridDim.x)
        if rules.key_half:  # blockIdx.x is the half, not a head
            b = cuda.blockIdx.z
        if b >= q.shape[0]:
            return
        bk = b // rules.group  # the K/V head of query head b
        # rank and rows a sum of blockIdx.y and parameters: a rank chosen
        # block by block made ptxas spill at three warpgroups (chapter 12)
        i0 = (cuda.gridDim.y - 1 - rank + rules.block_shift) * BR
        nq, nk = q.shape[1], k.shape[1]
        i1 = min(i0 + BR, nq)
        kv = kv_len[b]  # once: the loop's asm fences would reload it
        first, last = tile_range(i0, i1, nk, BC, rules, kv)
        if rules.key_half:
            first, last = key_half_tiles(first, last, cuda.blockIdx.x)
        at = shared_address(tiles, 0)
        bars = uint32(at + (ALIGN - at % ALIGN) % ALIGN)
        q_at = bars + uint32(BARRIERS)
        k_at = q_at + uint32(Q_B)  # stage s at + K_B s bytes
        v_at = k_at + uint32(2 * K_B)
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
                                     uint32(Q_B))
                for p in range(D // box):
                    tma.load_3d(q_at + uint32(p * BR * 128), maps_at,
                                int32(p * box), int32(i0), int32(b),
                                bars + uint32(8 * Q_FULL))
                for jt in range(first, last + 1):
                    n = jt - first
                    s, phase = n & 1, (n >> 1) & 1
                    # a stage is free once both warpgroups are done with
                    # it; the first pass finds every stage free
                    tma.wait(bars + uint32(8 * (K_EMPTY + s)),
                             uint32(1 - phase))
                    full = bars + uint32(8 * (K_FULL + s))
                    tma.arrive_expect_tx(full, uint32(K_B))
                    for p in range(D // box):
                        tma.load_3d(k_at + uint32(K_B * s + p * BC * 128),
                                    maps_at + uint64(128), int32(p * box),
                                    int32(jt * BC), int32(bk), full)
                    tma.wait(bars + uint32(8 * (V_EMPTY + s)),
                             uint32(1 - phase))
                    full = bars + uint32(8 * (V_FULL + s))
                    tma.arrive_expect_tx(full, uint32(V_B))
                    for p in range(v_panels):
                        tma.load_3d(
                            v_at + uint32(V_B * s + p * v_rows * 128),
                            maps_at + uint64(256),
                            int32(p * box + jt * BC * keys_x),
                            int32(jt * BC * (1 - keys_x)), int32(bk),
                            full)
            return
        take()
        wg = warp_uniform((w - 4) // 4)  # this consumer warpgroup
        if wg == 0 and first < last:  # the first turn is consumer 0's
            if PING_PONG:
                bar_arrive(int32(TURN), int32(256))
        row = i0 + 16 * (w - 4) + lane // 4  # this lane's first row (g)
        # this warpgroup's 64 rows r0..r1-1 and the last tile they visit
        # (`own_last`): under a causal mask a block's last tiles are
        # masked out for its first warpgroups, which only hand them back,
        # and fewer tiles need a mask for 64 rows than for 192
        # (order.warpgroup_visits: at 1K, a quarter of the visits and
        # half of the masked ones go)
        r0 = i0 + 64 * wg
        r1 = min(r0 + 64, nq)
        own_last = min(last, last_tile(r1, nk, BC, rules, kv)) \
            if r0 < r1 else first - 1
        q_desc = uint64(descriptor_128b(
            q_at + uint32(64 * 128 * ((w - 4) // 4)), lbo_k, sbo_k))
        k_desc = uint64(descriptor_128b(k_at, lbo_k, sbo_k))
        v_desc = uint64(descriptor_128b(v_at, lbo_v, sbo_v))
        k_next = uint64(K_B >> 4)  # descriptor step to the other stage
        v_next = uint64(V_B >> 4)
        for h in range(2):
            m[h] = NEG_INF
            l[h] = F0
            seen[h] = 0
        for n in range(NO):
            for x in range(4):
                of[n, x] = F0
        # the tiles that need no mask: one run, found once here. Tested
        # tile by tile (int64 bounds of causal, window and padding), the
        # test sat on each tile's critical path. (Where three warpgroups
        # share the registers, a tile that is not full still takes
        # tile_softmax: known_softmax there makes ptxas spill.)
        full_lo, full_hi = int32(0), int32(-1)
        if not rules.use_mask and first <= own_last:
            lo, hi = full_run(r0, r1, first, own_last, nk, BC, rules, kv)
            full_lo, full_hi = int32(lo), int32(hi)
        if first <= own_last:
            tma.wait(bars + uint32(8 * Q_FULL), uint32(0))
            tma.wait(bars + uint32(8 * K_FULL), uint32(0))
            s_issue(sf, q_desc, k_desc)  # S = Q_i K_first^T
            s_wait(sf)
            tma.arrive(bars + uint32(8 * K_EMPTY))
            if TIGHT:
                tile_softmax(sf, m, l, al, seen, NS, BC, b, row, r0, r1,
                             first * BC, nq, nk, rules, kv_len, mask, kv,
                             poly)
            else:
                known_softmax(sf, m, l, al, seen, NS, b, row, first * BC,
                              nq, nk, rules, kv_len, mask,
                              full_lo <= int32(first) <= full_hi, poly)
            to_a(pf, sf)
        for jt in range(first + 1, own_last + 1):
            # stage and phase by bits: n // 2 % 2 of a signed n costs a
            # dozen instructions ahead of every tile's products
            n = jt - first
            s, phase = n & 1, (n >> 1) & 1
            ps, p_phase = (n - 1) & 1, ((n - 1) >> 1) & 1  # tile jt - 1
            tma.wait(bars + uint32(8 * (K_FULL + s)), uint32(phase))
            my_turn(wg)
            s_issue(sf, q_desc, k_desc + k_next * uint64(s))  # S_{i,j}
            tma.wait(bars + uint32(8 * (V_FULL + ps)), uint32(p_phase))
            o_issue(of, pf, v_desc + v_next * uint64(ps))  # += P V_{j-1}
            next_turn(wg)
            s_wait_one(sf)
            tma.arrive(bars + uint32(8 * (K_EMPTY + s)))
            # the softmax of tile jt while P V of tile jt - 1 runs
            if not TIGHT:
                known_softmax(sf, m, l, al, seen, NS, b, row, jt * BC, nq,
                              nk, rules, kv_len, mask,
                              full_lo <= int32(jt) <= full_hi, poly)
                o_wait(of, pf)
            elif full_lo <= int32(jt) <= full_hi and not rules.use_dropout:
                plain_softmax(sf, m, l, al, seen, NS, rules, poly)
                o_wait(of, pf)
            else:  # a mask or dropout needs registers that P holds:
                o_wait(of, pf)  # P V first (a few tiles of a causal row)
                tile_softmax(sf, m, l, al, seen, NS, BC, b, row, r0, r1,
                             jt * BC, nq, nk, rules, kv_len, mask, kv,
                             poly)
            tma.arrive(bars + uint32(8 * (V_EMPTY + ps)))
            rescale(of, al, NO)
            to_a(pf, sf)
        if first <= own_last:  # O_i += P V of its last tile
            n = own_last - first
            tma.wait(bars + uint32(8 * (V_FULL + (n & 1))),
                     uint32((n >> 1) & 1))
            o_issue(of, pf, v_desc + v_next * uint64(n & 1))
            o_wait(of, pf)
            tma.arrive(bars + uint32(8 * (V_EMPTY + (n & 1))))
        # the block's tiles past its own: each stage handed back once it
        # is full (an arrival before then would count towards the stage's
        # previous tile, whose readers may not all be done). A block that
        # visits no tile (first > last) has none to hand back: its rows'
        # own_last of -1 would count from tile 0 and wait for copies that
        # never come
        for jt in range(max(own_last + 1, first), last + 1):
            if jt > first:  # every consumer takes each turn, or the
                my_turn(wg)  # others would wait for it forever
                next_turn(wg)
            n = jt - first
            s, phase = n & 1, (n >> 1) & 1
            tma.wait(bars + uint32(8 * (K_FULL + s)), uint32(phase))
            tma.arrive(bars + uint32(8 * (K_EMPTY + s)))
            tma.wait(bars + uint32(8 * (V_FULL + s)), uint32(phase))
            tma.arrive(bars + uint32(8 * (V_EMPTY + s)))
        if eight:  # V's per-tensor scale, on the sum it weighted
            for n in range(NO):
                for x in range(4):
                    of[n, x] *= out_scale
        # rows from block_shift Br on; halves of keys to heads x BH + b
        row0 = rules.block_shift * BR
        b_to = cuda.blockIdx.x * q.shape[0] + b if rules.key_half else b
        if not STAGE:
            store_rows(o, lse, of, m, l, seen, bad, bk, b_to, row - row0,
                       lane, nq - row0)
            return
        if first <= last:  # Q_i landed: no copy writes its tile after
            # the staging (a warpgroup that visits no tile never waited)
            tma.wait(bars + uint32(8 * Q_FULL), uint32(0))
        if TIGHT:
            # the thread's places read afresh: at 160 registers a place
            # worked out at the start and held across the loop spills
            # (104 bytes); through `opaque` ptxas cannot hoist it there
            t3 = int32(opaque(uint32(cuda.threadIdx.x)))
            w3, lane = t3 // 32, t3 % 32
            o_at = opaque(q_at) + uint32(stage_place((w3 - 4) % 4,
                                                     (w3 - 4) // 4, BR,
                                                     STAGED))
        elif IN_Q:  # among the rows of Q_i that only its warpgroup read
            o_at = q_at + uint32(stage_place((w - 4) % 4, wg, BR, STAGED))
        else:
            o_at = q_at + uint32(STAGE_AT + (w - 4) * STAGED)
        store_rows(o, lse, of, m, l, seen, bad, bk, b_to, row - row0, lane,
                   nq - row0, o_at)

    if eight:
        @cuda.jit
        def forward_v8_e4m3(q, k, v, o, lse, bad, rules, kv_len, mask,
                            descale_v, maps):
            # q, k: (BH, N, d) e4m3 bytes; v: V^T (BH_kv, d_v, Nk') in
            # to_v_t's key order; o: (BH, Nq, d_v / 2) bf16 pairs
            run(q, k, v, o, lse, bad, rules, kv_len, mask, maps, descale_v)

        return forward_v8_e4m3

    @cuda.jit
    def forward_v8(q, k, v, o, lse, bad, rules, kv_len, mask, maps):
        # q, k, v: (BH, N, d) 16-bit bits; o: (BH, Nq, d_v / 2) pairs;
        # maps: the tensor maps of q, k, v, 16 words each
        run(q, k, v, o, lse, bad, rules, kv_len, mask, maps, F0)

    return forward_v8


def make_e4m3(D, D_V):
    """The v8 kernel for e4m3 inputs (float8_e4m3fn bytes): S = Q K^T and
    O += P V on 8-bit wgmma (k32), P rounded to e4m3, V given transposed
    (V^T, d_v x keys, see to_v_t: an 8-bit B operand is read K-major
    only), O stored bf16 times descale_v. Q and K's descales are the
    caller's, folded into tau."""
    return make(D, D_V, "e4m3")


def compile_ptx(d, d_v, kind="bf16"):
    """PTX of v8 on `kind` inputs for sm_90a; needs no GPU."""
    from numba import cuda

    from flashlab.gpu import build, registry

    spec = registry.get(f"forward_v8_{kind}")
    with build.compiling_without_gpu(CC[:2]):
        ptx, _ = cuda.compile_ptx(spec.make(d, d_v).py_func,
                                  registry.argument_types(spec.args), cc=CC)
    return ptx


# the host's side: tensor maps --------------------------------------------

def encode(address, rows, heads, cols, box_rows, size=2):
    """The 128-byte TMA tensor map (16 uint64 words) of a (heads, rows,
    cols) array of `size`-byte values at `address` (16-bit, e4m3, or
    float32 for size 4): boxes of 128 bytes of columns x box_rows rows of
    one head, 128-byte swizzled, rows and columns past the end read as
    zeros (and left out of a store or a reduction)."""
    from cuda.bindings import driver

    u64, u32 = driver.cuuint64_t, driver.cuuint32_t
    kinds = driver.CUtensorMapDataType
    err, tmap = driver.cuTensorMapEncodeTiled(
        {2: kinds.CU_TENSOR_MAP_DATA_TYPE_UINT16,
         1: kinds.CU_TENSOR_MAP_DATA_TYPE_UINT8,
         4: kinds.CU_TENSOR_MAP_DATA_TYPE_FLOAT32}[size],
        u32(3), address, [u64(cols), u64(rows), u64(heads)],
        [u64(cols * size), u64(rows * cols * size)],
        [u32(SWIZZLE_BYTES // size), u32(box_rows), u32(1)],
        [u32(1), u32(1), u32(1)],
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
    br, bc = block_rows(d, d_v), BLOCK_K[d]
    return np.concatenate([encode(q_at, nq, bh, d, br),
                           encode(k_at, nk, bh_kv, d, bc),
                           encode(v_at, nk, bh_kv, d_v, bc)])


def tensor_maps_e4m3(q_at, k_at, v_at, bh, nq, bh_kv, nk, d, d_v, keys):
    """tensor_maps of e4m3 q, k and V^T (bh_kv, d_v, keys) at v_at: boxes
    of 128 bytes of Q_i's and K_j's rows, and of V^T's key columns."""
    br, bc = block_rows(d, d_v), BLOCK_K[d]
    return np.concatenate([encode(q_at, nq, bh, d, br, 1),
                           encode(k_at, nk, bh_kv, d, bc, 1),
                           encode(v_at, d_v, bh_kv, keys, d_v, 1)])


class _Slots:
    """Tensor maps in device memory: a ring of SLOTS sets, each copied on
    its launch's stream from a pinned host row that stays as it is until
    the copy has run. A set is made once per pointers and shapes (a
    training loop's tensors come back at the same addresses), and its
    slot is reused SLOTS sets later, after its copy has finished. A CUDA
    graph that captured a launch reads the slot it was given: replay it
    before SLOTS other sets have been made."""

    SLOTS = 256

    def __init__(self, words=48):
        from numba import cuda

        self.words = words  # of one set: 16 a tensor map
        self.host = cuda.pinned_array((self.SLOTS, words), np.uint64)
        self.device = cuda.device_array((self.SLOTS, words), np.uint64)
        # its address, read once: numba builds the interface dict anew
        # at every reading, and a launch needs only this number
        self.base = self.device.__cuda_array_interface__["data"][0]
        self.copied = [None] * self.SLOTS  # each slot's copy event
        self.keys = [None] * self.SLOTS
        self.made = [0] * self.SLOTS  # each slot's sets so far: a caller
        # that remembers a slot checks that it still holds its set
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
            self.made[slot] += 1
            on = cuda.external_stream(stream)
            self.device[slot].copy_to_device(self.host[slot], stream=on)
            self.copied[slot] = cuda.event(timing=False)
            self.copied[slot].record(on)
            self.keys[slot], self.slot_of[key] = key, slot
        return self.base + slot * self.words * 8


_SLOTS = []  # the one _Slots, made at the first launch


_FIELDS = struct.Struct("<Q3q")  # an array's data pointer and three dims


def _maps_for(packed, stream, eight=False):
    """The device address of the tensor maps of the q, k, v packed in
    `packed` (arguments 0, 1, 2; v as V^T where `eight`)."""
    from flashlab.gpu.launch import DATA_FIELD

    dims = packed.memo.get("v8 dims")  # fixed for a packed buffer
    if dims is None:
        offset = packed.kernel.layout.offset
        dims = packed.memo["v8 dims"] = tuple(
            x for arg in range(3) for x in _FIELDS.unpack_from(
                packed.buffer, offset(arg, DATA_FIELD))[1:])
    q_at, k_at, v_at = (packed.pointer(0), packed.pointer(1),
                        packed.pointer(2))
    if not _SLOTS:
        _SLOTS.append(_Slots())
    last = packed.memo.get("v8 last")  # a loop's calls: the same tensors
    if last is not None and last[0] == q_at and last[1] == k_at \
            and last[2] == v_at and _SLOTS[0].made[last[3]] == last[4]:
        return last[5]
    bh, nq, d, bh_kv, nk, _, _, n1, n2 = dims
    slots = _SLOTS[0]
    if eight:  # V^T: (bh_kv, d_v, keys)
        at = slots.address(
            (q_at, k_at, v_at, dims, 1),
            lambda: tensor_maps_e4m3(q_at, k_at, v_at, bh, nq, bh_kv, nk,
                                     d, n1, n2), stream)
    else:
        at = slots.address(
            (q_at, k_at, v_at, dims),
            lambda: tensor_maps(q_at, k_at, v_at, bh, nq, bh_kv, nk, d,
                                n2), stream)
    slot = (at - slots.base) // (slots.words * 8)
    packed.memo["v8 last"] = (q_at, k_at, v_at, slot, slots.made[slot], at)
    return at


def derived(d, d_v, eight=False):
    """launch.Derived of v8's last argument, the tensor maps (argument 9,
    or 10 after e4m3's descale_v)."""
    from flashlab.gpu.launch import Derived

    def placeholders():
        return (cuda.device_array(48, np.uint64),)

    def update(packed, stream):
        packed.point(10 if eight else 9, _maps_for(packed, stream, eight))

    return Derived(placeholders, update)


def derived_e4m3(d, d_v):
    """launch.Derived of the e4m3 kernel's tensor maps."""
    return derived(d, d_v, eight=True)


key_of_column8 = cuda.jit(device=True)(fragments.key_of_column8)
KEYS8 = 32  # keys of one e4m3 k-step: V^T's key order repeats every 32


@cuda.jit
def transpose_keys8(v, v_t):
    """V^T of e4m3 bytes, as to_v_t lays it out: v (BH_kv, Nk, d_v / 4)
    and v_t (BH_kv, d_v, Nk' / 4) as uint32 words of 4 bytes, blocks (Nk'
    / 32, BH_kv) of 2 d_v threads (transpose_threads).

    Four consecutive columns of V^T's key order hold two pairs of
    neighbouring keys (key_of_column8), so a thread loads word c (columns
    4 c .. 4 c + 3) of those four keys' rows and stores byte i of each as
    word 4 c + i of V^T: one pass, no shared memory, and the eight
    threads of one c write a row's 32 bytes together. Keys past Nk read
    as zeros."""
    b, g, t = cuda.blockIdx.y, cuda.blockIdx.x, cuda.threadIdx.x
    nk, words = v.shape[1], v.shape[2]
    c, w = t // 8, t % 8  # V's word column; V^T's word within the 32
    if c < words:
        x = cuda.local.array(4, uint32)
        for y in range(4):
            key = KEYS8 * g + key_of_column8(4 * w + y)
            x[y] = v[b, key, c] if key < nk else uint32(0)
        for i in range(4):
            out = uint32(0)
            for y in range(4):
                out |= ((x[y] >> uint32(8 * i)) & uint32(255)) << uint32(
                    8 * y)
            v_t[b, 4 * c + i, (KEYS8 // 4) * g + w] = out


def transpose_threads(d_v):
    """Threads per block of transpose_keys8: 8 per word of a V row."""
    return 8 * (d_v // 4)


def to_v_t(v):
    """V (..., Nk, d_v) e4m3 torch tensor (or its uint8 codes) -> V^T
    (..., d_v, Nk') uint8,
    Nk' = Nk rounded up to 32 (zeros past Nk), keys of each 32 in the
    order of fragments.key_order_8bit: the B operand of P V that an 8-bit
    wgmma reads K-major, one copy that makes packing P free. The torch
    model of transpose_keys8, which the host runs."""
    import torch

    *lead, nk, d_v = v.shape
    keys = -(-nk // 32) * 32
    x = v.reshape(-1, nk, d_v).view(torch.uint8)
    if keys != nk:
        x = torch.nn.functional.pad(x, (0, 0, 0, keys - nk))
    # key 16 h + 8 a + 2 t + c goes to column 16 h + 4 t + 2 a + c
    x = x.view(-1, keys // 32, 2, 2, 4, 2, d_v).permute(0, 6, 1, 2, 4, 3, 5)
    return x.reshape(*lead, d_v, keys)
