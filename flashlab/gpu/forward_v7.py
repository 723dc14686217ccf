"""Forward v7: v5 on Hopper's warpgroup MMA (wgmma), bf16 or float16.

The block is one warpgroup: four warps, 64 query rows, as in v5, and the
same semantics through the same helpers. What changes is the product:
S_ij = Q_i K_j^T is 4 (d = 64) or 8 (d = 128) wgmma m64n64k16 that read
Q_i and K_j from shared memory through descriptors, and O_i += P_ij V_j
is 4 wgmma m64n<d_v>k16 that take P_ij from registers (S's accumulator,
rounded to 16 bits, is already the A operand) and V_j, stored keys x d_v,
read transposed. A wgmma accumulator is v5's C fragments stacked over
the warpgroup (fragments.wgmma_c_places), so v5's softmax, masks,
dropout, rescale and epilogue apply to it unchanged. Tiles lie in shared
memory as unswizzled core matrices (fragments.core_offset), copied by
cp.async. sm_90a only: compile with cc=(9, 0, "a"). See chapter 12.
"""

from numba import cuda, float32, int16, int32, uint32, uint64

from flashlab import fragments
from flashlab.gpu.device import F0, NEG_INF, inline
from flashlab.gpu.intrinsics import (
    cp_async16,
    cp_async_commit,
    cp_async_wait_all,
    global_address,
    pack_bf16x2,
    pack_f16x2,
    shared_address,
)
from flashlab.gpu.warp import (
    BR,
    THREADS,
    a_from_c,
    make_store_rows16,
    rescale,
    tile_range,
    tile_softmax,
)
from flashlab.gpu.wgmma import mma_rs, mma_ss, proxy_fence

BC = 64  # keys per K/V tile
HEAD_DIMS = (64, 128)
CC = (9, 0, "a")  # wgmma exists on sm_90a only

core_copy_place = cuda.jit(device=True)(fragments.core_copy_place)
descriptor = cuda.jit(device=True)(fragments.descriptor)


def shape(d, d_v):
    """(Br, Bc, threads per block) for head dims d, d_v."""
    return BR, BC, THREADS


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


@inline
def landed():
    """Wait for this thread's copies and hand them to wgmma's proxy."""
    cp_async_wait_all()
    proxy_fence()


def make(D, D_V, kind="bf16"):
    """The v7 kernel for head dims D, D_V and 16-bit `kind` (bf16, f16)."""
    pack = {"bf16": pack_bf16x2, "f16": pack_f16x2}[kind]
    KD = D // 16  # k-steps of S = Q K^T
    KP = BC // 16  # k-steps of O += P V
    NS = BC // 8  # 8-column groups of S
    NO = D_V // 8  # 8-column groups of O
    Q_S, K_S, V_S = BR * D, BC * D, BC * D_V  # SRAM tiles (16-bit values)
    store_rows = make_store_rows16(pack, NO)  # the epilogue
    TILES = Q_S + K_S + V_S
    lbo_k, sbo_k, step_k = fragments.k_major(D // 8)  # Q, K: K along rows
    lbo_v, sbo_v, step_v = fragments.mn_major(D_V // 8)  # V: K down rows
    s_product = mma_ss(BC, KD, step_k, step_k, kind)  # S = Q K^T
    o_product = mma_rs(D_V, KP, step_v, kind)  # O += P V

    @cuda.jit
    def forward_v7(q, k, v, o, lse, bad, rules, kv_len, mask):
        # q, k, v: (BH, N, d) 16-bit bits; o: (BH, Nq, d_v / 2) pairs
        # Q_i, K_j, V_j in one array: the block's only static shared
        # memory starts its window, so all three are 16-byte aligned as
        # descriptors and cp.async need (numba aligns an int16 array to 2)
        tiles = cuda.shared.array(TILES, int16)
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
        i0 = cuda.blockIdx.x * BR
        nq, nk = q.shape[1], k.shape[1]
        i1 = min(i0 + BR, nq)
        row = i0 + 16 * w + lane // 4  # this lane's first row (g)
        first, last = tile_range(i0, i1, nk, BC, rules, kv_len[b])
        q_at = shared_address(tiles, 0)
        k_at, v_at = q_at + uint32(2 * Q_S), q_at + uint32(2 * (Q_S + K_S))
        # the descriptors of k-step 0; wgmma_ss/rs add the step per k-step
        q_desc = uint64(descriptor(q_at, lbo_k, sbo_k))
        k_desc = uint64(descriptor(k_at, lbo_k, sbo_k))
        v_desc = uint64(descriptor(v_at, lbo_v, sbo_v))
        # HBM -> SRAM: Q_i (Br d) and the first K tile (Bc d)
        load_cores(q_at, q, b, i0, BR, D, t)
        if first <= last:
            load_cores(k_at, k, bk, first * BC, BC, D, t)
        cp_async_commit()
        landed()
        cuda.syncthreads()  # Q_i, K_first in SRAM for wgmma
        for h in range(2):
            m[h] = NEG_INF
            l[h] = F0
            seen[h] = 0
        for n in range(NO):
            for x in range(4):
                of[n, x] = F0
        for jt in range(first, last + 1):
            j0 = jt * BC
            # HBM -> SRAM: V_j (Bc d_v), landing while S_ij is computed
            load_cores(v_at, v, bk, j0, BC, D_V, t)
            cp_async_commit()
            s_product(sf, q_desc, k_desc)  # S_ij = Q_i K_j^T: (64, Bc)
            landed()
            cuda.syncthreads()  # V_j landed; no wgmma reads K_j any more
            if jt < last:  # HBM -> SRAM: K_{j+1}, during softmax and P V
                load_cores(k_at, k, bk, j0 + BC, BC, D, t)
                cp_async_commit()
            tile_softmax(sf, m, l, al, seen, NS, BC, b, row, i0, i1, j0,
                         nq, nk, rules, kv_len, mask)  # S_ij -> P_ij
            rescale(of, al, NO)
            # O_i += P_ij V_j: S's accumulator is P V's A operand
            for kp in range(KP):
                for x in range(4):
                    n, e = a_from_c(x)
                    pf[kp, x] = pack(sf[2 * kp + n, e],
                                     sf[2 * kp + n, e + 1])
            o_product(of, pf, v_desc)
            landed()
            cuda.syncthreads()  # K_{j+1} landed; no wgmma reads V_j
        store_rows(o, lse, of, m, l, seen, bad, bk, b, row, lane, nq)

    return forward_v7


def compile_ptx(d, d_v, kind="bf16"):
    """PTX of v7 for sm_90a (v5's arguments); needs no GPU. v7 is not in
    flashlab.gpu.registry yet: nothing dispatches to it."""
    from numba import cuda

    from flashlab.gpu import build

    with build.compiling_without_gpu(CC[:2]):
        ptx, _ = cuda.compile_ptx(make(d, d_v, kind).py_func,
                                  build.signature(f"forward_v5_{kind}"),
                                  cc=CC)
    return ptx
