"""One property: every backend gives the reference's answer on the same
random call (shapes, masks, windows, padding, dropout, block sizes).

float64 backends must agree with the float64 reference to 1e-12; the
float32 GPU kernels (on the simulator here) within twice the error of
naive float32 attention, plus rounding per merged key block
(helpers.float32_budget).
"""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flashlab import cpu, gpu, reference, tiled
from flashlab import torch as fl_torch
from helpers import float32_budget, max_abs_err

sides = st.one_of(st.none(), st.integers(0, 12))


@st.composite
def calls(draw):
    """A random attention call: arrays and keyword arguments."""
    batch = draw(st.sampled_from([(1,), (2,), (2, 2)]))
    nq, nk = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    d_v = draw(st.sampled_from([16, 32]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q, k = (rng.standard_normal((*batch, n, 16)) for n in (nq, nk))
    v = rng.standard_normal((*batch, nk, d_v))
    opts = dict(causal=draw(st.sampled_from([False, True, "bottom_right"])))
    if draw(st.booleans()):
        opts["window"] = (draw(sides), draw(sides))
    if draw(st.booleans()):
        opts["kv_lengths"] = rng.integers(0, nk + 1, size=batch)
    if draw(st.booleans()):
        opts["mask"] = rng.random((*batch, nq, nk)) < draw(
            st.sampled_from([0.3, 0.8]))
    if draw(st.booleans()):
        opts.update(dropout_p=draw(st.sampled_from([0.1, 0.5])),
                    seed=draw(st.integers(0, 2**63)))
    blocks = dict(block_q=draw(st.integers(1, 48)),
                  block_k=draw(st.integers(1, 48)))
    opts_splits = draw(st.integers(1, 6))  # split-KV where a backend has it
    return q, k, v, opts, blocks, opts_splits


def float64_backends(q, k, v, opts, blocks, splits):
    """(name, o, lse) of every float64 backend."""
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    to, tlse = fl_torch.attention(tq, tk, tv, return_lse=True, **opts,
                                  num_splits=splits, **blocks)
    return [
        ("tiled fa2", *tiled.attention(q, k, v, return_lse=True, **opts,
                                       **blocks)),
        ("tiled split-KV", *tiled.attention(q, k, v, return_lse=True,
                                            num_splits=splits, **opts,
                                            **blocks)),
        ("tiled fa1", *tiled.attention(q, k, v, return_lse=True,
                                       order="fa1", **opts, **blocks)),
        ("cpu", *cpu.attention(q, k, v, return_lse=True, **opts, **blocks)),
        ("torch", to.numpy(), tlse.numpy()),
    ]


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(call=calls())
def test_every_backend_agrees_with_the_reference(call):
    q, k, v, opts, blocks, splits = call
    o_ref, lse_ref = reference.attention(q, k, v, return_lse=True, **opts)
    for name, o, lse in float64_backends(q, k, v, opts, blocks, splits):
        assert max_abs_err(o, o_ref) < 1e-12, name
        assert np.array_equal(np.isneginf(lse), np.isneginf(lse_ref)), name
        finite = np.isfinite(lse_ref)
        assert max_abs_err(lse[finite], lse_ref[finite]) < 1e-12, name
    q32, k32, v32 = (x.astype(np.float32) for x in (q, k, v))
    o = gpu.attention(q32, k32, v32, **opts)
    err_naive = max_abs_err(reference.naive(q32, k32, v32, **opts), o_ref)
    _, tile = gpu.tile_shape(gpu.DEFAULT_VERSION, 16, v.shape[-1])
    merges = -(-k.shape[-2] // tile)
    assert max_abs_err(o, o_ref) <= float32_budget(err_naive, o_ref, merges)


@pytest.mark.parametrize("splits", [2, 3])
def test_split_kv_is_exact_at_huge_scores(rng, splits):
    # a row of finfo.min (a fully masked row of an additive mask) and rows
    # of equal huge scores: the splits' m + log l all round to m, so they
    # must be weighed by their sums l, as the single pass does
    n = 19
    q, k = (rng.standard_normal((1, n, 8)).astype(np.float32)
            for _ in range(2))
    v = rng.standard_normal((1, n, 4)).astype(np.float32)
    bias = np.zeros((n, n), np.float32)
    bias[2] = np.finfo(np.float32).min
    want = reference.attention(q, k, v, mask=bias)
    assert np.max(np.abs(want[0, 2] - v[0].mean(axis=0))) < 1e-6
    got = tiled.attention(q, k, v, mask=bias, block_k=8, num_splits=splits)
    assert np.max(np.abs(got - want)) < 1e-5
    ones = np.ones((1, n, 1), np.float32)
    for score in (1e6, 3e38):
        keys = np.full((1, n, 1), score, np.float32)
        want = reference.attention(ones, keys, v, scale=1.0)
        got = tiled.attention(ones, keys, v, scale=1.0, block_k=8,
                              num_splits=splits)
        assert np.max(np.abs(got - want)) < 1e-5, score
        out = fl_torch.attention(*(torch.from_numpy(x)
                                   for x in (ones, keys, v)), scale=1.0,
                                 num_splits=splits)
        assert np.max(np.abs(out.numpy() - want)) < 1e-5, score
