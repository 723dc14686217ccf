"""Backward v8 (backward_v7's dK/dV kernel warp-specialized: TMA, a
producer warpgroup, mbarriers, setmaxnreg) on a Hopper GPU.

It forms the same products in the same order as v7's dK/dV kernel, from
the same tiles and row terms, so its gradients are v7's bit for bit: that
is the check at every semantic (ragged and unequal lengths, one row, one
key, masks, windows, causal at both alignments, key lengths, dropout,
grouped heads), on poisoned outputs. Its fused kernel (deterministic=
False: dQ in the same pass, added by TMA's reductions) gives v8's dK and
dV bit for bit, and dQ within a unit of the dtype of v8's (float32 sums
in another order, each rounded once). Backward v9 (that kernel with
each dQ tile's additions made in the order of the key blocks, and each
block's query tiles taken last to first) gives all three within a unit
of v8's, and the same bits on every run. test_gpu_tensor_cores holds
them to float64 within twice torch flash's error, as v5 and v7."""

import numpy as np
import pytest
from test_gpu_v7 import ragged

from flashlab import gpu, tiled
from helpers import max_abs_err, qkv

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    # every output is NaN until a kernel writes it
    monkeypatch.setattr(gpu, "POISON_OUTPUTS", True)


CASES = [dict(), dict(causal=True), dict(causal="bottom_right"),
         dict(window=(50, 30)), dict(mask="random"),
         dict(kv_lengths="random"), dict(dropout_p=0.2, seed=7),
         dict(causal=True, grouped=3)]


def inputs(rng, opts, nq, nk, dtype, d=64, d_v=None):
    """q, k, v, dO (torch CUDA, `dtype`, head dims d and d_v, d's if
    None) and the options as the kernels take them."""
    import torch

    opts = dict(opts)
    d_v = d if d_v is None else d_v
    group = opts.pop("grouped", 1)
    heads = 2 * group
    if opts.get("mask") == "random":
        keep = rng.random((2, heads, nq, nk)) < 0.7
        keep[..., 0] = True
        opts["mask"] = keep
    if opts.get("kv_lengths") == "random":
        opts["kv_lengths"] = rng.integers(0, nk + 1, (2, heads))
    kind = getattr(torch, dtype)
    q, k, v = (torch.tensor(x, device="cuda").to(kind)
               for x in qkv(rng, (2, heads), nq, nk, d, d_v, np.float32))
    if group > 1:  # two K/V heads, each for `group` query heads
        k, v = k[:, :2].contiguous(), v[:, :2].contiguous()
    do = torch.tensor(rng.standard_normal((2, heads, nq, d_v)),
                      device="cuda").to(kind)
    return q, k, v, do, opts


@pytest.mark.parametrize("opts", CASES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("d", [64, 128])
def test_backward_v8_is_v7_bit_for_bit(rng, opts, dtype, d):
    import torch

    for nq, nk in ((ragged(rng, 700), ragged(rng, 700)), (1, 1), (1, 70),
                   (130, 1)):
        q, k, v, do, kw = inputs(rng, opts, nq, nk, dtype, d)
        o, lse = gpu.attention(q, k, v, return_lse=True, **kw)
        got = gpu.attention_backward(q, k, v, o, lse, do, version=8, **kw)
        want = gpu.attention_backward(q, k, v, o, lse, do, version=7, **kw)
        for name, g, w in zip("qkv", got, want):
            assert g.dtype == w.dtype == q.dtype and g.shape == w.shape
            assert not torch.isnan(g).any(), (name, nq, nk, opts)
            assert torch.equal(g, w), (name, nq, nk, opts)


@pytest.mark.parametrize("opts", [dict(causal=True),
                                  dict(kv_lengths="random", grouped=2)])
@pytest.mark.parametrize("d, d_v", [(64, 128), (128, 64)])
def test_backward_v8_is_v7_bit_for_bit_at_mixed_head_dims(rng, opts, d,
                                                          d_v):
    import torch

    for nq, nk in ((ragged(rng, 500), ragged(rng, 500)), (1, 70)):
        q, k, v, do, kw = inputs(rng, opts, nq, nk, "bfloat16", d, d_v)
        o, lse = gpu.attention(q, k, v, return_lse=True, **kw)
        got = gpu.attention_backward(q, k, v, o, lse, do, version=8, **kw)
        want = gpu.attention_backward(q, k, v, o, lse, do, version=7, **kw)
        for name, g, w in zip("qkv", got, want):
            assert not torch.isnan(g).any(), (name, nq, nk, opts)
            assert torch.equal(g, w), (name, nq, nk, opts)


@pytest.mark.parametrize("opts", CASES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("d", [64, 128])
def test_backward_v8_fused_is_v8_up_to_dq_order(rng, opts, dtype, d):
    # dK and dV are the two kernels' bits (at d = 128 in two stages of
    # Q_i, dO_i where they have four: the same sums, in the same order);
    # dQ's additions land in another order
    import torch

    for nq, nk in ((ragged(rng, 700), ragged(rng, 700)), (1, 1), (1, 70),
                   (130, 1), (64, 64)):
        q, k, v, do, kw = inputs(rng, opts, nq, nk, dtype, d)
        o, lse = gpu.attention(q, k, v, return_lse=True, **kw)
        got = gpu.attention_backward(q, k, v, o, lse, do, version=8,
                                     deterministic=False, **kw)
        want = gpu.attention_backward(q, k, v, o, lse, do, version=8, **kw)
        for name, g, w in zip("qkv", got, want):
            assert g.dtype == w.dtype == q.dtype and g.shape == w.shape
            assert not torch.isnan(g).any(), (name, nq, nk, opts)
            if name == "q":  # a unit of the dtype at most, element-wise
                unit = float(torch.finfo(g.dtype).eps)
                gap = (g.float() - w.float()).abs()
                assert bool((gap <= unit * w.float().abs() + unit * 2.0**-6
                             * float(w.float().abs().max())).all()), (
                    nq, nk, opts, float(gap.max()))
            else:
                assert torch.equal(g, w), (name, nq, nk, opts)


@pytest.mark.parametrize("version", [8, 9])
@pytest.mark.parametrize("d", [64, 128])
def test_backward_v8_against_float64(rng, d, version):
    # not only v7's bits: a long ragged causal case against float64,
    # within the bound test_gpu_v7 holds v7 to (twice backward_v5's
    # error, and half a bf16 ulp of rounding)
    q, k, v, do, kw = inputs(rng, dict(causal=True), 1000, 1000,
                             "bfloat16", d)
    o, lse = gpu.attention(q, k, v, return_lse=True, **kw)
    got = gpu.attention_backward(q, k, v, o, lse, do, version=version,
                                 **kw)
    v5 = gpu.attention_backward(q, k, v, o, lse, do, version=5, **kw)
    x64 = [x.double().cpu().numpy() for x in (q, k, v, o, do)]
    want = tiled.attention_backward(*x64[:4], lse.double().cpu().numpy(),
                                    x64[4], **kw)
    for name, g, g5, w in zip("qkv", got, v5, want):
        fair = max_abs_err(g5.cpu().numpy(), w)
        assert max_abs_err(g.double().cpu().numpy(), w) <= 2 * fair + (
            2.0**-12 + 2.0**-8) * float(np.abs(w).max()), name


@pytest.mark.parametrize("d", [64, 128])
def test_backward_v9_is_the_default_from_its_keys(rng, d):
    # version None runs v9 at d = d_v from registry.ORDERED_MIN_KEYS keys
    # on (registry.ordered_pays; the same bits as asking for it), v8
    # below and at mixed head dims; under deterministic=False v8's fused
    # kernel: dK and dV v8's
    # bits, all three within a unit of v9's (it takes the query tiles in
    # the other order, `next_item_down`)
    import torch

    from flashlab.gpu import registry

    long = registry.ORDERED_MIN_KEYS
    for nk, version in ((300, 8), (long, 9)):
        q, k, v, do, kw = inputs(rng, dict(), 100, nk, "bfloat16", d)
        o, lse = gpu.attention(q, k, v, return_lse=True)
        want = gpu.attention_backward(q, k, v, o, lse, do, version=version)
        got = gpu.attention_backward(q, k, v, o, lse, do)
        assert all(torch.equal(g, w) for g, w in zip(got, want)), nk
        fused = gpu.attention_backward(q, k, v, o, lse, do,
                                       deterministic=False)
        for g, w in zip(fused, want):
            assert within_a_unit(g, w), nk
        if version == 8:
            assert all(torch.equal(g, w) for g, w in zip(fused[1:],
                                                          want[1:]))
    q, k, v, do, kw = inputs(rng, dict(), 200, long, "bfloat16", d, 192 - d)
    o, lse = gpu.attention(q, k, v, return_lse=True)
    got = gpu.attention_backward(q, k, v, o, lse, do)
    want = gpu.attention_backward(q, k, v, o, lse, do, version=8)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("opts", CASES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("d", [64, 128])
def test_backward_v9_is_v8_up_to_order_and_repeats(rng, opts, dtype, d):
    # v9 is v8's fused kernel with each dQ tile's additions in key-block
    # order, and each block's query tiles taken last to first: every
    # gradient within a unit of the dtype of v8's two kernels' (float32
    # sums in another order), and the same bits on every run. 700 keys
    # are six key blocks adding to each query tile in turn (causal: up
    # to six)
    import torch

    for nq, nk in ((ragged(rng, 700), ragged(rng, 700)), (1, 1), (1, 300),
                   (130, 1), (64, 64)):
        q, k, v, do, kw = inputs(rng, opts, nq, nk, dtype, d)
        o, lse = gpu.attention(q, k, v, return_lse=True, **kw)
        got = gpu.attention_backward(q, k, v, o, lse, do, version=9, **kw)
        want = gpu.attention_backward(q, k, v, o, lse, do, version=8, **kw)
        for name, g, w in zip("qkv", got, want):
            assert g.dtype == w.dtype == q.dtype and g.shape == w.shape
            assert not torch.isnan(g).any(), (name, nq, nk, opts)
            assert within_a_unit(g, w), (name, nq, nk, opts)
        for _ in range(3):
            again = gpu.attention_backward(q, k, v, o, lse, do, version=9,
                                           **kw)
            assert all(torch.equal(a, g) for a, g in zip(again, got)), (
                nq, nk, opts)


def within_a_unit(g, w):
    """Whether 16-bit g is w up to a unit of the dtype, element-wise (of
    |w|, and of 2^-6 of w's largest: float32 sums in another order, each
    rounded once)."""
    import torch

    unit = float(torch.finfo(g.dtype).eps)
    gap = (g.float() - w.float()).abs()
    return bool((gap <= unit * w.float().abs() + unit * 2.0**-6
                 * float(w.float().abs().max())).all())


def test_backward_v9_refuses_mixed_head_dims(rng):
    q, k, v, do, kw = inputs(rng, dict(), 100, 100, "bfloat16", 64, 128)
    o, lse = gpu.attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match="with d = d_v"):
        gpu.attention_backward(q, k, v, o, lse, do, version=9)
