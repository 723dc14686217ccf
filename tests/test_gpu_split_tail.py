"""Forward v8's split tail on a Hopper GPU (flashlab.gpu.host).

The last `tail` ranks of each head run as two launches' worth of pieces,
each block over half of its key tiles, merged by merge_halves. The
model picks a tail only without a mask; host.SPLIT_TAIL forces one here,
under every rule the kernel takes, so that each half meets causal and
window bounds, dropout and empty halves. Outputs are poisoned first
(the halves too); plans are made afresh for each test.

Error budget: v7's (test_gpu_v7.check): each half's O is rounded to 16
bits before the merge, which adds at most one more rounding of O.
"""

import numpy as np
import pytest
from test_gpu_tensor_cores import CASES, UNIT, half_budget
from test_gpu_v7 import check

from flashlab import gpu, reference
from flashlab.gpu import host
from helpers import max_abs_err, qkv

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def fresh_plans(monkeypatch):
    # every output NaN until a kernel writes it, and no plan kept from
    # another test (its tail was chosen then)
    monkeypatch.setattr(gpu, "POISON_OUTPUTS", True)
    monkeypatch.setattr(host, "_plans", {})


def run(q, k, v, tail, monkeypatch, **opts):
    """(o, lse, the plan's tail) of forward v8 with `tail` forced."""
    monkeypatch.setattr(host, "SPLIT_TAIL", tail)
    monkeypatch.setattr(host, "_plans", {})
    o, lse = gpu.attention(q, k, v, version=8, return_lse=True, **opts)
    plans = [p for p in host._plans.values()
             if isinstance(p, host._ForwardPlan)]
    return o, lse, plans[-1].tail


def on_gpu(dtype, *arrays):
    """torch CUDA tensors of `dtype` ("bfloat16", "float16")."""
    import torch

    return [torch.tensor(x, device="cuda").to(getattr(torch, dtype))
            for x in arrays]


@pytest.mark.parametrize("opts", CASES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("tail", [1, 3])
def test_split_tail_against_float64(rng, monkeypatch, opts, d, dtype,
                                    tail):
    nq, nk = (int(x) for x in rng.integers(600, 1300, size=2))
    dev = on_gpu(dtype, *qkv(rng, (2, 3), nq, nk, d, d, np.float32))
    o, lse, planned = run(*dev, tail, monkeypatch, **opts)
    assert planned == tail
    inputs = [x.double().cpu().numpy() for x in dev]
    check(o.double().cpu().numpy(), lse.cpu().numpy(), *inputs,
          np.float16 if dtype == "float16" else dtype, **opts)


@pytest.mark.parametrize("d", [64, 128])
def test_split_tail_keeps_the_whole_rows_bits(rng, monkeypatch, d):
    # rows before the tail come from the same blocks over all their keys:
    # the same bits; the tail's within one more rounding of O
    import torch

    dev = on_gpu("bfloat16", *qkv(rng, (1, 4), 1000, 777, d, d,
                                  np.float32))
    o0, lse0, none = run(*dev, 0, monkeypatch)
    o1, lse1, tail = run(*dev, 2, monkeypatch)
    assert (none, tail) == (0, 2)
    br = 192 if d == 64 else 128
    row0 = (-(-1000 // br) - tail) * br
    assert torch.equal(o0[..., :row0, :], o1[..., :row0, :])
    assert torch.equal(lse0[..., :row0], lse1[..., :row0])
    scale = float(o0[..., row0:, :].abs().max())
    assert float((o0[..., row0:, :].float() - o1[..., row0:, :].float())
                 .abs().max()) <= 2 * UNIT["bfloat16"] * scale
    assert np.allclose(lse0[..., row0:].cpu(), lse1[..., row0:].cpu(),
                       rtol=0, atol=1e-5)


def test_split_tail_nonfinite_and_grouped_heads(rng, monkeypatch):
    q, k, v = qkv(rng, (2, 4), 900, 640, 64, 64, dtype=np.float32)
    k, v = k[:, :2], v[:, :2]  # two query heads per K/V head
    v[1, 0, 600, 5] = np.inf  # a bad value in V: column 5 NaN
    q[0, 1, 850, 2] = np.nan  # NaN in a tail row of q: that row only
    dev = on_gpu("bfloat16", q, k, v)
    o, lse, tail = run(*dev, 2, monkeypatch)
    assert tail == 2
    o = o.double().cpu().numpy()
    wide = [x.double().cpu().numpy() for x in dev]
    o_ref = reference.attention(*wide)
    assert np.array_equal(np.isnan(o), np.isnan(o_ref))
    assert np.isnan(o[1, :2, :, 5]).all() and np.isnan(o[0, 1, 850]).all()
    assert not np.isnan(o[0, 1, 849]).any()
    ok = ~np.isnan(o_ref)
    assert max_abs_err(o[ok], o_ref[ok]) <= half_budget(
        o_ref[ok], wide[2][np.isfinite(wide[2])], UNIT["bfloat16"])

