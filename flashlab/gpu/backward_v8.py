"""Backward v8: backward_v7's dK/dV kernel, warp-specialized.

bf16 or float16, sm_90a, d = d_v = 64 or 128. FlashAttention-3's
producer and consumers (forward_v8's design) on backward_v7's dK/dV
tiles: a block is one producer warpgroup and two consumer warpgroups of
64 keys each. The producer's thread 0 moves K_j, V_j once and each
streamed Q_i, dO_i (64 queries, STAGES of them in flight) from global to
shared memory with TMA, 128-byte swizzled as v7's copies lay them; 64
more of its threads work out the stage's row terms
(backward_v5.row_terms) into shared memory. Both hand a stage over on
its "full" mbarrier (the bytes, and 65 arrivals), and the consumers give
it back on its "empty" one once dK's product, the last to read it, is
done. v7's dK/dV kernel has its 256 threads copy every stage and meet at
a block barrier per tile (measured on the H200 at d = 64: 0.54 warps
stalled on it per issue); here no warpgroup waits for another, and
`setmaxnreg` gives the producer's registers to the consumers (24 and 240
a thread, from a build cap of 168: the consumers' tiles need about 234,
which three warpgroups could not have otherwise). At d = 128 too: dK_j
and dV_j are 64 + 64 of a consumer's registers, S^T and dP^T 32 + 32,
and ptxas fits them in 240 with nothing spilled (v7's 253 there is what
its cap of 255 allowed, not what it needs).

dQ is backward_v7's dQ kernel (`make_dq`): backward version 8 is this
kernel and that one. The host encodes the four tensor maps (`derived`)
as forward_v8 does.

`make_fused` (where the caller allows atomics: deterministic=False) is
FlashAttention-3's whole backward in one pass: the same kernel also
forms dQ_i = dS K_j, dS^T kept in shared memory and read MN-major as
backward_v7's fused kernel does, but over all of the block's 128 keys,
with dQ_i's columns split between the two warpgroups (`dq_columns`).
They stage tau dQ_i in shared memory as TMA's float32 boxes lie, one
64 x d tile a block and tile pair, and one more producer thread adds
each staged tile to a float32 dQ in global memory with TMA's reduction
(`cp.reduce.async.bulk.tensor`), so the consumers never wait for an
atomic. Five products a tile pair instead of seven; dQ's last bits vary
with the order the additions land in. At d = 128 it streams two stages
(FUSED_STAGES: four would not fit beside its dS^T and dQ tiles), and
its consumers work out their store places from a thread index read
through intrinsics.opaque inside the loop (`place_source`): worked out
once before it, they stayed live across the loop and ptxas spilled
them. Measured on the H200 at 16K it is 13 to 16% faster than this
kernel with v7's dQ kernel at d = 64 and 128.

`make_ordered` is backward version 9: the fused kernel with the same
bits every run. The key blocks that visit a query tile add to it in rank
order, as FlashAttention-3's deterministic backward does: the thread
that hands a tile to TMA waits until an int32 count of that tile's
additions, in global memory, says the blocks of lower rank have made
theirs (an acquire load in a loop), waits for its own reductions to be
done, not only read, and adds one to the count (a release). Blocks
start in rank order (flashlab.order), so a block only waits for blocks
that started before it, and it takes its query tiles last to first
(`next_item_down`), where blocks of lower rank are never behind it. The
host passes the counts zeroed, beside the float32 dQ: the block whose
turn at a tile is first stores its part (TMA's store, the same box) and
the others add theirs, so dQ needs zeros only where a query tile may
have no key block (host.py's `_stores_every_tile`). See chapter 12.
"""

import numpy as np
from numba import cuda, float32, int16, int32, uint32, uint64

from flashlab import fragments
from flashlab.gpu import forward_v8, tma
from flashlab.gpu.backward_v5 import row_terms
from flashlab.gpu.backward_v7 import (
    PACKS,
    STREAMED,
    WG_ROWS,
    _dq_hooks,
    _no_ds,
    key_descriptors,
    make_scores_t,
    make_store_pairs,
    next_item,
    own,
)
from flashlab.gpu.device import F0, inline, tile_skipped
from flashlab.gpu.forward_v7 import ALIGN, CC, descriptor_128b, make_to_a
from flashlab.gpu.intrinsics import (
    bar_sync,
    global_address,
    opaque,
    shared_address,
)
from flashlab.gpu.warp import block_place, tile_range
from flashlab.gpu.wgmma import mma_rs, mma_ss, proxy_fence, wait_for

__all__ = ["CC", "FUSED_HEAD_DIMS", "HEAD_DIMS", "make_dkv", "make_fused",
           "make_ordered", "shared_bytes", "threads"]

HEAD_DIMS = (64, 128)  # of the dK/dV kernel
# of the fused kernel (the host runs it at d = d_v only)
FUSED_HEAD_DIMS = (64, 128)
GROUPS = 2  # consumer warpgroups: 128 keys a block, as v7's
# by kernel: (the cap per thread it is built with: 65536 registers over
# 384 threads, a multiple of 8; what setmaxnreg leaves the producer; and
# gives each consumer thread). The block holds 168 x 384 = 64512, and
# the consumers' increase waits until the producer's decrease covers it:
# 24 x 128 + 240 x 256 = 64512. The fused kernel's producer keeps 40
# (in 24 or 32 its dQ thread spills, ptxas says; in 40 nothing does)
REGISTERS = {"dkv": (168, 24, 240), "fused": (168, 40, 232)}
# stages of the streamed Q_i, dO_i: a power of two (measured on the H200
# against two: 1 to 4% faster at d = 64 fused and at N = 4096, d = 128,
# the same within noise elsewhere)
STAGES = 4
# the fused kernel's where not STAGES, by head dim: at d = 128 four
# stages and its two dS^T and dQ tiles would not fit in 227 KiB
FUSED_STAGES = {128: 2}
# mbarrier numbers: K_j and V_j landed; (fused) dQ tile buffer u staged
# (DQ_FULL + u) and read by TMA (DQ_EMPTY + u); stage s full (FULL + s),
# then each stage's empty (`barrier_numbers`). They lie in static shared
# memory, at an address the assembler knows (no register holds it), and
# the dynamic tiles from its first 1024-byte boundary (the 128-byte
# swizzle's period) with none of a 1024 spent on them
KV_FULL, DQ_FULL, DQ_EMPTY, FULL = 0, 1, 3, 5
TERM_THREADS = STREAMED  # the producer's threads 64.. : a query each
DRAIN = 32  # (fused) the producer's thread that issues dQ's reductions
BOX = 64  # columns of a TMA box: one 128-byte swizzle row of 16 bits
DQ_BOX = 32  # float32 columns of a dQ box: 128 bytes too


def barrier_numbers(stages):
    """(the first empty mbarrier, how many there are) with `stages`."""
    return FULL + stages, FULL + 2 * stages


def stages(d, d_v, fused=False):
    """Stages of Q_i, dO_i in flight: STAGES, or FUSED_STAGES by head
    dim for the fused kernel."""
    return FUSED_STAGES.get(max(d, d_v), STAGES) if fused else STAGES


def threads(d=64, d_v=64):
    """Threads per block: the producer's warpgroup and the consumers'."""
    return 128 * (GROUPS + 1)


def max_registers(d=64, d_v=64):
    """The registers per thread both kernels are built with."""
    return REGISTERS["dkv"][0]


def shared_bytes(d, d_v, fused=False):
    """Dynamic shared memory per block: K_j and V_j, `stages` stages of
    Q_i and dO_i, (fused) two each of dS^T of the block's keys and of a
    float32 dQ tile, and room to align them to 1024 bytes."""
    extra = 2 * (2 * own("dkv") * STREAMED + dq_bytes(d)) if fused else 0
    n = stages(d, d_v, fused)
    return 2 * (own("dkv") * (d + d_v)
                + n * STREAMED * (d + d_v)) + extra + ALIGN


def static_bytes(d=64, d_v=64, fused=False):
    """Static shared memory per block: the mbarriers, each stage's row
    terms (three float32 a query), and where each staged dQ tile goes
    (two int32 pairs, declared by both kernels)."""
    n = stages(d, d_v, fused)
    return 8 * barrier_numbers(n)[1] + 4 * 3 * n * STREAMED + 16


def dq_bytes(d):
    """Bytes of one staged float32 dQ tile: STREAMED rows, d wide."""
    return 4 * STREAMED * d


def dq_columns(d):
    """Columns of dQ_i a consumer warpgroup of the fused kernel takes:
    d / GROUPS (32 at d = 64, one panel's 64 at d = 128)."""
    return d // GROUPS


def make_dkv(D, D_V, kind="bf16"):
    """dK = tau dS^T Q and dV = P^T dO for head dims D, D_V and `kind`,
    warp-specialized."""
    return _make(D, D_V, kind, with_dq=False)


def make_fused(D, D_V, kind="bf16"):
    """make_dkv's kernel that also adds dQ = tau dS K of every tile pair to
    a float32 dQ by TMA's reductions: the whole backward in one pass."""
    return _make(D, D_V, kind, with_dq=True)


def make_ordered(D, D_V, kind="bf16"):
    """make_fused's kernel with each dQ tile's additions made in the
    order of the key blocks (backward version 9): the same bits every
    run."""
    return _make(D, D_V, kind, with_dq=True, ordered=True)


c_place = cuda.jit(device=True)(fragments.c_pair_offset32)


@inline
def _as_is(x):
    return x


@inline
def _opaque(x):
    return opaque(uint32(x))


def place_source(d):
    """What the fused kernel passes a thread's index through before it
    works out store places from it: at d = 128, intrinsics.opaque, so the
    places are worked out in the loop where they are used (hoisted out of
    it, ptxas spilled them: 144 bytes), else nothing."""
    return _opaque if d > BOX else _as_is


@inline
def next_item_down(g, it, groups, nt, nq, j0, j1, rules, kv_len, b0):
    """The ordered kernel's next_item: query tiles last to first, and at
    each tile the group's query heads in turn (g = -1, it = nt - 1 before
    the first); the first (g, it) after (g, it) that keys j0..j1-1 do not
    skip, g = groups if none is left.

    Its blocks add to a dQ tile in rank order, and start in rank order.
    Taken first to last, a block's first tile under a causal mask is the
    diagonal's, 2 r tiles in for rank r, which blocks of lower rank
    started at the same time reach only 2 r tiles later: each would wait
    that long. Taken last to first, every block starts at the last tile
    and blocks of lower rank are never behind (a window's runs, which
    move up with the rank, too); and tile by tile, not head by head, or
    with grouped heads a block of high rank, with fewer tiles a head,
    would reach the next head first and wait there.
    """
    g += 1
    while it >= 0:
        if g == groups:
            g = 0
            it -= 1
        else:
            i0 = it * STREAMED
            if not tile_skipped(i0, min(i0 + STREAMED, nq), j0, j1, rules,
                                kv_len[b0 + g]):
                return g, it
            g += 1
    return groups, it


def _stage_hooks(D, kind, ordered=False):
    """The fused kernel's steps of dQ_i = dS K_j, after dS^T is in
    shared memory: `start` (warpgroup c takes dQ_i's columns C c.., C =
    dq_columns(D), over all of the block's keys: one tile a block, not
    one a warpgroup, for TMA to add), `stage` (waits for the product and
    puts it where TMA reads it, `close` after the last), and `drain`, the
    producer's thread DRAIN that adds each staged tile to dQ (`ordered`:
    in turn, see `make_ordered`)."""
    BK, BQ, DQ_B = own("dkv"), STREAMED, dq_bytes(D)
    COLS = dq_columns(D)
    placed = place_source(D)
    turn, turn_done = _turns(ordered)
    lbo, sbo, step = fragments.mn_major_128b(BK)
    # dS (queries x keys) and K_j's columns: dS^T and K_j read MN-major
    q_issue = mma_ss(COLS, BK // 16, step, step, kind, trans_b=1,
                     wait=False, trans_a=1)
    q_wait = wait_for(0, COLS // 2)  # the 64 x COLS accumulator

    @inline
    def start(gq, ds_at, k_at, wc):
        proxy_fence()  # this thread's dS^T stores to wgmma's proxy, then
        bar_sync(1, 128 * GROUPS)  # every consumer's
        # warpgroup c's columns: bytes into K_j's panels of 64 columns
        # (half a row at d = 64, a panel of BK rows at 128)
        c0 = COLS * (wc // 4)
        cols = uint32(2 * (c0 % BOX) + BK * 128 * (c0 // BOX))
        q_issue(gq, uint64(descriptor_128b(ds_at, lbo, sbo)),
                uint64(descriptor_128b(k_at + cols, lbo, sbo)))

    @inline
    def claim(bars, n):
        # tile buffer n % 2, once TMA has read the tile before in it
        u, phase = n & 1, (n >> 1) & 1
        tma.wait(bars + uint32(8 * (DQ_EMPTY + u)), uint32(1 - phase))
        return u

    @inline
    def stage(gq, bars, dq_at, wc, n, lane, tau, where, b, i0):
        # C fragment (x, y) of the warpgroup's columns of dQ_i, times tau,
        # to its place in the tile (its boxes of DQ_BOX columns from
        # COLS (wc // 4) on); the first consumer thread says which rows,
        # dQ[b, i0:], it is added to
        q_wait(gq)
        u = claim(bars, n)
        # this thread among the consumers, read again here (placed)
        tc = placed(uint32(cuda.threadIdx.x - 128))
        box = dq_at + uint32(DQ_B * u) + uint32(BQ * 4 * COLS) * (tc >> 7)
        tw = tc & 127  # the thread in its warpgroup
        for h in range(2):
            for x in range(COLS // 8):
                tma.st_shared_f2(box + uint32(c_place(tw, x, h)),
                                 gq[x, 2 * h] * tau, gq[x, 2 * h + 1] * tau)
        if tc == 0:
            where[u, 0], where[u, 1] = b, i0
        proxy_fence()  # the stores, to TMA's proxy, before the arrival
        tma.arrive(bars + uint32(8 * (DQ_FULL + u)))

    @inline
    def close(bars, wc, n, lane, where):
        # after the last item: the drain's signal to stop (b = -1)
        u = claim(bars, n)
        if wc == 0 and lane == 0:
            where[u, 0] = -1
        tma.arrive(bars + uint32(8 * (DQ_FULL + u)))

    @inline
    def drain(maps_at, bars, dq_at, where, counts, rank, rules, kv_len, nq,
              nk):
        # each item's staged tile, added to rows i0.. of dQ[b] (the rows
        # past Nq left out by TMA), until told to stop; a buffer is free
        # again once TMA has read it, the additions land on their own.
        # Told where, not working it out: this thread has the producer's
        # few registers. Ordered, a block adds to a tile in its turn,
        # once counts[b, tile] says the ranks before it have (`_turns`)
        n = 0
        while True:
            u, phase = n & 1, (n >> 1) & 1
            tma.wait(bars + uint32(8 * (DQ_FULL + u)), uint32(phase))
            b, i0 = where[u, 0], where[u, 1]
            if b < 0:
                break
            at, first = turn(counts, b, i0, rank, rules, kv_len, nq, nk)
            for p in range(D // DQ_BOX):
                box = dq_at + uint32(DQ_B * u + p * BQ * 128)
                if first:  # the tile's first turn: written, not added
                    tma.store_3d(maps_at + uint64(512), int32(p * DQ_BOX),
                                 i0, b, box)
                else:
                    tma.reduce_add_3d(maps_at + uint64(512),
                                      int32(p * DQ_BOX), i0, b, box)
            tma.bulk_commit()
            # the staged tile read: its buffer is the consumers' again
            # before the additions land (ordered, the turn is passed on
            # once they have)
            tma.bulk_wait_read()
            tma.arrive(bars + uint32(8 * (DQ_EMPTY + u)))
            turn_done(at)
            n += 1
        tma.bulk_wait()  # the additions done before the block leaves

    return start, stage, close, drain


def _turns(ordered):
    """The drain's steps around a tile's additions: (`turn`, which waits
    for this block's turn at the tile and returns where its count is and
    whether the turn is the tile's first, whose tile is stored, and
    `turn_done`, which, ordered, passes the turn on once the additions
    are done)."""
    BK, BQ = own("dkv"), STREAMED
    if not ordered:
        @inline
        def no_turn(counts, b, i0, rank, rules, kv_len, nq, nk):
            return uint64(0), False

        @inline
        def no_pass(at):
            pass

        return no_turn, no_pass

    @inline
    def turn(counts, b, i0, rank, rules, kv_len, nq, nk):
        # the key blocks that visit query tile i0 / BQ of head b are the
        # ranks first..last (tile_range's run); rank r's turn is the
        # (r - first)-th
        first = tile_range(i0, min(i0 + BQ, nq), nk, BK, rules,
                           kv_len[b])[0]
        at = global_address(counts, (b, i0 // BQ))
        tma.wait_count(at, uint32(rank - first))
        return at, rank == first

    @inline
    def done(at):
        tma.bulk_wait()  # the additions made, not only read
        tma.count_up(at)

    return turn, done


@inline
def _no_start(gq, ds_at, k_at, wc):
    pass


@inline
def _no_stage(gq, bars, dq_at, wc, n, lane, tau, where, b, i0):
    pass


@inline
def _no_close(bars, wc, n, lane, where):
    pass


@inline
def _no_drain(maps_at, bars, dq_at, where, counts, rank, rules, kv_len, nq,
              nk):
    pass


def _make(D, D_V, kind, with_dq, ordered=False):
    """The kernel of a block of keys: dK and dV, and with_dq dQ too (in
    key-block order if `ordered`)."""
    BK, BQ = own("dkv"), STREAMED  # keys per block, queries per tile
    CONSUMERS = 128 * GROUPS  # consumer threads
    # stage n % NSTAGES of Q_i, dO_i, in phase (n / NSTAGES) % 2: by bits
    NSTAGES = stages(D, D_V, with_dq)
    SB = NSTAGES.bit_length() - 1
    if NSTAGES != 1 << SB:
        raise ValueError(f"STAGES: expected a power of two, got {NSTAGES}")
    EMPTY, MBARRIERS = barrier_numbers(NSTAGES)
    _, keep, grow = REGISTERS["fused" if with_dq else "dkv"]
    release = tma.release_registers[keep]  # the producer's setmaxnreg
    take = tma.take_registers[grow]  # and the consumers'
    KP = BQ // 16  # k-steps of dK and dV (S^T's: make_scores_t)
    NS, NK, NV = BQ // 8, D // 8, D_V // 8  # n-tiles: S^T, dK, dV
    K_B, V_B = 2 * BK * D, 2 * BK * D_V  # the block's own tiles, bytes
    Q_B, O_B = 2 * BQ * D, 2 * BQ * D_V  # one stage of each streamed
    STAGE_B = Q_B + O_B
    step_t = fragments.mn_major_128b(BQ)[2]  # Q_i, dO_i as B
    scores_t = make_scores_t(D, D_V, kind)
    v_issue = mma_rs(D_V, KP, step_t, kind, wait=False)
    k_issue = mma_rs(D, KP, step_t, kind, wait=False)
    v_wait = wait_for(1, NV * 4, KP * 4)  # dV and P^T (dK may fly)
    # dK and dS^T (dQ may fly)
    k_wait = wait_for(int(with_dq), NK * 4, KP * 4)
    to_a = make_to_a(PACKS[kind], KP)
    store_k = make_store_pairs(PACKS[kind], NK)
    store_v = make_store_pairs(PACKS[kind], NV)
    # dQ = dS K (fused): backward_v7's fused kernel's first two steps at
    # d = 64 (each warpgroup its own keys), then stage and drain; no-ops
    # for make_dkv
    keep_ds = _dq_hooks(D, kind)[0] if with_dq else _no_ds
    placed = place_source(D)
    start_dq, stage_dq, close, drain = _stage_hooks(D, kind, ordered) \
        if with_dq else (_no_start, _no_stage, _no_close, _no_drain)
    # the order of a block's query tiles: up, or (ordered) down, so that
    # at any tile the blocks of lower rank, whose additions come first,
    # are ahead (`next_item_down`)
    step = next_item_down if ordered else next_item
    DS_B = 2 * BK * BQ  # dS^T of the block's keys (fused)
    # n-tiles of a warpgroup's part of dQ_i (fused)
    DQ_TILES = dq_columns(D) // 8
    # bytes from the aligned start to K_j, dS^T and the dQ tiles
    K_AT = 0
    DS_AT = K_AT + K_B + V_B + NSTAGES * STAGE_B
    DQ_AT = DS_AT + 2 * DS_B  # after two of dS^T

    @inline
    def run(q, k, v, do, stats, delta, dk, dv, dq, counts, rules, kv_len,
            mask, maps):
        # q, do: (BH, Nq, d) and k, v: (BH_kv, Nk, d) 16-bit bits; dk, dv:
        # (BH_kv, Nk, d / 2) 16-bit pairs, one block row per K/V head;
        # stats: shifts (BH, Nq), then norms (BH, Nq) if present; dq
        # (fused): float32 (BH, Nq, d), tau dS K added to it; counts
        # (ordered): int32 (BH, query tiles), zeros; maps: the tensor maps
        # of q, k, v, do (and dq), 16 words each
        tiles = cuda.shared.array(0, int16)  # K_j, V_j, 2 x (Q_i, dO_i)
        barriers = cuda.shared.array(MBARRIERS, uint64)
        # row_terms (shift, zn, dl) of each stage's queries
        terms = cuda.shared.array((NSTAGES, 3, STREAMED), float32)
        # (fused) the query head and first row of each dQ buffer's tile
        where = cuda.shared.array((2, 2), int32)
        t = cuda.threadIdx.x
        w, lane = t // 32, t % 32
        # rank 0, the first key block, starts first: under a causal mask
        # every query visits it (flashlab.order); bk is the K/V head
        bk, rank = block_place(cuda.blockIdx.x, cuda.blockIdx.y,
                               cuda.blockIdx.z, cuda.gridDim.x)
        if bk >= k.shape[0]:
            return
        b0 = bk * rules.group  # the first query head of its group
        j0 = rank * BK
        nq, nk = q.shape[1], k.shape[1]
        j1 = min(j0 + BK, nk)
        nt = (nq + BQ - 1) // BQ
        # the item "before" the first: (head, query tile)
        g_start, before = (-1, nt - 1) if ordered else (0, -1)
        groups = rules.group  # query heads of this K/V head
        at = shared_address(tiles, 0)
        base = uint32(at + (ALIGN - at % ALIGN) % ALIGN)
        k_at = base + uint32(K_AT)
        bars = shared_address(barriers, 0)
        v_at = k_at + uint32(K_B)
        q_at = v_at + uint32(V_B)  # stage s: STAGE_B s bytes on
        o_at = q_at + uint32(Q_B)
        if t == 0:
            # K/V and full: the producer's arrivals (and the bytes);
            # empty: every consumer thread's
            tma.mbarrier_init(bars + uint32(8 * KV_FULL), uint32(1))
            for s in range(NSTAGES):
                tma.mbarrier_init(bars + uint32(8 * (FULL + s)),
                                  uint32(1 + TERM_THREADS))
                tma.mbarrier_init(bars + uint32(8 * (EMPTY + s)),
                                  uint32(CONSUMERS))
            if with_dq:  # the consumers' staging, the drain's reading
                for u in range(2):
                    tma.mbarrier_init(bars + uint32(8 * (DQ_FULL + u)),
                                      uint32(CONSUMERS))
                    tma.mbarrier_init(bars + uint32(8 * (DQ_EMPTY + u)),
                                      uint32(1))
            tma.fence_mbarrier_init()
        cuda.syncthreads()
        maps_at = global_address(maps, 0)
        if w < 4:  # the producer warpgroup
            release()
            if with_dq and t == DRAIN:
                drain(maps_at, bars, base + uint32(DQ_AT), where, counts,
                      rank, rules, kv_len, nq, nk)
                return
            if 0 < t < 128 - TERM_THREADS:
                return
            g, it = step(g_start, before, groups, nt, nq, j0, j1, rules,
                              kv_len, b0)
            if t == 0 and g < groups:
                full = bars + uint32(8 * KV_FULL)
                tma.arrive_expect_tx(full, uint32(K_B + V_B))
                for p in range(D // BOX):
                    tma.load_3d(k_at + uint32(p * BK * 128),
                                maps_at + uint64(128), int32(p * BOX),
                                int32(j0), int32(bk), full)
                for p in range(D_V // BOX):
                    tma.load_3d(v_at + uint32(p * BK * 128),
                                maps_at + uint64(256), int32(p * BOX),
                                int32(j0), int32(bk), full)
            n = 0
            while g < groups:
                s, phase = n & (NSTAGES - 1), (n >> SB) & 1
                b, i0 = b0 + g, it * BQ
                # a stage is free once both consumers are done with it;
                # the first pass finds both free
                tma.wait(bars + uint32(8 * (EMPTY + s)), uint32(1 - phase))
                full = bars + uint32(8 * (FULL + s))
                stage = uint32(STAGE_B * s)
                if t == 0:
                    tma.arrive_expect_tx(full, uint32(STAGE_B))
                    for p in range(D // BOX):
                        tma.load_3d(q_at + stage + uint32(p * BQ * 128),
                                    maps_at, int32(p * BOX), int32(i0),
                                    int32(b), full)
                    for p in range(D_V // BOX):
                        tma.load_3d(o_at + stage + uint32(p * BQ * 128),
                                    maps_at + uint64(384), int32(p * BOX),
                                    int32(i0), int32(b), full)
                else:
                    x = t - (128 - TERM_THREADS)  # this thread's query
                    r0, r1, r2 = row_terms(stats, delta, b, i0 + x, nq,
                                           q.shape[0], rules.drop_scale)
                    terms[s, 0, x], terms[s, 1, x] = r0, r1
                    terms[s, 2, x] = r2
                    tma.arrive(full)
                g, it = step(g, it, groups, nt, nq, j0, j1, rules,
                                  kv_len, b0)
                n += 1
            return
        take()
        sf = cuda.local.array((NS, 4), float32)  # S^T, then P^T Z
        pf = cuda.local.array((NS, 4), float32)  # dP^T, then dS^T
        pa = cuda.local.array((KP, 4), int32)  # P^T Z: A of dV's k-steps
        da = cuda.local.array((KP, 4), int32)  # dS^T: A of dK's k-steps
        gk = cuda.local.array((NK, 4), float32)  # dK_j
        gv = cuda.local.array((NV, 4), float32)  # dV_j
        # (fused) a warpgroup's 64 x 32 of dS K
        gq = cuda.local.array((DQ_TILES, 4), float32)
        wc = w - 4  # this warp among the consumers
        key = j0 + 16 * wc + lane // 4  # this lane's first key (g)
        tq = 2 * (lane % 4)  # this lane's first column in an n-tile
        wg = uint32(WG_ROWS * (wc // 4))  # this warpgroup's keys
        k_desc, v_desc, q_desc, o_desc, qt_desc, ot_desc = \
            key_descriptors(k_at, v_at, q_at, o_at, wg)
        next_stage = uint64(STAGE_B >> 4)  # in descriptor units
        for n in range(NK):
            for x in range(4):
                gk[n, x] = F0
        for n in range(NV):
            for x in range(4):
                gv[n, x] = F0
        tau = rules.scale
        g, it = step(g_start, before, groups, nt, nq, j0, j1, rules, kv_len,
                     b0)
        if g < groups:
            tma.wait(bars + uint32(8 * KV_FULL), uint32(0))
        n = 0
        while g < groups:
            s, phase = n & (NSTAGES - 1), (n >> SB) & 1
            b, i0 = b0 + g, it * BQ
            i1 = min(i0 + BQ, nq)
            tma.wait(bars + uint32(8 * (FULL + s)), uint32(phase))
            at_now = next_stage * uint64(s)
            scores_t(sf, pf, k_desc, q_desc + at_now, v_desc,
                     o_desc + at_now, b, key, i0, i1, j0, j1, nq, nk,
                     rules, kv_len, mask, tau, tq, terms[s, 0],
                     terms[s, 1], terms[s, 2])
            # dV_j += (P^T Z) dO_i and dK_j += dS^T Q_i: the rounded C
            # fragments are the A operands, dO_i and Q_i read MN-major
            to_a(pa, sf)
            v_issue(gv, pa, ot_desc + at_now)
            to_a(da, pf)
            # dS^T to buffer n % 2 (the other may still be read by the
            # other warpgroup's product), before dK's product takes da
            ds_at = base + uint32(DS_AT + DS_B * (n & 1))
            keep_ds(da, ds_at, placed(t - 128))
            k_issue(gk, da, qt_desc + at_now)
            v_wait(gv, pa)
            start_dq(gq, ds_at, k_at, wc)
            k_wait(gk, da)
            tma.arrive(bars + uint32(8 * (EMPTY + s)))  # stage s read
            # the next item worked out while dQ's product (fused) runs
            g, it = step(g, it, groups, nt, nq, j0, j1, rules,
                              kv_len, b0)
            stage_dq(gq, bars, base + uint32(DQ_AT), wc, n, lane, tau,
                     where, int32(b), int32(i0))
            n += 1
        close(bars, wc, n, lane, where)
        store_k(gk, dk, bk, key, nk, lane % 4, tau)
        store_v(gv, dv, bk, key, nk, lane % 4, float32(1))

    if ordered:
        @cuda.jit
        def backward_v9_fused(q, k, v, do, stats, delta, dk, dv, dq, counts,
                              rules, kv_len, mask, maps):
            run(q, k, v, do, stats, delta, dk, dv, dq, counts, rules,
                kv_len, mask, maps)

        return backward_v9_fused

    if with_dq:
        @cuda.jit
        def backward_v8_fused(q, k, v, do, stats, delta, dk, dv, dq, rules,
                              kv_len, mask, maps):
            run(q, k, v, do, stats, delta, dk, dv, dq, kv_len, rules,
                kv_len, mask, maps)

        return backward_v8_fused

    @cuda.jit
    def backward_v8_dkv(q, k, v, do, stats, delta, dk, dv, rules, kv_len,
                        mask, maps):
        run(q, k, v, do, stats, delta, dk, dv, stats, kv_len, rules, kv_len,
            mask, maps)

    return backward_v8_dkv


# the host's side: tensor maps --------------------------------------------

def tensor_maps(q_at, k_at, v_at, do_at, bh, nq, bh_kv, nk, d, d_v,
                dq_at=None):
    """The four tensor maps (64 uint64 words) of (bh, nq, d) q and dO
    and (bh_kv, nk, d / d_v) k and v: Q_i and dO_i boxes of STREAMED
    rows, K_j and V_j boxes of a block's keys, 64 columns each; and with
    dq_at, a fifth of the float32 (bh, nq, d) dQ in boxes of STREAMED rows
    and 32 columns."""
    rows, keys = STREAMED, own("dkv")
    maps = [forward_v8.encode(q_at, nq, bh, d, rows),
            forward_v8.encode(k_at, nk, bh_kv, d, keys),
            forward_v8.encode(v_at, nk, bh_kv, d_v, keys),
            forward_v8.encode(do_at, nq, bh, d_v, rows)]
    if dq_at is not None:
        maps.append(forward_v8.encode(dq_at, nq, bh, d, rows, 4))
    return np.concatenate(maps)


_SLOTS = {}  # a forward_v8._Slots per words of a set, made at first use
MAPS_ARG = 11  # the maps' place among the kernel's arguments (dK/dV)
DQ_ARG = 8  # dQ's place in the fused kernel's, before its maps


def _maps_for(packed, stream, fused):
    """The device address of the tensor maps of the q, k, v, dO packed
    in `packed` (arguments 0 to 3), and of dQ (DQ_ARG) if `fused`. A
    training loop's calls come back with the same tensors: the address
    of the last call's maps is kept in the buffer's memo while its slot
    still holds them, as forward_v8's are."""
    from flashlab.gpu.launch import DATA_FIELD

    at = (packed.pointer(0), packed.pointer(1), packed.pointer(2),
          packed.pointer(3), packed.pointer(DQ_ARG) if fused else None)
    words = 80 if fused else 64
    if words not in _SLOTS:
        _SLOTS[words] = forward_v8._Slots(words)
    slots = _SLOTS[words]
    last = packed.memo.get("maps last")
    if last is not None and last[0] == at \
            and slots.made[last[1]] == last[2]:
        return last[3]
    dims = packed.memo.get("dims")  # fixed for a packed buffer
    if dims is None:
        offset = packed.kernel.layout.offset
        dims = packed.memo["dims"] = tuple(
            forward_v8._FIELDS.unpack_from(
                packed.buffer, offset(arg, DATA_FIELD))[1:]
            for arg in range(3))
    (bh, nq, d), (bh_kv, nk, _), (_, _, d_v) = dims
    q_at, k_at, v_at, do_at, dq_at = at
    address = slots.address(
        (*at, bh, nq, bh_kv, nk, d, d_v),
        lambda: tensor_maps(q_at, k_at, v_at, do_at, bh, nq, bh_kv, nk, d,
                            d_v, dq_at), stream)
    slot = (address - slots.base) // (slots.words * 8)
    packed.memo["maps last"] = (at, slot, slots.made[slot], address)
    return address


def _derived(fused, ordered=False):
    """launch.Derived of the kernel's last argument, the tensor maps (after
    dQ, fused, and the counts, ordered)."""
    from flashlab.gpu.launch import Derived

    words, at = (80, MAPS_ARG + 1 + ordered) if fused else (64, MAPS_ARG)

    def placeholders():
        return (cuda.device_array(words, np.uint64),)

    def update(packed, stream):
        packed.point(at, _maps_for(packed, stream, fused))

    return Derived(placeholders, update)


def derived(d, d_v):
    """launch.Derived of the dK/dV kernel's maps."""
    return _derived(False)


def derived_fused(d, d_v):
    """launch.Derived of the fused kernel's maps (dQ's too)."""
    return _derived(True)


def derived_ordered(d, d_v):
    """launch.Derived of the ordered kernel's maps (dQ's too)."""
    return _derived(True, ordered=True)


NAMES = {"dkv": "backward_v8_dkv", "fused": "backward_v8_fused",
         "ordered": "backward_v9_fused"}  # registry names, by part


def compile_ptx(d, d_v, kind="bf16", part="dkv"):
    """PTX of kernel `part` ("dkv", "fused" or "ordered") for sm_90a;
    needs no GPU."""
    from flashlab.gpu import build, registry

    spec = registry.get(f"{NAMES[part]}_{kind}")
    with build.compiling_without_gpu(CC[:2]):
        ptx, _ = cuda.compile_ptx(spec.make(d, d_v).py_func,
                                  registry.argument_types(spec.args), cc=CC)
    return ptx
