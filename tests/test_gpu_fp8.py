"""The e4m3 forward (gpu.attention_fp8, v8 on 8-bit wgmma) on a Hopper GPU.

Inputs are fresh random float32 values quantized per tensor
(gpu.quantize); the reference is float64 attention of what the codes
stand for (flashlab.fp8.dequantize), so the error measured is the
kernel's own. Outputs are poisoned with NaN first; N is ragged.

Error budget, per output element (i, x): P_ij is rounded to e4m3 before
it weights V, by at most half a unit (flashlab.fp8.half_unit: 2^-4 P
relative, 2^-10 absolute below 2^-6), and the running maximum it is
taken against only makes P larger, so the weighted sum moves by at most
sum_j max(2^-4 P_ij, 2^-10) |V_jx| / l_i. Twice that covers the float32
exponentials and the tensor cores' sums of S and O; O's bf16 rounding
adds 2^-8 |O_ix|.
"""

import numpy as np
import pytest
from test_gpu_tensor_cores import CASES

from flashlab import dropout, fp8, gpu, reference
from helpers import qkv

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(gpu, "POISON_OUTPUTS", True)


def quantized(rng, batch, nq, nk, spread=1.0, kv_heads=None):
    """(codes on the GPU, descales, float64 values they stand for) of
    random q, k, v (d = 128; k and v with kv_heads heads if given)."""
    import torch

    host = qkv(rng, batch, nq, nk, 128, 128, np.float32, spread)
    if kv_heads is not None:
        host = (host[0], host[1][:, :kv_heads], host[2][:, :kv_heads])
    codes, scales, values = [], [], []
    for x in host:
        x8, scale = gpu.quantize(torch.tensor(x, device="cuda"))
        codes.append(x8)
        scales.append(scale)
        values.append(fp8.dequantize(
            x8.view(torch.uint8).cpu().numpy(), scale))
    return codes, scales, values


def run(codes, scales, **opts):
    """(o, lse) of attention_fp8, as float64 / float32 numpy."""
    q, k, v = codes
    o, lse = gpu.attention_fp8(q, k, v, descale_q=scales[0],
                               descale_k=scales[1], descale_v=scales[2],
                               return_lse=True, **opts)
    assert o.dtype.is_floating_point and str(o.dtype) == "torch.bfloat16"
    return o.double().cpu().numpy(), lse.cpu().numpy()


def budget(q, k, v, o_ref, **opts):
    """Per-element bound on |o - o_ref| (module docstring)."""
    s = reference.scores(q, k, **{n: opts[n] for n in opts
                                  if n not in ("dropout_p", "seed")})
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    p = np.exp(s - m)  # 0 where refused
    l = p.sum(-1, keepdims=True)
    weight = np.where(np.isfinite(s), 1.0, 0.0)
    if opts.get("dropout_p"):
        made = dropout.make(opts["dropout_p"], opts["seed"], s.shape[:-2])
        kept = made.keep(range(s.shape[-2]), range(s.shape[-1]))
        weight = weight * kept / (1 - opts["dropout_p"])
    if k.shape[-3] != q.shape[-3]:  # grouped heads: V per query head
        v = np.repeat(v, q.shape[-3] // k.shape[-3], axis=-3)
    rounding = np.maximum(2.0**-4 * p, 2.0**-10) * weight
    moved = rounding @ np.abs(v) / np.where(l > 0, l, 1)
    return 2 * moved + 2.0**-8 * np.abs(o_ref) + 1e-6


def check(o, lse, values, **opts):
    q, k, v = values
    o_ref, lse_ref = reference.attention(q, k, v, return_lse=True, **opts)
    assert not np.isnan(o).any()
    err = np.abs(o - o_ref)
    ratio = err / budget(q, k, v, o_ref, **opts)
    assert ratio.max() <= 1, (ratio.max(), np.unravel_index(
        ratio.argmax(), ratio.shape), err.max())
    finite = np.isfinite(lse_ref)
    assert np.array_equal(finite, np.isfinite(lse))
    # lse: float32 sums of Nk terms, and S from the tensor cores' sums of
    # 128 exact e4m3 products, which keep fewer bits than float32: on the
    # H200 |lse - lse_ref| reached 2^-12 of the largest tau |q| . |k| of
    # the row (12 runs, spreads 1 to 4); the budget is 2^-10 of it
    tau = 1 / np.sqrt(128)
    if k.shape[-3] != q.shape[-3]:
        k = np.repeat(k, q.shape[-3] // k.shape[-3], axis=-3)
    size = tau * (np.abs(q) @ np.abs(np.swapaxes(k, -1, -2))).max(-1)
    eps = float(np.finfo(np.float32).eps)
    tol = eps * (k.shape[-2] + 8 * (1 + np.abs(lse_ref))) + 2.0**-10 * size
    over = (np.abs(lse - lse_ref) / tol)[finite]
    assert over.max() <= 1, (over.max(), np.abs(lse - lse_ref)[finite].max())


def ragged(rng, high):
    """A length in 1..high that is not a multiple of 64."""
    n = int(rng.integers(1, high))
    return n + 1 if n % 64 == 0 else n


@pytest.mark.parametrize("opts", CASES)
@pytest.mark.parametrize("spread", [1.0, 3.0])
def test_fp8_against_float64(rng, opts, spread):
    nq, nk = ragged(rng, 700), ragged(rng, 700)
    codes, scales, values = quantized(rng, (2, 3), nq, nk, spread)
    o, lse = run(codes, scales, **opts)
    assert o.shape == (2, 3, nq, 128)
    check(o, lse, values, **opts)


@pytest.mark.parametrize("opts", [dict(), dict(causal=True)])
def test_fp8_grouped_heads(rng, opts):
    codes, scales, values = quantized(rng, (2, 4), 150, 281, 2.0,
                                      kv_heads=2)
    check(*run(codes, scales, **opts), values, **opts)


def test_fp8_sharp_rows_pick_their_key_exactly(rng):
    # q_i = 3 k_pi(i): that score (3 tau |k|^2, about 34) beats every
    # other (3 tau k . k', at most about 12) by 20 or more, so P is
    # one-hot after e4m3 rounding and O_i is V's row pi(i) times
    # descale_v, to bf16's rounding: a P packed against the wrong keys of
    # V^T (the order forward_v8.to_v_t stores) would pick another row
    import torch

    nk = 517
    k = rng.standard_normal((1, 2, nk, 128)).astype(np.float32)
    pick = rng.integers(0, nk, (1, 2, 300))
    q = 3 * np.take_along_axis(k, pick[..., None], 2)
    v = rng.standard_normal((1, 2, nk, 128)).astype(np.float32)
    codes, scales, values = [], [], []
    for x in (q, k, v):
        x8, scale = gpu.quantize(torch.tensor(x, device="cuda"))
        codes.append(x8)
        scales.append(scale)
        values.append(fp8.dequantize(x8.view(torch.uint8).cpu().numpy(),
                                     scale))
    o, _ = run(codes, scales)
    want = np.take_along_axis(values[2], pick[..., None], 2)
    assert np.all(np.abs(o - want) <= 2.0**-8 * np.abs(want) + 1e-6)


def test_fp8_masks_padding_and_nonfinite(rng):
    import torch

    codes, scales, values = quantized(rng, (2, 1), 130, 200, 2.0)
    mask = rng.random((2, 1, 130, 200)) < 0.6
    mask[0, 0, 7] = False  # an empty row: 0 and lse -inf
    opts = dict(mask=mask, kv_lengths=np.array([[200], [170]]))
    o, lse = run(codes, scales, **opts)
    assert np.all(o[0, 0, 7] == 0) and lse[0, 0, 7] == -np.inf
    ok = np.ones(o.shape[:-1], bool)
    ok[0, 0, 7] = False
    q, k, v = values
    o_ref = reference.attention(q, k, v, **opts)
    assert np.all(np.abs(o - o_ref)[ok]
                  <= budget(q, k, v, o_ref, **opts)[ok])
    # a NaN code in V: its column NaN in every row with a key, the padded
    # key 180 of batch element 1 included (flashlab.nonfinite)
    v8 = codes[2].view(torch.uint8).clone()
    v8[1, 0, 180, 3] = fp8.NAN_CODE
    bad = [codes[0], codes[1], v8.view(torch.float8_e4m3fn)]
    o = run(bad, scales, **opts)[0]
    assert np.isnan(o[1, 0, :, 3]).all()
    assert not np.isnan(np.delete(o[1, 0], 3, axis=-1)).any()
    q8 = codes[0].view(torch.uint8).clone()
    q8[0, 0, 5, 0] = fp8.NAN_CODE  # NaN in q: that row only
    o = run([q8.view(torch.float8_e4m3fn), *codes[1:]], scales)[0]
    assert np.isnan(o[0, 0, 5]).all() and not np.isnan(o[0, 0, 6]).any()


def test_fp8_descales_scale_exactly(rng):
    # V's descale multiplies the output (a power of two: exactly); Q's and
    # K's meet in tau, so trading a factor between them changes nothing
    codes, scales, _ = quantized(rng, (1, 2), 200, 333)
    o = run(codes, scales, causal=True)[0]
    q, k, v = scales
    o2 = run(codes, [2 * q, k / 2, 4 * v], causal=True)[0]
    assert np.array_equal(o2, 4 * o)


def test_fp8_single_rows_and_keys(rng):
    for nq, nk in ((1, 1), (1, 300), (300, 1)):
        codes, scales, values = quantized(rng, (1, 1), nq, nk)
        check(*run(codes, scales), values)


def test_fp8_descales_past_float32_are_refused(rng):
    # the kernel takes tau descale_q descale_k and descale_v as float32
    codes, scales, _ = quantized(rng, (1, 1), 70, 90)
    q, k, v = codes
    with pytest.raises(ValueError, match="^descale_q, descale_k: tau"):
        gpu.attention_fp8(q, k, v, descale_q=1e30, descale_k=1e30)
    with pytest.raises(ValueError, match="^descale_v: expected a finite"):
        gpu.attention_fp8(q, k, v, descale_v=1e39)
