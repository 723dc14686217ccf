"""The numba.cuda kernels: on the simulator here, on a real GPU with -m gpu.

Every output buffer is filled with NaN before the kernels run
(gpu.POISON_OUTPUTS), so an element left unwritten fails the comparison.
Simulator sizes stay small (N <= 128): it runs each thread in Python.
"""

import math

import numpy as np
import pytest
from conftest import SIMULATOR

from flashlab import cpu, gpu, merge, reference, tiled
from helpers import EPS32, float32_budget, max_abs_err, qkv


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(gpu, "POISON_OUTPUTS", True)


def tf32_score_error(q, k):
    """Bound on 3xTF32's error in any score: hi and lo each carry 2**-22
    of an operand and lo lo' is dropped, about 2**-20 of sum |q||k| tau."""
    s_abs = np.abs(q) @ np.abs(np.swapaxes(k, -1, -2))
    return 2.0**-20 * float(s_abs.max(initial=0)) / np.sqrt(q.shape[-1])


def check_forward(q, k, v, version, **opts):
    """Output and lse within twice the error of naive float32."""
    o, lse = gpu.attention(q, k, v, version=version, return_lse=True,
                           **opts)
    o_ref, lse_ref = reference.attention(q, k, v, return_lse=True, **opts)
    err_naive = max_abs_err(reference.naive(q, k, v, **opts), o_ref)
    assert o.dtype == np.float32 and not np.isnan(o).any()
    nk = k.shape[-2]
    _, tile = gpu.tile_shape(version, q.shape[-1], v.shape[-1])
    merges = -(-nk // tile)  # v1 merges key by key
    if version == 6:
        # 3xTF32 carries each operand to 2**-22 of itself (hi and lo of
        # 11 bits each) where float32 carries it to 2**-24: four times
        # naive float32's rounding of the scores (twice it was exceeded
        # by 5% in a draw of 112 queries and 41 keys, d = 128, causal)
        err_naive *= 4
    assert max_abs_err(o, o_ref) <= float32_budget(err_naive, o_ref, merges)
    finite = np.isfinite(lse_ref)
    assert np.array_equal(finite, np.isfinite(lse))
    # lse = m + log(l): summing Nk terms into l in float32 can lose up to
    # Nk eps relative (recursive summation), which log turns into Nk eps
    # absolute; the final add rounds at |lse| eps.
    # v6 (3xTF32) computes scores a few float32 ulps less exactly, and
    # a score error moves lse by as much
    eps = float(np.finfo(np.float32).eps)
    tol = eps * (k.shape[-2] + 8 * (1 + np.abs(lse_ref[finite])))
    if version == 6:
        tol = tol + tf32_score_error(q, k)
    assert np.all(np.abs(lse[finite] - lse_ref[finite]) <= tol)
    return o, lse


def check_backward(q, k, v, o, lse, **opts):
    """Gradients within twice naive float32's error, and deterministic."""
    rng = np.random.default_rng(1)
    do = rng.standard_normal(o.shape).astype(np.float32)
    got = gpu.attention_backward(q, k, v, o, lse, do, **opts)
    again = gpu.attention_backward(q, k, v, o, lse, do, **opts)
    for a, b in zip(got, again):
        assert np.array_equal(a, b)  # no atomics: bitwise repeatable
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    o64, lse64 = tiled.attention(q64, k64, v64, return_lse=True, **opts)
    want = tiled.attention_backward(q64, k64, v64, o64, lse64,
                                    do.astype(np.float64), **opts)
    naive = tiled.attention_backward(q, k, v, *tiled.attention(
        q, k, v, return_lse=True, block_q=10**9, block_k=10**9, **opts),
        do, block_q=10**9, block_k=10**9, **opts)  # one tile: the naive way
    # dQ sums one tile product per key tile, dK and dV one per query
    # tile, in order; naive float32 sums each in one blocked product, so
    # each tile added earns the merge slack of float32_budget
    tiles = math.ceil(max(q.shape[-2], k.shape[-2]) / 32)
    for g, w, n in zip(got, want, naive):
        assert not np.isnan(g).any()
        assert max_abs_err(g, w) <= float32_budget(max_abs_err(n, w), w,
                                                   tiles)


SIM_CASES = [
    dict(),
    dict(causal=True),
    dict(causal="bottom_right", window=(9, 3)),
    dict(dropout_p=0.25, seed=77),
]


# the versions the simulator runs (v5, v6 are inline PTX: GPU only)
SCALAR_VERSIONS = tuple(v for v in gpu.VERSIONS
                        if v not in gpu.TENSOR_CORE_VERSIONS)


@pytest.mark.skipif(not SIMULATOR, reason="simulator sizes; see -m gpu")
@pytest.mark.parametrize("version", SCALAR_VERSIONS)
@pytest.mark.parametrize("opts", SIM_CASES)
def test_simulator_forward(rng, version, opts):
    nq, nk = (int(x) for x in rng.integers(1, 70, size=2))
    q, k, v = qkv(rng, (1, 2), nq, nk, 16, 16, dtype=np.float32)
    check_forward(q, k, v, version, **opts)


@pytest.mark.skipif(not SIMULATOR, reason="simulator sizes; see -m gpu")
def test_simulator_masks_padding_and_backward(rng):
    nq, nk = 37, 45
    q, k, v = qkv(rng, (2, 1), nq, nk, 16, 16, dtype=np.float32)
    mask = rng.random((2, 1, nq, nk)) < 0.7
    mask[0, 0, 5] = False  # an empty row
    opts = dict(mask=mask, kv_lengths=np.array([[45], [20]]))
    o, lse = check_forward(q, k, v, 3, **opts)
    assert np.all(o[0, 0, 5] == 0) and lse[0, 0, 5] == -np.inf
    check_backward(q, k, v, o, lse, **opts)


@pytest.mark.skipif(not SIMULATOR, reason="simulator sizes; see -m gpu")
def test_simulator_backward_causal_dropout(rng):
    q, k, v = qkv(rng, (1,), 70, 40, 32, 16, dtype=np.float32)
    opts = dict(causal="bottom_right", dropout_p=0.2, seed=5)
    o, lse = check_forward(q, k, v, 3, **opts)
    check_backward(q, k, v, o, lse, **opts)


@pytest.mark.skipif(not SIMULATOR, reason="simulator sizes; see -m gpu")
def test_dropout_matches_the_cpu_path(rng):
    q, k, v = qkv(rng, (2,), 33, 33, 16, 16, dtype=np.float32)
    opts = dict(dropout_p=0.4, seed=2024, causal=True)
    got = gpu.attention(q, k, v, **opts)
    want = cpu.attention(q.astype(np.float64), k.astype(np.float64),
                         v.astype(np.float64), **opts)
    assert max_abs_err(got, want) < 1e-5  # same mask, float32 rounding


SPLIT_CASES = [
    dict(),
    dict(causal=True),
    dict(kv_lengths=np.array([40, 0])),
    dict(window=(20, 5), causal="bottom_right", dropout_p=0.2, seed=4),
]


@pytest.mark.skipif(not SIMULATOR, reason="simulator sizes; see -m gpu")
@pytest.mark.parametrize("opts", SPLIT_CASES)
def test_simulator_split_kv(rng, opts):
    # 3 rows against 5 key tiles of 32: splits of 1 to 7 (some empty)
    q, k, v = qkv(rng, (2,), 3, 150, 16, 16, dtype=np.float32)
    o_ref, lse_ref = reference.attention(q, k, v, return_lse=True, **opts)
    err_naive = max_abs_err(reference.naive(q, k, v, **opts), o_ref)
    for splits in (2, 3, 7):
        o, lse = gpu.attention(q, k, v, version=3, num_splits=splits,
                               return_lse=True, **opts)
        # each split merges its own tiles, the combine one more per split
        assert max_abs_err(o, o_ref) <= float32_budget(err_naive, o_ref,
                                                       5 + splits)
        finite = np.isfinite(lse_ref)
        assert np.array_equal(finite, np.isfinite(lse))
        assert max_abs_err(lse[finite], lse_ref[finite]) < 1e-5


def test_split_kv_is_exact_at_huge_scores(rng):
    # every score 1e6 (q = k = 1000 e_0, tau = 1): the output is the mean
    # of V over the allowed keys; splits of 96 and 54 keys (3 and 2 tiles
    # of 32), and under the causal mask rows whose splits hold different
    # counts, must be weighed by their counts, which each split's lse
    # rounds away and its (m, l) keeps
    q = np.zeros((1, 3, 16), np.float32)
    q[..., 0] = 1000.0
    k = np.zeros((1, 150, 16), np.float32)
    k[..., 0] = 1000.0
    v = rng.standard_normal((1, 150, 16)).astype(np.float32)
    for causal in (False, True):
        o, lse = gpu.attention(q, k, v, version=3, num_splits=2,
                               return_lse=True, scale=1.0, causal=causal,
                               align="bottom_right" if causal else None)
        allowed = np.arange(150)[None] <= np.arange(3)[:, None] + 147 \
            if causal else np.ones((3, 150), bool)
        want = (allowed @ v[0].astype(np.float64)) / allowed.sum(-1)[:,
                                                                     None]
        assert max_abs_err(o[0], want) < 1e-5
        assert max_abs_err(lse[0], 1e6 + np.log(allowed.sum(-1))) <= 0.0625


def test_statistics_and_a_backward_given_m_and_l(rng):
    # float32 kernels: gpu.attention_statistics as tiled's, and two key
    # ranges run alone with the whole row's (m, l) give its gradients
    # where scores of a few hundred put lse past merge.LSE_EXACT
    q, k, v = qkv(rng, (2,), 8, 40, 16, 16, dtype=np.float32)
    q *= 100.0
    do = rng.standard_normal((2, 8, 16)).astype(np.float32)
    o, lse = gpu.attention(q, k, v, version=3, return_lse=True)
    assert merge.lse_loses_l(lse).mean() > 0.75
    m, l = gpu.attention_statistics(q, k, v, lse)
    m64, l64 = tiled.attention_statistics(*(x.astype(np.float64) for x in
                                            (q, k, v, lse)))
    # a float32 score of d products rounds by up to about d |s| eps
    # (tau = 1/4: |s| near 300 here); P, l and the gradients carry it
    s_max = float(np.abs(q @ np.swapaxes(k, -1, -2)).max()) / 4
    rel = 16 * s_max * EPS32
    assert max_abs_err(m, m64) <= 4 * EPS32 * np.abs(m64).max()
    assert max_abs_err(l / l64, 1.0) < rel
    want = tiled.attention_backward(*(x.astype(np.float64) for x in (
        q, k, v, o, m, do)), l=l.astype(np.float64))
    parts = [gpu.attention_backward(q, k[:, r], v[:, r], o, m, do, l=l)
             for r in (slice(0, 24), slice(24, 40))]
    budget = rel * max(np.abs(w).max() for w in want)
    assert max_abs_err(parts[0][0] + parts[1][0], want[0]) < budget
    for i in (1, 2):
        whole = np.concatenate([parts[0][i], parts[1][i]], axis=-2)
        assert max_abs_err(whole, want[i]) < budget
    with pytest.raises(TypeError, match="l: expected dtype float32"):
        gpu.attention_backward(q, k, v, o, m, do, l=l.astype(np.float64))
    with pytest.raises(ValueError, match=r"l: expected shape \(2, 8\)"):
        gpu.attention_backward(q, k, v, o, m, do, l=l[:1])


def test_combine_matches_merge(rng):
    # 4 splits of (2, 3) heads x 5 rows, one split empty in some rows,
    # one row empty in every split; huge lses stress the shift
    outs = rng.standard_normal((4, 2, 3, 5, 16)).astype(np.float32)
    lses = (rng.standard_normal((4, 2, 3, 5)) * 30).astype(np.float32)
    lses[1, 0, :, 2] = -np.inf
    lses[:, 1, 2, 4] = -np.inf
    lses[2, 1, 0] = 80.0
    o, lse = gpu.combine(outs, lses)
    o_ref, lse_ref = merge.combine(outs.astype(np.float64), lses)
    # float32 rounding, relative to what is rounded: o folds S = 4
    # weighted outs (two roundings each) and divides, 9 half-ulps of max
    # |outs| (about 4, where 1e-6 was 2 ulps: 1000 seeds reached 5e-7);
    # lse = m + log l: l's S roundings move log l by S half-ulps, then
    # the sum rounds at |lse| (up to ~130, where an ulp is 1.5e-5)
    assert max_abs_err(o, o_ref) <= 8 * EPS32 * np.abs(outs).max()
    assert not np.isnan(o).any()
    assert np.array_equal(o[1, 2, 4], np.zeros(16))
    assert lse[1, 2, 4] == -np.inf
    finite = np.isfinite(lse_ref)
    err = np.abs(lse[finite] - lse_ref[finite])
    assert np.all(err <= EPS32 * (4 + 2 * (1 + np.abs(lse_ref[finite]))))
    with pytest.raises(TypeError, match="outs: expected a float32"):
        gpu.combine(outs.astype(np.float64), lses)
    with pytest.raises(ValueError, match=r"lses: expected shape \(4, 2"):
        gpu.combine(outs, lses[:, :1])
    with pytest.raises(ValueError, match=r"ls: expected shape \(4, 2"):
        gpu.combine(outs, lses, lses[:, :1])


def test_combine_of_maxes_and_sums_is_exact_at_any_size(rng):
    # 3 splits of 2 x 4 rows of equal scores s (1e6, finfo.min) over 7,
    # 1 and 12 keys, one split empty in a row: the output is the mean of
    # the rows' values, which lse = s + log l (log l rounded away) cannot
    # weigh; the (m, l) form weighs each split by its count
    #
    # At 1e6 float32's ulp is 1/16: lse keeps log 7 and log 12 as 1.9375
    # and 2.5, so the lse form weighs the splits 6.94 : 1 : 12.18, output
    # weights off by -0.0051, -0.0003 and +0.0054. On standard normal
    # means that moved some draws (about 4 in 10**6) by under 1e-2 in
    # every element. Split s's means lie within 0.5 of 2 (s - 1), so each
    # element moves by at least 2 (0.0051 + 0.0054) - 0.5 (0.0051 +
    # 0.0003 + 0.0054) > 0.015 here, and by more than 0.2 at finfo.min
    # (equal weights)
    counts = np.array([7, 1, 12], np.float32)
    centres = np.array([-2.0, 0.0, 2.0])[:, None, None, None]
    for score in (np.float32(1e6), np.finfo(np.float32).min):
        means = (centres + rng.uniform(-0.5, 0.5, (3, 2, 4, 8))).astype(
            np.float32)
        ms = np.full((3, 2, 4), score, np.float32)
        ls = np.broadcast_to(counts[:, None, None], ms.shape).copy()
        ms[1, 0, 3], ls[1, 0, 3] = -np.inf, 0.0
        o, m, l = gpu.combine(means, ms, ls)
        o_ref, m_ref, l_ref = merge.combine(means.astype(np.float64), ms,
                                            ls)
        want = (means * ls[..., None]).sum(0) / ls.sum(0)[..., None]
        assert max_abs_err(o_ref, want) < 1e-6  # the reference is right
        assert max_abs_err(o, o_ref) <= 8 * EPS32 * np.abs(means).max()
        assert np.array_equal(m, np.full((2, 4), score, np.float32))
        assert np.array_equal(l, l_ref.astype(np.float32))  # small ints
        with np.errstate(divide="ignore"):  # log 0: the empty split
            lse = (ms + np.log(ls)).astype(np.float32)
        lossy, _ = gpu.combine(means, lse)
        assert max_abs_err(lossy, want) > 1e-2  # the lse form cannot


@pytest.mark.skipif(not SIMULATOR, reason="the refusal is the simulator's")
def test_simulator_refuses_inline_ptx_clearly():
    # v5, v6 and the 16-bit backward are inline PTX: a clear error, not
    # numba's failure from inside a simulated thread
    x16 = np.zeros((2, 70, 64), np.float16)
    with pytest.raises(RuntimeError, match="version: v5 runs mma.sync"):
        gpu.attention(x16, x16, x16)
    x32 = x16.astype(np.float32)
    with pytest.raises(RuntimeError, match="version: v6 runs mma.sync"):
        gpu.attention(x32, x32, x32, version=6)
    lse = np.zeros((2, 70), np.float32)
    with pytest.raises(RuntimeError, match="the 16-bit backward"):
        gpu.attention_backward(x16, x16, x16, x16, lse, x16)
    assert np.isfinite(gpu.attention(x32, x32, x32)).all()  # v3 runs


def test_choose_splits_fills_the_gpu():
    # decoding: one query block per head, 16 heads, long keys -> splits
    # until 132 SMs x 4 blocks are busy, never under 4 tiles per split
    assert gpu.choose_splits(1, 131072, 16, 64, 64, sms=132) == 33
    assert gpu.choose_splits(1, 1024, 16, 64, 64, sms=132) == 8
    assert gpu.choose_splits(4096, 4096, 16, 64, 64, sms=132) == 1
    assert gpu.choose_splits(1, 64, 1, 64, 64, sms=132) == 1


def test_bad_input():
    x = np.zeros((4, 16), np.float32)
    with pytest.raises(TypeError, match="q: expected a dtype in"):
        gpu.attention(x.astype(np.float64), x, x)
    with pytest.raises(TypeError, match="k: expected dtype float16 to "):
        gpu.attention(x.astype(np.float16), x, x)
    with pytest.raises(ValueError, match="version: v3 does not take float16"):
        gpu.attention(*(x.astype(np.float16),) * 3, version=3)
    with pytest.raises(ValueError, match="version: v5 does not take float32"):
        gpu.attention(x, x, x, version=5)
    with pytest.raises(ValueError, match=r"q: v6 runs head dims \(64, 128\)"):
        gpu.attention(x, x, x, version=6)
    with pytest.raises(ValueError, match="num_splits: this backend"):
        gpu.attention(x, x, x, version=4, num_splits=2)
    with pytest.raises(ValueError, match="num_splits: expected"):
        gpu.attention(x, x, x, version=3, num_splits=0)
    with pytest.raises(ValueError, match="precision: only v6"):
        gpu.attention(x, x, x, precision="tf32")
    y = np.zeros((4, 64), np.float32)
    with pytest.raises(ValueError, match="precision: expected one of"):
        gpu.attention(y, y, y, version=6, precision="fp8")
    with pytest.raises(ValueError, match="q: expected a head dim"):
        gpu.attention(x[:, :8], x[:, :8], x)
    with pytest.raises(ValueError, match="version"):
        gpu.attention(x, x, x, version=0)
    with pytest.raises(ValueError, match="mask"):
        gpu.attention(x, x, x, mask=np.ones((3, 4), bool))
    lse = np.zeros(4, np.float32)
    with pytest.raises(TypeError, match="deterministic: expected True or"):
        gpu.attention_backward(x, x, x, x, lse, x, deterministic="no")


# ------------------------------------------------ real GPU (pytest -m gpu)

GPU_CASES = [
    dict(),
    dict(causal=True),
    dict(causal="bottom_right"),
    dict(window=(100, 0), causal=True),
    dict(dropout_p=0.1, seed=3),
]


@pytest.mark.gpu
@pytest.mark.parametrize("version, d", [
    (version, d) for version in gpu.FLOAT32_VERSIONS for d in (16, 64, 128)
    if gpu.supports(f"forward_v{version}_3xtf32" if version == 6
                    else f"forward_v{version}", d, d)])
@pytest.mark.parametrize("opts", GPU_CASES)
def test_gpu_forward_random_shapes(rng, version, opts, d):
    nq, nk = (int(x) for x in rng.integers(1, 700, size=2))
    q, k, v = qkv(rng, (2, 3), nq, nk, d, d, dtype=np.float32, spread=1.5)
    check_forward(q, k, v, version, **opts)


@pytest.mark.gpu
@pytest.mark.parametrize("opts", GPU_CASES)
@pytest.mark.parametrize("d, dv", [(64, 64), (128, 128), (32, 96)])
def test_gpu_backward_random_shapes(rng, opts, d, dv):
    nq, nk = (int(x) for x in rng.integers(1, 500, size=2))
    q, k, v = qkv(rng, (2, 2), nq, nk, d, dv, dtype=np.float32)
    mask = rng.random((2, 1, nq, nk)) < 0.9
    o, lse = check_forward(q, k, v, 3, mask=mask, **opts)
    check_backward(q, k, v, o, lse, mask=mask, **opts)


@pytest.mark.gpu
def test_gpu_torch_tensors_in_place_and_autograd(rng):
    import torch
    import torch.nn.functional as F

    from flashlab import torch as fl_torch

    q, k, v = (torch.tensor(x, device="cuda", requires_grad=True)
               for x in qkv(rng, (2, 4), 300, 300, 64, 64, np.float32))
    do = torch.randn(2, 4, 300, 64, device="cuda")
    out = fl_torch.attention(q, k, v, causal=True)
    grads = torch.autograd.grad(out, (q, k, v), do)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = F.scaled_dot_product_attention(q64, k64, v64, is_causal=True)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), do.double())
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    sdpa_grads = torch.autograd.grad(sdpa, (q, k, v), do)
    # the budget of check_backward, with torch's float32 kernel as the
    # naive program: chapter 9's backward adds one tile product per tile
    # of 32 rows, each a rounding more than one blocked product
    tiles = math.ceil(300 / 32)
    for mine, theirs, truth in zip((out, *grads), (sdpa, *sdpa_grads),
                                   (ref, *ref_grads)):
        truth = truth.detach().cpu().numpy()
        e_mine = max_abs_err(mine.detach().double().cpu().numpy(), truth)
        e_torch = max_abs_err(theirs.detach().double().cpu().numpy(), truth)
        assert e_mine <= float32_budget(e_torch, truth, tiles), (e_mine,
                                                                 e_torch)


@pytest.mark.gpu
@pytest.mark.parametrize("opts", SPLIT_CASES)
def test_gpu_split_kv_decoding(rng, opts):
    q, k, v = qkv(rng, (2, 8), 5, 3000, 64, 64, dtype=np.float32)
    if "kv_lengths" in opts:
        opts = dict(kv_lengths=np.array([[3000] * 8, [1000] * 8]))
    for splits in (4, "auto"):
        check_forward_split(q, k, v, splits, **opts)


def check_forward_split(q, k, v, splits, **opts):
    o, lse = gpu.attention(q, k, v, version=3, num_splits=splits,
                           return_lse=True, **opts)
    o_ref = reference.attention(q, k, v, **opts)
    err_naive = max_abs_err(reference.naive(q, k, v, **opts), o_ref)
    tiles = -(-k.shape[-2] // 32)
    assert max_abs_err(o, o_ref) <= float32_budget(err_naive, o_ref,
                                                   tiles + 64)


@pytest.mark.gpu
def test_gpu_numba_device_arrays(rng):
    from numba import cuda

    q, k, v = qkv(rng, (3,), 257, 129, 32, 32, dtype=np.float32)
    o = gpu.attention(*(cuda.to_device(x) for x in (q, k, v)), causal=True)
    got = o.copy_to_host()
    o_ref = reference.attention(q, k, v, causal=True)
    err_naive = max_abs_err(reference.naive(q, k, v, causal=True), o_ref)
    assert max_abs_err(got, o_ref) <= float32_budget(err_naive, o_ref)
