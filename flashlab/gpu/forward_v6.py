"""Forward v6: float32 inputs on the tensor cores, by 3xTF32.

The tf32 unit keeps 10 of float32's 23 mantissa bits. Split each operand
into its tf32 head and the rest, x = hi + lo, and a product is hi hi' +
hi lo' + lo hi' (lo lo' is below float32's rounding): three mmas give
about float32 accuracy (fragments.split_tf32 models the split).
`precision="tf32"` is one mma on the raw values, which the unit
truncates to tf32: about 1e-3 relative error, for speed.

The schedule is v5's: four warps of 16 rows, K_j and V_j through SRAM by
cp.async, S and O in fragments. Float32 fragments are not 16-bit pairs,
so there is no ldmatrix: lanes read SRAM rows whose padding puts every
fragment read in 32 different banks. The loops over k-steps stay loops
(unrolled, they would not fit the compiler's budget), so what they index
must not be a register array: Q's fragments are re-read from HBM (L1
hits after the first tile) and P goes through a per-warp SRAM tile.
"""


from numba import cuda, float32, int32, uint32

from flashlab.gpu.device import F0, NAN, NEG_INF, bad_bits, inline
from flashlab.gpu.intrinsics import (
    cp_async_commit,
    cp_async_wait_all,
    mma_tf32,
    shared_address,
    to_tf32,
)
from flashlab.gpu.warp import (
    BR,
    THREADS,
    WARPS,
    load_tile32,
    row_end,
    tile_range,
    tile_softmax,
)

HEAD_DIMS = (64, 128)
BC = 32  # keys per K/V tile
PRECISIONS = {"3xtf32": 3, "tf32": 1}  # mmas per product


def shape(d, d_v):
    """(Br, Bc, threads per block) for head dims d, d_v."""
    return BR, BC, THREADS


def strides(d, d_v):
    """(SK, SV, SP): padded SRAM row strides of K_j, V_j and P, in floats.

    Lane (g, t) reads K row g, column t (a stride of 4 mod 32 words puts
    the lanes in banks 4 g + t), V row t, column g (8 mod 32: banks 8 t +
    g) and P row g, column t (4 mod 32): 32 lanes, 32 banks.
    """
    return d + 4, d_v + 8, BC + 4


def make(D, D_V, precision="3xtf32"):
    """The v6 kernel for head dims D, D_V at `precision`."""
    PASSES = PRECISIONS[precision]
    KD = D // 8  # k-steps of S = Q K^T (m16n8k8)
    NS = BC // 8  # n-tiles of S; also the k-steps of P V
    NO = D_V // 8  # n-tiles of O
    SK, SV, SP = strides(D, D_V)
    K_S, V_S, P_S = BC * SK, BC * SV, (WARPS, 16 * SP)

    @inline
    def product(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """C + A B on tf32 units: 3 mmas (hi/lo split) or 1."""
        if PASSES == 1:  # the unit reads the top 10 mantissa bits
            return mma_tf32(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)
        h0, h1, h2, h3 = (to_tf32(a0), to_tf32(a1), to_tf32(a2),
                          to_tf32(a3))
        g0, g1 = to_tf32(b0), to_tf32(b1)
        # the small terms first; lo = x - hi is exact, and rounded (not
        # truncated by the unit) it loses 2**-11 |lo| <= 2**-22 |x|
        d = mma_tf32(to_tf32(a0 - h0), to_tf32(a1 - h1), to_tf32(a2 - h2),
                     to_tf32(a3 - h3), g0, g1, c0, c1, c2, c3)
        d = mma_tf32(h0, h1, h2, h3, to_tf32(b0 - g0), to_tf32(b1 - g1),
                     d[0], d[1], d[2], d[3])
        return mma_tf32(h0, h1, h2, h3, g0, g1, d[0], d[1], d[2], d[3])

    @cuda.jit
    def forward_v6(q, k, v, o, lse, bad, rules, kv_len, mask):
        # q, k, v: (BH, N, d) float32; o: (BH, Nq, d_v); lse: (BH, Nq)
        k_s = cuda.shared.array(K_S, float32)
        v_s = cuda.shared.array(V_S, float32)
        p_s = cuda.shared.array(P_S, float32)  # each warp's P_ij
        sf = cuda.local.array((NS, 4), float32)  # S_ij, then P_ij
        of = cuda.local.array((NO, 4), float32)  # O_i, unnormalized
        pv = cuda.local.array((NO, 4), float32)  # P_ij V_j of one tile
        m = cuda.local.array(2, float32)  # rows g and g + 8
        l = cuda.local.array(2, float32)
        al = cuda.local.array(2, float32)
        seen = cuda.local.array(2, int32)  # met an allowed key yet
        t = cuda.threadIdx.x
        w, lane = t // 32, t % 32
        g, tq = lane // 4, lane % 4
        b = cuda.blockIdx.y
        bk = b // rules.group  # the K/V head of query head b
        i0 = cuda.blockIdx.x * BR
        nq, nk = q.shape[1], k.shape[1]
        i1 = min(i0 + BR, nq)
        row = i0 + 16 * w + g  # this lane's first row
        r0, r1 = min(row, nq - 1), min(row + 8, nq - 1)  # rows it reads
        kv = kv_len[b]  # once: the loop's asm fences would reload it
        first, last = tile_range(i0, i1, nk, BC, rules, kv)
        k_at, v_at = shared_address(k_s, 0), shared_address(v_s, 0)
        if first <= last:  # HBM -> SRAM: the first K tile (Bc d)
            load_tile32(k_at, k, bk, first * BC, BC, D, SK, t)
        cp_async_commit()
        for h in range(2):
            m[h] = NEG_INF
            l[h] = F0
            seen[h] = 0
        for n in range(NO):
            for x in range(4):
                of[n, x] = F0
        cp_async_wait_all()
        cuda.syncthreads()  # K_first in SRAM for every warp
        for jt in range(first, last + 1):
            j0 = jt * BC
            # HBM -> SRAM: V_j (Bc d_v), landing while S_ij is computed
            load_tile32(v_at, v, bk, j0, BC, D_V, SV, t)
            cp_async_commit()
            # S_ij = Q_i K_j^T; K_j^T's B fragment: keys g, dims t, t + 4
            for n in range(NS):
                for x in range(4):
                    sf[n, x] = F0
            for ks in range(KD):
                c = 8 * ks + tq  # Q_i's A fragment: rows g, g + 8
                a0, a1 = q[b, r0, c], q[b, r1, c]
                a2, a3 = q[b, r0, c + 4], q[b, r1, c + 4]
                for n in range(NS):
                    kr = (8 * n + g) * SK + c
                    d = product(a0, a1, a2, a3, k_s[kr], k_s[kr + 4],
                                sf[n, 0], sf[n, 1], sf[n, 2], sf[n, 3])
                    for x in range(4):
                        sf[n, x] = d[x]
            cp_async_wait_all()
            cuda.syncthreads()  # V_j landed; no warp reads K_j any more
            if jt < last:  # HBM -> SRAM: K_{j+1}, during softmax and P V
                load_tile32(k_at, k, bk, j0 + BC, BC, D, SK, t)
                cp_async_commit()
            tile_softmax(sf, m, l, al, seen, NS, BC, b, row, i0, i1, j0,
                         nq, nk, rules, kv_len, mask, kv, 0)  # S_ij -> P
            # registers -> SRAM: P_ij, (16, Bc) per warp, for its A operand
            for n in range(NS):
                for x in range(4):
                    p_s[w, (g + 8 * (x // 2)) * SP + 8 * n + 2 * tq
                        + x % 2] = sf[n, x]
            cuda.syncwarp()  # the warp's P_ij written before it is read
            # PV = P_ij V_j, one k-step per 8 keys, summed on its own: the
            # unit truncates its sums, so adding each tile's few terms
            # straight into O_i would bias O by one truncation per tile
            for op in range(NO):
                for x in range(4):
                    pv[op, x] = F0
            for n in range(NS):
                pr = g * SP + 8 * n + tq
                a0, a1 = p_s[w, pr], p_s[w, pr + 8 * SP]
                a2, a3 = p_s[w, pr + 4], p_s[w, pr + 8 * SP + 4]
                vr = (8 * n + tq) * SV + g  # V_j's B fragment
                for op in range(NO):
                    d = product(a0, a1, a2, a3, v_s[vr + 8 * op],
                                v_s[vr + 4 * SV + 8 * op], pv[op, 0],
                                pv[op, 1], pv[op, 2], pv[op, 3])
                    for x in range(4):
                        pv[op, x] = d[x]
            for op in range(NO):  # O_i = alpha O_i + P_ij V_j, rounded
                for x in range(4):
                    of[op, x] = al[x // 2] * of[op, x] + pv[op, x]
            cp_async_wait_all()
            cuda.syncthreads()  # K_{j+1} landed; no warp reads V_j or P
        # O_i = O_i / l, lse = m + ln 2 log2 l, and the rule of
        # flashlab.nonfinite, as in v5
        bits = bad_bits(bad, bk, tq)  # this thread's columns
        for h in range(2):
            inv, lse_i, state = row_end(m[h], l[h], seen[h])
            i = row + 8 * h
            if i < nq:
                for n in range(NO):
                    for y in range(2):
                        x = 8 * n + 2 * tq + y
                        value = of[n, 2 * h + y] * inv
                        if state == 1:  # no key: 0, even where O_i is NaN
                            value = F0
                        elif (bits >> uint32(2 * n + y)) & 1:
                            value = NAN
                        o[b, i, x] = value
                if tq == 0:
                    lse[b, i] = lse_i

    return forward_v6
