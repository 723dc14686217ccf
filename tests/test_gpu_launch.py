"""The launch path and the torch op on a real GPU: cached plans reused
with new data, torch.compile(fullgraph=True), CUDA-graph capture, other
streams, the disk cache in a new process, and the ABI against the PTX
the driver loaded.

Budgets are those of test_gpu_tensor_cores: P and O rounded to 16 bits
(u/2 each), twice over, against float64 on the same 16-bit inputs.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

from flashlab import gpu, reference
from flashlab.gpu import build, launch, registry
from helpers import max_abs_err

pytestmark = pytest.mark.gpu
U_BF16 = 2.0**-8


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(gpu, "POISON_OUTPUTS", True)


def bf16_qkv(rng, shape_q, shape_kv, d=64):
    import torch

    return [torch.tensor(rng.standard_normal((*s, d)),
                         dtype=torch.bfloat16, device="cuda")
            for s in (shape_q, shape_kv, shape_kv)]


def check_bf16(o, q, k, v, **opts):
    wide = [x.double().cpu().numpy() for x in (q, k, v)]
    o_ref = reference.attention(*wide, **opts)
    got = o.double().cpu().numpy()
    assert not np.isnan(got).any()
    budget = U_BF16 * (np.abs(wide[2]).max() + np.abs(o_ref).max())
    assert max_abs_err(got, o_ref) <= budget


def test_cached_plan_is_reused_with_new_data(rng):
    import torch

    gpu._plans.clear()
    for _ in range(3):  # one plan; every call's data through its buffer
        q, k, v = bf16_qkv(rng, (2, 4, 200), (2, 4, 200))
        o = gpu.attention(q, k, v, causal=True)
        check_bf16(o, q, k, v, causal=True)
    assert len(gpu._plans) == 1
    torch.cuda.synchronize()


def test_cached_plan_grouped_heads_and_dropout_seeds(rng):
    import torch

    q, k, v = bf16_qkv(rng, (2, 8, 130), (2, 2, 170))
    o = gpu.attention(q, k, v)
    check_bf16(o, q, k, v)
    a = gpu.attention(q, k, v, dropout_p=0.3, seed=5)
    b = gpu.attention(q, k, v, dropout_p=0.3, seed=6)
    again = gpu.attention(q, k, v, dropout_p=0.3, seed=5)
    assert torch.equal(a, again) and not torch.equal(a, b)
    # the general path (a padding array takes it) agrees bit for bit
    full = np.full((2, 8), 170)
    slow = gpu.attention(q, k, v, dropout_p=0.3, seed=6, kv_lengths=full)
    assert torch.equal(b, slow)


def test_nonfinite_v_through_the_cached_plan(rng):
    q, k, v = bf16_qkv(rng, (1, 2, 70), (1, 2, 90))
    gpu.attention(q, k, v)  # the plan exists; now V holds an inf
    v[0, 1, 40, 3] = float("inf")
    o = gpu.attention(q, k, v).float().cpu().numpy()
    assert np.isnan(o[0, 1, :, 3]).all()
    assert not np.isnan(np.delete(o[0, 1], 3, axis=-1)).any()
    assert not np.isnan(o[0, 0]).any()


def test_another_stream(rng):
    import torch

    q, k, v = bf16_qkv(rng, (2, 2, 300), (2, 2, 300))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        o = gpu.attention(q, k, v, causal=True)
    torch.cuda.current_stream().wait_stream(side)
    check_bf16(o, q, k, v, causal=True)


def test_torch_compile_fullgraph_forward_and_backward(rng):
    import torch

    from flashlab import torch as fl_torch

    q, k, v = (x.requires_grad_() for x in bf16_qkv(rng, (2, 4, 256),
                                                    (2, 4, 256)))

    def step(q, k, v):
        return fl_torch.attention(q, k, v, is_causal=True)

    # the op's own output and gradients (a loss summed by inductor would
    # round in another order than eager's sum)
    do = torch.randn_like(q)
    eager = step(q, k, v)
    grads = torch.autograd.grad(eager, (q, k, v), do)
    compiled = torch.compile(step, fullgraph=True)
    got = compiled(q, k, v)
    got_grads = torch.autograd.grad(got, (q, k, v), do)
    assert torch.equal(got, eager)
    for g, h in zip(got_grads, grads):
        assert torch.equal(g, h)


def test_cuda_graph_training_step_replays(rng):
    import torch

    from flashlab import torch as fl_torch

    q, k, v = (x.requires_grad_() for x in bf16_qkv(rng, (1, 4, 128),
                                                    (1, 4, 128)))
    do = torch.randn(1, 4, 128, 64, device="cuda", dtype=torch.bfloat16)

    def step():
        q.grad = k.grad = v.grad = None
        o = fl_torch.attention(q, k, v, is_causal=True)
        o.backward(do)
        return o

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o = step()
    with torch.no_grad():
        for x in (q, k, v):
            x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    replayed = (o.clone(), q.grad.clone(), k.grad.clone(), v.grad.clone())
    eager_o = step()
    eager = (eager_o, q.grad, k.grad, v.grad)
    for a, b in zip(replayed, eager):
        assert torch.equal(a, b)


def test_driver_loaded_kernels_match_their_abi():
    cc = launch.target(launch.device_cc())
    for name in ("forward_v5_bf16", "backward_v5_dq_bf16", "row_dot"):
        ptx = build.compile_ptx(name, 64, 64, cc)
        layout = launch.Layout.of(build.signature(name))
        assert launch.code_kinds(layout.codes) == launch.ptx_params(ptx)
        res = build.kernel(name, 64, 64).resources()
        assert res["regs"] > 0 and res["local"] == 0, (name, res)
    # on Hopper the loaded modules are sm_90a ones
    if cc[:2] == (9, 0):
        assert ".target sm_90a" in build.compile_ptx("row_dot", 0, 0, cc)


def test_new_process_loads_from_the_disk_cache(tmp_path):
    code = ("import time, torch; t = time.perf_counter(); "
            "from flashlab import gpu; "
            "q = torch.randn(1, 2, 64, 64, device='cuda', "
            "dtype=torch.bfloat16); gpu.attention(q, q, q); "
            "torch.cuda.synchronize(); print(time.perf_counter() - t)")
    env = dict(os.environ, FLASHLAB_CACHE_DIR=str(tmp_path))
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    times = [float(subprocess.run([sys.executable, "-c", code], env=env,
                                  capture_output=True, text=True,
                                  check=True).stdout.split()[-1])
             for _ in range(2)]
    assert any(tmp_path.iterdir())
    print(f"cold start: {times[0]:.2f} s compiling, {times[1]:.2f} s "
          f"from the cache")


def test_best_version_on_this_gpu():
    cc = launch.device_cc()
    assert gpu._check_version(None, "bfloat16", 64, 64) == \
        registry.best_version("bfloat16", 64, 64, cc)


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_backward_plan_matches_the_general_path(rng, dtype, deterministic):
    import torch

    q, k, v = (x.to(getattr(torch, dtype)) for x in bf16_qkv(
        rng, (2, 4, 200), (2, 4, 230)))
    do = torch.randn_like(q)
    o, lse = gpu.attention(q, k, v, causal=True, return_lse=True)
    kw = dict(causal=True, deterministic=deterministic)
    fast = gpu.attention_backward(q, k, v, o, lse, do, **kw)
    again = gpu.attention_backward(q, k, v, o, lse, do, **kw)
    # a padding array takes the general path: D by torch, same kernels
    slow = gpu.attention_backward(q, k, v, o, lse, do, **kw,
                                  kv_lengths=np.full((2, 4), 230))
    for name, f, a, s in zip("qkv", fast, again, slow):
        if deterministic or name != "q":  # the plan reused: bit for bit
            assert torch.equal(f, a)
        else:  # dQ by atomics: float32 sums in any order, rounded once
            unit = float(torch.finfo(f.dtype).eps)
            assert float((f - a).abs().max()) <= unit * float(
                a.abs().max())
        # D_i summed in another order: float32 rounding of |dO||O| d,
        # and a 16-bit gradient (backward_v7) may then round the other
        # way: one unit of its dtype more
        scale = float(s.abs().max())
        unit = float(torch.finfo(f.dtype).eps)
        assert float((f - s).abs().max()) <= (1e-4 + unit) * scale


def test_strided_views_take_the_cached_plan(rng):
    # a model's q, k, v: heads transposed out of one (B, T, H, d) tensor
    import torch

    x = torch.tensor(rng.standard_normal((2, 150, 3, 4, 64)),
                     dtype=torch.bfloat16, device="cuda")
    q, k, v = (x[:, :, i].transpose(1, 2) for i in range(3))
    assert not q.is_contiguous()
    gpu._plans.clear()
    o = gpu.attention(q, k, v, causal=True)
    check_bf16(o, q, k, v, causal=True)
    assert len(gpu._plans) == 1
    assert torch.equal(o, gpu.attention(q.contiguous(), k.contiguous(),
                                        v.contiguous(), causal=True))


def test_torch_calls_run_the_plan_with_the_plans_own_buffers(
        rng, monkeypatch):
    # unpoisoned, as a user calls: flashlab.torch finds the plan by its own
    # key, and V's flags and an unwanted lse go to buffers the plan keeps
    # per stream, written afresh by every call
    import torch

    from flashlab import torch as fl_torch

    monkeypatch.setattr(gpu, "POISON_OUTPUTS", False)
    fl_torch._plans.clear()
    full = np.full((2, 4), 200)  # padding arrays take the general path
    for _ in range(2):
        q, k, v = bf16_qkv(rng, (2, 4, 200), (2, 4, 200))
        o, lse = fl_torch.attention(q, k, v, is_causal=True,
                                    return_lse=True)
        check_bf16(o, q, k, v, causal=True)
        slow, slow_lse = gpu.attention(q, k, v, causal=True,
                                       kv_lengths=full, return_lse=True)
        assert torch.equal(o, slow) and torch.equal(lse, slow_lse)
        assert torch.equal(fl_torch.attention(q, k, v, is_causal=True), o)
    assert len(fl_torch._plans) == 1
    # V's flags are rewritten by each call: an inf, then none again
    v[1, 2, 150, 7] = float("inf")
    bad = fl_torch.attention(q, k, v, is_causal=True).float()
    assert torch.isnan(bad[1, 2, :, 7]).all()
    assert not torch.isnan(bad[1, 2, :, :7]).any()
    assert not torch.isnan(bad[0]).any()
    v[1, 2, 150, 7] = 0.5
    again = fl_torch.attention(q, k, v, is_causal=True)
    check_bf16(again, q, k, v, causal=True)
    # another stream: buffers of its own
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        other = fl_torch.attention(q, k, v, is_causal=True)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(other, again)
    # a contiguous q that is not 16-byte aligned: the checked path
    room = torch.empty(q.numel() + 1, dtype=q.dtype, device="cuda")
    shifted = room[1:].view(q.shape)
    shifted.copy_(q)
    assert shifted.data_ptr() % 16
    assert torch.equal(fl_torch.attention(shifted, k, v, is_causal=True),
                       again)
    # dropout's seed drawn from torch's generator, through the plan
    drops = []
    for _ in range(2):
        torch.manual_seed(3)
        drops.append(fl_torch.attention(q, k, v, dropout_p=0.25))
    torch.manual_seed(3)
    seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))
    assert torch.equal(drops[0], drops[1])
    assert torch.equal(drops[1], gpu.attention(
        q, k, v, dropout_p=0.25, seed=seed, kv_lengths=full))


def test_backward_plan_keeps_its_scratch_per_stream(rng, monkeypatch):
    # D and the rows' statistics live in buffers the backward plan keeps:
    # each call's gradients, on new data, match the general path's
    import torch

    monkeypatch.setattr(gpu, "POISON_OUTPUTS", False)
    full = np.full((2, 4), 160)
    for _ in range(3):
        q, k, v, do = bf16_qkv(rng, (2, 4, 160), (2, 4, 160)) + bf16_qkv(
            rng, (2, 4, 160), (2, 4, 160))[:1]
        o, lse = gpu.attention(q, k, v, causal=True, return_lse=True)
        fast = gpu.attention_backward(q, k, v, o, lse, do, causal=True)
        slow = gpu.attention_backward(q, k, v, o, lse, do, causal=True,
                                      kv_lengths=full)
        for f, s in zip(fast, slow):  # D in another order: as above
            unit = float(torch.finfo(f.dtype).eps)
            assert float((f - s).abs().max()) <= (1e-4 + unit) * float(
                s.abs().max())


def test_torch_backward_runs_the_plan_by_its_own_key(rng, monkeypatch):
    # autograd's backward finds the GPU plan by flashlab.torch's own key
    # and skips the checks; its gradients match the general path's on new
    # data each call, through strided and unaligned dO and dropout
    import torch

    from flashlab import torch as fl_torch

    monkeypatch.setattr(gpu, "POISON_OUTPUTS", False)
    fl_torch._backward_plans.clear()
    full = np.full((2, 4), 176)  # padding arrays take the general path

    def close(got, want):  # D in another order: as the plan tests above
        for f, s in zip(got, want):
            assert f.dtype == s.dtype and f.shape == s.shape
            unit = float(torch.finfo(f.dtype).eps)
            assert float((f - s).abs().max()) <= (1e-4 + unit) * float(
                s.abs().max())

    def step(q, k, v, do, **kw):
        leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
        o, lse = fl_torch.attention(*leaves, return_lse=True, **kw)
        return o, lse, torch.autograd.grad(o, leaves, do)

    for _ in range(2):
        q, k, v, do = bf16_qkv(rng, (2, 4, 176), (2, 4, 176)) + bf16_qkv(
            rng, (2, 4, 176), (2, 4, 176))[:1]
        o, lse, grads = step(q, k, v, do, is_causal=True)
        close(grads, gpu.attention_backward(q, k, v, o.detach(), lse, do,
                                            causal=True, kv_lengths=full))
    assert len(fl_torch._backward_plans) == 1
    # dO strided (a copy is made) and dO contiguous but not 16-byte
    # aligned (the checked path)
    wide = torch.stack([do, do], -1)[..., 0]  # strides (..., 2)
    room = torch.empty(do.numel() + 1, dtype=do.dtype, device="cuda")
    shifted = room[1:].view(do.shape)
    shifted.copy_(do)
    assert not wide.is_contiguous() and shifted.data_ptr() % 16
    for odd in (wide, shifted):
        _, _, got = step(q, k, v, odd, is_causal=True)
        close(got, grads)
    assert len(fl_torch._backward_plans) == 1
    # dropout: the seed drawn for the forward reaches the plan's backward
    torch.manual_seed(5)
    seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))
    for _ in range(2):  # the first call makes the plan, the second runs it
        torch.manual_seed(5)
        o, lse, got = step(q, k, v, do, dropout_p=0.25)
        close(got, gpu.attention_backward(
            q, k, v, o.detach(), lse, do, dropout_p=0.25, seed=seed,
            kv_lengths=full))
    assert len(fl_torch._backward_plans) == 2
