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

from flashlab import dropout, kernel_args, masks, merge, tiled

_row_step = njit(merge.row_step)
_row_probability = njit(merge.row_probability)
_pair_allowed = njit(masks.pair_allowed)
_tile_skipped = njit(masks.tile_skipped)
_tile_full = njit(masks.tile_full)
_keep_bits = njit(dropout.keep_bits)
# Let LLVM fuse multiply-adds and reorder sums so the loops vectorize; no
# flag that assumes finite values, since masked scores are -inf.
_FAST = {"contract", "reassoc"}


def attention(q, k, v, *, block_q=64, block_k=64, return_lse=False,
              **options):
    """Numba CPU attention, arguments as tiled.attention: o (..., Nq, dv)."""
    q3, k3, v3, batch, p, a = kernel_args.flatten(
        q, k, v, dict(block_q=block_q, block_k=block_k, **options))
    o = np.empty((q3.shape[0], p.nq, v3.shape[-1]), dtype=q3.dtype)
    lse = np.empty((q3.shape[0], p.nq), dtype=q3.dtype)
    kt = np.ascontiguousarray(np.swapaxes(k3, -1, -2))  # (BH, d, Nk)
    _forward(np.ascontiguousarray(q3), kt, np.ascontiguousarray(v3), o, lse,
             p.block_q, p.block_k, *_scalars(a, q3.dtype))
    o = o.reshape(*batch, p.nq, -1)
    return (o, lse.reshape(*batch, p.nq)) if return_lse else o


def attention_backward(q, k, v, o, lse, do, *, block_q=64, block_k=64,
                       **options):
    """Numba CPU gradients (dq, dk, dv); arguments as tiled's backward."""
    q3, k3, v3, batch, p, a = kernel_args.flatten(
        q, k, v, dict(block_q=block_q, block_k=block_k, **options))
    o, lse, do = tiled.check_saved(q, v, o, lse, do)
    bh, dv_ = q3.shape[0], v3.shape[-1]
    do3 = np.ascontiguousarray(do.reshape(bh, p.nq, dv_))
    lse3 = np.ascontiguousarray(lse.reshape(bh, p.nq))
    delta = (do3 * o.reshape(bh, p.nq, dv_)).sum(axis=-1)  # D_i (BH, Nq)
    dq, dk, dv = (np.empty_like(x) for x in (q3, k3, v3))
    q3, k3 = np.ascontiguousarray(q3), np.ascontiguousarray(k3)
    kt, vt = (np.ascontiguousarray(np.swapaxes(x, -1, -2)) for x in (k3, v3))
    scalars = _scalars(a, q3.dtype)
    _backward_kv(q3, kt, vt, do3, lse3, delta, dk, dv, p.block_q, p.block_k,
                 *scalars)
    _backward_q(q3, kt, vt, do3, lse3, delta, k3, dq, p.block_q, p.block_k,
                *scalars)
    return (dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape))


def _scalars(a, dtype):
    """KernelArgs in kernel argument order, floats in the array dtype."""
    t = dtype.type
    return (t(a.scale), a.causal, a.offset, a.left, a.right, a.kv_len,
            a.mask, a.use_mask, a.seed, a.threshold, a.use_dropout,
            t(a.drop_scale), t(np.finfo(dtype).min))


@njit
def _mask_tile(s, b, i0, br, j0, bc, causal, offset, left, right, kv_len,
               mask, use_mask):
    """Set disallowed pairs of the score tile s[:br, :bc] to -inf."""
    for r in range(br):
        for c in range(bc):
            ok = _pair_allowed(i0 + r, j0 + c, causal, offset, left, right,
                               kv_len)
            if use_mask:
                ok = ok and mask[b, i0 + r, j0 + c]
            if not ok:
                s[r, c] = -np.inf


@njit(fastmath=_FAST)
def _score_tile(s, q_b, kt_b, i0, br, j0, bc, scale):
    """s[:br, :bc] = scale * Q_i K_j^T, vectorized along the keys.

    q_b (Nq, d) and kt_b (d, Nk) are one batch element's arrays. The inner
    loops run over 1-d slices of exactly bc elements, which is what lets
    LLVM vectorize them (3.5x faster than indexing 3-d arrays, measured),
    and four rows go together so that each K element loaded feeds four
    multiply-adds (1.5x more, measured).
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
def _forward(q, kt, v, o, lse, block_q, block_k, scale, causal, offset,
             left, right, kv_len, mask, use_mask, seed, threshold,
             use_dropout, drop_scale, lowest):
    bh, nq, _ = q.shape
    nk, dv = v.shape[1], v.shape[2]
    n_blocks = (nq + block_q - 1) // block_q
    for t in prange(bh * n_blocks):
        b = t // n_blocks
        i0 = (t % n_blocks) * block_q
        br = min(block_q, nq - i0)
        acc = np.zeros((br, dv), dtype=q.dtype)  # u, on chip
        m = np.full(br, -np.inf, dtype=q.dtype)
        l = np.zeros(br, dtype=q.dtype)
        s = np.empty((br, block_k), dtype=q.dtype)  # the one score tile
        for j0 in range(0, nk, block_k):
            bc = min(block_k, nk - j0)
            if _tile_skipped(i0, i0 + br, j0, j0 + bc, causal, offset, left,
                             right, kv_len[b]):
                continue
            _score_tile(s, q[b], kt[b], i0, br, j0, bc, scale)
            if use_mask or not _tile_full(i0, i0 + br, j0, j0 + bc, causal,
                                          offset, left, right, kv_len[b]):
                _mask_tile(s, b, i0, br, j0, bc, causal, offset, left,
                           right, kv_len[b], mask, use_mask)
            for r in range(br):
                tile_max = s[r, 0]
                for c in range(1, bc):
                    tile_max = max(tile_max, s[r, c])
                m[r], shift, alpha = _row_step(m[r], tile_max, lowest)
                row_sum = alpha * 0  # a zero of the array dtype
                for c in range(bc):  # branch-free, so it vectorizes
                    p = math.exp(s[r, c] - shift)
                    row_sum += p
                    s[r, c] = p
                l[r] = alpha * l[r] + row_sum
                for x in range(dv):
                    acc[r, x] *= alpha
            if use_dropout:  # dropped pairs leave the numerator only
                for r in range(br):
                    for c in range(bc):
                        keep = _keep_bits(seed, uint64(b), uint64(i0 + r),
                                          uint64(j0 + c)) >= threshold
                        s[r, c] = s[r, c] * drop_scale if keep else 0
            _add_pv(acc, s, v[b], br, j0, bc)  # acc += P_ij V_j
        for r in range(br):
            if l[r] > 0:
                for x in range(dv):
                    o[b, i0 + r, x] = acc[r, x] / l[r]
                lse[b, i0 + r] = m[r] + math.log(l[r])
            else:  # no allowed key: output 0, lse -inf
                for x in range(dv):
                    o[b, i0 + r, x] = 0
                lse[b, i0 + r] = -np.inf


@njit(fastmath=_FAST)
def _ds_tile(s, dp, pz, q_b, kt_b, do_b, vt_b, lse_b, delta_b, b, i0, br,
             j0, bc, scale, one, causal, offset, left, right, kv_len, mask,
             use_mask, seed, threshold, use_dropout, drop_scale, lowest):
    """Recompute the tile: P_ij Z into pz, dS_ij = P(dP Z - D) into s."""
    _score_tile(s, q_b, kt_b, i0, br, j0, bc, scale)  # S_ij
    _score_tile(dp, do_b, vt_b, i0, br, j0, bc, one)  # dP_ij = dO_i V_j^T
    for r in range(br):
        i = i0 + r
        for c in range(bc):
            j = j0 + c
            ok = _pair_allowed(i, j, causal, offset, left, right, kv_len)
            if use_mask:
                ok = ok and mask[b, i, j]
            if not ok:
                s[r, c] = 0
                pz[r, c] = 0
                continue
            p = _row_probability(s[r, c], lse_b[i], lowest)
            z = drop_scale
            if use_dropout and _keep_bits(seed, uint64(b), uint64(i),
                                          uint64(j)) < threshold:
                z = z * 0
            pz[r, c] = p * z
            s[r, c] = p * (dp[r, c] * z - delta_b[i])


@njit(parallel=True, fastmath=_FAST)
def _backward_kv(q, kt, vt, do, lse, delta, dk, dv, block_q, block_k,
                 scale, causal, offset, left, right, kv_len, mask, use_mask,
                 seed, threshold, use_dropout, drop_scale, lowest):
    bh, nq, d = q.shape
    nk, dvn = vt.shape[2], vt.shape[1]
    one = drop_scale / drop_scale  # 1 in the array dtype (never 0 / 0)
    n_blocks = (nk + block_k - 1) // block_k
    for t in prange(bh * n_blocks):
        b = t // n_blocks
        j0 = (t % n_blocks) * block_k
        bc = min(block_k, nk - j0)
        dk_j = np.zeros((bc, d), dtype=q.dtype)  # on chip for all Q_i
        dv_j = np.zeros((bc, dvn), dtype=q.dtype)
        s = np.empty((block_q, bc), dtype=q.dtype)
        dp = np.empty((block_q, bc), dtype=q.dtype)
        pz = np.empty((block_q, bc), dtype=q.dtype)
        q_b, do_b = q[b], do[b]
        for i0 in range(0, nq, block_q):
            br = min(block_q, nq - i0)
            if _tile_skipped(i0, i0 + br, j0, j0 + bc, causal, offset, left,
                             right, kv_len[b]):
                continue
            _ds_tile(s, dp, pz, q_b, kt[b], do_b, vt[b], lse[b], delta[b],
                     b, i0, br, j0, bc, scale, one, causal, offset, left,
                     right, kv_len[b], mask, use_mask, seed, threshold,
                     use_dropout, drop_scale, lowest)
            for r in range(br):
                q_r, do_r = q_b[i0 + r], do_b[i0 + r]
                for c in range(bc):
                    w = pz[r, c]  # dV_j += (P Z)^T dO_i
                    dv_c = dv_j[c]
                    for x in range(dvn):
                        dv_c[x] += w * do_r[x]
                    g = s[r, c] * scale  # dK_j += tau dS^T Q_i
                    dk_c = dk_j[c]
                    for x in range(d):
                        dk_c[x] += g * q_r[x]
        dk[b, j0:j0 + bc, :] = dk_j
        dv[b, j0:j0 + bc, :] = dv_j


@njit(parallel=True, fastmath=_FAST)
def _backward_q(q, kt, vt, do, lse, delta, k, dq, block_q, block_k, scale,
                causal, offset, left, right, kv_len, mask, use_mask, seed,
                threshold, use_dropout, drop_scale, lowest):
    bh, nq, d = q.shape
    nk = kt.shape[2]
    one = drop_scale / drop_scale  # 1 in the array dtype (never 0 / 0)
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
            if _tile_skipped(i0, i0 + br, j0, j0 + bc, causal, offset, left,
                             right, kv_len[b]):
                continue
            _ds_tile(s, dp, pz, q[b], kt[b], do[b], vt[b], lse[b], delta[b],
                     b, i0, br, j0, bc, scale, one, causal, offset, left,
                     right, kv_len[b], mask, use_mask, seed, threshold,
                     use_dropout, drop_scale, lowest)
            for r in range(br):
                dq_r = dq_i[r]
                for c in range(bc):
                    g = s[r, c] * scale  # dQ_i += tau dS K_j
                    k_c = k_b[j0 + c]
                    for x in range(d):
                        dq_r[x] += g * k_c[x]
        dq[b, i0:i0 + br, :] = dq_i
