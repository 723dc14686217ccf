"""flashlab.torch on CPU tensors: the numba kernels of flashlab.cpu.

The drop-in routes CPU calls to flashlab.cpu, forward and backward, for
every rule those kernels take, and to flashlab.tiled (the numpy program)
for the rest. Each routed call is checked against the same call forced
onto tiled: float64 within 1e-12 of it, float32 at most twice tiled's
own float32 error against float64 (or FLOOR_ULPS ulps, if more).
"""

import numpy as np
import pytest
import torch

from flashlab import cpu, tiled
from flashlab import torch as fl_torch
from helpers import EPS32, cancelling_sizes

B, H, NQ, NK, D, DV = 2, 4, 45, 67, 16, 8

# The float32 floor, in ulps (EPS32) of the largest |truth|: "at most
# twice the other program's error" is asked only above it. A gradient
# entry sums up to 2 NQ = 90 float32 products (dK, dV under GQA), whose
# roundings add like a random walk, sqrt(90) ~ 10 half-ulps a standard
# deviation; measured over 300 seeds, both programs reach 10 ulps, the
# other's error is as low as 2 on some draws, and a floor of 8 failed a
# run about once in 150 (rng seed 3093, "add" float32 rank 4 GQA: dK).
FLOOR_ULPS = 16

CASES = {
    "plain": dict(),
    "bool mask": dict(mask="bool"),
    "-inf float mask": dict(mask="-inf"),
    "additive float mask": dict(mask="add"),
    "finfo.min fill": dict(mask="finfo.min"),
    "-1e9 fill, causal": dict(mask="-1e9", causal=True, block_q=16,
                              block_k=8),
    "causal top-left": dict(causal=True, block_q=16, block_k=8),
    "causal bottom-right": dict(causal="bottom_right", block_q=7,
                                block_k=5),
    "is_causal": dict(is_causal=True),
    "window": dict(window=(6, 2), block_q=8, block_k=8),
    "padding": dict(kv_lengths="random"),
    "padding bottom-right": dict(kv_lengths="random", causal=True,
                                 align="bottom_right"),
    "dropout": dict(dropout_p=0.3, seed=11, block_q=16, block_k=16),
    "gqa": dict(enable_gqa=True),
    "gqa, mask and dropout": dict(enable_gqa=True, mask="bool",
                                  dropout_p=0.2, seed=5),
    "gqa, additive mask and dropout": dict(enable_gqa=True, mask="add",
                                           dropout_p=0.2, seed=5),
}


def _float_mask(rng, keep, kind, dtype):
    """A float mask from `keep`: 0 / -inf, N(0, 2) / -inf (an additive
    mask), or N(0, 1) / a large finite fill (finfo.min, -1e9)."""
    if kind == "-inf":
        mask = np.where(keep, 0.0, -np.inf)
    elif kind == "add":
        mask = np.where(keep, 2 * rng.standard_normal(keep.shape), -np.inf)
    else:
        fill = (torch.finfo(dtype).min if kind == "finfo.min"
                else float(kind))
        mask = np.where(keep, rng.standard_normal(keep.shape), fill)
    return torch.from_numpy(mask).to(dtype)


def _inputs(rng, case, dtype):
    """q, k, v leaves, dO and the keywords of one case."""
    kw = dict(case)
    h_kv = H // 2 if kw.get("enable_gqa") else H
    shapes = ((B, H, NQ, D), (B, h_kv, NK, D), (B, h_kv, NK, DV))
    q, k, v = (torch.tensor(rng.standard_normal(s), dtype=dtype,
                            requires_grad=True) for s in shapes)
    do = torch.tensor(rng.standard_normal((B, H, NQ, DV)), dtype=dtype)
    if kw.get("mask") is not None:
        keep = rng.random((B, 1, NQ, NK)) < 0.7
        keep[0, 0, 3] = False  # a fully masked row: 0, and no gradient
        # (with a finite fill: the uniform average, its lse the fill)
        kw["mask"] = torch.from_numpy(keep) if kw["mask"] == "bool" else \
            _float_mask(rng, keep, kw["mask"], dtype)
    if kw.get("kv_lengths") is not None:
        kw["kv_lengths"] = torch.from_numpy(
            rng.integers(0, NK + 1, size=(B, 1)))
    return q, k, v, do, kw


def _run(q, k, v, do, kw):
    """Output and the three gradients of flashlab.torch.attention."""
    out = fl_torch.attention(q, k, v, **kw)
    return [out.detach(), *torch.autograd.grad(out, (q, k, v), do)]


def _on_tiled(monkeypatch, fn, *args):
    """fn(*args) with every CPU call forced onto flashlab.tiled."""
    with monkeypatch.context() as m:
        m.setattr(fl_torch, "_cpu_backend", lambda *a, **k: tiled)
        return fn(*args)


def _err(a, b):
    return float((a.double() - b.double()).abs().max())


@pytest.mark.parametrize("case", CASES.values(), ids=CASES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_routed_path_gives_what_tiled_gives(rng, monkeypatch, case, dtype):
    q, k, v, do, kw = _inputs(rng, case, dtype)
    routed = _run(q, k, v, do, kw)
    on_tiled = _on_tiled(monkeypatch, _run, q, k, v, do, kw)
    wide = [x.detach().double().requires_grad_() for x in (q, k, v)]
    kw64 = dict(kw)
    if isinstance(kw64.get("mask"), torch.Tensor) and \
            kw64["mask"].is_floating_point():
        kw64["mask"] = kw64["mask"].double()
    truth = _on_tiled(monkeypatch, _run, *wide, do.double(), kw64)
    for name, mine, theirs, ref in zip(("o", "dq", "dk", "dv"), routed,
                                       on_tiled, truth):
        assert mine.dtype == dtype and mine.shape == ref.shape, name
        scale = max(1.0, float(ref.abs().max()))
        if dtype == torch.float64:  # both exact: orders of rounding only
            assert _err(mine, theirs) / scale < 1e-12, name
        else:  # float32: as good as the numpy program, with a floor
            floor = FLOOR_ULPS * EPS32 * scale
            assert _err(mine, ref) <= max(2 * _err(theirs, ref), floor), \
                name


def test_broadcast_leading_dims(rng, monkeypatch):
    # q and k with fewer leading dims than v (SDPA aligns from the right)
    xs = [torch.tensor(rng.standard_normal(s), requires_grad=True)
          for s in ((NQ, D), (3, NK, D), (2, 3, NK, DV))]
    do = torch.tensor(rng.standard_normal((2, 3, NQ, DV)))
    routed = _run(*xs, do, {})
    on_tiled = _on_tiled(monkeypatch, _run, *xs, do, {})
    for mine, theirs in zip(routed, on_tiled):
        assert mine.shape == theirs.shape
        assert _err(mine, theirs) < 1e-12  # float64, values near 1


def _watch(monkeypatch, module, calls):
    """Count calls of module's attention and attention_backward, with
    whether q reached them without a copy."""
    for name in ("attention", "attention_backward"):
        real = getattr(module, name)

        def counted(q, *args, _real=real, _name=name, **kw):
            calls.append((module.__name__, _name))
            return _real(q, *args, **kw)
        monkeypatch.setattr(module, name, counted)


def test_cpu_route_is_taken_without_copies(rng, monkeypatch):
    q, k, v, do, kw = _inputs(rng, CASES["gqa, mask and dropout"],
                              torch.float32)
    calls, seen = [], []
    _watch(monkeypatch, tiled, calls)
    real = cpu.attention

    def forward(q_np, k_np, v_np, **opts):
        seen.append(all(np.shares_memory(a, t.detach().numpy())
                        for a, t in ((q_np, q), (k_np, k), (v_np, v))))
        return real(q_np, k_np, v_np, **opts)
    monkeypatch.setattr(cpu, "attention", forward)
    _watch(monkeypatch, cpu, calls)
    _run(q, k, v, do, kw)
    assert calls == [("flashlab.cpu", "attention"),
                     ("flashlab.cpu", "attention_backward")]
    assert seen == [True]  # numpy views of the tensors, not copies


@pytest.mark.parametrize("kind", ["add", "finfo.min", "-1e9"])
def test_float_masks_that_add_run_on_the_kernels(rng, monkeypatch, kind):
    q, k, v, do, kw = _inputs(rng, dict(mask=kind), torch.float32)
    calls = []
    _watch(monkeypatch, tiled, calls)
    _watch(monkeypatch, cpu, calls)
    _run(q, k, v, do, kw)
    assert calls == [("flashlab.cpu", "attention"),
                     ("flashlab.cpu", "attention_backward")]


@pytest.mark.parametrize("extra, forward, backward", [
    (dict(order="fa1"), "flashlab.tiled", "flashlab.cpu"),
    (dict(num_splits=2), "flashlab.tiled", "flashlab.cpu"),
])
def test_what_the_kernels_cannot_run_falls_back_to_tiled(
        rng, monkeypatch, extra, forward, backward):
    # fa1 and split-KV: the kernels run FA2 in one pass, while one
    # backward loop follows every forward order
    q, k, v, do, _ = _inputs(rng, {}, torch.float64)
    calls = []
    _watch(monkeypatch, tiled, calls)
    _watch(monkeypatch, cpu, calls)
    _run(q, k, v, do, extra)
    assert calls == [(forward, "attention"), (backward, "attention_backward")]


def test_unsupported_names_the_reason():
    shape = (2, 3, 5, 4)
    assert cpu.unsupported(shape, shape, shape) is None
    assert cpu.unsupported(shape, shape, shape, mask=np.zeros(
        (5, 5), bool)) is None
    for fill in (-np.inf, -1e9, np.nan):  # every float mask runs here
        assert cpu.unsupported(shape, shape, shape, mask=np.full(
            (5, 5), fill)) is None
    for kw, word in ((dict(order="fa1"), "order"),
                     (dict(num_splits=3), "num_splits")):
        assert cpu.unsupported(shape, shape, shape, **kw).startswith(word)
    assert cpu.unsupported(shape, (3, 5, 4), (3, 5, 4)).startswith("k, v")


def test_is_causal_and_unhashable_options_are_refused_by_name():
    q, k, v = torch.randn(2, 10, 4), torch.randn(2, 12, 4), torch.randn(2,
                                                                     12, 4)
    # SDPA takes a bool; "bottom_right" here is not flashlab's causal=
    for bad in ("no", 1, "bottom_right", [0]):
        with pytest.raises(TypeError, match="is_causal: expected True"):
            fl_torch.attention(q, k, v, is_causal=bad)
    # a window that is no pair: the ValueError every backend gives
    # (masks.check_window)
    for window in (np.array([1, 2]), {1, 2}):
        with pytest.raises(ValueError, match="window: expected"):
            fl_torch.attention(q, k, v, window=window)
    assert torch.equal(fl_torch.attention(q, k, v, is_causal=True),
                       fl_torch.attention(q, k, v, causal=True))


def _sdpa_math(*args, **kw):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        return torch.nn.functional.scaled_dot_product_attention(*args, **kw)


def _with_grads(fn, xs, do, *args, **kw):
    """fn's output and the gradients of q, k, v (leaves made of xs)."""
    leaves = [x.detach().clone().requires_grad_() for x in xs]
    out = fn(*leaves, *args, **kw)
    return [out.detach(), *torch.autograd.grad(out, leaves, do)]


MASK_RANKS = {2: (NQ, NK), 3: (H, NQ, NK), 4: (B, 1, NQ, NK)}


@pytest.mark.parametrize("gqa", [False, True])
@pytest.mark.parametrize("rank", MASK_RANKS)
@pytest.mark.parametrize("kind, dtype", [
    ("add", torch.float64), ("finfo.min", torch.float64),
    ("-1e9", torch.float64), ("add", torch.float32),
    ("finfo.min", torch.float32)])
def test_additive_masks_match_sdpa_math(rng, kind, dtype, rank, gqa):
    # the drop-in on the kernels against torch's math backend called the
    # same way; rows fully masked by a finite fill attend every key as
    # SDPA's do (rows of -inf only are left out: SDPA gives NaN there,
    # flashlab 0). float64: 1e-10, a few merges of rounding; float32:
    # against SDPA's float64, within twice SDPA's own float32 error (or
    # FLOOR_ULPS ulps). -1e9 in float32 rounds every fully masked score
    # to the fill in flashlab and in SDPA alike, not in float64: left out.
    kw = dict(enable_gqa=True) if gqa else {}
    h_kv = H // 2 if gqa else H
    shapes = ((B, H, NQ, D), (B, h_kv, NK, D), (B, h_kv, NK, DV))
    xs = [torch.tensor(rng.standard_normal(s), dtype=dtype) for s in shapes]
    do = torch.tensor(rng.standard_normal((B, H, NQ, DV)), dtype=dtype)
    keep = rng.random(MASK_RANKS[rank]) < 0.7
    keep[..., 0] = True
    if kind != "add":
        keep[..., 2, :] = False  # fully masked by the fill
    mask = _float_mask(rng, keep, kind, dtype)
    mine = _with_grads(fl_torch.attention, xs, do, mask, **kw)
    truth = _with_grads(_sdpa_math, [x.double() for x in xs], do.double(),
                        mask.double(), **kw)
    theirs = _with_grads(_sdpa_math, xs, do, mask, **kw)
    sizes = cancelling_sizes(*xs, do, mask)
    for name, a, t, w in zip(("o", "dq", "dk", "dv"), mine, theirs, truth):
        assert a.dtype == dtype and a.shape == w.shape, name
        assert torch.isfinite(a).all(), name
        if dtype == torch.float64:
            assert _err(a, w) < 1e-10, name
        else:
            # FLOOR_ULPS ulps of max |truth|, or twice the rounding bound
            # of dQ and dK where one-hot rows make it the larger. The
            # floor alone: over 3000 seeds dQ reached 12.6 ulps (rng seed
            # 345, "add" rank 4 GQA), past 16 an estimated 1 run in
            # 20000 to 100000; the error reached 0.94 eps of the bound
            # wherever that exceeded 8 ulps of max |truth|
            floor = FLOOR_ULPS * EPS32 * max(1.0, float(w.abs().max()))
            floor = max(floor, 2 * EPS32 * sizes.get(name, 0.0))
            assert _err(a, w) <= max(2 * _err(t, w), floor), name
