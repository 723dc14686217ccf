"""Forward v5: FlashAttention-2 on the tensor cores, bf16 or float16 inputs.

Each of the block's four warps owns 16 query rows. Q_i goes HBM -> SRAM
-> registers once, as mma A fragments (ldmatrix). K_j and V_j stream
through SRAM by cp.async, stored swizzled so that ldmatrix reads are free
of bank conflicts; V_j is fetched while the warps compute S_ij = Q_i K_j^T
and K_{j+1} while they compute the softmax and P_ij V_j. S stays in
registers: its C fragments, rounded to 16 bits, are already the A
fragments of P V (fragments.c_places against a_places). Scores, softmax
and O accumulate in float32; the output is rounded to the input's dtype.
"""


from numba import cuda, float32, int16, int32, uint32

from flashlab.gpu.device import F0, NEG_INF
from flashlab.gpu.intrinsics import (
    cp_async_commit,
    cp_async_wait_all,
    ldmatrix_x4,
    ldmatrix_x4_trans,
    mma_bf16,
    mma_f16,
    pack_bf16x2,
    pack_f16x2,
    shared_address,
)
from flashlab.gpu.warp import (
    BR,
    THREADS,
    a_from_c,
    at_step,
    lane_bases,
    ldmatrix_a,
    ldmatrix_b,
    ldmatrix_b_trans,
    load_tile16,
    make_store_rows16,
    rescale,
    swizzled_offset,
    tile_range,
    tile_softmax,
)

BC = 64  # keys per K/V tile
HEAD_DIMS = (64, 128)  # a swizzled SRAM row needs 8 or 16 chunks


def shape(d, d_v):
    """(Br, Bc, threads per block) for head dims d, d_v."""
    return BR, BC, THREADS


def make(D, D_V, kind="bf16"):
    """The v5 kernel for head dims D, D_V and 16-bit `kind` (bf16, f16)."""
    mma, pack = {"bf16": (mma_bf16, pack_bf16x2),
                 "f16": (mma_f16, pack_f16x2)}[kind]
    KD = D // 16  # k-steps of S = Q K^T
    NS = BC // 8  # n-tiles of S (8 keys each)
    NO = D_V // 8  # n-tiles of O
    CQ, CV = D // 8, D_V // 8  # 16-byte chunks per SRAM row
    Q_S, K_S, V_S = BR * D, BC * D, BC * D_V  # SRAM tiles (16-bit values)
    store_rows = make_store_rows16(pack, NO)  # the epilogue

    @cuda.jit
    def forward_v5(q, k, v, o, lse, bad, rules, kv_len, mask):
        # q, k, v: (BH, N, d) 16-bit bits; o: (BH, Nq, d_v / 2) pairs
        q_s = cuda.shared.array(Q_S, int16)
        k_s = cuda.shared.array(K_S, int16)
        v_s = cuda.shared.array(V_S, int16)
        qf = cuda.local.array((KD, 4), int32)  # Q_i: A fragments
        sf = cuda.local.array((NS, 4), float32)  # S_ij, then P_ij
        pf = cuda.local.array(4, int32)  # P_ij: one k-step's A fragment
        of = cuda.local.array((NO, 4), float32)  # O_i, unnormalized
        m = cuda.local.array(2, float32)  # rows g and g + 8
        l = cuda.local.array(2, float32)
        al = cuda.local.array(2, float32)
        seen = cuda.local.array(2, int32)  # met an allowed key yet
        kb = cuda.local.array(4, uint32)  # ldmatrix bases: K_j as B
        vb = cuda.local.array(4, uint32)  # V_j as B, read transposed
        t = cuda.threadIdx.x
        w, lane = t // 32, t % 32
        b_row, b_chunk = ldmatrix_b(lane, 0, 0)  # this lane's B places
        t_row, t_chunk = ldmatrix_b_trans(lane, 0, 0)
        b = cuda.blockIdx.y
        bk = b // rules.group  # the K/V head of query head b
        i0 = cuda.blockIdx.x * BR
        nq, nk = q.shape[1], k.shape[1]
        i1 = min(i0 + BR, nq)
        row = i0 + 16 * w + lane // 4  # this lane's first row (g)
        kv = kv_len[b]  # once: the loop's asm fences would reload it
        first, last = tile_range(i0, i1, nk, BC, rules, kv)
        # SRAM tiles by address: cp.async and ldmatrix add offsets to these
        q_at, k_at = shared_address(q_s, 0), shared_address(k_s, 0)
        v_at = shared_address(v_s, 0)
        # HBM -> SRAM: Q_i (Br d) and the first K tile (Bc d)
        load_tile16(q_at, q, b, i0, BR, D, t)
        if first <= last:
            load_tile16(k_at, k, bk, first * BC, BC, D, t)
        cp_async_commit()
        cp_async_wait_all()
        cuda.syncthreads()  # Q_i, K_first in SRAM for every warp
        for ks in range(KD):
            r, c = ldmatrix_a(lane, ks)
            r += 16 * w  # this warp's rows of Q_i
            a = ldmatrix_x4(q_at + swizzled_offset(r, c, CQ))
            for x in range(4):
                qf[ks, x] = a[x]
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
            load_tile16(v_at, v, bk, j0, BC, D_V, t)
            cp_async_commit()
            # S_ij = Q_i K_j^T: (16, Bc) per warp, KD x NS mmas
            lane_bases(kb, k_at, b_row, b_chunk, CQ)
            lane_bases(vb, v_at, t_row, t_chunk, CV)
            for n in range(NS):
                for x in range(4):
                    sf[n, x] = F0
            for ks in range(KD):
                for jp in range(NS // 2):
                    kf = ldmatrix_x4(at_step(kb, 16 * jp, 2 * ks, CQ))
                    for y in range(2):
                        d = mma(qf[ks, 0], qf[ks, 1], qf[ks, 2], qf[ks, 3],
                                kf[2 * y], kf[2 * y + 1],
                                sf[2 * jp + y, 0], sf[2 * jp + y, 1],
                                sf[2 * jp + y, 2], sf[2 * jp + y, 3])
                        for x in range(4):
                            sf[2 * jp + y, x] = d[x]
            cp_async_wait_all()
            cuda.syncthreads()  # V_j landed; no warp reads K_j any more
            if jt < last:  # HBM -> SRAM: K_{j+1}, during softmax and P V
                load_tile16(k_at, k, bk, j0 + BC, BC, D, t)
                cp_async_commit()
            tile_softmax(sf, m, l, al, seen, NS, BC, b, row, i0, i1, j0,
                         nq, nk, rules, kv_len, mask, kv, 0)  # S_ij -> P
            rescale(of, al, NO)
            # O_i += P_ij V_j: P's C fragments are P V's A fragments
            for kp in range(NS // 2):
                for x in range(4):
                    n, e = a_from_c(x)
                    pf[x] = pack(sf[2 * kp + n, e], sf[2 * kp + n, e + 1])
                for op in range(NO // 2):
                    vf = ldmatrix_x4_trans(at_step(vb, 16 * kp, 2 * op, CV))
                    for y in range(2):
                        d = mma(pf[0], pf[1], pf[2], pf[3], vf[2 * y],
                                vf[2 * y + 1],
                                of[2 * op + y, 0], of[2 * op + y, 1],
                                of[2 * op + y, 2], of[2 * op + y, 3])
                        for x in range(4):
                            of[2 * op + y, x] = d[x]
            cp_async_wait_all()
            cuda.syncthreads()  # K_{j+1} landed; no warp reads V_j
        store_rows(o, lse, of, m, l, seen, bad, bk, b, row, lane, nq)

    return forward_v5
