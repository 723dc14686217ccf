"""Grouped-query and multi-query heads on every backend.

k and v with H_q / g heads: each backend must give what the float64
reference gives with K/V repeated g times, forward and backward (dK, dV
summed over the group), without being handed the repeated arrays.
"""

import numpy as np
import pytest
from conftest import SIMULATOR

from flashlab import cpu, gpu, reference, tiled
from helpers import float32_budget, max_abs_err


def grouped(rng, g, b=2, hq=4, nq=37, nk=45, d=16, dv=16):
    q = rng.standard_normal((b, hq, nq, d))
    k = rng.standard_normal((b, hq // g, nk, d))
    v = rng.standard_normal((b, hq // g, nk, dv))
    do = rng.standard_normal((b, hq, nq, dv))
    return q, k, v, do


def want(q, k, v, do, **opts):
    """Reference output, and tiled's gradients with K/V repeated, summed
    back over each group."""
    g = q.shape[1] // k.shape[1]
    kr, vr = (np.repeat(x, g, axis=1) for x in (k, v))
    o, lse = tiled.attention(q, kr, vr, return_lse=True, **opts)
    dq, dk, dv = tiled.attention_backward(q, kr, vr, o, lse, do, **opts)
    def fold(x):
        return x.reshape(x.shape[0], -1, g, *x.shape[2:]).sum(2)

    return (reference.attention(q, kr, vr, **opts), dq, fold(dk), fold(dv),
            reference.naive(*(x.astype(np.float32) for x in (q, kr, vr)),
                            **opts))


OPTS = [dict(), dict(causal=True, align="bottom_right"),
        dict(window=(6, 2), kv_lengths=np.array([[40], [9]]))]


@pytest.mark.parametrize("g", [2, 4])
@pytest.mark.parametrize("opts", OPTS)
def test_tiled_grouped(rng, g, opts):
    q, k, v, do = grouped(rng, g)
    o_ref, *grads, _ = want(q, k, v, do, **opts)
    o, lse = tiled.attention(q, k, v, return_lse=True, block_q=8,
                             block_k=16, **opts)
    assert max_abs_err(o, o_ref) < 1e-12
    got = tiled.attention_backward(q, k, v, o, lse, do, **opts)
    for a, b in zip(got, grads):
        assert a.shape == b.shape and max_abs_err(a, b) < 1e-12


@pytest.mark.parametrize("g", [2, 4])
@pytest.mark.parametrize("opts", OPTS)
@pytest.mark.parametrize("b", [1, 8])  # both backward schedules
def test_cpu_grouped(rng, g, opts, b):
    q, k, v, do = grouped(rng, g, b=b)
    if "kv_lengths" in opts:
        opts = {**opts, "kv_lengths": np.arange(b)[:, None] * 5 % 45}
    o_ref, *grads, naive = want(q, k, v, do, **opts)
    x32 = [x.astype(np.float32) for x in (q, k, v)]
    o, lse = cpu.attention(*x32, return_lse=True, **opts)
    assert max_abs_err(o, o_ref) <= float32_budget(
        max_abs_err(naive, o_ref), o_ref, 4)
    got = cpu.attention_backward(*x32, o, lse, do.astype(np.float32),
                                 **opts)
    for a, b_ in zip(got, grads):
        assert a.shape == b_.shape
        assert max_abs_err(a, b_) < 1e-4 * max(1, np.abs(b_).max())


@pytest.mark.skipif(not SIMULATOR, reason="simulator sizes; see -m gpu")
@pytest.mark.parametrize("version", [1, 3])
def test_simulator_grouped(rng, monkeypatch, version):
    monkeypatch.setattr(gpu, "POISON_OUTPUTS", True)
    q, k, v, do = grouped(rng, 2, b=1, hq=4, nq=9, nk=70)
    opts = dict(causal=True, align="bottom_right")
    o_ref, *grads, naive = want(q, k, v, do, **opts)
    x32 = [x.astype(np.float32) for x in (q, k, v)]
    o, lse = gpu.attention(*x32, version=version, return_lse=True, **opts)
    assert max_abs_err(o, o_ref) <= float32_budget(
        max_abs_err(naive, o_ref), o_ref, 4)
    if version == 3:
        o2 = gpu.attention(*x32, version=3, num_splits=2, **opts)
        assert max_abs_err(o2, o_ref) <= float32_budget(
            max_abs_err(naive, o_ref), o_ref, 6)
        got = gpu.attention_backward(*x32, o, lse, do.astype(np.float32),
                                     **opts)
        for a, b in zip(got, grads):
            assert a.shape == b.shape and max_abs_err(a, b) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("g", [2, 8])
@pytest.mark.parametrize("opts", OPTS)
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_grouped(rng, monkeypatch, g, opts, d):
    import torch

    monkeypatch.setattr(gpu, "POISON_OUTPUTS", True)
    q, k, v, do = grouped(rng, g, hq=8, nq=200, nk=333, d=d, dv=d)
    if "kv_lengths" in opts:
        opts = {**opts, "kv_lengths": np.array([[300], [0]])}
    o_ref, *grads, naive = want(q, k, v, do, **opts)
    budget = float32_budget(max_abs_err(naive, o_ref), o_ref, 12)
    x32 = [torch.tensor(x, dtype=torch.float32, device="cuda")
           for x in (q, k, v, do)]
    for version in (3, 6):
        o, lse = gpu.attention(*x32[:3], version=version, return_lse=True,
                               **opts)
        assert max_abs_err(o.cpu().numpy(), o_ref) <= budget, version
    o3 = gpu.attention(*x32[:3], version=3, num_splits=3, **opts)
    assert max_abs_err(o3.cpu().numpy(), o_ref) <= budget
    half = [x.bfloat16() for x in x32[:3]]
    o5 = gpu.attention(*half, version=5, **opts).float().cpu().numpy()
    o5_ref = reference.attention(*(x.float().cpu().numpy() for x in half),
                                 **opts)
    assert max_abs_err(o5, o5_ref) < 2e-2
    got = gpu.attention_backward(*x32[:3], o, lse, x32[3], **opts)
    for a, b in zip(got, grads):
        assert tuple(a.shape) == b.shape
        assert max_abs_err(a.cpu().numpy(), b) < 1e-4 * max(
            1, np.abs(b).max())
