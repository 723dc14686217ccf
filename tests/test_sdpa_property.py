"""flashlab.torch.attention against SDPA's math backend, on random legal
arguments (hypothesis): leading dims broadcast every way, masks bool and
float of every rank (with -inf, finfo.min and large negative fills, and
rows masked whole by a finite fill), is_causal, scale, enable_gqa,
dropout with its keep mask handed to the math backend, float32 and
float64. Output and all three gradients; the truth is the math backend
in float64 on the same (float32 or float64) values.

Each example draws the parameters and one integer seed for the values,
so a failure prints what replays it.
"""

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashlab import dropout
from flashlab import torch as fl_torch

# float64: a few roundings of values near 1, as the tiled tests; float32
# against the float64 truth: a few float32 ulps of the largest value,
# summed over at most 9 keys and 8 head dims
TOL = {np.float64: 1e-12, np.float32: 2e-5}
FILLS = ("-inf", "finfo.min", -1e30, -1e9)


@st.composite
def shapes_under(draw, lead):
    """A shape that broadcasts to `lead`: fewer dims, or 1s, or both."""
    n = draw(st.integers(0, len(lead)))
    return tuple(s if draw(st.booleans()) else 1
                 for s in lead[len(lead) - n:])


@st.composite
def sdpa_cases(draw):
    """Parameters of one SDPA-legal call (values come from `seed`)."""
    lead = tuple(draw(st.lists(st.integers(1, 3), max_size=3)))
    gqa = draw(st.booleans()) and len(lead) >= 1
    case = dict(
        dtype=draw(st.sampled_from([np.float32, np.float64])),
        L=draw(st.integers(1, 9)), S=draw(st.integers(1, 9)),
        E=draw(st.integers(1, 8)), Ev=draw(st.integers(1, 8)),
        seed=draw(st.integers(0, 2**32 - 1)), enable_gqa=gqa)
    if gqa:  # heads (dim -3) of k and v divide q's
        h_kv, g = draw(st.integers(1, 3)), draw(st.integers(1, 3))
        rest = lead[:-1]
        q_lead = (*draw(shapes_under(rest)), h_kv * g)
        kv_lead = (*draw(shapes_under(rest)), h_kv)
        case.update(q=q_lead, k=kv_lead, v=kv_lead)
    else:
        case.update(q=draw(shapes_under(lead)), k=draw(shapes_under(lead)),
                    v=draw(shapes_under(lead)))
    kind = draw(st.sampled_from(["none", "causal", "bool", "float"]))
    case["mask"] = kind
    if kind in ("bool", "float"):
        # SDPA adds the mask in place to scores of q and k's leading
        # dims: it may broadcast up to them, never beyond
        case["mask_shape"] = draw(shapes_under((*out_lead(case, "qk"),
                                                case["L"], case["S"])))
        case["keep"] = draw(st.floats(0.2, 1.0))
        case["fill"] = draw(st.sampled_from(FILLS))
    case["scale"] = draw(st.one_of(st.none(), st.floats(0.05, 2.0)))
    case["dropout_p"] = draw(st.sampled_from([0.0, 0.0, 0.3, 0.7]))
    return case


def out_lead(case, names="qkv"):
    """The output's leading dims: q, k and v's broadcast (or those of
    `names`), with q's heads under enable_gqa."""
    if case["enable_gqa"]:
        return (*np.broadcast_shapes(*(case[n][:-1] for n in names)),
                case["q"][-1])
    return np.broadcast_shapes(*(case[n] for n in names))


def build(case):
    """numpy q, k, v, do, the mask (or None) and the keyword arguments."""
    rng = np.random.default_rng(case["seed"])
    dtype = case["dtype"]
    q = rng.standard_normal((*case["q"], case["L"], case["E"]))
    k = rng.standard_normal((*case["k"], case["S"], case["E"]))
    v = rng.standard_normal((*case["v"], case["S"], case["Ev"]))
    mask = None
    if case["mask"] in ("bool", "float"):
        keep = rng.random(case["mask_shape"]) < case["keep"]
        fill = case["fill"]
        # -inf or False on a whole row is SDPA's NaN and flashlab's 0:
        # those rows keep key 0; a finite fill may mask a row whole
        # (float32 rounds s - 1e9 to multiples of 64: there too)
        if fill == "-inf" or case["mask"] == "bool" or (
                fill == -1e9 and dtype == np.float32):
            if keep.ndim:
                keep[..., 0] = True
            else:
                keep = np.ones((), bool)
        if case["mask"] == "bool":
            mask = keep
        else:
            fill = {"-inf": -np.inf,
                    "finfo.min": np.finfo(dtype).min}.get(fill, fill)
            bias = rng.standard_normal(keep.shape)
            mask = np.where(keep, bias, fill).astype(dtype)
    lead = out_lead(case)
    do = rng.standard_normal((*lead, case["L"], case["Ev"]))
    kw = dict(scale=case["scale"], enable_gqa=case["enable_gqa"],
              is_causal=case["mask"] == "causal")
    return [x.astype(dtype) for x in (q, k, v, do)], mask, kw, lead


@settings(max_examples=150, deadline=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(case=sdpa_cases())
def test_attention_matches_sdpa_math(case):
    (q, k, v, do), mask, kw, lead = build(case)
    p, seed = case["dropout_p"], case["seed"]
    xs = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
    m = None if mask is None else torch.tensor(mask)
    o = fl_torch.attention(*xs, attn_mask=m, dropout_p=p, seed=seed, **kw)
    got = [o, *torch.autograd.grad(o, xs, torch.tensor(do))]

    # the truth: the math backend in float64, given flashlab's keep mask
    ts = [torch.tensor(x, dtype=torch.float64, requires_grad=True)
          for x in (q, k, v)]
    m64 = None if m is None else (m if m.dtype == torch.bool
                                  else m.double())
    with sdpa_kernel(SDPBackend.MATH):
        if p:
            keep = torch.tensor(dropout.keep_mask(
                p, seed, (*lead, case["L"], case["S"])))
            if m64 is not None and m64.dtype == torch.bool:
                # the public SDPA turns bool masks into 0 / -inf first;
                # its math op alone takes the additive form
                m64 = torch.zeros(m64.shape, dtype=torch.float64
                                  ).masked_fill(~m64, -torch.inf)
            want, _ = torch.ops.aten._scaled_dot_product_attention_math(
                *ts, m64, p, kw["is_causal"], keep, scale=kw["scale"],
                enable_gqa=kw["enable_gqa"])
        else:
            want = torch.nn.functional.scaled_dot_product_attention(
                *ts, attn_mask=m64, **kw)
    want = [want, *torch.autograd.grad(want, ts, torch.tensor(
        do, dtype=torch.float64))]
    for name, g, w in zip(("o", "dq", "dk", "dv"), got, want):
        g, w = g.detach().double().numpy(), w.detach().numpy()
        assert g.shape == w.shape, (name, g.shape, w.shape)
        assert np.isfinite(w).all()  # legal arguments: SDPA is finite
        scale = max(1.0, float(np.abs(w).max()))
        err = float(np.abs(g - w).max()) / scale if g.size else 0.0
        assert err < TOL[case["dtype"]], (name, err)
