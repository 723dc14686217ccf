"""Packed variable-length batches against one explicit mask per sequence.

Random packings (empty sequences and single rows included) run through
flashlab.varlen on the tiled and cpu backends and through
flashlab.torch.varlen_attention; each sequence must equal the float64
reference of that sequence alone, under a mask built from flash-attn's
rule on the sequence's own lengths (bottom-right: query i sits on key
i + n_k - n_q).
"""

import numpy as np
import pytest
import torch

from flashlab import cpu, reference, tiled, varlen
from flashlab import torch as fl_torch


def packing(rng, count):
    """Random (n_q, n_k) per sequence, some 0 and some 1."""
    nq = rng.integers(0, 12, count)
    nk = rng.integers(0, 12, count)
    nq[0], nk[0] = 1, 1
    return nq, nk


def rule_mask(nq, nk, causal, window):
    i = np.arange(nq)[:, None] + nk - nq
    j = np.arange(nk)[None, :]
    keep = np.ones((nq, nk), bool)
    if causal:
        keep &= j <= i
    if window is not None:
        left, right = window
        keep &= j >= i - left
        keep &= j <= i + right
    return keep


def packed(rng, nq, nk, hq, hkv, d=8, dv=6):
    cu_q = np.concatenate([[0], np.cumsum(nq)])
    cu_k = np.concatenate([[0], np.cumsum(nk)])
    q = rng.standard_normal((cu_q[-1], hq, d))
    k = rng.standard_normal((cu_k[-1], hkv, d))
    v = rng.standard_normal((cu_k[-1], hkv, dv))
    return q, k, v, cu_q, cu_k


def expected(q, k, v, cu_q, cu_k, causal, window, do=None):
    """Per sequence: reference output, and tiled's gradients if do."""
    g = q.shape[1] // k.shape[1]
    o = np.zeros((q.shape[0], q.shape[1], v.shape[2]))
    grads = [np.zeros_like(x) for x in (q, k, v)]
    for b in range(len(cu_q) - 1):
        rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if rq.stop == rq.start or rk.stop == rk.start:
            continue
        keep = rule_mask(rq.stop - rq.start, rk.stop - rk.start, causal,
                         window)
        x = [np.swapaxes(a, 0, 1) for a in (q[rq], k[rk], v[rk])]
        x[1], x[2] = (np.repeat(a, g, 0) for a in x[1:])
        o_b, lse_b = reference.attention(*x, mask=keep, return_lse=True)
        o[rq] = np.swapaxes(o_b, 0, 1)
        if do is not None:
            gb = tiled.attention_backward(*x, o_b, lse_b, np.swapaxes(
                do[rq], 0, 1), mask=keep)
            grads[0][rq] = np.swapaxes(gb[0], 0, 1)
            for t, gt in ((1, gb[1]), (2, gb[2])):  # sum each group
                grads[t][rk] = np.swapaxes(gt.reshape(
                    k.shape[1], g, *gt.shape[1:]).sum(1), 0, 1)
    return o, grads


CASES = [(False, None), (True, None), (False, (2, 1)), (True, (3, 0))]


@pytest.mark.parametrize("causal, window", CASES)
@pytest.mark.parametrize("hq, hkv", [(2, 2), (4, 2)])
def test_packed_matches_each_sequence(rng, causal, window, hq, hkv):
    nq, nk = packing(rng, 7)
    q, k, v, cu_q, cu_k = packed(rng, nq, nk, hq, hkv)
    do = rng.standard_normal((q.shape[0], hq, 6))
    want, grads = expected(q, k, v, cu_q, cu_k, causal, window, do)
    kw = dict(causal=causal, window=window, align="bottom_right")
    o, lse = varlen.attention(q, k, v, cu_q, cu_k, return_lse=True,
                              block_q=4, block_k=3, **kw)
    assert np.max(np.abs(o - want)) < 1e-12
    got = varlen.attention_backward(q, k, v, o, lse, do, cu_q, cu_k, **kw)
    for a, b in zip(got, grads):
        assert np.max(np.abs(a - b)) < 1e-12
    if hq == hkv:  # the numba kernels take equal heads
        o32 = varlen.attention(*(x.astype(np.float32) for x in (q, k, v)),
                               cu_q, cu_k, backend=cpu, **kw)
        assert np.max(np.abs(o32 - want)) < 1e-5


@pytest.mark.parametrize("causal, window", CASES)
def test_torch_varlen_gradients(rng, causal, window):
    nq, nk = packing(rng, 6)
    q, k, v, cu_q, cu_k = packed(rng, nq, nk, 4, 2)
    do = rng.standard_normal((q.shape[0], 4, 6))
    want, grads = expected(q, k, v, cu_q, cu_k, causal, window, do)
    x = [torch.tensor(a, requires_grad=True) for a in (q, k, v)]
    # deterministic=False is the GPU kernels' choice: the same on a CPU
    for flag in (True, False):
        out = fl_torch.varlen_attention(*x, torch.tensor(cu_q),
                                        torch.tensor(cu_k), causal=causal,
                                        window=window, align="bottom_right",
                                        deterministic=flag)
        got = torch.autograd.grad(out, x, torch.tensor(do))
        assert np.max(np.abs(out.detach().numpy() - want)) < 1e-12
        for a, b in zip(got, grads):
            assert np.max(np.abs(a.numpy() - b)) < 1e-12
    with pytest.raises(TypeError, match="deterministic: expected True"):
        fl_torch.varlen_attention(*x, torch.tensor(cu_q),
                                  torch.tensor(cu_k), deterministic="no")


def test_sequences_draw_their_own_dropout(rng):
    q, k, v, cu_q, cu_k = packed(rng, np.array([5, 5]), np.array([5, 5]),
                                 2, 2)
    k[5:], v[5:], q[5:] = k[:5], v[:5], q[:5]  # two identical sequences
    o = varlen.attention(q, k, v, cu_q, cu_k, dropout_p=0.5, seed=3)
    assert not np.allclose(o[:5], o[5:])
    again = varlen.attention(q, k, v, cu_q, cu_k, dropout_p=0.5, seed=3)
    assert np.array_equal(o, again)


def test_bad_input(rng):
    q, k, v, cu_q, cu_k = packed(rng, np.array([3, 2]), np.array([4, 1]),
                                 2, 2)
    with pytest.raises(ValueError, match=r"cu_seqlens_q: expected 0 = "):
        varlen.attention(q, k, v, np.array([0, 3, 4]), cu_k)
    with pytest.raises(ValueError, match="cu_seqlens_k: expected a 1-d "
                                         "integer"):
        varlen.attention(q, k, v, cu_q, cu_k.astype(float))
    with pytest.raises(ValueError, match="cu_seqlens_k: expected 2 "
                                         "sequences"):
        varlen.attention(q, k, v, cu_q, np.array([0, 5]))
    with pytest.raises(ValueError, match="mask: not taken by a packed"):
        varlen.attention(q, k, v, cu_q, cu_k, mask=np.ones((5, 5), bool))
    with pytest.raises(ValueError, match="k: expected a number of heads"):
        varlen.attention(q, k[:, :1].repeat(3, 1), v, cu_q, cu_k)
    with pytest.raises(ValueError, match="q: expected \\(total, heads, d"):
        varlen.attention(q[0], k, v, cu_q, cu_k)


@pytest.mark.gpu
@pytest.mark.parametrize("causal, window", CASES)
def test_packed_on_the_gpu(rng, causal, window):
    from flashlab import gpu

    nq, nk = packing(rng, 7)
    q, k, v, cu_q, cu_k = packed(rng, nq, nk, 2, 2, d=16, dv=16)
    do = rng.standard_normal((q.shape[0], 2, 16))
    want, grads = expected(q, k, v, cu_q, cu_k, causal, window, do)
    x = [a.astype(np.float32) for a in (q, k, v)]
    kw = dict(causal=causal, window=window, align="bottom_right")
    o, lse = varlen.attention(*x, cu_q, cu_k, backend=gpu,
                              return_lse=True, **kw)
    assert np.max(np.abs(o - want)) < 1e-5
    got = varlen.attention_backward(*x, o, lse, do.astype(np.float32),
                                    cu_q, cu_k, backend=gpu, **kw)
    for a, b in zip(got, grads):
        assert np.max(np.abs(a - b)) < 1e-4
