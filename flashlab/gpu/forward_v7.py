"""Forward v7: FlashAttention-3's forward on Hopper's warpgroup MMA.

bf16 or float16, sm_90a only (compile with cc=(9, 0, "a")). A block is
two warpgroups (eight warps, 128 query rows); each warpgroup owns 64 rows
of Q_i and both read the same K_j, V_j tiles, so a tile loaded once
feeds 128 rows. Per tile:

- S_ij = Q_i K_j^T is KD wgmma m64n<Bc>k16 reading Q_i and K_j from
  shared memory through descriptors;
- O_i += P_ij V_j is KP wgmma m64n<d_v>k16 taking P_ij from registers
  (S's accumulator rounded to 16 bits is already the A operand) and V_j,
  stored keys x d_v, read transposed.

The products are asynchronous, and the loop is FlashAttention-3's
intra-warpgroup pipeline: it issues S_{i,j+1} and O_i += P_ij V_j, waits
for S_{i,j+1} only, and computes its softmax while P_ij V_j is still on
the tensor cores. K and V tiles are double-buffered: the copies of
V_{j+1} and K_{j+2} (cp.async, into the stages no product reads any
more) fly during tile j + 1's work, and one barrier per tile hands them
over. A wgmma accumulator is v5's C fragments stacked over a warpgroup
(fragments.wgmma_c_places), so v5's softmax, masks, dropout, rescale and
epilogue apply to it unchanged. Tiles lie in shared memory with the
128-byte swizzle (fragments.panel_offset: panels of 64 columns, 16-byte
chunk c of row r at chunk c ^ (r % 8)), which wgmma reads at full speed;
SWIZZLE = False builds the unswizzled core matrices of
fragments.core_offset instead, for comparison. The block's shared memory
is dynamic (over the 48 KB static limit). See chapter 12.
"""

from numba import cuda, float32, int16, int32, uint32, uint64

from flashlab import fragments
from flashlab.gpu.device import F0, NEG_INF, inline
from flashlab.gpu.intrinsics import (
    cp_async16,
    cp_async_commit,
    cp_async_wait_all,
    cp_async_wait_one,
    global_address,
    pack_bf16x2,
    pack_f16x2,
    shared_address,
)
from flashlab.gpu.warp import (
    a_from_c,
    block_place,
    make_store_rows16,
    rescale,
    tile_range,
    tile_softmax,
)
from flashlab.gpu.wgmma import mma_rs, mma_ss, proxy_fence, wait_for

GROUPS = 2  # consumer warpgroups per block
THREADS = 128 * GROUPS
BR = 64 * GROUPS  # query rows per block: 64 per warpgroup
BLOCK_K = {64: 128, 128: 128}  # keys per K/V tile, by d
HEAD_DIMS = (64, 128)
CC = (9, 0, "a")  # wgmma exists on sm_90a only
SWIZZLE = True  # 128-byte swizzled tiles, else unswizzled core matrices
ALIGN = 1024  # a swizzled tile starts at a multiple of 1024 bytes

core_copy_place = cuda.jit(device=True)(fragments.core_copy_place)
descriptor = cuda.jit(device=True)(fragments.descriptor)
MODE_128B = fragments.SWIZZLE_128B << 62  # descriptor bits 62-63


@inline
def descriptor_128b(address, lbo, sbo):
    """fragments.descriptor_128b, on the device."""
    return uint64(descriptor(address, lbo, sbo)) | uint64(MODE_128B)


def shape(d, d_v):
    """(Br, Bc, threads per block) for head dims d, d_v."""
    return BR, BLOCK_K[d], THREADS


def shared_bytes(d, d_v):
    """Dynamic shared memory per block: Q_i and two stages of K_j, V_j."""
    bc = BLOCK_K[d]
    return 2 * (BR * d + 2 * bc * d + 2 * bc * d_v) + ALIGN


@inline
def load_cores(dst, src, b, r0, rows, cols, t):
    """HBM -> SRAM: rows r0.. of src[b] (16-bit bits) into the core-matrix
    tile at shared address dst (fragments.core_offset), rows past the end
    zero-filled. Asynchronous: commit, wait, fence and sync after."""
    n = src.shape[1]
    r, c, step = core_copy_place(t, cols // 8, THREADS)
    at = global_address(src, (b, 0, 0)) + uint64(c * 16)
    for p in range(rows // step):
        i = r0 + r + p * step
        cp_async16(dst + uint32(16 * (t + p * THREADS)),
                   at + uint64(min(i, n - 1)) * uint64(cols * 2),
                   int32(16 if i < n else 0))


def panel_copy_place(t, per_row, rows, threads):
    """(byte offset, row, chunk, rows per pass) of the first chunk thread t
    copies into a 128-byte-swizzled tile (fragments.panel_offset) of
    `rows` rows: a row's chunks come from consecutive threads (coalesced)
    and land in one 128-byte line (free of bank conflicts). The rows per
    pass are a multiple of 8, so r % 8, hence the swizzle, stays fixed:
    pass p is p * step * 128 bytes on."""
    c, r, step = t % per_row, t // per_row, threads // per_row
    return ((c // 8) * rows * 128 + r * 128 + ((c % 8) ^ (r % 8)) * 16,
            r, c, step)


def k_steps_128b(rows, steps):
    """Byte offset of each k-step of a K-major 128-byte-swizzled tile of
    `rows` rows: 32 bytes along a row, then the next panel."""
    step = fragments.k_major_128b(rows)[2]
    return tuple((s // 4) * rows * 128 + (s % 4) * step
                 for s in range(steps))


panel_place = cuda.jit(device=True)(panel_copy_place)


def make_load_panels(threads):
    """load_panels for blocks of `threads` threads, all copying."""

    @inline
    def load_panels(dst, src, b, r0, rows, cols, t):
        """load_cores into a 128-byte-swizzled tile (panel_copy_place)."""
        n = src.shape[1]
        offset, r, c, step = panel_place(t, cols // 8, rows, threads)
        at = dst + uint32(offset)
        src_at = global_address(src, (b, 0, 0)) + uint64(c * 16)
        for p in range(rows // step):
            i = r0 + r + p * step
            cp_async16(at + uint32(p * step * 128),
                       src_at + uint64(min(i, n - 1)) * uint64(cols * 2),
                       int32(16 if i < n else 0))

    return load_panels


load_panels = make_load_panels(THREADS)


@inline
def handed_over():
    """This thread's landed copies to wgmma's proxy, then every thread's
    (the barrier): the tiles are ready to be read by the products."""
    proxy_fence()
    cuda.syncthreads()


def make_to_a(pack, kp_steps):
    """to_a(pf, sf): P_ij (float32 C fragments sf) rounded by `pack` to
    the A fragments pf of P V's kp_steps k-steps."""

    @inline
    def to_a(pf, sf):
        for kp in range(kp_steps):
            for x in range(4):
                n, e = a_from_c(x)
                pf[kp, x] = pack(sf[2 * kp + n, e], sf[2 * kp + n, e + 1])

    return to_a


def make(D, D_V, kind="bf16"):
    """The v7 kernel for head dims D, D_V and 16-bit `kind` (bf16, f16)."""
    pack = {"bf16": pack_bf16x2, "f16": pack_f16x2}[kind]
    BC = BLOCK_K[D]
    KD = D // 16  # k-steps of S = Q K^T
    KP = BC // 16  # k-steps of O += P V
    NS = BC // 8  # 8-column groups of S
    NO = D_V // 8  # 8-column groups of O
    Q_S, K_S, V_S = BR * D, BC * D, BC * D_V  # SRAM tiles (16-bit values)
    store_rows = make_store_rows16(pack, NO)  # the epilogue
    if SWIZZLE:  # k-step s: 32 s bytes into a row, panels of 4 k-steps
        load, describe = load_panels, descriptor_128b
        lbo_k, sbo_k, _, _ = fragments.k_major_128b(BR)
        steps_q, steps_k = k_steps_128b(BR, KD), k_steps_128b(BC, KD)
        lbo_v, sbo_v, step_v = fragments.mn_major_128b(BC)
        wg_rows = 64 * 128  # a warpgroup's 64 rows within each panel
    else:
        load, describe = load_cores, descriptor
        lbo_k, sbo_k, steps_q = fragments.k_major(D // 8)
        steps_k = steps_q
        lbo_v, sbo_v, step_v = fragments.mn_major(D_V // 8)
        wg_rows = 64 * D * 2
    s_issue = mma_ss(BC, KD, steps_q, steps_k, kind, wait=False)
    o_issue = mma_rs(D_V, KP, step_v, kind, wait=False)
    s_wait_one = wait_for(1, NS * 4)  # S in; O += P V may still fly
    s_wait = wait_for(0, NS * 4)
    o_wait = wait_for(0, NO * 4, KP * 4)  # O, and P (its A operand)

    to_a = make_to_a(pack, KP)

    @cuda.jit
    def forward_v7(q, k, v, o, lse, bad, rules, kv_len, mask):
        # q, k, v: (BH, N, d) 16-bit bits; o: (BH, Nq, d_v / 2) pairs
        # dynamic shared memory: Q_i, K stages 0 and 1, V stages 0 and 1
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
        if b >= q.shape[0]:
            return
        bk = b // rules.group  # the K/V head of query head b
        i0 = (cuda.gridDim.y - 1 - rank) * BR
        nq, nk = q.shape[1], k.shape[1]
        i1 = min(i0 + BR, nq)
        row = i0 + 16 * w + lane // 4  # this lane's first row (g)
        kv = kv_len[b]  # once: the loop's asm fences would reload it
        first, last = tile_range(i0, i1, nk, BC, rules, kv)
        at = shared_address(tiles, 0)
        q_at = uint32(at + (ALIGN - at % ALIGN) % ALIGN)
        k_at = q_at + uint32(2 * Q_S)  # stage s at + 2 K_S s bytes
        v_at = k_at + uint32(4 * K_S)
        # this warpgroup's 64 rows of Q_i; k-step 0 of stage 0 of K and V
        q_desc = uint64(describe(q_at + uint32(wg_rows * (w // 4)), lbo_k,
                                 sbo_k))
        k_desc = uint64(describe(k_at, lbo_k, sbo_k))
        v_desc = uint64(describe(v_at, lbo_v, sbo_v))
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
            # HBM -> SRAM: Q_i and K_first, then V_first in a later group
            load(q_at, q, b, i0, BR, D, t)
            load(k_at, k, bk, first * BC, BC, D, t)
            cp_async_commit()
            load(v_at, v, bk, first * BC, BC, D_V, t)
            cp_async_commit()
            cp_async_wait_one()  # Q_i, K_first landed; V_first may fly
            handed_over()
            s_issue(sf, q_desc, k_desc)  # S = Q_i K_first^T
            s_wait(sf)
            if first < last:  # K_{first+1} into stage 1, free so far
                load(k_at + uint32(2 * K_S), k, bk, first * BC + BC, BC, D,
                     t)
            cp_async_commit()
            tile_softmax(sf, m, l, al, seen, NS, BC, b, row, i0, i1,
                         first * BC, nq, nk, rules, kv_len, mask, kv, 0)
            to_a(pf, sf)
        for jt in range(first + 1, last + 1):
            # stage of tile jt: (jt - first) % 2; of tile jt - 1: the other
            now = uint64((jt - first) % 2)
            cp_async_wait_all()  # K_jt, V_{jt-1} landed
            # the barrier also means every warpgroup has waited for S of
            # tile jt - 1 and P V of jt - 2: stage `1 - now` of K and
            # stage `now` of V are read by no product any more
            handed_over()
            load(v_at + uint32(2 * V_S) * uint32(now), v, bk, jt * BC,
                 BC, D_V, t)
            if jt < last:
                load(k_at + uint32(2 * K_S) * uint32(1 - now), k, bk,
                     jt * BC + BC, BC, D, t)
            cp_async_commit()
            s_issue(sf, q_desc, k_desc + k_next * now)  # S_{i,j}
            o_issue(of, pf, v_desc + v_next * (1 - now))  # += P V_{j-1}
            s_wait_one(sf)
            # the softmax of tile jt while P V of tile jt - 1 runs
            tile_softmax(sf, m, l, al, seen, NS, BC, b, row, i0, i1,
                         jt * BC, nq, nk, rules, kv_len, mask, kv, 0)
            o_wait(of, pf)
            rescale(of, al, NO)
            to_a(pf, sf)
        if first <= last:  # O_i += P V of the last tile
            cp_async_wait_all()
            handed_over()
            o_issue(of, pf, v_desc + v_next * uint64((last - first) % 2))
            o_wait(of, pf)
        store_rows(o, lse, of, m, l, seen, bad, bk, b, row, lane, nq)

    return forward_v7


def compile_ptx(d, d_v, kind="bf16"):
    """PTX of v7 for sm_90a (v5's arguments); needs no GPU."""
    from numba import cuda

    from flashlab.gpu import build

    with build.compiling_without_gpu(CC[:2]):
        ptx, _ = cuda.compile_ptx(make(d, d_v, kind).py_func,
                                  build.signature(f"forward_v5_{kind}"),
                                  cc=CC)
    return ptx
