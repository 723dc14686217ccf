"""test_sdpa_property's hypothesis test on CUDA tensors (needs -m gpu).

The same SDPA-legal cases (its strategy and value builder, imported), on
the GPU's dtypes and head dims: float32 at head dims the float32 kernels
take (16-128), bf16 and float16 at the tensor-core ones (64, 128). Float
masks keep their -inf entries and 0 elsewhere: the kernels allow or
refuse a pair, and float masks that add other values run on the CPU only
(chapter 8). The truth is SDPA's math backend in float64 on the same
values (16-bit inputs widened exactly), output and all three gradients.
Each example prints its parameters and seed on failure.
"""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_sdpa_property import build, sdpa_cases
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashlab import dropout
from flashlab import torch as fl_torch

pytestmark = pytest.mark.gpu

HEAD_DIMS = {"float32": (16, 64, 96, 128), "bfloat16": (64, 128),
             "float16": (64, 128)}
# 16-bit unit roundoff: P and dS enter their products rounded to 16 bits
# (u/2 each) and O is stored in 16 bits (u/2 of |O|); sums of at most 9
# such terms of values of order one, and dQ, dK's cancelling sums, stay
# within 8 u of the largest value. The backward's D = rowsum(dO o O) of
# the stored O is off by up to u/2 sum |dO| |O| (`d_slack`)
UNIT = {"bfloat16": 2.0**-8, "float16": 2.0**-11}


@st.composite
def gpu_cases(draw):
    """An SDPA case on the GPU: its dtype and head dims drawn anew."""
    case = draw(sdpa_cases())
    dtype = draw(st.sampled_from(sorted(HEAD_DIMS)))
    dims = HEAD_DIMS[dtype]
    return dict(case, dtype=np.float32, gpu_dtype=dtype,
                E=draw(st.sampled_from(dims)), Ev=draw(st.sampled_from(dims)))


def tolerance(case, q, k, v, do, scale):
    """Allowed error, relative to max(1, max |truth|), of one result.

    float32: the CPU test's 2e-5, plus what 3xTF32 (v6, the float32
    forward on the tensor cores) adds: each score off by up to 2**-20 of
    tau sum |q||k| (tests/test_gpu.tf32_score_error), which moves P by
    that fraction, and every result is a sum of P or dS times values of
    at most max |v|, |dO|, |q|, |k|."""
    if case["gpu_dtype"] != "float32":
        return 8 * UNIT[case["gpu_dtype"]]
    tau = scale if scale is not None else 1 / np.sqrt(q.shape[-1])
    s_abs = tau * np.abs(q).max() * np.abs(k).max() * q.shape[-1]
    big = max(1.0, *(float(np.abs(x).max(initial=0)) for x in (q, k, v, do)))
    return 2e-5 + 8 * 2.0**-20 * s_abs * big**3 * max(1.0, tau)


def d_slack(case, q, k, o, do, scale, p):
    """Absolute error that D's 16-bit O adds to dq and dk (0 for o, dv):
    D_i moves dS_ij by P_ij Z_ij times its error, P Z summing to at most
    1 / (1 - p) over keys, and dS meets tau |K| in dQ, tau |Q| (L rows)
    in dK."""
    if case["gpu_dtype"] == "float32":
        return dict(o=0.0, dq=0.0, dk=0.0, dv=0.0)
    tau = scale if scale is not None else 1 / np.sqrt(q.shape[-1])
    err_d = UNIT[case["gpu_dtype"]] / 2 * float(
        (np.abs(do) * np.abs(o)).sum(-1).max(initial=0)) / (1 - p)
    return dict(o=0.0, dv=0.0,
                dq=tau * err_d * float(np.abs(k).max(initial=0)),
                dk=tau * err_d * case["L"] * float(np.abs(q).max(initial=0)))


@settings(max_examples=60, deadline=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(case=gpu_cases())
def test_attention_on_cuda_matches_sdpa_math(case):
    (q, k, v, do), mask, kw, lead = build(case)
    if mask is not None and mask.dtype != np.bool_:
        mask = np.where(np.isneginf(mask), -np.inf, 0.0).astype(np.float32)
    p, seed = case["dropout_p"], case["seed"]
    kind = getattr(torch, case["gpu_dtype"])
    xs = [torch.tensor(x, device="cuda").to(kind).requires_grad_()
          for x in (q, k, v)]
    m = None if mask is None else torch.tensor(mask, device="cuda")
    o = fl_torch.attention(*xs, attn_mask=m, dropout_p=p, seed=seed, **kw)
    dot = torch.tensor(do, device="cuda").to(kind)
    got = [o, *torch.autograd.grad(o, xs, dot)]

    # the truth: the math backend in float64 on the same (rounded)
    # values, given flashlab's keep mask, on the CPU
    ts = [x.detach().cpu().double().requires_grad_() for x in xs]
    m64 = None if mask is None else torch.tensor(mask)
    m64 = m64 if m64 is None or m64.dtype == torch.bool else m64.double()
    with sdpa_kernel(SDPBackend.MATH):
        if p:
            keep = torch.tensor(dropout.keep_mask(
                p, seed, (*lead, case["L"], case["S"])))
            if m64 is not None and m64.dtype == torch.bool:
                m64 = torch.zeros(m64.shape, dtype=torch.float64
                                  ).masked_fill(~m64, -torch.inf)
            want, _ = torch.ops.aten._scaled_dot_product_attention_math(
                *ts, m64, p, kw["is_causal"], keep, scale=kw["scale"],
                enable_gqa=kw["enable_gqa"])
        else:
            want = torch.nn.functional.scaled_dot_product_attention(
                *ts, attn_mask=m64, **kw)
    do64 = dot.cpu().double()
    want = [want, *torch.autograd.grad(want, ts, do64)]
    q64, k64, v64 = (t.detach().numpy() for t in ts)
    tol = tolerance(case, q64, k64, v64, do64.numpy(), kw["scale"])
    slack = d_slack(case, q64, k64, want[0].detach().numpy(), do64.numpy(),
                    kw["scale"], p)
    for name, g, w in zip(("o", "dq", "dk", "dv"), got, want):
        g, w = g.detach().double().cpu().numpy(), w.detach().numpy()
        assert g.shape == w.shape, (name, g.shape, w.shape)
        assert np.isfinite(w).all()  # legal arguments: SDPA is finite
        scale = max(1.0, float(np.abs(w).max()))
        err = float(np.abs(g - w).max()) if g.size else 0.0
        assert err <= tol * scale + slack[name], (name, err, tol, slack)
