"""flashlab.torch.attention as a drop-in for torch's SDPA, and its windows.

The grid runs both on the same float64 inputs, called the same way
(positional attn_mask, is_causal, scale, enable_gqa), against torch's
math backend: output and all three gradients within 1e-10. Windows are
checked against an explicit mask built from flash-attn's documented rule
for window_size=(left, right): with the window aligned bottom-right,
query i may attend key j when i + Nk - Nq - left <= j <= i + Nk - Nq +
right (a side of -1 unbounded), causal adding j <= i + Nk - Nq.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashlab import cpu, reference, tiled
from flashlab import torch as fl_torch

TOL = 1e-10  # float64 throughout: a few merges of rounding, far below


def sdpa_math(*args, **kw):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(*args, **kw)


def both(rng, q_shape, k_shape, args, kw):
    """Output and gradients of SDPA and of flashlab, same call."""
    q, k = (torch.tensor(rng.standard_normal(s), requires_grad=True)
            for s in (q_shape, k_shape))
    v = torch.tensor(rng.standard_normal((*k_shape[:-1], 5)),
                     requires_grad=True)
    results = []
    for fn in (sdpa_math, fl_torch.attention):
        out = fn(q, k, v, *args, **kw)
        do = torch.tensor(np.random.default_rng(1).standard_normal(
            out.shape))
        results.append([out, *torch.autograd.grad(out, (q, k, v), do)])
    return results


def mask_for(rng, shape, kind):
    """A bool or float mask of `shape` whose every row keeps a key."""
    keep = rng.random(shape) < 0.6
    keep[..., 0] = True  # SDPA gives NaN for empty rows; flashlab 0
    if kind == "bool":
        return torch.from_numpy(keep)
    bias = rng.standard_normal(shape) * 2
    return torch.from_numpy(np.where(keep, bias, -np.inf))


# (q shape, k shape): L != S both ways, broadcast leading dims
SHAPES = [((2, 4, 7, 8), (2, 4, 11, 8)),
          ((2, 4, 13, 8), (2, 4, 6, 8)),
          ((3, 1, 9, 8), (1, 5, 9, 8)),  # q and k broadcast each other
          ((4, 10, 8), (4, 10, 8))]
MASK_SHAPES = {2: lambda b, L, S: (L, S),
               3: lambda b, L, S: (b[-1] if b else 1, L, S),
               4: lambda b, L, S: (1, 1, L, S)}


# every valid combination: no mask, or a bool or float mask of rank 2 to
# that of q (SDPA refuses more, and refuses a mask with is_causal)
GRID = [(shapes, mask, rank, is_causal, scale)
        for shapes in SHAPES for scale in (None, 0.3)
        for mask, rank, is_causal in (
            [(None, None, False), (None, None, True)]
            + [(m, r, False) for m in ("bool", "float")
               for r in (2, 3, 4) if r <= len(shapes[0])])]


@pytest.mark.parametrize("shapes, mask, rank, is_causal, scale", GRID)
def test_matches_sdpa_math(rng, shapes, mask, rank, is_causal, scale):
    (q_shape, k_shape) = shapes
    batch = torch.broadcast_shapes(q_shape[:-2], k_shape[:-2])
    args = ()
    if mask is not None:
        m_shape = MASK_SHAPES[rank](batch, q_shape[-2], k_shape[-2])
        args = (mask_for(rng, m_shape, mask),)
    want, got = both(rng, q_shape, k_shape, args,
                     dict(is_causal=is_causal, scale=scale))
    for name, a, b in zip(("o", "dq", "dk", "dv"), want, got):
        assert a.shape == b.shape, name
        assert float((a - b).detach().abs().max()) < TOL, name


@pytest.mark.parametrize("groups", [1, 2, 4, 8])
@pytest.mark.parametrize("is_causal, mask", [(False, None), (True, None),
                                             (False, "float")])
def test_grouped_query_heads_match_sdpa(rng, groups, is_causal, mask):
    # 8 query heads over 8 / groups K/V heads; groups=8 is multi-query
    args = () if mask is None else (mask_for(rng, (8, 9, 12), mask),)
    want, got = both(rng, (2, 8, 9, 16), (2, 8 // groups, 12, 16), args,
                     dict(is_causal=is_causal, enable_gqa=True))
    for name, a, b in zip(("o", "dq", "dk", "dv"), want, got):
        assert a.shape == b.shape, name
        assert float((a - b).detach().abs().max()) < TOL, name


def test_grouped_heads_are_not_copied(rng):
    # the backward saves k and v at their own size, not repeated
    q = torch.tensor(rng.standard_normal((1, 8, 16, 4)), requires_grad=True)
    k, v = (torch.tensor(rng.standard_normal((1, 2, 16, 4)),
                         requires_grad=True) for _ in range(2))
    shapes = fl_torch.saved_shapes(lambda a, b, c: fl_torch.attention(
        a, b, c, enable_gqa=True), q, k, v)
    assert (1, 2, 16, 4) in shapes and (1, 8, 16, 4) in shapes
    assert all(s[-3] in (2, 8) for s in shapes if len(s) == 4)


def flash_attn_mask(nq, nk, left, right, causal):
    """flash-attn's rule for window_size=(left, right), bottom-right."""
    i = np.arange(nq)[:, None] + nk - nq
    j = np.arange(nk)[None, :]
    keep = np.ones((nq, nk), bool)
    if left >= 0:
        keep &= j >= i - left
    if right >= 0:
        keep &= j <= i + right
    if causal:
        keep &= j <= i
    return keep


@pytest.mark.parametrize("nq, nk", [(7, 19), (19, 7), (12, 12), (1, 30)])
@pytest.mark.parametrize("left, right", [(3, 0), (2, 5), (-1, 2), (4, -1)])
@pytest.mark.parametrize("causal", [False, True])
def test_windows_align_as_flash_attn(rng, nq, nk, left, right, causal):
    q, k, v = (rng.standard_normal((2, n, 8)) for n in (nq, nk, nk))
    keep = flash_attn_mask(nq, nk, left, right, causal)
    want = reference.attention(q, k, v, mask=keep)
    window = tuple(None if w < 0 else w for w in (left, right))
    kw = dict(window=window, causal=causal, align="bottom_right")
    o, lse = tiled.attention(q, k, v, block_q=4, block_k=5,
                             return_lse=True, **kw)
    assert np.max(np.abs(o - want)) < 1e-12
    # rows with no key in the window: 0 and lse -inf, on every backend
    assert np.array_equal(np.isneginf(lse), ~keep.any(-1)[None].repeat(2, 0))
    got = cpu.attention(q.astype(np.float32), k.astype(np.float32),
                        v.astype(np.float32), **kw)
    assert np.max(np.abs(got - want)) < 1e-5


def test_top_left_is_the_default_and_one_rule(rng):
    # one offset for causal and window alike; the string forms of causal
    # are causal=True with that align, and contradicting them is refused
    q, k, v = (rng.standard_normal((5, 8)), rng.standard_normal((9, 8)),
               rng.standard_normal((9, 8)))
    for align, offset in (("top_left", 0), ("bottom_right", 4)):
        i = np.arange(5)[:, None] + offset
        j = np.arange(9)[None, :]
        keep = (j >= i - 1) & (j <= i + 2)
        want = reference.attention(q, k, v, mask=keep)
        got = tiled.attention(q, k, v, window=(1, 2), align=align)
        assert np.max(np.abs(got - want)) < 1e-12
        assert np.array_equal(
            tiled.attention(q, k, v, causal=align),
            tiled.attention(q, k, v, causal=True, align=align))
    assert np.array_equal(tiled.attention(q, k, v, window=(1, 2)),
                          tiled.attention(q, k, v, window=(1, 2),
                                          align="top_left"))
    with pytest.raises(ValueError, match="align: 'top_left' contradicts"):
        tiled.attention(q, k, v, causal="bottom_right", align="top_left")
    with pytest.raises(ValueError, match="align: expected one of"):
        tiled.attention(q, k, v, align="center")


def test_float_masks_on_the_cpu_kernels(rng):
    q = rng.standard_normal((2, 6, 8)).astype(np.float32)
    bias = np.where(rng.random((6, 6)) < 0.5, -np.inf, 0.0)
    bias[:, 0] = 0.0
    want = reference.attention(q, q, q, mask=bias > -np.inf)
    assert np.max(np.abs(cpu.attention(q, q, q, mask=bias) - want)) < 1e-5
    bias[1, 0] = 0.5  # a value that adds: the kernels add it too
    want = reference.attention(q, q, q, mask=bias)
    assert np.max(np.abs(cpu.attention(q, q, q, mask=bias) - want)) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("shapes, mask, rank, is_causal, scale", [
    c for c in GRID if c[1] != "float"])
def test_cuda_matches_sdpa_within_float32(rng, shapes, mask, rank,
                                          is_causal, scale):
    # CUDA float32 (flashlab.gpu takes head dims of 16 and up): each
    # against SDPA's float64 math on the same inputs, within twice the
    # error of SDPA's own float32 math on the GPU, floored at 8 ulps
    q_shape, k_shape = ((*s[:-1], 16) for s in shapes)
    batch = torch.broadcast_shapes(q_shape[:-2], k_shape[:-2])
    args = ()
    if mask is not None:
        args = (mask_for(rng, MASK_SHAPES[rank](batch, q_shape[-2],
                                                k_shape[-2]), mask),)
    q, k = (torch.tensor(rng.standard_normal(s)) for s in (q_shape, k_shape))
    v = torch.tensor(rng.standard_normal((*k_shape[:-1], 16)))
    kw = dict(is_causal=is_causal, scale=scale)
    results = []
    for fn, dtype, device in ((sdpa_math, torch.float64, "cpu"),
                              (sdpa_math, torch.float32, "cuda"),
                              (fl_torch.attention, torch.float32, "cuda")):
        x = [t.to(device, dtype).requires_grad_() for t in (q, k, v)]
        out = fn(*x, *(a.to(device) for a in args), **kw)
        do = torch.ones_like(out)
        results.append([t.detach().double().cpu() for t in (
            out, *torch.autograd.grad(out, x, do))])
    for name, exact, theirs, ours in zip(("o", "dq", "dk", "dv"),
                                         *results):
        floor = 8 * 2.0**-23 * max(1.0, float(exact.abs().max()))
        budget = max(2 * float((theirs - exact).abs().max()), floor)
        assert float((ours - exact).abs().max()) <= budget, name
