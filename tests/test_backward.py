"""Backward with recomputation against finite differences and autograd."""

import numpy as np
import pytest
import torch

from flashlab import checks, dropout, merge, reference, tiled
from helpers import EPS32, max_abs_err, qkv

EPS64 = float(np.finfo(np.float64).eps)


def torch_reference(q, k, v, do, keep, scale, p_drop=0.0, z=None,
                    dtype=torch.float64):
    """Gradients of the materialized program by torch autograd."""
    tq, tk, tv = (torch.tensor(x, dtype=dtype, requires_grad=True)
                  for x in (q, k, v))
    s = scale * tq @ tk.transpose(-1, -2)
    s = s.masked_fill(~torch.from_numpy(np.array(keep)), -torch.inf)
    m = s.amax(-1, keepdim=True).nan_to_num(neginf=0.0).detach()
    e = torch.exp(s - m)  # empty rows: all zeros, no NaN
    p = e / e.sum(-1, keepdim=True).clamp_min(1e-30)
    if z is not None:
        p = p * torch.from_numpy(z) / (1 - p_drop)
    (p @ tv).backward(torch.tensor(do, dtype=dtype))
    return tq.grad.numpy(), tk.grad.numpy(), tv.grad.numpy()


def allowed(q, k, **opts):
    return np.isfinite(reference.scores(q, k, **opts))


CASES = [
    dict(),
    dict(causal=True, block_q=5, block_k=7),
    dict(causal="bottom_right", block_q=3, block_k=4),
    dict(window=(3, 1), block_q=4, block_k=4),
    dict(block_q=50, block_k=50),
]


@pytest.mark.parametrize("opts", CASES)
def test_float64_matches_autograd(rng, opts):
    nq, nk = (int(x) for x in rng.integers(1, 40, size=2))
    q, k, v = qkv(rng, (2, 2), nq, nk, 6, 4)
    do = rng.standard_normal((2, 2, nq, 4))
    o, lse = tiled.attention(q, k, v, return_lse=True, **opts)
    grads = tiled.attention_backward(q, k, v, o, lse, do, **opts)
    keep = allowed(q, k, **{x: y for x, y in opts.items()
                            if x in ("causal", "window")})
    keep = np.broadcast_to(keep, (*o.shape[:-1], nk))
    want = torch_reference(q, k, v, do, keep, 1 / np.sqrt(6))
    for g, w in zip(grads, want):
        # relative to the gradient's size; with one key the softmax is
        # constant and dq = dk = 0 exactly, so the scale is floored at the
        # inputs' order of magnitude, 1
        scale = max(1.0, float(np.max(np.abs(w))))
        assert max_abs_err(g, w) <= 1e-10 * scale


def test_masked_rows_and_padding_have_zero_gradient(rng):
    q, k, v = qkv(rng, (3,), 9, 12, 4, 4)
    do = rng.standard_normal((3, 9, 4))
    mask = rng.random((3, 9, 12)) < 0.5
    mask[0, 2] = False  # query 2 of sequence 0 sees nothing
    lengths = np.array([12, 5, 0])
    opts = dict(mask=mask, kv_lengths=lengths, block_q=4, block_k=5)
    with np.errstate(all="raise"):
        o, lse = tiled.attention(q, k, v, return_lse=True, **opts)
        dq, dk, dv = tiled.attention_backward(q, k, v, o, lse, do, **opts)
    assert np.all(dq[0, 2] == 0) and np.all(dq[2] == 0)
    assert np.all(dk[1, 5:] == 0) and np.all(dv[1, 5:] == 0)
    keep = mask & (np.arange(12) < lengths[:, None, None])
    want = torch_reference(q, k, v, do, keep, 0.5)
    for g, w in zip((dq, dk, dv), want):
        assert max_abs_err(g, w) < 1e-12


def test_finite_differences(rng):
    q, k, v = qkv(rng, (), 5, 7, 3, 2)
    do = rng.standard_normal((5, 2))
    opts = dict(causal="bottom_right", block_q=2, block_k=3)
    o, lse = tiled.attention(q, k, v, return_lse=True, **opts)
    grads = tiled.attention_backward(q, k, v, o, lse, do, **opts)

    def loss(q, k, v):
        return float(np.sum(tiled.attention(q, k, v, **opts) * do))

    # central differences: O(h^2) truncation + O(eps/h) rounding
    assert checks.finite_difference_error(loss, (q, k, v), grads) < 1e-8


@pytest.mark.parametrize("opts", CASES[:3])
def test_float32_within_twice_naive_error(rng, opts):
    q, k, v = qkv(rng, (2,), 45, 38, 16, 8, dtype=np.float32)
    do = rng.standard_normal((2, 45, 8)).astype(np.float32)
    o, lse = tiled.attention(q, k, v, return_lse=True, **opts)
    grads = tiled.attention_backward(q, k, v, o, lse, do, **opts)
    keep = allowed(q, k, **{x: y for x, y in opts.items()
                            if x == "causal"})
    keep = np.broadcast_to(keep, (2, 45, 38))
    want = torch_reference(q, k, v, do, keep, 0.25)
    # naive float32: the same materialized autograd, in float32
    naive = torch_reference(q, k, v, do, keep, 0.25, dtype=torch.float32)
    # twice naive float32's error, or 16 ulps of max |w| if more: each
    # entry sums 38 to 45 float32 products, which tiled adds block by
    # block (blocks of 3 and 4 keys: a rounding per block more). Over
    # 800 seeds ours reached 9 ulps while naive's was at times under 1;
    # a floor of 8 failed rng seed 40062 (bottom_right, dQ), about one
    # run in 400
    for g, n, w in zip(grads, naive, want):
        floor = 16 * EPS32 * max(1.0, float(np.max(np.abs(w))))
        assert max_abs_err(g, w) <= max(2 * max_abs_err(n, w), floor)


def test_dropout_forward_and_backward_agree_with_explicit_mask(rng):
    q, k, v = qkv(rng, (2, 3), 20, 26, 8, 5)
    do = rng.standard_normal((2, 3, 20, 5))
    opts = dict(dropout_p=0.25, seed=1234, causal=True, block_q=6,
                block_k=7)
    z = dropout.keep_mask(0.25, 1234, (2, 3, 20, 26))
    o, lse = tiled.attention(q, k, v, return_lse=True, **opts)
    o_ref = reference.attention(q, k, v, causal=True, dropout_p=0.25,
                                dropout_mask=z)
    assert max_abs_err(o, o_ref) < 1e-12
    grads = tiled.attention_backward(q, k, v, o, lse, do, **opts)
    keep = np.broadcast_to(allowed(q, k, causal=True), z.shape)
    want = torch_reference(q, k, v, do, keep, 1 / np.sqrt(8), 0.25, z)
    for g, w in zip(grads, want):
        assert max_abs_err(g, w) < 1e-12
    # a different seed is a different mask, and the answer changes
    other = tiled.attention(q, k, v, **{**opts, "seed": 1235})
    assert max_abs_err(other, o_ref) > 1e-3


def test_fa1_order_gives_the_same_forward_for_backward(rng):
    q, k, v = qkv(rng, (), 30, 30, 4, 4)
    o1, lse1 = tiled.attention(q, k, v, return_lse=True, order="fa1",
                               block_q=7, block_k=9)
    o2, lse2 = tiled.attention(q, k, v, return_lse=True, block_q=7,
                               block_k=9)
    assert max_abs_err(o1, o2) < 1e-13 and max_abs_err(lse1, lse2) < 1e-13


def test_saved_tensor_checks(rng):
    q, k, v = qkv(rng, (), 4, 6, 3, 2)
    o, lse = tiled.attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match="do: expected shape"):
        tiled.attention_backward(q, k, v, o, lse, np.zeros((4, 3)))
    with pytest.raises(ValueError, match="lse: expected shape"):
        tiled.attention_backward(q, k, v, o, lse[:3], np.zeros((4, 2)))
    with pytest.raises(TypeError, match="o: expected dtype"):
        tiled.attention_backward(q, k, v, o.astype(np.float32), lse,
                                 np.zeros((4, 2)))


@pytest.mark.parametrize("hot", [1.0, 100.0, -100.0])
def test_pieces_of_the_keys_sum_to_the_gradient_given_m_and_l(rng, hot):
    # two key ranges, each run alone with the whole row's (m, l): their
    # dQ add up to the whole one and their dK, dV are its slices. Scores
    # of a few hundred (hot) put lse past merge.LSE_EXACT, where the
    # saved lse alone would make each range's P sum to 1 by itself
    q, k, v = qkv(rng, (2, 4), 9, 23, 8, 5)
    k = k.reshape(2, 2, 2, 23, 8)[:, :, 0]  # 2 K/V heads: grouped
    v = v.reshape(2, 2, 2, 23, 5)[:, :, 0]
    q = hot * q
    do = rng.standard_normal((2, 4, 9, 5))
    o, lse = tiled.attention(q, k, v, return_lse=True, block_k=4)
    m, l = tiled.attention_statistics(q, k, v, lse)
    lossy = merge.lse_loses_l(lse)
    assert lossy.mean() > 0.75 if hot != 1.0 else not lossy.any()
    want = tiled.attention_backward(q, k, v, o, lse, do, block_k=4)
    parts = [tiled.attention_backward(q, k[..., r, :], v[..., r, :], o, m,
                                      do, block_k=4, l=l)
             for r in (slice(0, 10), slice(10, 23))]
    # the ranges compute the scores in other blocks than the whole pass,
    # and a score |s| <= s_max is rounded by up to s_max eps / 2, which
    # moves P by as much relatively in each program: they differ by up to
    # about s_max eps of each gradient's size (floored at 1e-13, sums of
    # a few dozen terms of order 1). A bound of 1e-13 |hot| failed 2 runs
    # in 16000 (rng seed 847002558, hot 100: dK of size 214 off by
    # 1.2e-11); over 23000 seeds per hot of 100 and -100 the error
    # reached 1.7 of this unit, so 8 of it leaves a wide margin
    s_max = max(1.0, float(np.abs(reference.scores(q, k)).max()))
    whole = [parts[0][0] + parts[1][0]] + [
        np.concatenate([parts[0][i], parts[1][i]], axis=-2)
        for i in (1, 2)]  # dQ sums, dK and dV are slices
    for got, w in zip(whole, want):
        unit = EPS64 * s_max * max(1.0, float(np.max(np.abs(w))))
        assert max_abs_err(got, w) <= max(1e-13, 8 * unit)
    # where lse lost l, a range's own pass finds its own (m, l): wrong
    own = tiled.attention_backward(q, k[..., :10, :], v[..., :10, :], o,
                                   lse, do, block_k=4)
    assert (max_abs_err(own[0], parts[0][0]) > 1e-3) == (hot != 1.0)


def test_attention_statistics_are_the_rows_max_and_sum(rng):
    q, k, v = qkv(rng, (3,), 6, 11, 4, 4)
    # batch 0: row i scores 150 on key i, so lse >= 150 > LSE_EXACT for
    # any draw (a scaled random row can miss it): m and l are recomputed
    k0 = k[0, :6]
    q[0] = 300.0 * k0 / (k0 * k0).sum(-1, keepdims=True)
    s = reference.scores(q, k)  # tau Q K^T, tau = 1/2
    _, lse = tiled.attention(q, k, v, return_lse=True)
    m, l = tiled.attention_statistics(q, k, v, lse)
    lossy = merge.lse_loses_l(lse)
    assert lossy[0].all() and not lossy[1:].any()
    assert np.array_equal(m[1:], lse[1:]) and np.all(l[1:] == 1)
    assert np.allclose(m[0], s[0].max(-1), rtol=1e-15, atol=0)
    assert np.allclose(l[0], np.exp(s[0] - m[0][:, None]).sum(-1),
                       rtol=1e-13)
    with pytest.raises(ValueError, match=r"lse: expected shape \(3, 6\)"):
        tiled.attention_statistics(q, k, v, lse[:2])
    with pytest.raises(ValueError, match=r"l: expected shape \(3, 6\)"):
        tiled.attention_backward(q, k, v, q[..., :4], m, q[..., :4],
                                 l=l[:2])
    with pytest.raises(TypeError, match="l: expected dtype float64"):
        tiled.attention_backward(q, k, v, q[..., :4], m, q[..., :4],
                                 l=l.astype(np.float32))
