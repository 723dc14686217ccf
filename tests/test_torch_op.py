"""flashlab.torch.attention as torch ops: opcheck, torch.compile with
fullgraph=True on the CPU (eager and compiled give the same numbers,
dropout included), and the transforms it refuses, with their reason."""

import numpy as np
import pytest
import torch

from flashlab import reference
from flashlab import torch as fl_torch


def _inputs(rng, shape_q=(2, 4, 33, 16), heads_kv=4, dtype=torch.float64):
    b, h, n, d = shape_q
    q = torch.tensor(rng.standard_normal(shape_q), dtype=dtype)
    k, v = (torch.tensor(rng.standard_normal((b, heads_kv, n + 5, d)),
                         dtype=dtype) for _ in range(2))
    return [x.requires_grad_() for x in (q, k, v)]


OPTIONS = [dict(), dict(is_causal=True), dict(enable_gqa=True),
           dict(window=(4, 2)), dict(dropout_p=0.2, seed=11)]


@pytest.mark.parametrize("opts", OPTIONS)
def test_opcheck(rng, opts):
    q, k, v = _inputs(rng, heads_kv=2 if opts.get("enable_gqa") else 4)
    options = fl_torch._encode(dict(
        block_q=None, block_k=None, scale=None,
        causal=opts.get("is_causal", False), window=opts.get("window"),
        align=None, dropout_p=opts.get("dropout_p", 0.0), order="fa2",
        num_splits=1, seed=opts.get("seed"), deterministic=True))
    torch.library.opcheck(fl_torch.attention_op,
                          (q, k, v, None, None, None, options))


@pytest.mark.parametrize("opts", OPTIONS)
def test_compile_fullgraph_equals_eager(rng, opts):
    q, k, v = _inputs(rng, heads_kv=2 if opts.get("enable_gqa") else 4)
    mask = torch.tensor(rng.random((33, 38)) < 0.8)

    def step(q, k, v):
        o = fl_torch.attention(q, k, v, **opts)
        if not opts:  # a mask of the caller's, as a model passes one
            o = o + fl_torch.attention(q, k, v, attn_mask=mask)
        return (o * o).sum()

    eager = step(q, k, v)
    grads = torch.autograd.grad(eager, (q, k, v))
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="eager")
    got = compiled(q, k, v)
    got_grads = torch.autograd.grad(got, (q, k, v))
    assert torch.equal(got, eager)
    for g, h in zip(got_grads, grads):
        assert torch.equal(g, h)


def test_compiled_matches_reference(rng):
    q, k, v = _inputs(rng)
    compiled = torch.compile(
        lambda q, k, v: fl_torch.attention(q, k, v, is_causal=True),
        fullgraph=True)
    o = compiled(q, k, v).detach().numpy()
    want = reference.attention(*(x.detach().numpy() for x in (q, k, v)),
                               causal=True)
    # float64 tiles against float64 reference: a few roundings of 1
    assert np.max(np.abs(o - want)) < 1e-12


def test_drawn_dropout_seed_compiles(rng):
    # a seed drawn from torch's generator is a graph op: with inductor's
    # fallback_random the compiled draw is eager's, so outputs agree
    import torch._inductor.config as inductor

    q, k, v = _inputs(rng, dtype=torch.float32)

    def step(q, k, v):
        return fl_torch.attention(q, k, v, dropout_p=0.3)

    torch.manual_seed(5)
    eager = step(q, k, v)
    torch._dynamo.reset()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(inductor, "fallback_random", True)
        torch.manual_seed(5)
        got = torch.compile(step, fullgraph=True)(q, k, v)
    assert torch.equal(got, eager)


def test_vmap_and_second_derivatives_refuse_clearly(rng):
    q, k, v = _inputs(rng)
    with pytest.raises(NotImplementedError, match="vmap is not supported"):
        torch.func.vmap(lambda a: fl_torch.attention(a, a, a))(q.detach())
    o = fl_torch.attention(q, k, v)
    with pytest.raises(RuntimeError, match="differentiable once"):
        torch.autograd.grad(o.sum(), q, create_graph=True)


def test_eager_calls_skip_the_op_dispatch(rng, monkeypatch):
    # eager calls run the same functions through _Eager; the op is for
    # torch.compile and torch.func, so a plain call never reaches it
    called = []
    monkeypatch.setattr(fl_torch, "attention_op",
                        lambda *a: called.append(a))
    q, k, v = _inputs(rng)
    fl_torch.attention(q, k, v).sum().backward()
    assert not called and q.grad is not None
