"""Ring attention on one GPU (a ring of one, NCCL): 16-bit inputs run the
tensor-core backward, not float32 copies. Needs a GPU: pytest -m gpu."""

import pytest

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def group():
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("causal", [False, True])
def test_ring_backward_runs_16_bit_kernels(group, monkeypatch, rng, dtype,
                                           causal):
    import torch

    from flashlab import distributed, gpu

    seen = []
    real = gpu.attention_backward

    def spy(q, *args, **options):
        seen.append(q.dtype)
        return real(q, *args, **options)

    monkeypatch.setattr(gpu, "attention_backward", spy)
    dt = getattr(torch, dtype)
    q, k, v, do = (torch.tensor(rng.standard_normal((2, 3, 200, 64)),
                                device="cuda").to(dt) for _ in range(4))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = distributed.ring_attention(*leaves, causal=causal, group=group)
    grads = torch.autograd.grad(out, leaves, do)
    assert seen and all(x == dt for x in seen)
    # against float64 SDPA (math, on the CPU) on the same 16-bit inputs:
    # the 16-bit output (8 or 11 bits) and P rounded to 16 bits inside
    # the kernels bound the error
    wide = [x.double().cpu().requires_grad_() for x in (q, k, v)]
    want = torch.nn.functional.scaled_dot_product_attention(
        *wide, is_causal=causal)
    want_grads = torch.autograd.grad(want, wide, do.double().cpu())
    tol = 4e-2 if dtype == "bfloat16" else 5e-3
    assert (out.double().cpu() - want).abs().max() < tol
    for g, w in zip(grads, want_grads):
        assert g.dtype == dt
        err = (g.double().cpu() - w).abs().max().item()
        assert err < tol * max(1.0, w.abs().max().item()), err
