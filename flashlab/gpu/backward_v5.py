"""Backward on the tensor cores, bf16 or float16 inputs (FlashAttention-2).

Two kernels, as the float32 backward, deterministic and without atomics:

- `make_dq`: a block owns 64 query rows, 16 per warp, with Q_i and dO_i
  held as mma A fragments; K_j and V_j stream through SRAM. Per tile it
  recomputes S = Q_i K_j^T and dP = dO_i V_j^T on the tensor cores, forms
  P = exp2((S tau - shift) log2 e) norm and dS = P (dP - D) in float32 in
  registers, and accumulates dQ_i += dS K_j, dS re-packed from C to A
  fragments exactly as the forward re-packs P.
- `make_dkv`: a block owns 64 keys, 16 per warp, with K_j and V_j as A
  fragments; Q_i and dO_i stream through SRAM. It computes the transposed
  tiles S^T = K_j Q_i^T and dP^T = V_j dO_i^T, so a warp's rows are keys
  and its columns queries, and accumulates dV_j += P^T dO_i and dK_j +=
  dS^T Q_i.

Each warp works through its (16, 64) tile of S and dP in column slices
(`parts`), small enough that nothing spills at d = 128.

`stats` holds each row's shift and norm of P (`row_statistics_bf16`,
`_f16`: the saved lse and 1, or the row's own max and 1 / sum where lse
lost log l), or is the saved lse alone; the norm rides on D and the
dropout weight. P's exponent (`row_terms`, `p_of`) shifts the rounded
S tau before log2 e multiplies, so equal huge scores give P's exact
ones and no finite score overflows.

Masks, padding and dropout follow `tiled`: a pair's rules are checked
per element wherever a tile is not wholly allowed. Gradients accumulate
in float32 and are stored in float32; with grouped heads dK and dV are
per query head, summed over each group by the host. See chapter 10.
"""


from numba import cuda, float32, int16, int32, int64, uint32

from flashlab.gpu.device import (
    F0,
    NEG_INF,
    inline,
    make_row_statistics,
    row_norm,
    statistics_kernel,
    tile_full,
    tile_skipped,
)
from flashlab.gpu.intrinsics import (
    cp_async_commit,
    cp_async_wait_all,
    ex2,
    ldmatrix_x4,
    ldmatrix_x4_trans,
    mma_bf16,
    mma_f16,
    pack_bf16x2,
    pack_f16x2,
    shared_address,
    unpack_bf16x2,
    unpack_f16x2,
)
from flashlab.gpu.warp import (
    BR,
    LOG2E,
    a_from_c,
    allowed_bits_of,
    at_step,
    dot_rows,
    dropped_bits,
    dropped_bits_of,
    lane_bases,
    ldmatrix_a,
    ldmatrix_b,
    ldmatrix_b_trans,
    load_tile16,
    mask_scores,
    swizzled_offset,
    tile_range,
)

BC = BR  # keys per block (dK, dV) and per K/V tile (dQ)
ROWS = BR  # the same as a literal for shared arrays
HEAD_DIMS = (64, 128)  # as forward v5


@inline
def row_terms(stats, delta, b, i, nq, bh, drop_scale):
    """(shift, zn, dl) of query row i of head b (of bh): P / norm =
    p_of(s, tau, shift), the dropout's kept weight zn and D's term dl,
    both times the row's norm. Rows past Nq, and empty rows (lse -inf:
    no allowed pair, P is 0 whatever the shift) shift by 0; NaN stays
    NaN."""
    shift, zn, dl = F0, F0, F0
    if i < nq:
        if stats[b, i] != NEG_INF:
            shift = stats[b, i]
        norm = row_norm(stats, bh, b, i)
        zn = drop_scale * norm
        dl = delta[b, i] * norm
    return shift, zn, dl


@inline
def p_of(s, tau, shift):
    """P / norm of score s: exp2((s tau - shift) log2 e), s tau rounded as
    the forward and row_statistics round it, then shifted. The shift is
    subtracted before log2 e multiplies: equal huge scores give exactly
    exp2(0), and no finite score overflows (warp.WIDE says what folding
    log2 e into the shift costs)."""
    return ex2((s * tau - shift) * LOG2E)


@inline
def ds_of_rows(sf, pf, tiles, tau, sh, zn, dl, gone):
    """S fragments sf -> dS = P (dP Z - D) in place (the norm in zn, dl),
    dP in pf: a tile whose rows are queries, the lane's rows g and g + 8
    taking row_terms' (sh, zn, dl)[h]; dropout bits `gone`."""
    for n in range(tiles):
        for x in range(4):
            h = x >> 1
            z = F0 if (gone >> (4 * n + x)) & 1 else zn[h]
            p = p_of(sf[n, x], tau, sh[h])
            sf[n, x] = p * (pf[n, x] * z - dl[h])


@inline
def ds_of_columns(sf, pf, tiles, tau, c0, sh, zn, dl, ok, gone):
    """S^T, dP^T fragments -> P^T Z in sf and dS^T in pf: a transposed
    tile whose element (n, x) is query column c0 + 8 n + (x & 1) (c0 the
    lane's first), taking row_terms' sh, zn, dl of each; pairs allowed by
    bits `ok`, dropped by bits `gone`."""
    for n in range(tiles):
        for x in range(4):
            c = c0 + 8 * n + (x & 1)
            bit = 4 * n + x
            p = p_of(sf[n, x], tau, sh[c]) if (ok >> bit) & 1 else F0
            z = F0 if (gone >> bit) & 1 else zn[c]
            sf[n, x] = p * z
            pf[n, x] = p * (pf[n, x] * z - dl[c])


@inline
def ds_of_full_columns(sf, pf, tiles, tau, c0, sh, zn, dl):
    """ds_of_columns of a tile whose every pair is allowed and none
    dropped, to the same bits: no bit is tested, and each column's row
    terms are read once, at an unsigned index (a signed one is checked
    for wrapping on every read)."""
    for n in range(tiles):
        for y in range(2):  # the lane's two columns of n-tile n
            c = uint32(c0) + uint32(8 * n + y)
            shift, norm, dlt = sh[c], zn[c], dl[c]
            for x in range(y, 4, 2):  # keys g and g + 8
                p = p_of(sf[n, x], tau, shift)
                sf[n, x] = p * norm
                pf[n, x] = p * (pf[n, x] * norm - dlt)


def _load16(unpack):
    """Element c of row i of x[b], x holding 16-bit values as int16 bits,
    widened to float32 by the kind's `unpack` (exact)."""

    @cuda.jit(device=True)
    def load(x, b, i, c):
        lo, _ = unpack(int32(x[b, i, c]) & int32(0xFFFF))
        return lo

    return load


# device.row_statistics of 16-bit q, k (int16 bits), with S = tau (Q K^T)
# as these kernels form it: the shifts and norms they take
row_statistics_bf16 = statistics_kernel(_load16(unpack_bf16x2), False)
row_statistics_f16 = statistics_kernel(_load16(unpack_f16x2), False)


def _prepare16(unpack):
    """prepare16 for one 16-bit kind (its pair-widening intrinsic)."""
    _, saved_stats, exact_stats = make_row_statistics(_load16(unpack),
                                                      False)

    # row r of the BH Nq rows is row r % Nq of head r // Nq: its lse is
    # lse[r], its shift and norm stats[0, r] and stats[1, r], and only
    # its rare exact pass divides (int64 division, a routine of many
    # instructions, had doubled the kernel's time where each row did)
    @inline
    def fetch(r, extra):  # the row's lse, loaded with its pieces
        return extra[2][r]

    @inline
    def keep(r, shift, extra):
        counts = extra[4]
        if r < counts.size:  # one count per row, as far as they go
            counts[r] = 0
        return saved_stats(shift, extra[3], 0, r)

    @inline
    def exact(r, extra):
        q, k, lse, stats, counts, rules, kv_len, mask = extra
        nq = q.shape[1]
        stats[0, r], stats[1, r] = exact_stats(q, k, r // nq, r % nq,
                                               rules, kv_len, mask)

    rows_of = dot_rows(unpack, fetch, keep, exact)

    @cuda.jit
    def prepare16(do, o, delta, q, k, lse, stats, counts, rules, kv_len,
                  mask):
        """The 16-bit backward's one preparation, as FlashAttention-3's
        is: D = rowsum(dO o O) into delta (rows), as row_dot16 forms it,
        and beside each row's sum the row's shift and norm into stats, as
        row_statistics forms them, and the ordered kernel's counts zeroed
        (any number up to the rows; none where the backward keeps none).
        do, o: (BH Nq, d_v / 2) 16-bit pairs; q, k: (BH, Nq, d), (BH_kv,
        Nk, d) int16 bits; lse (BH Nq); stats (2, BH Nq)."""
        rows_of(do, o, delta,
                (q, k, lse, stats, counts, rules, kv_len, mask))

    return prepare16


prepare_bf16 = _prepare16(unpack_bf16x2)
prepare_f16 = _prepare16(unpack_f16x2)


def parts(kernel, d, d_v):
    """How many column slices of its (16, 64) S tile a warp of `kernel`
    ("dq" or "dkv") works through one after another, at head dims d, d_v.

    The fragments a warp holds for the whole loop (Q and dO, or K and V,
    and the float32 gradients: about 192 of a thread's 255 registers at
    d = 128) leave too few for a whole S and dP tile: slices of 32 or 16
    columns keep them in registers (python -m flashlab.ptx reports what
    ptxas makes of each; tests/test_gpu_ptx.py requires no spill).
    """
    wide = max(d, d_v) > 64
    return {"dq": (1, 2), "dkv": (2, 4)}[kernel][wide]


def _warp_products(kind):
    """(load_a, s_and_dp, c_times_b): the warp-level products both
    kernels are made of, for 16-bit `kind` (bf16, f16)."""
    mma, pack = {"bf16": (mma_bf16, pack_bf16x2),
                 "f16": (mma_f16, pack_f16x2)}[kind]

    @inline
    def load_a(frag, at, lane, row0, ksteps, per_row):
        """frag (ksteps, 4) = A fragments of rows row0.. of an SRAM tile."""
        for ks in range(ksteps):
            r, c = ldmatrix_a(lane, ks)
            a = ldmatrix_x4(at + swizzled_offset(r + row0, c, per_row))
            for x in range(4):
                frag[ks, x] = a[x]

    @inline
    def times_bt(acc, frag, bases, ksteps, tiles, per_row):
        """acc (tiles, 4) += A B^T: A (16, 16 ksteps) in fragments, B 8
        tiles rows of an SRAM tile (one row per column of the result),
        read from the lane's ldmatrix_b bases."""
        for ks in range(ksteps):
            for jp in range(tiles // 2):
                bb = ldmatrix_x4(at_step(bases, 16 * jp, 2 * ks,
                                         per_row))
                for y in range(2):
                    n = 2 * jp + y
                    d = mma(frag[ks, 0], frag[ks, 1], frag[ks, 2],
                            frag[ks, 3], bb[2 * y], bb[2 * y + 1],
                            acc[n, 0], acc[n, 1], acc[n, 2], acc[n, 3])
                    for x in range(4):
                        acc[n, x] = d[x]

    @inline
    def c_times_b(acc, c, af, bases, kpairs, tiles, per_row):
        """acc (tiles, 4) += C B: C (16, 16 kpairs) held as C fragments c
        (re-packed to A fragments in af), B an SRAM tile read transposed
        (16 kpairs rows, 8 tiles columns) from the lane's
        ldmatrix_b_trans bases."""
        for kp in range(kpairs):
            for x in range(4):
                n, e = a_from_c(x)
                af[x] = pack(c[2 * kp + n, e], c[2 * kp + n, e + 1])
            for op in range(tiles // 2):
                bb = ldmatrix_x4_trans(at_step(bases, 16 * kp, 2 * op,
                                               per_row))
                for y in range(2):
                    n = 2 * op + y
                    d = mma(af[0], af[1], af[2], af[3], bb[2 * y],
                            bb[2 * y + 1], acc[n, 0], acc[n, 1], acc[n, 2],
                            acc[n, 3])
                    for x in range(4):
                        acc[n, x] = d[x]

    @inline
    def s_and_dp(sf, pf, fa, fb, ba, bb, ka, kb, tiles, ca, cb):
        """sf = A B^T and pf = A' B'^T from zero: a slice's S and dP (or
        S^T and dP^T), A, A' held as fragments fa, fb (ka, kb k-steps), B,
        B' read at the lane's ldmatrix_b bases ba, bb (ca, cb chunks per
        row), each product a nest small enough to unroll."""
        for n in range(tiles):
            for x in range(4):
                sf[n, x] = F0
                pf[n, x] = F0
        times_bt(sf, fa, ba, ka, tiles, ca)
        times_bt(pf, fb, bb, kb, tiles, cb)

    return load_a, s_and_dp, c_times_b


def make_dq(D, D_V, kind="bf16"):
    """dQ = tau dS K for head dims D, D_V and 16-bit `kind`."""
    load_a, s_and_dp, c_times_b = _warp_products(kind)
    KD, KV = D // 16, D_V // 16  # k-steps of S and of dP
    PARTS = parts("dq", D, D_V)  # slices of a K/V tile, one after another
    NS = BC // 8 // PARTS  # n-tiles of a slice of S, dP (8 keys each)
    NQ = D // 8  # n-tiles of dQ
    CQ, CV = D // 8, D_V // 8  # 16-byte chunks per SRAM row
    K_S, V_S = BC * D, BC * D_V  # SRAM tiles (16-bit values)

    @cuda.jit
    def backward_v5_dq(q, k, v, do, stats, delta, dq, rules, kv_len, mask):
        # q, k, v, do: (BH, N, d) 16-bit bits; delta: (BH, Nq); stats:
        # shifts (BH, Nq), then norms (BH, Nq) if present
        k_s = cuda.shared.array(K_S, int16)  # Q_i first, then K_j
        v_s = cuda.shared.array(V_S, int16)  # dO_i first, then V_j
        qf = cuda.local.array((KD, 4), int32)  # Q_i: A fragments
        df = cuda.local.array((KV, 4), int32)  # dO_i: A fragments
        sf = cuda.local.array((NS, 4), float32)  # S, then P, then dS
        pf = cuda.local.array((NS, 4), float32)  # dP
        af = cuda.local.array(4, int32)  # dS: one k-step's A fragment
        gf = cuda.local.array((NQ, 4), float32)  # dQ_i
        kb = cuda.local.array(4, uint32)  # ldmatrix bases: K_j as B
        kt = cuda.local.array(4, uint32)  # K_j as B, read transposed
        vb = cuda.local.array(4, uint32)  # V_j as B
        sh = cuda.local.array(2, float32)  # rows g, g + 8: row_terms
        zn = cuda.local.array(2, float32)  # 1 / (1 - p) norm
        dl = cuda.local.array(2, float32)  # D norm
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
        first, last = tile_range(i0, i1, nk, BC, rules, kv_len[b])
        k_at, v_at = shared_address(k_s, 0), shared_address(v_s, 0)
        # Q_i, dO_i: HBM -> SRAM -> registers, once
        load_tile16(k_at, q, b, i0, BR, D, t)
        load_tile16(v_at, do, b, i0, BR, D_V, t)
        cp_async_commit()
        cp_async_wait_all()
        cuda.syncthreads()
        load_a(qf, k_at, lane, 16 * w, KD, CQ)
        load_a(df, v_at, lane, 16 * w, KV, CV)
        for h in range(2):
            r0, r1, r2 = row_terms(stats, delta, b, row + 8 * h, nq,
                                   q.shape[0], rules.drop_scale)
            sh[h], zn[h], dl[h] = r0, r1, r2
        tau = rules.scale
        for n in range(NQ):
            for x in range(4):
                gf[n, x] = F0
        cuda.syncthreads()  # every warp has its fragments: SRAM is free
        for jt in range(first, last + 1):
            j0 = jt * BC
            load_tile16(k_at, k, bk, j0, BC, D, t)
            load_tile16(v_at, v, bk, j0, BC, D_V, t)
            cp_async_commit()
            cp_async_wait_all()
            cuda.syncthreads()
            full = not rules.use_mask and j0 + BC <= nk and tile_full(
                i0, i1, j0, j0 + BC, rules, kv_len[b])
            for part in range(PARTS):
                c0 = 8 * NS * part  # the slice's first key in the tile
                # ldmatrix bases of its rows of K_j and V_j
                lane_bases(kb, k_at + c0 * 16 * CQ, b_row, b_chunk, CQ)
                lane_bases(kt, k_at + c0 * 16 * CQ, t_row, t_chunk, CQ)
                lane_bases(vb, v_at + c0 * 16 * CV, b_row, b_chunk, CV)
                # S = Q_i K_j^T and dP = dO_i V_j^T: (16, 8 NS) per warp
                s_and_dp(sf, pf, qf, df, kb, vb, KD, KV, NS, CQ, CV)
                if not full:  # masked scores -inf: P 0
                    mask_scores(sf, b, row, j0 + c0, nq, nk, rules, kv_len,
                                mask, NS)
                gone = dropped_bits(b, row, j0 + c0, rules, NS) if (
                    rules.use_dropout) else int64(0)
                ds_of_rows(sf, pf, NS, tau, sh, zn, dl, gone)
                # dQ_i += dS K_j: dS's C fragments are its A fragments
                c_times_b(gf, sf, af, kt, NS // 2, NQ, CQ)
            cuda.syncthreads()  # no warp reads K_j, V_j any more
        for h in range(2):
            i = row + 8 * h
            if i < nq:
                for n in range(NQ):
                    x = 8 * n + 2 * (lane % 4)
                    dq[b, i, x] = gf[n, 2 * h] * rules.scale
                    dq[b, i, x + 1] = gf[n, 2 * h + 1] * rules.scale

    return backward_v5_dq


def make_dkv(D, D_V, kind="bf16"):
    """dK = tau dS^T Q and dV = P^T dO, for head dims D, D_V and `kind`."""
    load_a, s_and_dp, c_times_b = _warp_products(kind)
    KD, KV = D // 16, D_V // 16  # k-steps of S^T and of dP^T
    PARTS = parts("dkv", D, D_V)  # slices of a Q/dO tile, one after another
    NS = BR // 8 // PARTS  # n-tiles of a slice of S^T, dP^T (8 queries)
    NK, NV = D // 8, D_V // 8  # n-tiles of dK, dV
    CQ, CV = D // 8, D_V // 8  # 16-byte chunks per SRAM row
    Q_S, O_S = BR * D, BR * D_V  # SRAM tiles (16-bit values)

    @cuda.jit
    def backward_v5_dkv(q, k, v, do, stats, delta, dk, dv, rules, kv_len,
                        mask):
        # q, k, v, do: (BH, N, d) 16-bit bits; dk, dv: per query head;
        # stats: shifts (BH, Nq), then norms (BH, Nq) if present
        q_s = cuda.shared.array(Q_S, int16)  # K_j first, then Q_i
        o_s = cuda.shared.array(O_S, int16)  # V_j first, then dO_i
        sh_s = cuda.shared.array(ROWS, float32)  # row_terms of query i
        zn_s = cuda.shared.array(ROWS, float32)  # 1 / (1 - p) norm_i
        dl_s = cuda.shared.array(ROWS, float32)  # D_i norm_i
        kf = cuda.local.array((KD, 4), int32)  # K_j: A fragments
        vf = cuda.local.array((KV, 4), int32)  # V_j: A fragments
        sf = cuda.local.array((NS, 4), float32)  # S^T, then P^T Z
        pf = cuda.local.array((NS, 4), float32)  # dP^T, then dS^T
        af = cuda.local.array(4, int32)  # one k-step's A fragment
        gk = cuda.local.array((NK, 4), float32)  # dK_j
        gv = cuda.local.array((NV, 4), float32)  # dV_j
        qb = cuda.local.array(4, uint32)  # ldmatrix bases: Q_i as B
        qt = cuda.local.array(4, uint32)  # Q_i as B, read transposed
        ob = cuda.local.array(4, uint32)  # dO_i as B
        ot = cuda.local.array(4, uint32)  # dO_i as B, read transposed
        t = cuda.threadIdx.x
        w, lane = t // 32, t % 32
        b_row, b_chunk = ldmatrix_b(lane, 0, 0)  # this lane's B places
        t_row, t_chunk = ldmatrix_b_trans(lane, 0, 0)
        b = cuda.blockIdx.y
        bk = b // rules.group  # the K/V head of query head b
        j0 = cuda.blockIdx.x * BC
        nq, nk = q.shape[1], k.shape[1]
        j1 = min(j0 + BC, nk)
        key = j0 + 16 * w + lane // 4  # this lane's first key (g)
        q_at, o_at = shared_address(q_s, 0), shared_address(o_s, 0)
        # K_j, V_j: HBM -> SRAM -> registers, once
        load_tile16(q_at, k, bk, j0, BC, D, t)
        load_tile16(o_at, v, bk, j0, BC, D_V, t)
        cp_async_commit()
        cp_async_wait_all()
        cuda.syncthreads()
        load_a(kf, q_at, lane, 16 * w, KD, CQ)
        load_a(vf, o_at, lane, 16 * w, KV, CV)
        for n in range(NK):
            for x in range(4):
                gk[n, x] = F0
        for n in range(NV):
            for x in range(4):
                gv[n, x] = F0
        tau = rules.scale
        tq = 2 * (lane % 4)  # this lane's first column in an n-tile
        cuda.syncthreads()  # every warp has its fragments: SRAM is free
        for it in range((nq + BR - 1) // BR):
            i0 = it * BR
            i1 = min(i0 + BR, nq)
            if tile_skipped(i0, i1, j0, j1, rules, kv_len[b]):
                continue  # the same for the whole block
            load_tile16(q_at, q, b, i0, BR, D, t)
            load_tile16(o_at, do, b, i0, BR, D_V, t)
            cp_async_commit()
            if t < BR:  # rows past Nq add 0
                r0, r1, r2 = row_terms(stats, delta, b, i0 + t, nq,
                                       q.shape[0], rules.drop_scale)
                sh_s[t], zn_s[t], dl_s[t] = r0, r1, r2
            cp_async_wait_all()
            cuda.syncthreads()  # Q_i, dO_i, their statistics in SRAM
            for part in range(PARTS):
                c0 = 8 * NS * part  # the slice's first query in the tile
                # ldmatrix bases of its rows of Q_i and dO_i
                lane_bases(qb, q_at + c0 * 16 * CQ, b_row, b_chunk, CQ)
                lane_bases(qt, q_at + c0 * 16 * CQ, t_row, t_chunk, CQ)
                lane_bases(ob, o_at + c0 * 16 * CV, b_row, b_chunk, CV)
                lane_bases(ot, o_at + c0 * 16 * CV, t_row, t_chunk, CV)
                # S^T = K_j Q_i^T and dP^T = V_j dO_i^T: (16 keys, 8 NS)
                s_and_dp(sf, pf, kf, vf, qb, ob, KD, KV, NS, CQ, CV)
                # element (n, x): key `key` + 8 (x >> 1), query column
                # c0 + 8 n + tq + (x & 1) of the tile. Which pairs are
                # allowed and dropped comes first, as bits: the loop that
                # applies them then stays small enough to keep the
                # fragments in registers
                full = not rules.use_mask and j1 - j0 == BC and \
                    i1 - i0 == BR and tile_full(i0, i1, j0, j1, rules,
                                                kv_len[b])
                ok = int64(-1) if full else allowed_bits_of(
                    b, key, i0 + c0, nq, nk, rules, kv_len, mask, NS, True)
                gone = dropped_bits_of(b, key, i0 + c0, rules, NS, True) \
                    if rules.use_dropout else int64(0)
                # P^T Z and dS^T (p_of); the norm is in zn_s and dl_s
                ds_of_columns(sf, pf, NS, tau, c0 + tq, sh_s, zn_s, dl_s, ok,
                              gone)
                # dV_j += (P^T Z) dO_i and dK_j += dS^T Q_i: C fragments
                # are A fragments, dO_i and Q_i the B operands (read
                # transposed)
                c_times_b(gv, sf, af, ot, NS // 2, NV, CV)
                c_times_b(gk, pf, af, qt, NS // 2, NK, CQ)
            cuda.syncthreads()  # no warp reads Q_i, dO_i any more
        for h in range(2):
            j = key + 8 * h
            if j < nk:
                # row views and unsigned columns: plain stores, with no
                # index arithmetic left to hold registers at the end
                dk_j, dv_j = dk[b, j], dv[b, j]
                for n in range(NK):
                    x = uint32(8 * n + tq)
                    dk_j[x] = gk[n, 2 * h] * rules.scale
                    dk_j[x + uint32(1)] = gk[n, 2 * h + 1] * rules.scale
                for n in range(NV):
                    x = uint32(8 * n + tq)
                    dv_j[x] = gv[n, 2 * h]
                    dv_j[x + uint32(1)] = gv[n, 2 * h + 1]

    return backward_v5_dkv
