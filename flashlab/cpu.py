"""Tiled attention compiled for the CPU with numba: forward and backward.

Same arguments and semantics as `flashlab.tiled`, float32 and float64.
Query blocks (forward, dQ pass) and key blocks (dK/dV pass) of every
batch element run in parallel threads; nothing is shared between
threads, so results do not depend on the thread count. The per-row
algebra is `merge.row_step`, the mask rules `masks.pair_allowed`, the
dropout hash `dropout.keep_bits`, compiled here as they are. See
chapter 9.
"""

import math

import numpy as np
from numba import njit, prange, uint64

from flashlab import dropout, kernel_args, masks, merge, nonfinite, tiled
from flashlab._validate import check_flag

_row_step = njit(merge.row_step)
_row_probability = njit(merge.row_probability)
_pair_allowed = njit(masks.pair_allowed)
_tile_skipped = njit(masks.tile_skipped)
_tile_full = njit(masks.tile_full)
_keep_bits = njit(dropout.keep_bits)
# Let LLVM fuse multiply-adds and reorder sums so the loops vectorize; no
# flag that assumes finite values, since masked scores are -inf.
_FAST = {"contract", "reassoc"}


ORDERS = ("fa2",)  # the loop order these kernels run


def attention(q, k, v, *, block_q=None, block_k=None, scale=None,
              causal=False, mask=None, window=None, kv_lengths=None,
              dropout_p=0.0, seed=None, return_lse=False, order="fa2",
              num_splits=1):
    """Numba CPU attention; keywords as tiled.attention: o (..., Nq, dv)."""
    tiled.check_order(order, ORDERS)
    tiled.check_splits(num_splits, supported=1)
    return_lse = check_flag("return_lse", return_lse)
    q3, k3, v3, batch, plan, a = kernel_args.flatten(q, k, v, dict(
        block_q=block_q, block_k=block_k, scale=scale, causal=causal,
        mask=mask, window=window, kv_lengths=kv_lengths,
        dropout_p=dropout_p, seed=seed))
    bh, d_v = q3.shape[0], v3.shape[-1]
    o = np.empty((bh, plan.nq, d_v), dtype=q3.dtype)
    lse = np.empty((bh, plan.nq), dtype=q3.dtype)
    kt = np.ascontiguousarray(np.swapaxes(k3, -1, -2))  # (BH, d, Nk)
    _forward(np.ascontiguousarray(q3), kt, np.ascontiguousarray(v3), o, lse,
             plan.block_q, plan.block_k, a.rules, a.kv_len, a.mask)
    o = o.reshape(*batch, plan.nq, d_v)
    lse = lse.reshape(*batch, plan.nq)
    nonfinite.finish(o, lse, v3.reshape(*batch, plan.nk, d_v),
                     plan.empty_rows(batch))
    return (o, lse) if return_lse else o


def attention_backward(q, k, v, o, lse, do, *, block_q=None, block_k=None,
                       scale=None, causal=False, mask=None, window=None,
                       kv_lengths=None, dropout_p=0.0, seed=None,
                       order="fa2"):
    """Numba CPU gradients (dq, dk, dv); keywords as tiled's backward."""
    tiled.check_order(order)  # one backward loop follows either forward
    q3, k3, v3, batch, plan, a = kernel_args.flatten(q, k, v, dict(
        block_q=block_q, block_k=block_k, scale=scale, causal=causal,
        mask=mask, window=window, kv_lengths=kv_lengths,
        dropout_p=dropout_p, seed=seed))
    o, lse, do = tiled.check_saved(q, v, o, lse, do)
    bh, d_v = q3.shape[0], v3.shape[-1]
    do3 = np.ascontiguousarray(do.reshape(bh, plan.nq, d_v))
    lse3 = np.ascontiguousarray(lse.reshape(bh, plan.nq))
    delta = (do3 * o.reshape(bh, plan.nq, d_v)).sum(axis=-1)  # D_i (BH, Nq)
    dq, dk, dv = (np.empty_like(x) for x in (q3, k3, v3))
    q3, k3 = np.ascontiguousarray(q3), np.ascontiguousarray(k3)
    kt, vt = (np.ascontiguousarray(np.swapaxes(x, -1, -2)) for x in (k3, v3))
    _backward_kv(q3, kt, vt, do3, lse3, delta, dk, dv, plan.block_q,
                 plan.block_k, a.rules, a.kv_len, a.mask)
    _backward_q(q3, kt, vt, do3, lse3, delta, k3, dq, plan.block_q,
                plan.block_k, a.rules, a.kv_len, a.mask)
    return (dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape))


@njit
def _allowed(r, b, i, j, kv_len, mask):
    """Pair (i, j) of batch element b is allowed by every rule."""
    ok = _pair_allowed(i, j, r, kv_len[b])
    if r.use_mask:
        ok = ok and mask[b, i, j]
    return ok


@njit
def _mask_tile(s, r, b, i0, br, j0, bc, kv_len, mask):
    """Set disallowed pairs of the score tile s[:br, :bc] to -inf."""
    for a in range(br):
        for c in range(bc):
            if not _allowed(r, b, i0 + a, j0 + c, kv_len, mask):
                s[a, c] = -np.inf


@njit
def _dropout_weight(r, b, i, j):
    """1 / (1 - p) for a kept pair, 0 for a dropped one, 1 without dropout."""
    if r.use_dropout and _keep_bits(r.seed, uint64(b), uint64(i),
                                    uint64(j)) < r.threshold:
        return r.drop_scale * 0
    return r.drop_scale


@njit(fastmath=_FAST)
def _score_tile(s, q_b, kt_b, i0, br, j0, bc, scale):
    """s[:br, :bc] = scale * Q_i K_j^T, vectorized along the keys.

    q_b (Nq, d) and kt_b (d, Nk) are one batch element's arrays. The inner
    loops run over 1-d slices of exactly bc elements, which is what lets
    LLVM vectorize them (indexing the 3-d arrays directly does not), and
    four rows go together so that each K element loaded feeds four
    multiply-adds. Chapter 9 has the measurements.
    """
    r = 0
    while r + 4 <= br:
        s0, s1, s2, s3 = s[r, :bc], s[r + 1, :bc], s[r + 2, :bc], s[r + 3, :bc]
        q0, q1 = q_b[i0 + r], q_b[i0 + r + 1]
        q2, q3 = q_b[i0 + r + 2], q_b[i0 + r + 3]
        s0[:] = 0
        s1[:] = 0
        s2[:] = 0
        s3[:] = 0
        for x in range(q_b.shape[1]):
            a0, a1 = q0[x] * scale, q1[x] * scale
            a2, a3 = q2[x] * scale, q3[x] * scale
            k_x = kt_b[x, j0:j0 + bc]
            for c in range(bc):
                kc = k_x[c]
                s0[c] += a0 * kc
                s1[c] += a1 * kc
                s2[c] += a2 * kc
                s3[c] += a3 * kc
        r += 4
    for rest in range(r, br):  # the last br % 4 rows
        s_r = s[rest, :bc]
        q_r = q_b[i0 + rest]
        s_r[:] = 0
        for x in range(q_b.shape[1]):
            a = q_r[x] * scale
            k_x = kt_b[x, j0:j0 + bc]
            for c in range(bc):
                s_r[c] += a * k_x[c]


@njit(fastmath=_FAST)
def _add_pv(acc, s, v_b, br, j0, bc):
    """acc[:br] += s[:br, :bc] V_j, four keys per pass over a row of acc."""
    for r in range(br):
        acc_r = acc[r]
        c = 0
        while c + 4 <= bc:
            p0, p1, p2, p3 = s[r, c], s[r, c + 1], s[r, c + 2], s[r, c + 3]
            v0, v1 = v_b[j0 + c], v_b[j0 + c + 1]
            v2, v3 = v_b[j0 + c + 2], v_b[j0 + c + 3]
            for x in range(acc_r.shape[0]):
                acc_r[x] += p0 * v0[x] + p1 * v1[x] + p2 * v2[x] + p3 * v3[x]
            c += 4
        for rest in range(c, bc):  # the last bc % 4 keys
            p = s[r, rest]
            v_c = v_b[j0 + rest]
            for x in range(acc_r.shape[0]):
                acc_r[x] += p * v_c[x]


@njit(parallel=True, fastmath=_FAST)
def _forward(q, kt, v, o, lse, block_q, block_k, r, kv_len, mask):
    bh, nq, _ = q.shape
    nk, d_v = v.shape[1], v.shape[2]
    n_blocks = (nq + block_q - 1) // block_q
    for t in prange(bh * n_blocks):
        b = t // n_blocks
        i0 = (t % n_blocks) * block_q
        br = min(block_q, nq - i0)
        acc = np.zeros((br, d_v), dtype=q.dtype)  # u, on chip
        m = np.full(br, -np.inf, dtype=q.dtype)
        l = np.zeros(br, dtype=q.dtype)
        s = np.empty((br, block_k), dtype=q.dtype)  # the one score tile
        for j0 in range(0, nk, block_k):
            bc = min(block_k, nk - j0)
            if _tile_skipped(i0, i0 + br, j0, j0 + bc, r, kv_len[b]):
                continue
            _score_tile(s, q[b], kt[b], i0, br, j0, bc, r.scale)
            if r.use_mask or not _tile_full(i0, i0 + br, j0, j0 + bc, r,
                                            kv_len[b]):
                _mask_tile(s, r, b, i0, br, j0, bc, kv_len, mask)
            for a in range(br):
                tile_max = s[a, 0]
                for c in range(1, bc):
                    tile_max = max(tile_max, s[a, c])
                m[a], shift, alpha = _row_step(m[a], tile_max, r.lowest)
                row_sum = alpha * 0  # a zero of the array dtype
                for c in range(bc):  # branch-free, so it vectorizes
                    p = math.exp(s[a, c] - shift)
                    row_sum += p
                    s[a, c] = p
                l[a] = alpha * l[a] + row_sum
                for x in range(d_v):
                    acc[a, x] *= alpha
            if r.use_dropout:  # dropped pairs leave the numerator only
                for a in range(br):
                    for c in range(bc):
                        s[a, c] *= _dropout_weight(r, b, i0 + a, j0 + c)
            _add_pv(acc, s, v[b], br, j0, bc)  # acc += P_ij V_j
        for a in range(br):
            if l[a] != 0:  # NaN is not "no key": it stays NaN
                for x in range(d_v):
                    o[b, i0 + a, x] = acc[a, x] / l[a]
                lse[b, i0 + a] = m[a] + math.log(l[a])
            else:  # no allowed key: output 0, lse -inf
                for x in range(d_v):
                    o[b, i0 + a, x] = 0
                lse[b, i0 + a] = -np.inf


@njit(fastmath=_FAST)
def _ds_tile(s, dp, pz, q_b, kt_b, do_b, vt_b, lse_b, delta_b, b, i0, br,
             j0, bc, r, kv_len, mask):
    """Recompute the tile: P_ij Z into pz, dS_ij = P(dP Z - D) into s."""
    _score_tile(s, q_b, kt_b, i0, br, j0, bc, r.scale)  # S_ij
    one = r.drop_scale / r.drop_scale  # 1 in the array dtype (never 0 / 0)
    _score_tile(dp, do_b, vt_b, i0, br, j0, bc, one)  # dP_ij = dO_i V_j^T
    for a in range(br):
        i = i0 + a
        for c in range(bc):
            j = j0 + c
            if not _allowed(r, b, i, j, kv_len, mask):
                s[a, c] = 0
                pz[a, c] = 0
                continue
            p = _row_probability(s[a, c], lse_b[i], r.lowest)
            z = _dropout_weight(r, b, i, j)
            pz[a, c] = p * z
            s[a, c] = p * (dp[a, c] * z - delta_b[i])


@njit(parallel=True, fastmath=_FAST)
def _backward_kv(q, kt, vt, do, lse, delta, dk, dv, block_q, block_k, r,
                 kv_len, mask):
    bh, nq, d = q.shape
    nk, d_v = vt.shape[2], vt.shape[1]
    n_blocks = (nk + block_k - 1) // block_k
    for t in prange(bh * n_blocks):
        b = t // n_blocks
        j0 = (t % n_blocks) * block_k
        bc = min(block_k, nk - j0)
        dk_j = np.zeros((bc, d), dtype=q.dtype)  # on chip for all Q_i
        dv_j = np.zeros((bc, d_v), dtype=q.dtype)
        s = np.empty((block_q, bc), dtype=q.dtype)
        dp = np.empty((block_q, bc), dtype=q.dtype)
        pz = np.empty((block_q, bc), dtype=q.dtype)
        q_b, do_b = q[b], do[b]
        for i0 in range(0, nq, block_q):
            br = min(block_q, nq - i0)
            if _tile_skipped(i0, i0 + br, j0, j0 + bc, r, kv_len[b]):
                continue
            _ds_tile(s, dp, pz, q_b, kt[b], do_b, vt[b], lse[b], delta[b],
                     b, i0, br, j0, bc, r, kv_len, mask)
            for a in range(br):
                q_a, do_a = q_b[i0 + a], do_b[i0 + a]
                for c in range(bc):
                    w = pz[a, c]  # dV_j += (P Z)^T dO_i
                    dv_c = dv_j[c]
                    for x in range(d_v):
                        dv_c[x] += w * do_a[x]
                    g = s[a, c] * r.scale  # dK_j += tau dS^T Q_i
                    dk_c = dk_j[c]
                    for x in range(d):
                        dk_c[x] += g * q_a[x]
        dk[b, j0:j0 + bc, :] = dk_j
        dv[b, j0:j0 + bc, :] = dv_j


@njit(parallel=True, fastmath=_FAST)
def _backward_q(q, kt, vt, do, lse, delta, k, dq, block_q, block_k, r,
                kv_len, mask):
    bh, nq, d = q.shape
    nk = kt.shape[2]
    n_blocks = (nq + block_q - 1) // block_q
    for t in prange(bh * n_blocks):
        b = t // n_blocks
        i0 = (t % n_blocks) * block_q
        br = min(block_q, nq - i0)
        dq_i = np.zeros((br, d), dtype=q.dtype)
        s = np.empty((br, block_k), dtype=q.dtype)
        dp = np.empty((br, block_k), dtype=q.dtype)
        pz = np.empty((br, block_k), dtype=q.dtype)
        k_b = k[b]
        for j0 in range(0, nk, block_k):
            bc = min(block_k, nk - j0)
            if _tile_skipped(i0, i0 + br, j0, j0 + bc, r, kv_len[b]):
                continue
            _ds_tile(s, dp, pz, q[b], kt[b], do[b], vt[b], lse[b], delta[b],
                     b, i0, br, j0, bc, r, kv_len, mask)
            for a in range(br):
                dq_a = dq_i[a]
                for c in range(bc):
                    g = s[a, c] * r.scale  # dQ_i += tau dS K_j
                    k_c = k_b[j0 + c]
                    for x in range(d):
                        dq_a[x] += g * k_c[x]
        dq[b, i0:i0 + br, :] = dq_i
