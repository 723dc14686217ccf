"""Input makers and error measures shared by the tests."""

import numpy as np

EPS32 = float(np.finfo(np.float32).eps)


def qkv(rng, batch, nq, nk, d, dv, dtype=np.float64, spread=1.0):
    """Random q (*batch, Nq, d), k (*batch, Nk, d), v (*batch, Nk, dv)."""
    q = rng.standard_normal((*batch, nq, d)) * spread
    k = rng.standard_normal((*batch, nk, d)) * spread
    v = rng.standard_normal((*batch, nk, dv))
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)


def max_abs_err(x, ref):
    """Largest elementwise |x - ref|, computed in float64 (0 if empty)."""
    diff = np.abs(np.asarray(x, np.float64) - ref)
    return float(diff.max()) if diff.size else 0.0


def float32_budget(err_naive, ref, merges=0):
    """Allowed float32 error: twice naive float32's, floored at 8 ulps,
    plus 2 ulps for every merge of a key block into the running state.

    Both errors are a few ulps of the output, so their ratio is noise when
    naive float32 happens to be nearly exact; the floor absorbs that.
    Each merge rounds the rescale factor and the sum once more than the
    materialized program does, so tiny key blocks earn a little slack.
    """
    scale = max(1.0, float(np.max(np.abs(ref))))
    return max(2 * err_naive, 8 * EPS32 * scale) + 2 * merges * EPS32 * scale


def cancelling_sizes(q, k, v, do, bias):
    """Bounds on the float32 rounding of dQ and dK, in units of eps.

    dS_ij = P_ij (dP_ij - D_i) is a difference of numbers up to |dO_i|
    (|V_j| + |O_i|) in size, which cancel where a row's P is nearly one-
    hot; flashlab takes D = rowsum(dO O) from the float32 output, as
    FlashAttention does, and torch another way, so the two round dS
    differently. Each entry of dQ (dK) sums tau dS_ij K_j (Q_i): its
    rounding is up to about eps of these sizes summed, tens of times
    max |dQ| where a few rows are one-hot. q, k, v, do: torch tensors
    (B, H, N, d), k and v with H / group heads; bias: additive, float."""
    import torch

    h_kv = k.shape[-3]
    q, k, v, do = (x.detach().double() for x in (q, k, v, do))
    k, v = (x.repeat_interleave(q.shape[-3] // h_kv, -3) for x in (k, v))
    tau = q.shape[-1] ** -0.5
    p = torch.softmax(tau * q @ k.transpose(-1, -2) + bias.double(), -1)
    o_size = (p @ v).norm(dim=-1, keepdim=True)
    a = p * do.norm(dim=-1, keepdim=True) * (v.norm(dim=-1)[..., None, :]
                                             + o_size)
    dk = tau * a.transpose(-1, -2) @ q.abs()  # per query head: add groups
    dk = dk.unflatten(-3, (h_kv, -1)).sum(-3)
    return {"dq": float((tau * a @ k.abs()).max()), "dk": float(dk.max())}
