"""Backward v7: backward_v5's two kernels on Hopper's warpgroup MMA.

bf16 or float16, sm_90a only. Deterministic and without atomics, as
backward_v5 (unless the caller allows them: `make_fused` below): one
kernel accumulates dQ per block of queries, the other dK and dV per
block of keys, so dQ's S and dP are formed twice (seven
products a tile pair where a backward with atomics needs five). Each
warpgroup of a block owns 64 rows of its tiles, and all of them read the
streamed tiles of the other side, double-buffered (`GROUPS` says how
many a block has):

- `make_dq`: 64 query rows (one warpgroup). Q_i and dO_i stay in shared
  memory; K_j and V_j (64 keys) stream. S = Q_i K_j^T and dP = dO_i
  V_j^T are wgmma from shared memory (m64n64k16), P and dS = P (dP - D)
  are formed in registers, and dQ_i += dS K_j takes dS from registers as
  the A operand and K_j, read MN-major, as B.
- `make_dkv`: 128 keys (two warpgroups). K_j and V_j stay; Q_i and dO_i
  (64 queries) stream with their rows' statistics. S^T = K_j Q_i^T and
  dP^T = V_j dO_i^T from shared memory, then dV_j += (P^T Z) dO_i and
  dK_j += dS^T Q_i with P^T and dS^T as register A operands.
- `make_fused` (where the caller allows atomics: deterministic=False):
  `make_dkv`'s kernel that also keeps each tile's dS^T in shared memory
  and runs dQ_i = dS K_j from it (dS^T read MN-major as the A operand),
  adding tau dQ_i to a float32 dQ by vector reductions: five products a
  tile pair, and dQ's last bits vary with the order of the additions.
  Measured on the H200 it is no faster than the two kernels (0.94 to
  1.05 times, hopper_backward_h200.csv): the warps that issue the
  reductions wait for them.

Gradients leave in the inputs' 16-bit type, rounded once from their
float32 accumulators (`make_store_pairs`), and dK, dV per K/V head: a
dK/dV block visits the query tiles of every query head of its group in
turn (`next_item`), so grouped heads sum in registers, not in a pass
over per-query-head copies.

An accumulator is backward_v5's C fragments stacked over a warpgroup
(fragments.wgmma_c_places), so its element-wise steps (`row_terms`,
`ds_of_rows`, `ds_of_columns`, masks and dropout bits) apply unchanged.
Per tile, one barrier hands the next tile's stage over: by then every
product that read the stage it refills has been waited for. Tiles lie
128-byte swizzled (forward_v7.load_panels) in dynamic shared memory. See
chapter 12.
"""

from numba import cuda, float32, int16, int32, int64, uint32, uint64

from flashlab import fragments
from flashlab.gpu.backward_v5 import (
    ds_of_columns,
    ds_of_full_columns,
    ds_of_rows,
    row_terms,
)
from flashlab.gpu.device import F0, inline, tile_full, tile_skipped
from flashlab.gpu.forward_v7 import (
    ALIGN,
    CC,
    descriptor_128b,
    handed_over,
    k_steps_128b,
    make_load_panels,
    make_to_a,
)
from flashlab.gpu.intrinsics import (
    bar_sync,
    cp_async_commit,
    cp_async_wait_all,
    global_address,
    pack_bf16x2,
    pack_f16x2,
    red_add2,
    shared_address,
    st_shared32,
)
from flashlab.gpu.warp import (
    allowed_bits_of,
    block_place,
    dropped_bits,
    dropped_bits_of,
    mask_scores,
    tile_range,
)
from flashlab.gpu.wgmma import mma_rs, mma_ss, proxy_fence, wait_for

# warpgroups per block, by kernel: each owns 64 rows (queries for dQ,
# keys for dK and dV) and all of a block's share the streamed tiles
# (measured on the H200: one warpgroup per dQ block, so two blocks share
# an SM and one's softmax runs under the other's products, is 5 to 12%
# faster than two; for dK and dV two, loading each Q/dO tile once for
# 128 keys, are as fast or faster)
GROUPS = {"dq": 1, "dkv": 2, "fused": 2}  # fused: dkv's, and dQ
STREAMED = 64  # rows of the other side per streamed tile
HEAD_DIMS = (64, 128)
WG_ROWS = 64 * 128  # bytes to a warpgroup's 64 rows in each panel
PACKS = {"bf16": pack_bf16x2, "f16": pack_f16x2}


def threads(part):
    """Threads per block of kernel `part` ("dq", "dkv" or "fused")."""
    return 128 * GROUPS[part]


def own(part):
    """Rows a block of kernel `part` owns."""
    return 64 * GROUPS[part]


def shared_bytes(part, d, d_v):
    """Dynamic shared memory per block of kernel `part`: its own rows of
    two tiles (d and d_v wide), two stages of the streamed ones, dS^T
    (own rows x STREAMED) for the fused kernel, and room to align them."""
    ds = own(part) * STREAMED if part == "fused" else 0
    return 2 * (own(part) * (d + d_v) + 2 * STREAMED * (d + d_v) + ds) \
        + ALIGN


def make_store_pairs(pack, tiles):
    """store_pairs for one 16-bit `pack` and `tiles` n-tiles of 8 columns
    of a gradient."""

    @inline
    def store_pairs(g, out, b, r, n_rows, t, factor):
        """A warp's rows r and r + 8 of out[b] (16-bit pairs, BH, N, d / 2)
        from float32 C fragments g times factor, each rounded once; rows
        past n_rows not. t is the lane's place in its group of four."""
        for h in range(2):
            if r + 8 * h < n_rows:
                # a row view and unsigned columns: plain stores, no index
                # arithmetic left to hold registers at the end
                out_r = out[b, r + 8 * h]
                for n in range(tiles):
                    out_r[uint32(4 * n + t)] = pack(g[n, 2 * h] * factor,
                                                    g[n, 2 * h + 1] * factor)

    return store_pairs


def make_dq(D, D_V, kind="bf16"):
    """dQ = tau dS K for head dims D, D_V and 16-bit `kind`."""
    BR, BC = own("dq"), STREAMED  # query rows per block, keys per tile
    load_panels = make_load_panels(threads("dq"))
    KD, KV, KP = D // 16, D_V // 16, BC // 16  # k-steps: S, dP, dQ
    NS, NQ = BC // 8, D // 8  # n-tiles of S (and dP), of dQ
    Q_S, O_S = BR * D, BR * D_V  # the block's own tiles (16-bit values)
    K_S, V_S = BC * D, BC * D_V  # one stage of each streamed tile
    OWN_S, STAGE_S = Q_S + O_S, K_S + V_S
    lbo, sbo, _, _ = fragments.k_major_128b(BR)
    lbo_t, sbo_t, step_t = fragments.mn_major_128b(BC)  # K_j as B of dQ
    s_issue = mma_ss(BC, KD, k_steps_128b(BR, KD), k_steps_128b(BC, KD),
                     kind, wait=False)
    p_issue = mma_ss(BC, KV, k_steps_128b(BR, KV), k_steps_128b(BC, KV),
                     kind, wait=False)
    g_issue = mma_rs(D, KP, step_t, kind, wait=False)
    sp_wait = wait_for(0, NS * 4, NS * 4)
    g_wait = wait_for(0, NQ * 4, KP * 4)  # dQ, and dS (its A operand)
    to_a = make_to_a(PACKS[kind], KP)
    store_pairs = make_store_pairs(PACKS[kind], NQ)

    @cuda.jit
    def backward_v7_dq(q, k, v, do, stats, delta, dq, rules, kv_len, mask):
        # q, k, v, do: (BH, N, d) 16-bit bits; delta: (BH, Nq); stats:
        # shifts (BH, Nq), then norms (BH, Nq) if present; dq: (BH, Nq,
        # d / 2) 16-bit pairs
        tiles = cuda.shared.array(0, int16)  # Q_i, dO_i, 2 x (K_j, V_j)
        sf = cuda.local.array((NS, 4), float32)  # S, then P, then dS
        pf = cuda.local.array((NS, 4), float32)  # dP
        af = cuda.local.array((KP, 4), int32)  # dS: A of each k-step
        gf = cuda.local.array((NQ, 4), float32)  # dQ_i
        sh = cuda.local.array(2, float32)  # rows g, g + 8: row_terms
        zn = cuda.local.array(2, float32)
        dl = cuda.local.array(2, float32)
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
        o_at = q_at + uint32(2 * Q_S)
        k_at = q_at + uint32(2 * OWN_S)  # stage s: 2 STAGE_S s bytes on
        v_at = k_at + uint32(2 * K_S)
        wg = uint32(WG_ROWS * (w // 4))  # this warpgroup's rows
        q_desc = uint64(descriptor_128b(q_at + wg, lbo, sbo))
        o_desc = uint64(descriptor_128b(o_at + wg, lbo, sbo))
        k_desc = uint64(descriptor_128b(k_at, lbo, sbo))
        v_desc = uint64(descriptor_128b(v_at, lbo, sbo))
        t_desc = uint64(descriptor_128b(k_at, lbo_t, sbo_t))
        next_stage = uint64(2 * STAGE_S >> 4)  # in descriptor units
        for h in range(2):
            r0, r1, r2 = row_terms(stats, delta, b, row + 8 * h, nq,
                                   q.shape[0], rules.drop_scale)
            sh[h], zn[h], dl[h] = r0, r1, r2
        for n in range(NQ):
            for x in range(4):
                gf[n, x] = F0
        tau = rules.scale
        if first <= last:  # HBM -> SRAM: Q_i, dO_i and tile `first`
            load_panels(q_at, q, b, i0, BR, D, t)
            load_panels(o_at, do, b, i0, BR, D_V, t)
            load_panels(k_at, k, bk, first * BC, BC, D, t)
            load_panels(v_at, v, bk, first * BC, BC, D_V, t)
            cp_async_commit()
        for jt in range(first, last + 1):
            now = uint32((jt - first) & 1)  # the stage of tile jt
            cp_async_wait_all()
            # tile jt has landed; every warpgroup has waited for the
            # products of tile jt - 1: the other stage is free
            handed_over()
            if jt < last:
                free = uint32(2 * STAGE_S) * (uint32(1) - now)
                load_panels(k_at + free, k, bk, jt * BC + BC, BC, D, t)
                load_panels(v_at + free, v, bk, jt * BC + BC, BC, D_V, t)
            cp_async_commit()
            j0 = jt * BC
            s_issue(sf, q_desc, k_desc + next_stage * uint64(now))
            p_issue(pf, o_desc, v_desc + next_stage * uint64(now))
            sp_wait(sf, pf)
            if rules.use_mask or j0 + BC > nk or not tile_full(
                    i0, i1, j0, j0 + BC, rules, kv):
                mask_scores(sf, b, row, j0, nq, nk, rules, kv_len, mask,
                            NS)  # masked scores -inf: P 0
            gone = dropped_bits(b, row, j0, rules, NS) if (
                rules.use_dropout) else int64(0)
            ds_of_rows(sf, pf, NS, tau, sh, zn, dl, gone)
            to_a(af, sf)  # dS rounded to 16 bits: dQ's A operand
            g_issue(gf, af, t_desc + next_stage * uint64(now))
            g_wait(gf, af)
        store_pairs(gf, dq, b, row, nq, lane % 4, tau)

    return backward_v7_dq


@inline
def next_item(g, it, groups, nt, nq, j0, j1, rules, kv_len, b0):
    """The first (g, it) after (g, it), query tile it (of nt, STREAMED rows
    each, of Nq) of query head b0 + g (of the group's `groups`), that keys
    j0..j1-1 do not skip; g = groups if none is left. Counters, not a
    flat index: no division in the loop."""
    it += 1
    while g < groups:
        if it == nt:
            g += 1
            it = 0
        else:
            i0 = it * STREAMED
            if not tile_skipped(i0, min(i0 + STREAMED, nq), j0, j1, rules,
                                kv_len[b0 + g]):
                return g, it
            it += 1
    return g, it


# the dK/dV kernels' descriptor strides (LBO, SBO): own keys and the
# streamed queries read K-major (the same at any rows), and the streamed
# queries MN-major as the B operand of dK and dV
LBO_K, SBO_K = fragments.k_major_128b(own("dkv"))[:2]
LBO_MN, SBO_MN = fragments.mn_major_128b(STREAMED)[:2]


@inline
def key_descriptors(k_at, v_at, q_at, o_at, wg):
    """(K_j, V_j, Q_i, dO_i, Q_i MN-major, dO_i MN-major) descriptors of a
    dK/dV kernel: its warpgroup's keys (wg bytes in) of the own tiles at
    k_at, v_at, and stage 0 of the streamed ones at q_at, o_at."""
    lbo, sbo, lbo_t, sbo_t = LBO_K, SBO_K, LBO_MN, SBO_MN
    return (uint64(descriptor_128b(k_at + wg, lbo, sbo)),
            uint64(descriptor_128b(v_at + wg, lbo, sbo)),
            uint64(descriptor_128b(q_at, lbo, sbo)),
            uint64(descriptor_128b(o_at, lbo, sbo)),
            uint64(descriptor_128b(q_at, lbo_t, sbo_t)),
            uint64(descriptor_128b(o_at, lbo_t, sbo_t)))


def make_dkv(D, D_V, kind="bf16"):
    """dK = tau dS^T Q and dV = P^T dO, for head dims D, D_V and `kind`."""
    return _make_keys(D, D_V, kind, with_dq=False)


def make_fused(D, D_V, kind="bf16"):
    """make_dkv's kernel that also adds dQ = tau dS K of every tile pair to
    a float32 dQ by atomics: five products a tile pair, not seven."""
    return _make_keys(D, D_V, kind, with_dq=True)


def dq_split(d):
    """(k-steps, whether each warpgroup takes its own keys) of the fused
    kernel's dQ product: at d = 128 warpgroup w takes dQ's columns 64 w..
    over all of the block's keys, at d = 64 all columns over its own 64
    keys (both add theirs); either way a 64 x 64 accumulator each."""
    own_keys = d == 64
    return (64 if own_keys else own("dkv")) // 16, own_keys



def make_scores_t(D, D_V, kind="bf16"):
    """scores_t for head dims D, D_V and `kind`: one streamed tile's
    S^T = K_j Q_i^T and dP^T = V_j dO_i^T for a warpgroup's 64 keys (wgmma
    from shared memory), then P^T Z in sf and dS^T in pf (ds_of_columns)
    under the tile's masks and dropout."""
    BK, BQ = own("dkv"), STREAMED  # keys per block, queries per tile
    KD, KV, NS = D // 16, D_V // 16, BQ // 8
    s_issue = mma_ss(BQ, KD, k_steps_128b(BK, KD), k_steps_128b(BQ, KD),
                     kind, wait=False)
    p_issue = mma_ss(BQ, KV, k_steps_128b(BK, KV), k_steps_128b(BQ, KV),
                     kind, wait=False)
    sp_wait = wait_for(0, NS * 4, NS * 4)

    @inline
    def scores_t(sf, pf, k_desc, q_desc, v_desc, o_desc, b, key, i0, i1,
                 j0, j1, nq, nk, rules, kv_len, mask, tau, tq, sh, zn,
                 dl):
        s_issue(sf, k_desc, q_desc)  # S^T = K_j Q_i^T
        p_issue(pf, v_desc, o_desc)  # dP^T = V_j dO_i^T
        kv = kv_len[b]  # loaded while the products run
        sp_wait(sf, pf)
        # element (n, x): key `key` + 8 (x >> 1), query column
        # 8 n + tq + (x & 1) of the tile; which pairs are allowed
        # and dropped comes first, as bits
        full = not rules.use_mask and j1 - j0 == BK and \
            i1 - i0 == BQ and tile_full(i0, i1, j0, j1, rules, kv)
        if full and not rules.use_dropout:
            # most tiles: testing each pair's bits, and reading its
            # column's terms under that test, took a third of the
            # consumers' instructions (chapter 12)
            ds_of_full_columns(sf, pf, NS, tau, tq, sh, zn, dl)
            return
        ok = int64(-1) if full else allowed_bits_of(
            b, key, i0, nq, nk, rules, kv_len, mask, NS, True)
        gone = dropped_bits_of(b, key, i0, rules, NS, True) \
            if rules.use_dropout else int64(0)
        ds_of_columns(sf, pf, NS, tau, tq, sh, zn, dl, ok, gone)

    return scores_t

def _make_keys(D, D_V, kind, with_dq):
    """The kernel of a block of keys: dK and dV, and with_dq dQ too."""
    BK, BQ = own("dkv"), STREAMED  # keys per block, queries per tile
    load_panels = make_load_panels(threads("dkv"))
    KP = BQ // 16  # k-steps of dK and dV (S^T's: make_scores_t)
    NS, NK, NV = BQ // 8, D // 8, D_V // 8  # n-tiles: S^T, dK, dV
    K_S, V_S = BK * D, BK * D_V  # the block's own tiles (16-bit values)
    Q_S, O_S = BQ * D, BQ * D_V  # one stage of each streamed tile
    OWN_S, STAGE_S = K_S + V_S, Q_S + O_S
    step_t = fragments.mn_major_128b(BQ)[2]  # Q_i, dO_i as B
    scores_t = make_scores_t(D, D_V, kind)
    v_issue = mma_rs(D_V, KP, step_t, kind, wait=False)
    k_issue = mma_rs(D, KP, step_t, kind, wait=False)
    # dV and P^T in (dK may still fly), then dK and dS^T (dQ may fly)
    v_wait = wait_for(1, NV * 4, KP * 4)
    k_wait = wait_for(int(with_dq), NK * 4, KP * 4)
    to_a = make_to_a(PACKS[kind], KP)
    store_k = make_store_pairs(PACKS[kind], NK)
    store_v = make_store_pairs(PACKS[kind], NV)
    # dQ = dS K: A dS^T (keys x queries, one panel) and B K_j, both read
    # MN-major from 128-byte-swizzled tiles; the hooks are no-ops without
    keep_ds, start_dq, finish_dq = _dq_hooks(D, kind) if with_dq else (
        _no_ds, _no_start, _no_finish)
    _, OWN_KEYS = dq_split(D)
    lbo_d, sbo_d, _ = fragments.mn_major_128b(BK)

    @inline
    def run(q, k, v, do, stats, delta, dk, dv, dq, rules, kv_len, mask):
        # q, do: (BH, Nq, d) and k, v: (BH_kv, Nk, d) 16-bit bits; dk, dv:
        # (BH_kv, Nk, d / 2) 16-bit pairs, one block row per K/V head;
        # stats: shifts (BH, Nq), then norms (BH, Nq) if present; dq
        # (fused): float32 (BH, Nq, d), tau dS K summed into it
        tiles = cuda.shared.array(0, int16)  # K_j, V_j, 2 x (Q_i, dO_i)
        # row_terms (shift, zn, dl) of each stage's queries
        terms = cuda.shared.array((2, 3, STREAMED), float32)
        sf = cuda.local.array((NS, 4), float32)  # S^T, then P^T Z
        pf = cuda.local.array((NS, 4), float32)  # dP^T, then dS^T
        pa = cuda.local.array((KP, 4), int32)  # P^T Z: A of dV's k-steps
        da = cuda.local.array((KP, 4), int32)  # dS^T: A of dK's k-steps
        gk = cuda.local.array((NK, 4), float32)  # dK_j
        gv = cuda.local.array((NV, 4), float32)  # dV_j
        gq = cuda.local.array((8, 4), float32)  # 64 x 64 of dS K (fused)
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
        key = j0 + 16 * w + lane // 4  # this lane's first key (g)
        tq = 2 * (lane % 4)  # this lane's first column in an n-tile
        at = shared_address(tiles, 0)
        k_at = uint32(at + (ALIGN - at % ALIGN) % ALIGN)
        v_at = k_at + uint32(2 * K_S)
        q_at = k_at + uint32(2 * OWN_S)  # stage s: 2 STAGE_S s bytes on
        o_at = q_at + uint32(2 * Q_S)
        ds_at = q_at + uint32(4 * STAGE_S)  # dS^T, after both stages
        wg = uint32(WG_ROWS * (w // 4))  # this warpgroup's keys
        k_desc, v_desc, q_desc, o_desc, qt_desc, ot_desc = \
            key_descriptors(k_at, v_at, q_at, o_at, wg)
        # dQ's operands: this warpgroup's keys of dS^T and K_j, or all
        # keys and its panel of K_j (dq_split)
        mine = wg if OWN_KEYS else uint32(0)
        panel = uint32(0) if OWN_KEYS else uint32(BK * 128 * (w // 4))
        ds_desc = uint64(descriptor_128b(ds_at + mine, lbo_d, sbo_d))
        kq_desc = uint64(descriptor_128b(k_at + panel + mine, lbo_d,
                                         sbo_d))
        next_stage = uint64(2 * STAGE_S >> 4)  # in descriptor units
        for n in range(NK):
            for x in range(4):
                gk[n, x] = F0
        for n in range(NV):
            for x in range(4):
                gv[n, x] = F0
        tau = rules.scale
        nt = (nq + BQ - 1) // BQ
        groups = rules.group  # query heads of this K/V head
        g, it = next_item(0, -1, groups, nt, nq, j0, j1, rules, kv_len, b0)
        if g < groups:  # HBM -> SRAM: K_j, V_j and the first query tile
            b, i0 = b0 + g, it * BQ
            load_panels(k_at, k, bk, j0, BK, D, t)
            load_panels(v_at, v, bk, j0, BK, D_V, t)
            load_panels(q_at, q, b, i0, BQ, D, t)
            load_panels(o_at, do, b, i0, BQ, D_V, t)
            cp_async_commit()
            if t < BQ:
                r0, r1, r2 = row_terms(stats, delta, b, i0 + t, nq,
                                       q.shape[0], rules.drop_scale)
                terms[0, 0, t], terms[0, 1, t], terms[0, 2, t] = r0, r1, r2
        now = 0  # the stage of (g, it)
        while g < groups:
            gn, itn = next_item(g, it, groups, nt, nq, j0, j1, rules,
                                kv_len, b0)
            cp_async_wait_all()
            # item (g, it) and its terms have landed; every warpgroup has
            # waited for the products of the item before (and read its
            # dS^T): the other stage is free
            handed_over()
            if gn < groups:
                free = uint32(2 * STAGE_S) * uint32(1 - now)
                bn, n0 = b0 + gn, itn * BQ
                load_panels(q_at + free, q, bn, n0, BQ, D, t)
                load_panels(o_at + free, do, bn, n0, BQ, D_V, t)
                if t < BQ:
                    r0, r1, r2 = row_terms(stats, delta, bn, n0 + t, nq,
                                           q.shape[0], rules.drop_scale)
                    s1 = 1 - now
                    terms[s1, 0, t], terms[s1, 1, t] = r0, r1
                    terms[s1, 2, t] = r2
            cp_async_commit()
            b, i0 = b0 + g, it * BQ
            i1 = min(i0 + BQ, nq)
            at_now = next_stage * uint64(now)
            scores_t(sf, pf, k_desc, q_desc + at_now, v_desc,
                     o_desc + at_now, b, key, i0, i1, j0, j1, nq, nk,
                     rules, kv_len, mask, tau, tq, terms[now, 0],
                     terms[now, 1], terms[now, 2])
            # dV_j += (P^T Z) dO_i and dK_j += dS^T Q_i: the rounded C
            # fragments are the A operands, dO_i and Q_i read MN-major
            to_a(pa, sf)
            v_issue(gv, pa, ot_desc + at_now)
            to_a(da, pf)
            keep_ds(da, ds_at, t)  # before dK's product takes da
            k_issue(gk, da, qt_desc + at_now)
            v_wait(gv, pa)  # P^T's registers free before dQ's are taken
            start_dq(gq, ds_desc, kq_desc, t)
            k_wait(gk, da)
            finish_dq(gq, dq, b, i0 + 16 * (w % 4) + lane // 4, nq,
                      (0 if OWN_KEYS else 64 * (w // 4)) + tq, tau)
            g, it = gn, itn
            now = 1 - now
        store_k(gk, dk, bk, key, nk, lane % 4, tau)
        store_v(gv, dv, bk, key, nk, lane % 4, float32(1))

    if with_dq:
        @cuda.jit
        def backward_v7_fused(q, k, v, do, stats, delta, dk, dv, dq, rules,
                              kv_len, mask):
            run(q, k, v, do, stats, delta, dk, dv, dq, rules,
                       kv_len, mask)

        return backward_v7_fused

    @cuda.jit
    def backward_v7_dkv(q, k, v, do, stats, delta, dk, dv, rules, kv_len,
                        mask):
        run(q, k, v, do, stats, delta, dk, dv, dk, rules, kv_len,
                   mask)

    return backward_v7_dkv


ds_place = cuda.jit(device=True)(fragments.a_pair_offset)


def _dq_hooks(D, kind):
    """The fused kernel's three steps of dQ = dS K, around dK's product:
    keep dS^T in SRAM, start the product once every warpgroup's is there,
    wait for it and add it to dQ."""
    QSTEPS, OWN_KEYS = dq_split(D)
    _, _, step = fragments.mn_major_128b(own("dkv"))
    q_issue = mma_ss(64, QSTEPS, step, step, kind, trans_b=1, wait=False,
                     trans_a=1)
    q_wait = wait_for(0, 32)
    KP = STREAMED // 16

    @inline
    def keep_ds(da, ds_at, t):
        # dS^T's A registers, each a pair of a C fragment row (keys), to
        # their places in the swizzled keys x queries tile
        for kp in range(KP):
            for x in range(4):
                st_shared32(uint32(ds_at + uint32(ds_place(t, kp, x))),
                            da[kp, x])

    @inline
    def start_dq(gq, ds_desc, kq_desc, t):
        proxy_fence()  # this thread's dS^T stores to wgmma's proxy,
        # then every thread's that the product reads: the warpgroup's
        # own where it takes its own keys (d = 64), else the block's.
        # (a named barrier for the one warpgroup: 4% of the kernel's time
        # at d = 64, N = 16K on the H200)
        if OWN_KEYS:
            bar_sync(1 + t // 128, 128)
        else:
            cuda.syncthreads()
        q_issue(gq, ds_desc, kq_desc)

    @inline
    def finish_dq(gq, dq, b, row, nq, col, tau):
        # C fragment (n, x): query row + 8 (x >> 1), column col + 8 n +
        # (x & 1) of dQ, a pair of neighbours per reduction (col even),
        # times tau; rows past Nq are not there
        q_wait(gq)
        for h in range(2):
            if row + 8 * h < nq:
                at = global_address(dq, (b, row + 8 * h, col))
                for n in range(8):
                    red_add2(at + uint64(32 * n), gq[n, 2 * h] * tau,
                             gq[n, 2 * h + 1] * tau)

    return keep_ds, start_dq, finish_dq


@inline
def _no_ds(da, ds_at, t):
    pass


@inline
def _no_start(gq, ds_desc, kq_desc, t):
    pass


@inline
def _no_finish(gq, dq, b, row, nq, col, tau):
    pass


def compile_ptx(part, d, d_v, kind="bf16"):
    """PTX of kernel `part` ("dq" or "dkv") for sm_90a; needs no GPU."""
    from flashlab.gpu import build

    with build.compiling_without_gpu(CC[:2]):
        ptx, _ = cuda.compile_ptx(
            {"dq": make_dq, "dkv": make_dkv, "fused": make_fused}[part](
                d, d_v, kind).py_func,
            build.signature(f"backward_v7_{part}_{kind}"), cc=CC)
    return ptx
