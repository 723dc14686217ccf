"""The placed kernels give the same results in every block order.

Forward v7, v8 (bf16 and e4m3) and the backward v7 and v8 kernels read
their head and rank from flashlab.order.place; the host chooses how many
heads start together (order.for_launch). Here that choice is forced: 1
(head by head), 4 of 6 heads (the second group has two idle places,
whose blocks must leave without writing) and all 6. Each block computes
alone, so the deterministic kernels' outputs must match bit for bit; the
fused backward's dQ (atomic sums in any order) within a unit of bf16.
Outputs are poisoned with NaN first."""

import numpy as np
import pytest

from flashlab import gpu, order
from flashlab.gpu import fp8 as gpu_fp8
from flashlab.gpu import host
from helpers import qkv

pytestmark = pytest.mark.gpu

TOGETHER = (4, 6)  # against 1; 4 does not divide the 6 heads
MASKS = [dict(causal=True), dict(causal="bottom_right"),
         dict(window=(70, 20))]


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    # every output is NaN until a kernel writes it
    monkeypatch.setattr(gpu, "POISON_OUTPUTS", True)


def forced(monkeypatch, g):
    """Start g heads together from now on (no plan kept from before)."""
    monkeypatch.setattr(order, "for_launch", lambda *shape: g)
    monkeypatch.setattr(host, "_plans", {})
    monkeypatch.setattr(gpu_fp8, "_plans", {})


def tensors(rng, nq, nk, d):
    """q, k, v, dO: bf16 CUDA tensors of 2 x 3 heads."""
    import torch

    q, k, v = (torch.tensor(x, device="cuda").bfloat16()
               for x in qkv(rng, (2, 3), nq, nk, d, d, np.float32))
    do = torch.tensor(rng.standard_normal((2, 3, nq, d)),
                      device="cuda").bfloat16()
    return q, k, v, do


@pytest.mark.parametrize("opts", MASKS)
@pytest.mark.parametrize("version, d", [(7, 128), (8, 64), (8, 128)])
def test_forward_is_the_same_in_every_order(monkeypatch, rng, opts,
                                            version, d):
    import torch

    q, k, v, _ = tensors(rng, 777, 650, d)
    out = {}
    for g in (1, *TOGETHER):
        forced(monkeypatch, g)
        out[g] = gpu.attention(q, k, v, version=version, return_lse=True,
                               **opts)
    for g in TOGETHER:
        for a, b in zip(out[1], out[g]):
            assert not torch.isnan(b).any()
            assert torch.equal(a, b), (g, opts)


@pytest.mark.parametrize("opts", MASKS)
def test_e4m3_forward_is_the_same_in_every_order(monkeypatch, rng, opts):
    import torch

    q, k, v, _ = tensors(rng, 777, 650, 128)
    codes = [gpu.quantize(x) for x in (q, k, v)]
    out = {}
    for g in (1, *TOGETHER):
        forced(monkeypatch, g)
        out[g] = gpu.attention_fp8(
            *(c for c, _ in codes), descale_q=codes[0][1],
            descale_k=codes[1][1], descale_v=codes[2][1],
            return_lse=True, **opts)
    for g in TOGETHER:
        for a, b in zip(out[1], out[g]):
            assert not torch.isnan(b).any()
            assert torch.equal(a, b), (g, opts)


@pytest.mark.parametrize("opts", MASKS)
@pytest.mark.parametrize("version, d", [(7, 128), (8, 64), (8, 128),
                                        (9, 64), (9, 128)])
def test_backward_is_the_same_in_every_order(monkeypatch, rng, opts,
                                             version, d):
    import torch

    q, k, v, do = tensors(rng, 700, 777, d)
    o, lse = gpu.attention(q, k, v, return_lse=True, **opts)
    grads = {}
    for g in (1, *TOGETHER):
        forced(monkeypatch, g)
        grads[g] = gpu.attention_backward(q, k, v, o, lse, do,
                                          version=version,
                                          deterministic=True, **opts)
    for g in TOGETHER:
        for a, b in zip(grads[1], grads[g]):
            assert not torch.isnan(b).any()
            assert torch.equal(a, b), (g, opts)
    # and the fused kernel: dK, dV the same bits; dQ, summed by atomics
    # in any order, within a unit of bf16 of the deterministic one (as
    # test_gpu_backward_v8 holds it)
    unit = float(torch.finfo(torch.bfloat16).eps)
    for g in (1, *TOGETHER):
        forced(monkeypatch, g)
        got = gpu.attention_backward(q, k, v, o, lse, do, version=version,
                                     deterministic=False, **opts)
        for name, x, w in zip("qkv", got, grads[1]):
            assert not torch.isnan(x).any(), (g, name, opts)
            if name == "q":
                gap = (x.float() - w.float()).abs()
                assert bool((gap <= unit * w.float().abs() + unit * 2.0**-6
                             * float(w.float().abs().max())).all()), (
                    g, opts, float(gap.max()))
            elif version == 9:  # v8's fused kernel takes the query
                # tiles in the other order: dK, dV within a unit too
                gap = (x.float() - w.float()).abs()
                assert bool((gap <= unit * w.float().abs() + unit * 2.0**-6
                             * float(w.float().abs().max())).all()), (
                    g, name, opts, float(gap.max()))
            else:
                assert torch.equal(x, w), (g, name, opts)
