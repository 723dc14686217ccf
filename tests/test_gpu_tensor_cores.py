"""Forward v5 (bf16, float16) and v6 (3xTF32, tf32) on a real GPU.

Inline PTX does not run on the simulator, so these tests need -m gpu; CI
checks the same kernels' PTX (test_gpu_ptx) and their fragment layouts
(test_fragments). Outputs are poisoned with NaN before every launch.

Error budgets. v5 stores P and O in 16 bits (unit roundoff u = 2**-8 for
bf16, 2**-11 for float16, round to nearest: half of that): P V's terms
each carry a relative u/2, so |dO| <= u/2 max|V|, and the output's own
rounding adds u/2 |O|; twice that sum is allowed, against float64 on the
same 16-bit inputs. v6 at 3xTF32 gets naive float32's budget
(test_gpu.check_forward); at tf32, q, k, P and V each lose 2**-10.
"""

import numpy as np
import pytest
from test_gpu import check_forward

from flashlab import gpu, reference
from helpers import max_abs_err, qkv

pytestmark = pytest.mark.gpu

UNIT = {np.float16: 2.0**-11, "bfloat16": 2.0**-8}
CASES = [
    dict(),
    dict(causal=True),
    dict(causal="bottom_right"),
    dict(window=(100, 20)),
    dict(window=(70, 0), causal=True),
    dict(dropout_p=0.2, seed=9),
]


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(gpu, "POISON_OUTPUTS", True)


def half_budget(o_ref, v, u):
    """2 (u/2 max|V| + u/2 max|O|): P's and O's 16-bit rounding."""
    return u * (float(np.abs(v).max()) + float(np.abs(o_ref).max()))


@pytest.mark.parametrize("opts", CASES)
@pytest.mark.parametrize("d, d_v", [(64, 64), (128, 128), (64, 128)])
def test_v5_float16_against_float64(rng, opts, d, d_v):
    nq, nk = (int(x) for x in rng.integers(1, 600, size=2))
    q, k, v = qkv(rng, (2, 3), nq, nk, d, d_v, dtype=np.float16)
    o, lse = gpu.attention(q, k, v, return_lse=True, **opts)
    wide = [x.astype(np.float64) for x in (q, k, v)]
    o_ref, lse_ref = reference.attention(*wide, return_lse=True, **opts)
    assert o.dtype == np.float16 and lse.dtype == np.float32
    assert not np.isnan(o).any()
    assert max_abs_err(o, o_ref) <= half_budget(o_ref, v, UNIT[np.float16])
    # lse: -inf exactly where no key is allowed; elsewhere float32 sums
    # of Nk terms (Nk eps relative in l, so absolute in log l)
    finite = np.isfinite(lse_ref)
    assert np.array_equal(finite, np.isfinite(lse))
    eps = float(np.finfo(np.float32).eps)
    tol = eps * (nk + 8 * (1 + np.abs(lse_ref[finite])))
    assert np.all(np.abs(lse[finite] - lse_ref[finite]) <= tol)


@pytest.mark.parametrize("opts", CASES[:3])
@pytest.mark.parametrize("d", [64, 128])
def test_v5_bf16_torch_tensors(rng, opts, d):
    import torch

    nq, nk = (int(x) for x in rng.integers(1, 1100, size=2))
    q, k, v = (torch.tensor(x, device="cuda").bfloat16()
               for x in qkv(rng, (2, 2), nq, nk, d, d, np.float32))
    o = gpu.attention(q, k, v, **opts)
    assert o.dtype == torch.bfloat16 and o.shape == (2, 2, nq, d)
    wide = [x.double().cpu().numpy() for x in (q, k, v)]
    o_ref = reference.attention(*wide, **opts)
    got = o.double().cpu().numpy()
    assert max_abs_err(got, o_ref) <= half_budget(o_ref, wide[2],
                                                  UNIT["bfloat16"])


def test_v5_masks_padding_and_nonfinite(rng):
    q, k, v = qkv(rng, (2, 1), 130, 200, 64, 64, dtype=np.float16)
    mask = rng.random((2, 1, 130, 200)) < 0.6
    mask[0, 0, 7] = False  # an empty row: 0 and lse -inf
    v[1, 0, 150, 3] = np.inf  # a bad value in V: column 3 NaN
    opts = dict(mask=mask, kv_lengths=np.array([[200], [170]]))
    o, lse = gpu.attention(q, k, v, return_lse=True, **opts)
    wide = [x.astype(np.float64) for x in (q, k, v)]
    o_ref, lse_ref = reference.attention(*wide, return_lse=True, **opts)
    assert np.all(o[0, 0, 7] == 0) and lse[0, 0, 7] == -np.inf
    assert np.array_equal(np.isnan(o), np.isnan(o_ref))
    assert np.isnan(o[1, 0, :, 3]).all()
    ok = ~np.isnan(o_ref)
    assert max_abs_err(o[ok], o_ref[ok]) <= half_budget(
        o_ref[ok], v[0], UNIT[np.float16])
    q[0, 0, 5, 0] = np.nan  # NaN in q: that row only
    o = gpu.attention(q, k, v)
    assert np.isnan(o[0, 0, 5]).all() and not np.isnan(o[0, 0, 6]).any()


@pytest.mark.parametrize("opts", CASES)
@pytest.mark.parametrize("d", [64, 128])
def test_v6_3xtf32_float32_budget(rng, opts, d):
    nq, nk = (int(x) for x in rng.integers(1, 700, size=2))
    q, k, v = qkv(rng, (2, 3), nq, nk, d, d, dtype=np.float32, spread=1.5)
    check_forward(q, k, v, 6, **opts)


@pytest.mark.parametrize("d", [64, 128])
def test_v6_tf32_is_tf32_accurate_and_3xtf32_better(rng, d):
    q, k, v = qkv(rng, (2, 2), 500, 700, d, d, dtype=np.float32)
    o_ref = reference.attention(*(x.astype(np.float64) for x in (q, k, v)))
    err_one = max_abs_err(gpu.attention(q, k, v, version=6,
                                        precision="tf32"), o_ref)
    err_three = max_abs_err(gpu.attention(q, k, v, version=6), o_ref)
    # truncation to tf32 loses up to 2**-10 of each operand: scores lose
    # 2 * 2**-10 of sum |q||k| / sqrt(d), P V another 2 * 2**-10
    s_abs = np.abs(q) @ np.abs(np.swapaxes(k, -1, -2)) / np.sqrt(d)
    bound = 2.0**-9 * (s_abs.max() + 1) * np.abs(v).max()
    assert err_one <= bound
    assert err_three * 20 < err_one  # the split buys ~3 decimal digits


@pytest.mark.parametrize("deterministic", [True, False])
def test_torch_bf16_forward_and_backward(rng, deterministic):
    # deterministic=False: dQ by atomics on Hopper (the fused backward),
    # the same kernels as True elsewhere
    import torch
    import torch.nn.functional as F

    from flashlab import torch as fl_torch

    q, k, v = (torch.tensor(x, device="cuda").bfloat16().requires_grad_()
               for x in qkv(rng, (2, 4), 300, 300, 64, 64, np.float32))
    do = torch.randn(2, 4, 300, 64, device="cuda").bfloat16()
    out = fl_torch.attention(q, k, v, causal=True,
                             deterministic=deterministic)
    grads = torch.autograd.grad(out, (q, k, v), do)
    wide = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = F.scaled_dot_product_attention(*wide, is_causal=True)
    ref_grads = torch.autograd.grad(ref, wide, do.double())
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    sdpa_grads = torch.autograd.grad(sdpa, (q, k, v), do)
    for mine, theirs, truth in zip((out, *grads), (sdpa, *sdpa_grads),
                                   (ref, *ref_grads)):
        assert mine.dtype == torch.bfloat16
        e_mine = float((mine.double() - truth).abs().max())
        e_torch = float((theirs.double() - truth).abs().max())
        # torch's bf16 kernels set the scale of a fair error
        assert e_mine <= 2 * e_torch + 2.0**-8 * float(truth.abs().max())


BACKWARD_CASES = CASES + [
    dict(kv_lengths=np.array([[250, 0], [300, 17]])),
    dict(mask="random"),
    dict(causal=True, grouped=True),
]


def backward_version(version, d=64):
    """Skip where this GPU does not run the 16-bit backward `version`, or
    it is not built for head dim d."""
    from flashlab.gpu import launch, registry

    spec = registry.get(registry.backward_names(version, "bf16")[0])
    if not spec.runs_on(launch.device_cc()):
        pytest.skip(f"backward v{version} does not run on this GPU")
    if not spec.takes(d, d):
        pytest.skip(f"backward v{version} is not built for d = {d}")
    return version


@pytest.mark.parametrize("version", [5, 7, 8, 9, "7 fused", "8 fused"])
@pytest.mark.parametrize("opts", BACKWARD_CASES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16bit_backward_against_float64(rng, opts, d, dtype, version):
    # backward_v5, v7 (its two kernels, and with deterministic=False
    # its fused kernel, dQ by atomics), v8 (and fused, dQ by TMA's
    # reductions) and v9 (in turn) against tiled's
    # float64 backward on the same 16-bit inputs; the scale of a fair
    # error is torch's flash backward in the same dtype on the same
    # inputs (causal or not; its kernels take no other mask, nor a
    # causal one with Nq != Nk), as the torch test
    fused = isinstance(version, str)
    version = backward_version(int(str(version).split()[0]), d)
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashlab import tiled

    opts = dict(opts)
    grouped = opts.pop("grouped", False)
    if opts.get("mask") == "random":
        keep = rng.random((2, 2, 300, 300)) < 0.7
        keep[..., 0] = True
        opts["mask"] = keep
    kind = getattr(torch, dtype)
    q, k, v = (torch.tensor(x, device="cuda").to(kind)
               for x in qkv(rng, (2, 2), 300, 300, d, d, np.float32))
    if grouped:  # one K/V head for both query heads
        k, v = k[:, :1].contiguous(), v[:, :1].contiguous()
    do = torch.tensor(rng.standard_normal((2, 2, 300, d)),
                      device="cuda").to(kind)
    o, lse = gpu.attention(q, k, v, return_lse=True, **opts)
    got = gpu.attention_backward(q, k, v, o, lse, do, version=version,
                                 deterministic=not fused, **opts)
    again = gpu.attention_backward(q, k, v, o, lse, do, version=version,
                                   deterministic=not fused, **opts)
    x64 = [x.double().cpu().numpy() for x in (q, k, v, do)]
    o64, lse64 = tiled.attention(*x64[:3], return_lse=True, **opts)
    want = tiled.attention_backward(*x64[:3], o64, lse64, x64[3], **opts)
    # Nq = Nk here, so bottom-right is the top-left mask flash takes; the
    # fair scale of a causal result is flash's causal error (seed
    # 330934803823114915087986246538959161556: every backward, flash's
    # too, is 1.4e-2 from float64 in causal dQ, five times flash's
    # non-causal error)
    causal = opts.get("causal") in (True, "bottom_right")
    kf, vf = (x.expand(-1, 2, -1, -1) for x in (k, v))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION if dtype == "bfloat16"
                     else SDPBackend.EFFICIENT_ATTENTION):
        x = [t.clone().requires_grad_() for t in (q, kf, vf)]
        out = F.scaled_dot_product_attention(*x, is_causal=causal)
        flash = torch.autograd.grad(out, x, do)
    plain = dict(causal=causal)
    o_p, lse_p = tiled.attention(*x64[:3], return_lse=True, **plain)
    truth = tiled.attention_backward(*x64[:3], o_p, lse_p, x64[3], **plain)
    for name, g, g2, w, f, t in zip("qkv", got, again, want, flash, truth):
        if fused and name == "q":  # float32 sums in any order, rounded
            # once to 16 bits: a unit of the dtype apart at most
            unit = float(torch.finfo(g.dtype).eps)
            assert float((g - g2).abs().max()) <= unit * float(
                g.abs().max()), name
        else:  # no atomics: bitwise repeatable
            assert torch.equal(g, g2), name
        # float32 (v5) or the inputs' dtype (v7), as flash's
        assert g.dtype == (q.dtype if version >= 7 else torch.float32)
        g = g.double().cpu().numpy()
        assert g.shape == w.shape and not np.isnan(g).any(), name
        f = f.double().cpu().numpy()
        if grouped and name != "q":
            f = f.sum(axis=1, keepdims=True)
        fair = max_abs_err(f, t)
        assert max_abs_err(g, w) <= 2 * fair + 2.0**-8 * float(
            np.abs(w).max()), name


def test_compiled_kernels_do_not_spill():
    from flashlab import ptx

    for key, r in ptx.resources(((64, 64), (128, 128))).items():
        # as compiled by this GPU's driver (CI checks ptxas's count)
        if key.startswith(("forward_v5", "forward_v6", "backward_v5")):
            assert r["local"] == 0, (key, r)
