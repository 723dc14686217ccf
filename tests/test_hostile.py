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
