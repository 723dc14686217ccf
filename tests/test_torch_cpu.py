"""flashlab.torch on CPU tensors: the numba kernels of flashlab.cpu.

The drop-in routes CPU calls to flashlab.cpu, forward and backward, for
every rule those kernels take, and to flashlab.tiled (the numpy program)
for the rest. Each routed call is checked against the same call forced
onto tiled: float64 within 1e-12 of it, float32 at most twice tiled's
own float32 error against float64 (floor 8 ulps).
"""

import numpy as np
import pytest
import torch

from flashlab import cpu, tiled
from flashlab import torch as fl_torch
from helpers import EPS32

B, H, NQ, NK, D, DV = 2, 4, 45, 67, 16, 8

CASES = {
    "plain": dict(),
    "bool mask": dict(mask="bool"),
    "-inf float mask": dict(mask="-inf"),
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
}


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
        kw["mask"] = torch.from_numpy(keep) if kw["mask"] == "bool" else \
            torch.from_numpy(np.where(keep, 0.0, -np.inf)).to(dtype)
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
        else:  # float32: as good as the numpy program, floor 8 ulps
            floor = 8 * EPS32 * scale
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


@pytest.mark.parametrize("extra, forward, backward", [
    (dict(mask="finfo.min"), "flashlab.tiled", "flashlab.tiled"),
    (dict(order="fa1"), "flashlab.tiled", "flashlab.cpu"),
    (dict(num_splits=2), "flashlab.tiled", "flashlab.cpu"),
])
def test_what_the_kernels_cannot_run_falls_back_to_tiled(
        rng, monkeypatch, extra, forward, backward):
    # float masks that add to scores: the kernels only allow or refuse a
    # pair; fa1 and split-KV: the kernels run FA2 in one pass, while one
    # backward loop follows every forward order
    q, k, v, do, _ = _inputs(rng, {}, torch.float64)
    if extra.get("mask") == "finfo.min":
        keep = rng.random((B, 1, NQ, NK)) < 0.7
        keep[1, 0, 2] = False
        extra = dict(mask=torch.from_numpy(np.where(
            keep, rng.standard_normal(keep.shape),
            np.finfo(np.float64).min)))
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
    assert cpu.unsupported(shape, shape, shape, mask=np.full(
        (5, 5), -np.inf)) is None
    for kw, word in ((dict(order="fa1"), "order"),
                     (dict(num_splits=3), "num_splits"),
                     (dict(mask=np.full((5, 5), -1e9)), "mask"),
                     (dict(mask=np.full((5, 5), np.nan)), "mask")):
        assert cpu.unsupported(shape, shape, shape, **kw).startswith(word)
    assert cpu.unsupported(shape, (3, 5, 4), (3, 5, 4)).startswith("k, v")
