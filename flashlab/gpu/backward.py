"""Backward kernels: dK and dV over key blocks, dQ over query blocks.

Two kernels without atomics, so the gradients are bitwise identical from
run to run (chapter 8's recomputation: S and P are rebuilt from Q, K and
the rows' statistics, never stored). `stats` is the saved lse (BH, Nq),
or `device.row_statistics`' shifts and norms (2 BH, Nq), P = exp(S -
shift) norm, which stay exact where lse = m + log l lost log l. For head
dims up to BLOCKED_MAX_DIM they are register blocked like forward v4;
larger head dims use one thread per key or query row. `device.row_dot`
computes D_i = rowsum(dO_i * O_i) first.
"""

from numba import cuda, float32

from flashlab.gpu.device import (
    F0,
    F1,
    NEG_INF,
    THREADS,
    allowed,
    fill,
    output_piece,
    pair_grads,
    place,
    row_norm,
    score_piece,
    stage,
    stage_stats,
    tile_skipped,
)

BLOCK_BWD = 32  # keys (dK/dV pass) or queries (dQ pass) per blocked tile
BLOCKED_MAX_DIM = 64  # larger head dims would overflow 48 KiB of SRAM


def sizes(D, D_V):
    """(threads per block, rows per staged chunk) of the backward kernels."""
    return (64, 16) if max(D, D_V) <= 64 else (32, 8)


def make_kv(D, D_V):
    """dK, dV: one thread per key row; query chunks staged in SRAM."""
    NT, CH = sizes(D, D_V)
    DP, D_VP = D + 1, D_V + 1  # padded own rows: conflict-free reads

    @cuda.jit
    def backward_kv(q, k, v, do, stats, delta, dk, dv, rules, kv_len,
                    mask):
        k_s = cuda.shared.array((NT, DP), float32)  # own rows, padded
        v_s = cuda.shared.array((NT, D_VP), float32)
        q_s = cuda.shared.array((CH, D), float32)
        do_s = cuda.shared.array((CH, D_V), float32)
        sh_s = cuda.shared.array(CH, float32)  # shift_i
        nm_s = cuda.shared.array(CH, float32)  # norm_i
        dl_s = cuda.shared.array(CH, float32)  # D_i
        dk_j = cuda.local.array(D, float32)
        dv_j = cuda.local.array(D_V, float32)
        pk = cuda.local.array(D, float32)  # this chunk's share, summed
        pvv = cuda.local.array(D_V, float32)  # apart (a blocked sum)
        t = cuda.threadIdx.x
        b = cuda.blockIdx.y
        bk = b // rules.group  # the K/V head of query head b
        j0 = cuda.blockIdx.x * NT
        j = j0 + t
        nq, nk = q.shape[1], k.shape[1]
        j1 = min(j0 + NT, nk)
        for x in range(D):
            k_s[t, x] = k[bk, j, x] if j < nk else F0
            dk_j[x] = F0
        for x in range(D_V):
            v_s[t, x] = v[bk, j, x] if j < nk else F0
            dv_j[x] = F0
        for i0 in range(0, nq, CH):
            if tile_skipped(i0, min(i0 + CH, nq), j0, j1, rules, kv_len[b]):
                continue
            cuda.syncthreads()  # the previous chunk is no longer read
            stage(q_s, q, b, i0, CH, D, rules.scale, t, NT)
            stage(do_s, do, b, i0, CH, D_V, F1, t, NT)
            stage_stats(sh_s, nm_s, dl_s, stats, delta, b, i0, CH, t)
            cuda.syncthreads()  # the chunk of Q, dO and its statistics
            for x in range(D):
                pk[x] = F0
            for x in range(D_V):
                pvv[x] = F0
            for r in range(CH):
                if not allowed(b, i0 + r, j, nq, nk, rules, kv_len, mask):
                    continue
                s = F0
                for x in range(D):
                    s += q_s[r, x] * k_s[t, x]
                dp = F0
                for x in range(D_V):
                    dp += do_s[r, x] * v_s[t, x]
                pz, ds = pair_grads(b, i0 + r, j, nq, nk, s, dp, sh_s[r],
                                    nm_s[r], dl_s[r], rules, kv_len, mask)
                for x in range(D_V):
                    pvv[x] += pz * do_s[r, x]
                for x in range(D):
                    pk[x] += ds * q_s[r, x]  # q_s already holds tau Q
            for x in range(D):
                dk_j[x] += pk[x]
            for x in range(D_V):
                dv_j[x] += pvv[x]
        if j < nk:
            for x in range(D):
                dk[b, j, x] = dk_j[x]
            for x in range(D_V):
                dv[b, j, x] = dv_j[x]

    return backward_kv


def make_q(D, D_V):
    """dQ: one thread per query row; key chunks staged in SRAM."""
    NT, CH = sizes(D, D_V)
    DP, D_VP = D + 1, D_V + 1  # padded own rows: conflict-free reads

    @cuda.jit
    def backward_q(q, k, v, do, stats, delta, dq, rules, kv_len, mask):
        q_s = cuda.shared.array((NT, DP), float32)  # own rows, padded
        do_s = cuda.shared.array((NT, D_VP), float32)
        k_s = cuda.shared.array((CH, D), float32)
        v_s = cuda.shared.array((CH, D_V), float32)
        dq_i = cuda.local.array(D, float32)
        pq = cuda.local.array(D, float32)  # this chunk's share
        t = cuda.threadIdx.x
        b = cuda.blockIdx.y
        bk = b // rules.group  # the K/V head of query head b
        i0 = cuda.blockIdx.x * NT
        i = i0 + t
        nq, nk = q.shape[1], k.shape[1]
        i1 = min(i0 + NT, nq)
        for x in range(D):
            q_s[t, x] = q[b, i, x] * rules.scale if i < nq else F0
            dq_i[x] = F0
        for x in range(D_V):
            do_s[t, x] = do[b, i, x] if i < nq else F0
        sh_i = stats[b, i] if i < nq else NEG_INF
        nm_i = row_norm(stats, q.shape[0], b, i) if i < nq else F0
        d_i = delta[b, i] if i < nq else F0
        for j0 in range(0, nk, CH):
            if tile_skipped(i0, i1, j0, min(j0 + CH, nk), rules, kv_len[b]):
                continue
            cuda.syncthreads()  # the previous chunk is no longer read
            stage(k_s, k, bk, j0, CH, D, F1, t, NT)
            stage(v_s, v, bk, j0, CH, D_V, F1, t, NT)
            cuda.syncthreads()  # the chunk of K and V is loaded
            for x in range(D):
                pq[x] = F0
            for c in range(CH):
                if not allowed(b, i, j0 + c, nq, nk, rules, kv_len, mask):
                    continue
                s = F0
                for x in range(D):
                    s += q_s[t, x] * k_s[c, x]
                dp = F0
                for x in range(D_V):
                    dp += do_s[t, x] * v_s[c, x]
                _, ds = pair_grads(b, i, j0 + c, nq, nk, s, dp, sh_i, nm_i,
                                   d_i, rules, kv_len, mask)
                for x in range(D):
                    pq[x] += ds * rules.scale * k_s[c, x]
            for x in range(D):
                dq_i[x] += pq[x]
        if i < nq:
            for x in range(D):
                dq[b, i, x] = dq_i[x]

    return backward_q


def make_kv_blocked(D, D_V):
    """dK, dV with register blocking, for head dims up to 64.

    A block owns 32 keys and walks over chunks of 32 queries. Each of its
    128 threads computes a 4 x 2 piece of S^T = K_j Q_i^T and of
    dP^T = V_j dO_i^T in registers, then 4 rows of dV_j += (P Z)^T dO_i
    and dK_j += dS^T Q_i; no atomics, so the result is bitwise repeatable.
    """
    BK = BQ = BLOCK_BWD
    RM = 4
    TY = BK // RM
    TX = THREADS // TY
    CN = BQ // TX
    OK_, OV = D // TX, D_V // TX
    DP, D_VP, BQP = D + 1, D_V + 1, BQ + 1

    @cuda.jit
    def backward_kv_blocked(q, k, v, do, stats, delta, dk, dv, rules,
                            kv_len, mask):
        k_s = cuda.shared.array((BK, DP), float32)
        v_s = cuda.shared.array((BK, D_VP), float32)
        q_s = cuda.shared.array((BQ, DP), float32)
        do_s = cuda.shared.array((BQ, D_VP), float32)
        pt_s = cuda.shared.array((BK, BQP), float32)  # (P Z)^T
        dst_s = cuda.shared.array((BK, BQP), float32)  # dS^T
        sh_s = cuda.shared.array(BQ, float32)  # shift_i
        nm_s = cuda.shared.array(BQ, float32)  # norm_i
        dl_s = cuda.shared.array(BQ, float32)  # D_i
        s = cuda.local.array((RM, CN), float32)
        dp = cuda.local.array((RM, CN), float32)
        qa = cuda.local.array(RM, float32)
        ones = cuda.local.array(RM, float32)
        acc_k = cuda.local.array((RM, OK_), float32)
        acc_v = cuda.local.array((RM, OV), float32)
        pk = cuda.local.array((RM, OK_), float32)
        pvv = cuda.local.array((RM, OV), float32)
        vk = cuda.local.array(OK_, float32)
        vv = cuda.local.array(OV, float32)
        nq, nk = q.shape[1], k.shape[1]
        t, ty, tx, b, j0, j1 = place(BK, TX, nk)
        bk = b // rules.group  # the K/V head of query head b
        kv = kv_len[b]
        for a in range(RM):
            ones[a] = F1
        fill(acc_k, F0, RM, OK_)
        fill(acc_v, F0, RM, OV)
        # HBM -> SRAM once: K_j, V_j, used against every query chunk
        stage(k_s, k, bk, j0, BK, D, F1, t, THREADS)
        stage(v_s, v, bk, j0, BK, D_V, F1, t, THREADS)
        for i0 in range(0, nq, BQ):
            i1 = min(i0 + BQ, nq)
            if tile_skipped(i0, i1, j0, j1, rules, kv):
                continue  # uniform over the block: barriers stay aligned
            cuda.syncthreads()  # the previous chunk is no longer read
            stage(q_s, q, b, i0, BQ, D, rules.scale, t, THREADS)
            stage(do_s, do, b, i0, BQ, D_V, F1, t, THREADS)
            stage_stats(sh_s, nm_s, dl_s, stats, delta, b, i0, BQ, t)
            cuda.syncthreads()  # K_j, V_j and this chunk are in SRAM
            score_piece(s, qa, k_s, q_s, ty * RM, tx * CN, RM, CN, D)
            score_piece(dp, qa, v_s, do_s, ty * RM, tx * CN, RM, CN, D_V)
            for a in range(RM):
                r = ty * RM + a  # key row in the block
                for c in range(CN):
                    col = tx * CN + c  # query in the chunk
                    pt_s[r, col], dst_s[r, col] = pair_grads(
                        b, i0 + col, j0 + r, nq, nk, s[a, c], dp[a, c],
                        sh_s[col], nm_s[col], dl_s[col], rules, kv_len, mask)
            cuda.syncthreads()  # (P Z)^T and dS^T complete
            output_piece(acc_v, pvv, vv, ones, pt_s, do_s, ty * RM, tx, RM,
                          OV, BQ, TX)
            output_piece(acc_k, pk, vk, ones, dst_s, q_s, ty * RM, tx, RM,
                          OK_, BQ, TX)  # q_s holds tau Q: dK = tau dS^T Q
        for a in range(RM):
            j = j0 + ty * RM + a
            if j < nk:
                for c in range(OK_):
                    dk[b, j, tx + TX * c] = acc_k[a, c]
                for c in range(OV):
                    dv[b, j, tx + TX * c] = acc_v[a, c]

    return backward_kv_blocked


def make_q_blocked(D, D_V):
    """dQ with register blocking, for head dims up to 64.

    A block owns 32 queries and walks over chunks of 32 keys; each thread
    computes a 4 x 2 piece of S and dP, then 4 rows of dQ_i += tau dS K_j.
    """
    BQ = BK = BLOCK_BWD
    RM = 4
    TY = BQ // RM
    TX = THREADS // TY
    CN = BK // TX
    OQ = D // TX
    DP, D_VP, BKP = D + 1, D_V + 1, BK + 1

    @cuda.jit
    def backward_q_blocked(q, k, v, do, stats, delta, dq, rules, kv_len,
                           mask):
        q_s = cuda.shared.array((BQ, DP), float32)
        do_s = cuda.shared.array((BQ, D_VP), float32)
        k_s = cuda.shared.array((BK, DP), float32)
        v_s = cuda.shared.array((BK, D_VP), float32)
        ds_s = cuda.shared.array((BQ, BKP), float32)
        sh_s = cuda.shared.array(BQ, float32)  # shift_i
        nm_s = cuda.shared.array(BQ, float32)  # norm_i
        dl_s = cuda.shared.array(BQ, float32)  # D_i
        s = cuda.local.array((RM, CN), float32)
        dp = cuda.local.array((RM, CN), float32)
        qa = cuda.local.array(RM, float32)
        ones = cuda.local.array(RM, float32)
        acc = cuda.local.array((RM, OQ), float32)
        pq = cuda.local.array((RM, OQ), float32)
        vq = cuda.local.array(OQ, float32)
        nq, nk = q.shape[1], k.shape[1]
        t, ty, tx, b, i0, i1 = place(BQ, TX, nq)
        bk = b // rules.group  # the K/V head of query head b
        kv = kv_len[b]
        for a in range(RM):
            ones[a] = F1
        fill(acc, F0, RM, OQ)
        stage(q_s, q, b, i0, BQ, D, rules.scale, t, THREADS)
        stage(do_s, do, b, i0, BQ, D_V, F1, t, THREADS)
        stage_stats(sh_s, nm_s, dl_s, stats, delta, b, i0, BQ, t)
        for j0 in range(0, nk, BK):
            j1 = min(j0 + BK, nk)
            if tile_skipped(i0, i1, j0, j1, rules, kv):
                continue  # uniform over the block: barriers stay aligned
            cuda.syncthreads()  # the previous chunk is no longer read
            stage(k_s, k, bk, j0, BK, D, F1, t, THREADS)
            stage(v_s, v, bk, j0, BK, D_V, F1, t, THREADS)
            cuda.syncthreads()  # Q_i, dO_i and this K/V chunk are in SRAM
            score_piece(s, qa, q_s, k_s, ty * RM, tx * CN, RM, CN, D)
            score_piece(dp, qa, do_s, v_s, ty * RM, tx * CN, RM, CN, D_V)
            for a in range(RM):
                r = ty * RM + a  # query row in the block
                for c in range(CN):
                    col = tx * CN + c  # key in the chunk
                    _, ds = pair_grads(b, i0 + r, j0 + col, nq, nk, s[a, c],
                                       dp[a, c], sh_s[r], nm_s[r], dl_s[r],
                                       rules, kv_len, mask)
                    ds_s[r, col] = ds * rules.scale
            cuda.syncthreads()  # tau dS_ij complete
            output_piece(acc, pq, vq, ones, ds_s, k_s, ty * RM, tx, RM, OQ,
                          BK, TX)
        for a in range(RM):
            i = i0 + ty * RM + a
            if i < nq:
                for c in range(OQ):
                    dq[b, i, tx + TX * c] = acc[a, c]

    return backward_q_blocked

