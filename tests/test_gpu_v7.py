"""Forward v7 (wgmma, bf16 and float16) on a Hopper GPU.

v7 is compiled for sm_90a and launched by flashlab's own path, through
gpu.attention(version=7), as v5 is. Outputs are poisoned with NaN first;
inputs are fresh random values, N is ragged (never a multiple of the
64-row tiles).

Error budget: v5's (test_gpu_tensor_cores.half_budget): v7 rounds P and
O to 16 bits as v5 does and sums in float32 on the tensor cores; lse as
v5's, float32 sums of Nk terms.

    python tests/test_gpu_v7.py OUT_DIR   # TFLOP/s against torch's SDPA"""

import sys

import numpy as np
import pytest
from test_gpu_tensor_cores import CASES, UNIT, half_budget

from flashlab import gpu, reference
from helpers import max_abs_err, qkv

pytestmark = pytest.mark.gpu


@pytest.fixture(params=[7, 8])
def version(request):
    """Hopper's forwards: v7 (wgmma) and v8 (its warp-specialized form)."""
    return request.param


def hopper(version, q, k, v, **opts):
    """(o, lse) of forward `version` on torch CUDA tensors."""
    return gpu.attention(q, k, v, version=version, return_lse=True, **opts)


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    # every output is NaN until a kernel writes it
    monkeypatch.setattr(gpu, "POISON_OUTPUTS", True)


def check(o, lse, q, k, v, dtype, **opts):
    """o, lse (numpy) against float64 on the same 16-bit inputs."""
    wide = [x.astype(np.float64) for x in (q, k, v)]
    o_ref, lse_ref = reference.attention(*wide, return_lse=True, **opts)
    assert not np.isnan(o).any()
    assert max_abs_err(o, o_ref) <= half_budget(o_ref, wide[2],
                                                UNIT[dtype])
    # lse: -inf exactly where no key is allowed; elsewhere float32 sums
    # of Nk terms (Nk eps relative in l, so absolute in log l)
    finite = np.isfinite(lse_ref)
    assert np.array_equal(finite, np.isfinite(lse))
    eps = float(np.finfo(np.float32).eps)
    tol = eps * (k.shape[-2] + 8 * (1 + np.abs(lse_ref[finite])))
    assert np.all(np.abs(lse[finite] - lse_ref[finite]) <= tol)


def ragged(rng, high):
    """A length in 1..high that is not a multiple of 64."""
    n = int(rng.integers(1, high))
    return n + 1 if n % 64 == 0 else n


@pytest.mark.parametrize("opts", CASES)
@pytest.mark.parametrize("d, d_v", [(64, 64), (128, 128), (64, 128)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_v7_against_float64(version, rng, opts, d, d_v, dtype):
    import torch

    nq, nk = ragged(rng, 600), ragged(rng, 600)
    host = qkv(rng, (2, 3), nq, nk, d, d_v, np.float32)
    q, k, v = (torch.tensor(x, device="cuda").to(getattr(torch, dtype))
               for x in host)
    o, lse = hopper(version, q, k, v, **opts)
    assert o.dtype == q.dtype and o.shape == (2, 3, nq, d_v)
    inputs = [x.double().cpu().numpy() for x in (q, k, v)]
    check(o.double().cpu().numpy(), lse.cpu().numpy(), *inputs,
          np.float16 if dtype == "float16" else dtype, **opts)


def test_v7_masks_padding_and_nonfinite(version, rng):
    import torch

    q, k, v = qkv(rng, (2, 1), 130, 200, 64, 64, dtype=np.float16)
    mask = rng.random((2, 1, 130, 200)) < 0.6
    mask[0, 0, 7] = False  # an empty row: 0 and lse -inf
    v[1, 0, 150, 3] = np.inf  # a bad value in V: column 3 NaN
    opts = dict(mask=mask, kv_lengths=np.array([[200], [170]]))
    dev = [torch.tensor(x, device="cuda") for x in (q, k, v)]
    o, lse = (x.cpu().numpy() for x in hopper(version, *dev, **opts))
    wide = [x.astype(np.float64) for x in (q, k, v)]
    o_ref = reference.attention(*wide, **opts)
    assert np.all(o[0, 0, 7] == 0) and lse[0, 0, 7] == -np.inf
    assert np.array_equal(np.isnan(o), np.isnan(o_ref))
    assert np.isnan(o[1, 0, :, 3]).all()
    ok = ~np.isnan(o_ref)
    assert max_abs_err(o[ok], o_ref[ok]) <= half_budget(
        o_ref[ok], v[0], UNIT[np.float16])
    q[0, 0, 5, 0] = np.nan  # NaN in q: that row only
    dev[0] = torch.tensor(q, device="cuda")
    o = hopper(version, *dev)[0].cpu().numpy()
    assert np.isnan(o[0, 0, 5]).all() and not np.isnan(o[0, 0, 6]).any()


@pytest.mark.parametrize("opts", [dict(), dict(causal=True)])
def test_v7_grouped_heads(version, rng, opts):
    import torch

    q, k, v = qkv(rng, (2, 4), 150, 281, 128, 128, dtype=np.float32)
    k, v = k[:, :2], v[:, :2]  # two query heads per K/V head
    dev = [torch.tensor(x, device="cuda").bfloat16() for x in (q, k, v)]
    o, lse = hopper(version, *dev, **opts)
    inputs = [x.double().cpu().numpy() for x in dev]
    check(o.double().cpu().numpy(), lse.cpu().numpy(), *inputs,
          "bfloat16", **opts)


@pytest.mark.parametrize("nq, nk", [(1, 1), (1000, 1024), (1024, 700),
                                    (129, 1030)])
@pytest.mark.parametrize("opts", [
    dict(causal=True), dict(causal="bottom_right"),
    dict(window=(200, 30), causal=True),
    dict(causal=True, dropout_p=0.1, seed=3)])
def test_v8_warpgroups_stop_at_their_own_last_tile(rng, nq, nk, opts):
    # at d = 64 a block's three warpgroups stop where their own 64 rows
    # do (masks.last_tile) and hand the block's later tiles back: rows
    # that end early, rows past Nq, rows that see no key at all, and a
    # block whose every tile is skipped by its first warpgroups
    import torch

    host = qkv(rng, (2, 2), nq, nk, 64, 64, np.float32)
    q, k, v = (torch.tensor(x, device="cuda").bfloat16() for x in host)
    o, lse = hopper(8, q, k, v, **opts)
    inputs = [x.double().cpu().numpy() for x in (q, k, v)]
    check(o.double().cpu().numpy(), lse.cpu().numpy(), *inputs,
          "bfloat16", **opts)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, "bottom_right"])
def test_v8_blocks_that_visit_no_tile(rng, d, causal):
    # an element whose keys are all padding (kv_lengths 0), and under a
    # bottom-right mask with Nq > Nk the first blocks' rows: every block
    # there visits no tile, and must wait for no copy (it had counted
    # the tiles to hand back from own_last + 1 = 0 and hung); those rows
    # are 0 with lse -inf, the others match float64
    import torch

    host = qkv(rng, (3, 2), 1100, 700, d, d, np.float32)
    q, k, v = (torch.tensor(x, device="cuda").bfloat16() for x in host)
    opts = dict(causal=causal, kv_lengths=np.array([[700], [0], [333]]))
    o, lse = hopper(8, q, k, v, **opts)
    o, lse = o.double().cpu().numpy(), lse.cpu().numpy()
    assert np.all(o[1] == 0) and np.all(lse[1] == -np.inf)
    inputs = [x.double().cpu().numpy() for x in (q, k, v)]
    check(o, lse, *inputs, "bfloat16", **opts)


def test_v7_matches_v5_closely(version, rng):
    # same tiles, same softmax: only the products' summation order differs
    import torch

    q, k, v = (torch.tensor(x, device="cuda").bfloat16()
               for x in qkv(rng, (2, 2), 333, 517, 128, 128, np.float32))
    o7 = hopper(version, q, k, v, causal=True)[0].double()
    o5 = gpu.attention(q, k, v, causal=True, version=5).double()
    # one bf16 rounding of O apart, at most
    assert float((o7 - o5).abs().max()) <= 2.0**-8 * float(o5.abs().max())


def bench(out_dir):
    """TFLOP/s of v7 against torch SDPA (flash, cuDNN), bf16, B2 H8."""
    import json

    rows = [bench_case(n, d, causal) for n in (4096, 16384)
            for d in (64, 128) for causal in (False, True)]
    with open(f"{out_dir}/v7_bench.json", "w") as f:
        json.dump(rows, f, indent=1)


def bench_case(n, d, causal):
    """{n, d, causal, v7, flash, cudnn}: TFLOP/s at B2 H8, bf16."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (torch.randn(2, 8, n, d, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    flop = 4 * 2 * 8 * n * n * d / (2 if causal else 1)
    def sdpa(backend):
        with sdpa_kernel(backend):
            F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    runs = {"v7": lambda: gpu.attention(q, k, v, causal=causal,
                                        version=7),
            "flash": lambda: sdpa(SDPBackend.FLASH_ATTENTION),
            "cudnn": lambda: sdpa(SDPBackend.CUDNN_ATTENTION)}
    row = dict(n=n, d=d, causal=causal)
    for name, run in runs.items():
        row[name] = round(flop / median_ms(run) / 1e9, 1)
    print(row, flush=True)
    return row


def median_ms(run, reps=20):
    """Median milliseconds of run() on the device, after warm-up."""
    import torch

    for _ in range(3):
        run()
    times = []
    for _ in range(reps):
        start, end = (torch.cuda.Event(enable_timing=True)
                      for _ in range(2))
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(np.median(times))


if __name__ == "__main__":
    bench(sys.argv[1])


def test_v8_tensor_maps_follow_new_tensors_and_reused_slots(rng,
                                                             monkeypatch):
    # a ring of two slots: five calls on fresh tensors reuse each slot
    # twice, and a tensor seen before is found again; every output is
    # the one its own q, k, v give (v7 reads no tensor maps)
    import torch

    from flashlab.gpu import forward_v8

    monkeypatch.setattr(forward_v8._Slots, "SLOTS", 2)
    monkeypatch.setattr(forward_v8, "_SLOTS", [])
    made = []
    real = forward_v8.tensor_maps
    monkeypatch.setattr(forward_v8, "tensor_maps",
                        lambda *a: made.append(a) or real(*a))
    calls = [[torch.tensor(x, device="cuda").bfloat16() for x in
              qkv(rng, (1, 2), n, n + 7, 64, 64, np.float32)]
             for n in (100, 200, 300, 400, 500)]
    for q, k, v in calls + calls[-1:]:
        o8 = gpu.attention(q, k, v, version=8)
        o7 = gpu.attention(q, k, v, version=7)
        assert torch.equal(o8, o7)
    assert len(made) == 5  # the repeated call found its maps


@pytest.mark.parametrize("opts", [dict(), dict(causal="bottom_right"),
                                  dict(window=(50, 30))])
@pytest.mark.parametrize("d, d_v", [(64, 128), (128, 64)])
def test_backward_v7_against_float64_and_v5(rng, opts, d, d_v):
    # the wgmma backward on ragged Nq != Nk and unequal head dims (one
    # row, one key too), poisoned outputs: within twice backward_v5's
    # error against float64 on the same 16-bit inputs (v5 is held to
    # torch's flash backward in test_gpu_tensor_cores), and repeatable;
    # the fused kernel too
    import torch

    from flashlab import tiled

    for nq, nk in ((ragged(rng, 400), ragged(rng, 400)), (1, 1), (1, 70)):
        q, k, v = (torch.tensor(x, device="cuda").bfloat16()
                   for x in qkv(rng, (2, 3), nq, nk, d, d_v, np.float32))
        do = torch.tensor(rng.standard_normal((2, 3, nq, d_v)),
                          device="cuda").bfloat16()
        o, lse = gpu.attention(q, k, v, return_lse=True, **opts)
        got, v5 = (gpu.attention_backward(q, k, v, o, lse, do,
                                          version=ver, **opts)
                   for ver in (7, 5))
        again = gpu.attention_backward(q, k, v, o, lse, do, version=7,
                                       **opts)
        # the fused kernel (dQ by atomics), held to the same bound
        fused = gpu.attention_backward(q, k, v, o, lse, do, version=7,
                                       deterministic=False, **opts)
        x64 = [x.double().cpu().numpy() for x in (q, k, v, o, do)]
        lse64 = lse.double().cpu().numpy()
        want = tiled.attention_backward(*x64[:4], lse64, x64[4], **opts)
        for name, g, g5, g2, gf, w in zip("qkv", got, v5, again, fused,
                                          want):
            assert torch.equal(g, g2), name
            assert g.dtype == gf.dtype == torch.bfloat16
            assert g5.dtype == torch.float32
            fair = max_abs_err(g5.cpu().numpy(), w)
            for mine in (g, gf):
                mine = mine.double().cpu().numpy()
                assert not np.isnan(mine).any(), (name, nq, nk)
                # v7 stores its float32 sums rounded to bf16 (half an
                # ulp, at most 2**-8 of each); v5 stores them as they are
                assert max_abs_err(mine, w) <= 2 * fair + (
                    2.0**-12 + 2.0**-8) * float(np.abs(w).max()), (
                    name, nq, nk)
