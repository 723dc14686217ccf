"""Hostile input: non-finite values, degenerate sizes, wrong arguments.

Every backend present follows flashlab.nonfinite's rule: only rows the
masks empty give 0 (lse -inf); NaN or inf anywhere else comes out as NaN,
in the same places as the float64 reference, whatever the block sizes.
"""

import numpy as np
import pytest
import torch

from flashlab import cpu, dense, gpu, io, merge, reference, tiled
from flashlab import torch as fl_torch
from helpers import max_abs_err, qkv


def backends():
    """(name, fn(q, k, v, **opts) -> (o, lse)) for every backend."""

    def torch_cpu(q, k, v, **opts):
        o, lse = fl_torch.attention(*(torch.from_numpy(x) for x in (q, k, v)),
                                    return_lse=True, **opts)
        return o.numpy(), lse.numpy()

    def gpu32(q, k, v, **opts):
        opts.pop("block_q", None), opts.pop("block_k", None)
        return gpu.attention(*(x.astype(np.float32) for x in (q, k, v)),
                             return_lse=True, **opts)

    return [
        ("tiled fa2", lambda q, k, v, **o: tiled.attention(
            q, k, v, return_lse=True, **o)),
        ("tiled fa1", lambda q, k, v, **o: tiled.attention(
            q, k, v, return_lse=True, order="fa1", **o)),
        ("dense", lambda q, k, v, **o: dense.attention(
            q, k, v, return_lse=True, **o)),
        ("cpu", lambda q, k, v, **o: cpu.attention(
            q, k, v, return_lse=True, **o)),
        ("torch", torch_cpu),
        ("gpu", gpu32),
    ]


BACKENDS = backends()
IDS = [name for name, _ in BACKENDS]


def check_same_nans(q, k, v, fn, **opts):
    """NaNs where the reference has them; elsewhere close to it."""
    rules = {n: x for n, x in opts.items() if not n.startswith("block")}
    o_ref, lse_ref = reference.attention(q, k, v, return_lse=True, **rules)
    o, lse = fn(q, k, v, **opts)
    assert np.array_equal(np.isnan(o), np.isnan(o_ref))
    assert np.array_equal(np.isnan(lse), np.isnan(lse_ref))
    keep = ~np.isnan(o_ref)
    tol = 1e-12 if o.dtype == np.float64 else 1e-4
    assert max_abs_err(o[keep], o_ref[keep]) < tol
    return o, lse


@pytest.fixture
def inputs(rng):
    return qkv(rng, (2,), 19, 23, 16, 16)


@pytest.mark.parametrize("name, fn", BACKENDS, ids=IDS)
def test_nan_in_one_query_row(inputs, name, fn):
    q, k, v = inputs
    q[1, 5, 3] = np.nan
    o, lse = check_same_nans(q, k, v, fn, block_q=8, block_k=8)
    assert np.isnan(o[1, 5]).all() and np.isnan(lse[1, 5])
    assert np.isfinite(np.delete(o[1], 5, axis=0)).all()


@pytest.mark.parametrize("name, fn", BACKENDS, ids=IDS)
def test_nan_in_one_key_poisons_exactly_the_rows_that_see_it(inputs, name,
                                                            fn):
    q, k, v = inputs
    k[0, 11, 0] = np.nan
    o, _ = check_same_nans(q, k, v, fn, causal=True, block_q=4, block_k=8)
    # causal: rows 0..10 never see key 11, rows 11.. do
    assert np.isfinite(o[0, :11]).all() and np.isnan(o[0, 11:]).all()
    assert np.isfinite(o[1]).all()


@pytest.mark.parametrize("name, fn", BACKENDS, ids=IDS)
@pytest.mark.parametrize("value", [np.inf, -np.inf])
def test_infinite_query_is_nan_never_a_zero_row(inputs, name, fn, value):
    q, k, v = inputs
    k[0, :, 0] = np.abs(k[0, :, 0]) + 0.5  # all scores of row 2 -> value
    q[0, 2, 0] = value
    o, lse = check_same_nans(q, k, v, fn)
    assert np.isnan(o[0, 2]).all() and np.isnan(lse[0, 2])


@pytest.mark.parametrize("name, fn", BACKENDS, ids=IDS)
def test_float32_score_overflow_is_nan(inputs, name, fn):
    q, k, v = (x.astype(np.float32) for x in inputs)
    q[1, 0] = 1e38  # finite, but tau q . k overflows float32 to +inf
    k[1] = np.abs(k[1]) + 2
    o, lse = fn(q, k, v)
    assert np.isnan(o[1, 0]).all() and np.isnan(lse[1, 0])
    assert np.isfinite(o[1, 1:]).all() and np.isfinite(o[0]).all()


@pytest.mark.parametrize("name, fn", BACKENDS, ids=IDS)
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_value_column_rule(inputs, name, fn, bad):
    q, k, v = inputs
    v[0, 3, 7] = bad
    mask = np.ones((2, 19, 23), bool)
    mask[0, 4] = False  # row 4 is empty: stays 0
    mask[0, :, 3] = False  # nobody attends key 3, its column is NaN anyway
    outs = [fn(q, k, v, mask=mask, block_q=bq, block_k=bk)[0]
            for bq, bk in ((4, 4), (64, 64), (7, 5))]
    o_ref = reference.attention(q, k, v, mask=mask)
    for o in outs:
        assert np.array_equal(np.isnan(o), np.isnan(o_ref))
    want = np.zeros_like(o_ref, dtype=bool)
    want[0, :, 7] = True
    want[0, 4] = False
    assert np.array_equal(np.isnan(o_ref), want)
    assert np.all(outs[0][0, 4] == 0)


@pytest.mark.parametrize("name, fn", BACKENDS, ids=IDS)
def test_masked_rows_stay_zero_with_lse_minus_inf(inputs, name, fn):
    q, k, v = inputs
    o, lse = fn(q, k, v, causal="bottom_right", window=(2, 0))
    # Nq = 19 < Nk = 23: every row has keys; now pad batch 0 to none
    o, lse = fn(q, k, v, kv_lengths=np.array([0, 23]))
    assert np.all(o[0] == 0) and np.all(np.isneginf(lse[0]))
    assert np.isfinite(o[1]).all()


def test_double_backward_fails_loudly(rng):
    q, k, v = (torch.tensor(x, requires_grad=True)
               for x in qkv(rng, (), 5, 6, 4, 4))
    o = fl_torch.attention(q, k, v)
    with pytest.raises(RuntimeError, match="differentiable once"):
        torch.autograd.grad((o * o).sum(), q, create_graph=True)
    (dq,) = torch.autograd.grad((o * o).sum(), q)  # once is fine
    assert torch.isfinite(dq).all()


def test_torch_return_lse_and_meta_tensors(rng):
    q, k, v = (torch.tensor(x) for x in qkv(rng, (), 5, 6, 4, 4))
    o, lse = fl_torch.attention(q, k, v, return_lse=True)
    _, lse_ref = reference.attention(q.numpy(), k.numpy(), v.numpy(),
                                     return_lse=True)
    assert max_abs_err(lse.numpy(), lse_ref) < 1e-12
    meta = torch.empty(5, 4, device="meta")
    with pytest.raises(ValueError, match="query: expected a CPU or CUDA"):
        fl_torch.attention(meta, meta, meta)
    with pytest.raises(TypeError, match="return_lse: expected True"):
        fl_torch.attention(q, k, v, return_lse=1)


def test_reference_validates_dropout_like_every_entry_point(inputs):
    q, k, v = inputs
    keep = np.ones((2, 19, 23), bool)
    with pytest.raises(ValueError, match="dropout_p"):
        reference.attention(q, k, v, dropout_p=2.0, dropout_mask=keep)
    with pytest.raises(TypeError, match="dropout_mask: expected a boolean"):
        reference.attention(q, k, v, dropout_p=0.5,
                            dropout_mask=keep.astype(float))
    with pytest.raises(ValueError, match="dropout_mask: given"):
        reference.attention(q, k, v, dropout_mask=keep)
    with pytest.raises(ValueError, match="dropout_mask: expected a shape"):
        reference.attention(q, k, v, dropout_p=0.5, dropout_mask=keep[:, :3])


def test_merge_refuses_summaries_of_different_rows():
    a = merge.summarize(np.zeros((3, 4)), np.zeros((4, 2)))
    b = merge.summarize(np.zeros((1, 4)), np.zeros((4, 2)))
    with pytest.raises(ValueError, match="summaries of different rows"):
        merge.merge(a, b)


@pytest.mark.parametrize("bad", [0, -4, 2.5, True, None])
def test_io_sizes_must_be_positive_integers(bad):
    with pytest.raises((ValueError, TypeError), match="block_q"):
        io.predicted("fa2", 64, 16, block_q=bad, block_k=8)
    with pytest.raises((ValueError, TypeError), match="sram"):
        io.fa1_blocks(bad, 16)


def test_degenerate_sizes_on_the_cpu_backend(rng):
    q, k, v = qkv(rng, (0, 3), 7, 5, 4, 4)  # an empty batch
    assert cpu.attention(q, k, v).shape == (0, 3, 7, 4)
    q, k, v = qkv(rng, (2,), 1, 1, 4, 4)  # N = 1, blocks far larger
    o = cpu.attention(q, k, v, block_q=10**12, block_k=10**12)
    assert max_abs_err(o, reference.attention(q, k, v)) < 1e-12
    q, k, v = qkv(rng, (2,), 9, 9, 4, 4)
    o = cpu.attention(q, k, v, window=(10**30, 10**30), causal=True)
    assert max_abs_err(o, reference.attention(q, k, v, causal=True)) < 1e-12


def test_every_backend_refuses_what_it_cannot_do(inputs):
    q, k, v = (x.astype(np.float32) for x in inputs)
    with pytest.raises(ValueError, match="block_q: flashlab.gpu v3"):
        gpu.attention(q, k, v, block_q=7)
    with pytest.raises(ValueError, match="order: expected one of"):
        cpu.attention(q, k, v, order="fa1")
    with pytest.raises(ValueError, match="order: expected one of"):
        gpu.attention(q, k, v, order="fa1")
    with pytest.raises(ValueError, match="order: expected one of"):
        tiled.attention_backward(q, k, v, q, q[..., 0], q, order="fa3")
    with pytest.raises(TypeError, match="return_lse: expected True"):
        tiled.attention(q, k, v, return_lse="yes")
    with pytest.raises(ValueError, match="num_splits: this backend"):
        cpu.attention(q, k, v, num_splits=2)
    with pytest.raises(ValueError, match="num_splits: this backend"):
        gpu.attention(q, k, v, num_splits=2, version=4)
    with pytest.raises(ValueError, match="num_splits: split-KV runs"):
        tiled.attention(q, k, v, num_splits=2, order="fa1")
    with pytest.raises(ValueError, match="num_splits: expected"):
        tiled.attention(q, k, v, num_splits=0)
    with pytest.raises(TypeError, match="q: expected a torch CUDA tensor"):
        gpu.attention(q.tolist(), k, v)
    with pytest.raises(TypeError, match="q: expected a torch CUDA tensor"):
        gpu.attention(1.0, k, v)
    with pytest.raises(ValueError, match="version: expected one of"):
        gpu.attention(q, k, v, version=True)
    t = torch.from_numpy(q)
    with pytest.raises(ValueError, match="q: expected a CUDA tensor"):
        gpu.attention(t, t, t)


def test_order_is_accepted_by_every_backward(rng):
    q, k, v = qkv(rng, (2,), 9, 11, 4, 4)
    o, lse = tiled.attention(q, k, v, return_lse=True)
    do = rng.standard_normal(o.shape)
    want = tiled.attention_backward(q, k, v, o, lse, do)
    for got in (tiled.attention_backward(q, k, v, o, lse, do, order="fa1"),
                cpu.attention_backward(q, k, v, o, lse, do, order="fa1")):
        for g, w in zip(got, want):
            assert max_abs_err(g, w) < 1e-12


# ------------------------------------------- issue 22: nothing silently wrong
# The truth is torch's SDPA math backend in float64: the same softmax
# written out, so the drop-in must agree with it to float64 rounding.

def sdpa_math(q, k, v, do, dtype=torch.float64, **kw):
    """SDPA (math backend) output and gradients, as numpy."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    xs = [torch.tensor(x, dtype=dtype, requires_grad=True)
          for x in (q, k, v)]
    with sdpa_kernel(SDPBackend.MATH):
        o = torch.nn.functional.scaled_dot_product_attention(*xs, **kw)
    grads = torch.autograd.grad(o, xs, torch.tensor(do, dtype=o.dtype))
    return [x.detach().numpy() for x in (o, *grads)]


def fl_grads(q, k, v, do, **kw):
    """flashlab.torch's output and gradients, as numpy."""
    xs = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
    o = fl_torch.attention(*xs, **kw)
    grads = torch.autograd.grad(o, xs, torch.tensor(do))
    return [x.detach().numpy() for x in (o, *grads)]


RANKS = [  # (q, k, v) shapes whose leading dims align from the right
    ((2, 3, 3, 4), (3, 6, 4), (3, 6, 5)),
    ((2, 3, 5, 4), (1, 6, 4), (6, 5)),
    ((3, 5, 4), (2, 3, 6, 4), (2, 1, 6, 4)),
    ((2, 1, 5, 4), (4, 6, 4), (1, 4, 6, 4)),
    ((5, 4), (2, 3, 6, 4), (6, 4)),
]


@pytest.mark.parametrize("shapes", RANKS, ids=str)
def test_leading_dims_broadcast_from_the_right(rng, shapes):
    q, k, v = (rng.standard_normal(s) for s in shapes)
    lead = np.broadcast_shapes(*(s[:-2] for s in shapes))
    do = rng.standard_normal((*lead, q.shape[-2], v.shape[-1]))
    want = sdpa_math(q, k, v, do)
    got = fl_grads(q, k, v, do)
    for g, w in zip(got, want):
        assert g.shape == w.shape and max_abs_err(g, w) < 1e-12
    # the numpy backend on its own: forward and backward, same shapes
    o, lse = tiled.attention(q, k, v, block_q=2, block_k=4,
                             return_lse=True)
    assert max_abs_err(o, want[0]) < 1e-12
    grads = tiled.attention_backward(q, k, v, o, lse, do, block_q=2,
                                     block_k=4)
    for g, w in zip(grads, want[1:]):
        assert g.shape == w.shape and max_abs_err(g, w) < 1e-12
    assert max_abs_err(reference.attention(q, k, v), want[0]) < 1e-12
    for kw in (dict(order="fa1"), dict(num_splits=2)):
        o = tiled.attention(q, k, v, block_q=2, block_k=2, **kw)
        assert max_abs_err(o, want[0]) < 1e-12, kw
    assert max_abs_err(dense.attention(q, k, v), want[0]) < 1e-12


def test_cpu_kernels_refuse_broadcasts_they_do_not_index(rng):
    # the numba kernels index k and v by q's batch element (or its
    # group): other broadcasts are refused by name, never mispaired
    q, k, v = (rng.standard_normal(s) for s in RANKS[0])
    with pytest.raises(ValueError, match="other broadcasts run on "
                       "flashlab.tiled and flashlab.torch"):
        cpu.attention(q, k, v)


@pytest.mark.parametrize("fill", ["finfo.min", -1e30, -3.4e38, -1e9])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_large_negative_masks_have_the_forward_s_gradient(rng, fill, dtype):
    # a row masked whole by a finite fill attends every key equally in
    # the forward (as SDPA): the backward must be that forward's
    # derivative, 1/S of dO to each key, not all of it
    q, k, v = qkv(rng, (2, 2), 7, 9, 8, 5)
    fill = np.finfo(dtype).min if fill == "finfo.min" else fill
    mask = np.where(rng.random((2, 2, 7, 9)) < 0.3, fill, 0.0)
    mask[0, 1, 3] = fill  # fully masked rows
    mask[1, :, 6] = fill
    do = rng.standard_normal((2, 2, 7, 5))
    # in float32, s - 1e9 keeps nothing of s (ulp 64): the truth is
    # SDPA's math in float32 there, which rounds the same sums
    x32 = [x.astype(dtype) for x in (q, k, v, do)]
    mask = torch.tensor(mask.astype(dtype))
    want = sdpa_math(*x32, dtype=mask.dtype, attn_mask=mask)
    got = fl_grads(*x32, attn_mask=mask)
    tol = 1e-12 if dtype == np.float64 else 1e-5
    for g, w in zip(got, want):
        err = max_abs_err(g, w) / max(1.0, np.abs(w).max())
        assert err < tol, err


def test_huge_equal_scores_have_the_forward_s_gradient(rng):
    # float32 scores of 1.8e7, equal along each row: lse = m + log S
    # rounds to m; P must still be 1/S in the backward
    q, k, v = qkv(rng, (2,), 6, 10, 4, 3, dtype=np.float32)
    k[:] = k[:, :1]  # every key the same: every score of a row equal
    q[:, :, 0] = 1.8e7 / (k[:, :1, 0] / 2)  # tau = 1/2: scores ~1.8e7
    do = rng.standard_normal((2, 6, 3)).astype(np.float32)
    want = sdpa_math(q, k, v, do)
    got = fl_grads(q, k, v, do)
    for g, w in zip(got, want):
        assert max_abs_err(g, w) / max(1.0, np.abs(w).max()) < 1e-5


def test_cpu_scores_near_the_float32_limit(rng):
    # tau q.k up to 3e38: finite, and once NaN on the numba kernels
    # (log2(e) folded into the scale overflowed past 2.36e38)
    q, k, v = qkv(rng, (2, 2), 5, 7, 4, 3, dtype=np.float32)
    q[0, 0, :, 0] = 3e38
    q[0, 0, :, 1:] = 0
    k[0, 0, :, 0] = np.linspace(0.5, 1.0, 7)
    kw = dict(scale=1.0)
    o_ref, lse_ref = reference.attention(q, k, v, return_lse=True, **kw)
    o, lse = cpu.attention(q, k, v, return_lse=True, **kw)
    assert np.isfinite(o).all() and np.isfinite(lse).all()
    assert max_abs_err(o, o_ref) < 1e-5
    # the 3e38 rows relative to a few float32 ulps (6e-8 each); the
    # others absolutely: lse there is O(1) and may be near zero, where
    # a ratio magnifies the float32 rounding of the scores (~1e-6)
    big = lse_ref > 1e30
    assert big.any() and not big.all()
    assert max_abs_err(lse[big] / lse_ref[big], 1.0) < 1e-6
    assert max_abs_err(lse[~big], lse_ref[~big]) < 1e-5
    do = rng.standard_normal(o.shape).astype(np.float32)
    o_t, lse_t = tiled.attention(q, k, v, return_lse=True, **kw)
    want = tiled.attention_backward(q, k, v, o_t, lse_t, do, **kw)
    got = cpu.attention_backward(q, k, v, o, lse, do, **kw)
    for g, w in zip(got, want):
        assert np.isfinite(g).all()
        assert max_abs_err(g, w) <= 1e-5 * max(1.0, np.abs(w).max())


@pytest.mark.parametrize("p", [1 - 2.0**-24 / 2, 1 - 1e-6, 1 - 2.0**-13,
                               np.nextafter(1.0, 0)])
def test_dropout_rates_24_bits_cannot_hold_are_refused(p):
    q = np.zeros((1, 4, 4))
    for fn in (tiled.attention, cpu.attention, reference.attention):
        with pytest.raises(ValueError, match=r"dropout_p: expected at most"):
            fn(q, q, q, dropout_p=p, seed=1)
    with pytest.raises(ValueError, match=r"dropout_p: expected at most"):
        fl_torch.attention(*(torch.tensor(q),) * 3, dropout_p=p)


def test_dropout_kept_fraction_is_within_its_stated_bound():
    # every rate accepted keeps k / 2**24 of the pairs, within 2**-12 of
    # 1 - p relatively: the bound dropout's docstring states
    from flashlab import dropout

    rates = np.concatenate([np.linspace(0, dropout.MAX_RATE, 1001),
                            dropout.MAX_RATE - np.arange(50) * 1e-9])
    for p in rates:
        kept = (2**24 - int(dropout.threshold(p))) / 2**24
        assert abs(kept - (1 - p)) <= 2.0**-12 * (1 - p), p
    dropout.make(dropout.MAX_RATE, 0, ())  # the bound itself is taken


def test_torch_refuses_float_masks_sdpa_refuses(rng):
    q = torch.tensor(rng.standard_normal((2, 5, 4)), dtype=torch.float32)
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        with pytest.raises(TypeError, match="attn_mask: expected a bool "
                           "mask or a float one of dtype float32"):
            fl_torch.attention(q, q, q, attn_mask=torch.zeros(
                5, 5, dtype=dtype))
    meta = torch.zeros(5, 5, dtype=torch.bool, device="meta")
    with pytest.raises(ValueError, match="attn_mask: expected a CPU or"):
        fl_torch.attention(q, q, q, attn_mask=meta)
    with pytest.raises(ValueError, match="kv_lengths: expected a CPU or"):
        fl_torch.attention(q, q, q, kv_lengths=torch.ones(
            2, dtype=torch.int64, device="meta"))


def test_zero_key_value_heads_are_refused(rng):
    q = torch.tensor(rng.standard_normal((2, 4, 5, 8)))
    kv = torch.zeros(2, 0, 6, 8, dtype=q.dtype)
    with pytest.raises(ValueError, match="key: expected a number of heads"):
        fl_torch.attention(q, kv, kv, enable_gqa=True)
    with pytest.raises(ValueError, match="k: expected leading dims"):
        tiled.attention(q.numpy(), kv.numpy(), kv.numpy())
    with pytest.raises(ValueError, match="k: expected a number of heads"):
        fl_torch.varlen_attention(q[0].transpose(0, 1), kv[0].transpose(
            0, 1), kv[0].transpose(0, 1), torch.tensor([0, 5]),
            torch.tensor([0, 6]))


def test_batch_zero_with_grouped_heads(rng):
    q, k, v = qkv(rng, (0, 4), 5, 6, 8, 3)
    k, v = k[:, :2], v[:, :2]
    for backend in (tiled, cpu):
        o, lse = backend.attention(q, k, v, return_lse=True)
        assert o.shape == (0, 4, 5, 3) and lse.shape == (0, 4, 5)
        grads = backend.attention_backward(q, k, v, o, lse, o)
        assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    xs = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
    fl_torch.attention(*xs, enable_gqa=True).sum().backward()
    assert [x.grad.shape for x in xs] == [x.shape for x in xs]


def test_combine_names_its_bad_arguments():
    with pytest.raises(ValueError, match="outs: expected an array of one"):
        merge.combine([np.zeros((3, 2)), np.zeros((4, 2))],
                      [np.zeros(3), np.zeros(4)])
    with pytest.raises(TypeError, match="outs: expected a float array"):
        merge.combine(np.array([None, None]), np.array([None]))
    with pytest.raises(TypeError, match="lses: expected a float array"):
        merge.combine(np.zeros((2, 3)), np.array(["a", "b"]))
    with pytest.raises(ValueError, match=r"outs: expected \(S, \.\.\., d_v"):
        merge.combine(np.zeros(3), np.zeros(()))


def test_varlen_refuses_meta_lengths_and_keeps_gradients_without_keys(rng):
    q = torch.tensor(rng.standard_normal((5, 2, 4)), requires_grad=True)
    kv = torch.zeros(0, 2, 4, dtype=q.dtype, requires_grad=True)
    with pytest.raises(ValueError, match="cu_seqlens_q: expected a CPU"):
        fl_torch.varlen_attention(q, kv, kv, torch.tensor(
            [0, 5], device="meta"), torch.tensor([0, 0]))
    # no sequence has a key: rows of 0, and a backward of zeros (once
    # the output had no grad_fn and backward raised)
    o = fl_torch.varlen_attention(q, kv, kv, torch.tensor([0, 2, 5]),
                                  torch.tensor([0, 0, 0]))
    assert o.shape == (5, 2, 4) and torch.all(o == 0)
    q2 = q.detach().clone().requires_grad_()
    o = fl_torch.varlen_attention(q2, kv, kv, torch.tensor([0, 2, 5]),
                                  torch.tensor([0, 0, 0]))
    dq, dkv = torch.autograd.grad(o.sum(), (q2, kv))
    assert torch.all(dq == 0) and dkv.shape == kv.shape


def flash_attn_padded_mask(nq, lengths, nk, left, right, causal):
    """flash-attn's documented rule, sequence by sequence: query i of a
    sequence with seqlen_k keys attends keys j (< seqlen_k) with
    i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q +
    right, and j <= i + seqlen_k - seqlen_q if causal; -1 = unbounded.
    Padded keys (j >= seqlen_k) are never attended."""
    keep = np.zeros((len(lengths), nq, nk), bool)
    for b, seqlen_k in enumerate(lengths):
        i = np.arange(nq)[:, None]
        j = np.arange(seqlen_k)[None, :]
        diag = i + seqlen_k - nq
        ok = np.ones((nq, seqlen_k), bool)
        if left >= 0:
            ok &= j >= diag - left
        if right >= 0:
            ok &= j <= diag + right
        if causal:
            ok &= j <= diag
        keep[b, :, :seqlen_k] = ok
    return keep


@pytest.mark.parametrize("left, right, causal", [
    (-1, -1, True), (2, 0, False), (3, 1, True), (-1, 2, False)])
def test_bottom_right_aligns_each_padded_sequence(rng, left, right,
                                                  causal):
    lengths = np.array([11, 7, 3, 0, 5])
    nq, nk = 5, 11
    q, k, v = qkv(rng, (5, 2), nq, nk, 8, 4)
    keep = flash_attn_padded_mask(nq, lengths, nk, left, right, causal)
    want, lse_want = reference.attention(q, k, v, mask=keep[:, None],
                                         return_lse=True)
    window = tuple(None if w < 0 else w for w in (left, right))
    kw = dict(causal=causal, align="bottom_right",
              kv_lengths=lengths[:, None],
              window=None if window == (None, None) else window)
    for name, fn in [("tiled", tiled.attention), ("cpu", cpu.attention),
                     ("reference", reference.attention)]:
        o, lse = fn(q, k, v, return_lse=True, block_q=2, block_k=3, **kw) \
            if name != "reference" else fn(q, k, v, return_lse=True, **kw)
        assert max_abs_err(o, want) < 1e-12, name
        assert np.array_equal(np.isneginf(lse), np.isneginf(lse_want)), name
    o_t = fl_torch.attention(*(torch.tensor(x) for x in (q, k, v)),
                             **kw).numpy()
    assert max_abs_err(o_t, want) < 1e-12
    # the backward follows the same rule: as the explicit mask's
    do = rng.standard_normal(want.shape)
    o, lse = tiled.attention(q, k, v, return_lse=True, **kw)
    grads = tiled.attention_backward(q, k, v, o, lse, do, **kw)
    masked = tiled.attention_backward(q, k, v, o, lse, do,
                                      mask=keep[:, None])
    for g, w in zip(grads, masked):
        assert max_abs_err(g, w) < 1e-12
    grads = cpu.attention_backward(q, k, v, o, lse, do, **kw)
    for g, w in zip(grads, masked):
        assert max_abs_err(g, w) < 1e-12


def test_threads_at_once_give_what_one_at_a_time_gives(rng):
    # no state shared between calls: eight threads, each its own inputs,
    # all running together, match the same calls made one by one
    from concurrent.futures import ThreadPoolExecutor

    cases = []
    for n in range(8):
        q, k, v = qkv(rng, (2, 2), 9 + n, 11, 8, 4)
        mask = rng.random((9 + n, 11)) < 0.8
        cases.append((q, k, v, mask, rng.standard_normal(
            (2, 2, 9 + n, 4)), dict(dropout_p=0.2 if n % 2 else 0.0,
                                    seed=n, causal=n % 3 == 0)))

    def run(case):
        q, k, v, mask, do, kw = case
        xs = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
        o = fl_torch.attention(*xs, attn_mask=torch.tensor(mask)
                               if not kw["causal"] else None, **kw)
        grads = torch.autograd.grad(o, xs, torch.tensor(do))
        c = cpu.attention(q, k, v, block_q=4, block_k=4, **kw)
        return [x.detach().numpy() for x in (o, *grads)] + [c]

    alone = [run(c) for c in cases]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(run, cases * 2))
    for a, t in zip(alone * 2, together):
        for x, y in zip(a, t):
            assert np.array_equal(x, y)


def test_nested_lists_and_none_reach_the_named_checks(rng):
    # the numba and packed entries read shapes as tiled does: lists are
    # arrays, None is named
    from flashlab import varlen

    q = rng.standard_normal((2, 10, 4))
    want = tiled.attention(q, q, q)
    got = cpu.attention(q.tolist(), q.tolist(), q.tolist())
    assert np.max(np.abs(got - want)) < 1e-12
    with pytest.raises(TypeError, match="q: expected a float32"):
        cpu.attention(None, q, q)
    packed = np.swapaxes(q, 0, 1)  # (10 rows, 2 heads, 4)
    cu = np.array([0, 4, 10])
    want = varlen.attention(packed, packed, packed, cu, cu)
    got = varlen.attention(*(packed.tolist(),) * 3, cu, cu)
    assert np.max(np.abs(got - want)) < 1e-12
    with pytest.raises(ValueError, match="q: expected \\(total, heads"):
        varlen.attention(None, packed, packed, cu, cu)



def test_ragged_lists_numpy_bools_and_scales_past_the_dtype(rng):
    q = rng.standard_normal((6, 4))
    with pytest.raises(ValueError, match="q: expected an array of one "
                                         "shape, got ragged"):
        tiled.attention([[1.0, 2.0], [3.0]], q, q)
    # numpy's bools are bools here, as torch's wrapper takes them
    assert np.array_equal(tiled.attention(q, q, q, causal=np.True_),
                          tiled.attention(q, q, q, causal=True))
    # a scale float32 cannot hold would turn every score to inf, then NaN
    q32 = q.astype(np.float32)
    with pytest.raises(ValueError, match="scale: expected a number that "
                                         "float32"):
        tiled.attention(q32, q32, q32, scale=1e39)
    # float64 holds it: scores of 1e39 pick each row's largest exactly
    big = tiled.attention(q, q, q, scale=1e39)
    s = q @ q.T
    want = q[np.argmax(s, axis=-1)]
    assert np.max(np.abs(big - want)) < 1e-12


DROPOUT = [(n, f) for n, f in BACKENDS if n != "dense"]  # dense has none


@pytest.mark.parametrize("name, fn", DROPOUT, ids=[n for n, _ in DROPOUT])
def test_a_dropped_overflow_is_nan_never_a_zero(name, fn):
    # +inf in k overflows key 0's score: the row's denominator is NaN,
    # and dropping that key must not leave a finite row (the reference
    # had divided first and then dropped the one NaN term, giving 0)
    q = np.ones((1, 16))
    k = np.zeros((2, 16))
    k[0, 0] = np.inf
    v = np.ones((2, 16))
    opts = dict(dropout_p=0.5, seed=4)
    from flashlab import dropout

    keep = dropout.make(0.5, 4, ()).keep(range(1), range(2))
    assert keep.tolist() == [[False, True]]  # key 0 dropped, 1 kept
    o_ref, lse_ref = reference.attention(q, k, v, return_lse=True, **opts)
    assert np.isnan(o_ref).all() and np.isnan(lse_ref).all()
    check_same_nans(q, k, v, fn, **opts)


def test_reference_softmax_of_an_overflowed_row_is_nan():
    p = reference.softmax(np.array([[np.inf, 0.0, -1.0], [0.0, 1.0, 2.0]]))
    assert np.isnan(p[0]).all() and np.allclose(p[1].sum(), 1)


def test_a_numpy_float32_scale_is_read_without_a_warning(rng):
    import warnings

    x = rng.standard_normal((1, 4, 4))
    want = tiled.attention(x, x, x, scale=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for attend in (tiled.attention, cpu.attention):
            got = attend(x, x, x, scale=np.float32(0.5))
            assert np.max(np.abs(got - want)) < 1e-12


def test_merge_names_a_bad_summary_and_negative_denominators():
    a = merge.summarize(np.zeros((3, 4)), np.ones((4, 2)))
    with pytest.raises(TypeError, match="b: expected a merge.Summary"):
        merge.merge(a, None)
    with pytest.raises(TypeError, match="a: expected a merge.Summary"):
        merge.merge((a.m, a.l, a.u), a)
    outs, ms = np.ones((2, 1, 2)), np.zeros((2, 1))
    with pytest.raises(ValueError, match="ls: expected denominators >= 0"):
        merge.combine(outs, ms, np.array([[1.0], [-1.0]]))
    # a NaN denominator is not refused: it comes out as NaN
    out, m, l = merge.combine(outs, ms, np.array([[1.0], [np.nan]]))
    assert np.isnan(out).all() and np.isnan(l).all()


def test_torch_names_its_window_and_takes_one_length_as_a_tensor(rng):
    q = torch.from_numpy(rng.standard_normal((2, 3, 5, 4)))
    for bad in (3, {1: 2}, "12"):
        with pytest.raises(ValueError, match="window: expected"):
            fl_torch.attention(q, q, q, window=bad)
    want = reference.attention(*(q.numpy(),) * 3, kv_lengths=4)
    got = fl_torch.attention(q, q, q, kv_lengths=torch.tensor(4))
    assert np.max(np.abs(got.numpy() - want)) < 1e-12


def test_ragged_lists_and_string_masks_are_named(rng):
    k = np.ones((3, 2))
    with pytest.raises(ValueError, match="q: expected an array of one "
                                         "shape, got ragged"):
        cpu.attention([[1.0, 2.0], [3.0]], k, k)
    q = torch.from_numpy(rng.standard_normal((5, 4)))
    with pytest.raises(TypeError, match="attn_mask: expected a boolean or "
                                        "float mask"):
        fl_torch.attention(q, q, q, attn_mask=np.array([["a"] * 5] * 5))
    # numpy masks of either kind still work
    keep = rng.random((5, 5)) < 0.7
    keep[:, 0] = True
    want = reference.attention(*(q.numpy(),) * 3, mask=keep)
    got = fl_torch.attention(q, q, q, attn_mask=keep)
    assert np.max(np.abs(got.numpy() - want)) < 1e-12
