"""Hostile inputs on the GPU kernels (issue 22): rows whose lse lost log l.

P = exp(S - lse) is no longer P where lse = m + log l rounds back to m
(huge equal scores, scores near -finfo.max): the backward kernels take
`device.row_statistics`' shift and norm of each row instead. These run
the float32 kernels on the simulator here (on a GPU too, through the
same launches); the tensor-core kernels (inline PTX, which the simulator
cannot run) only with -m gpu. They also form exp2's argument so that
scores above 2.36e38 (where s tau log2 e overflows) stay finite. The
truth is flashlab.reference's probabilities in float64 and their
gradients in closed form.
"""

import math

import numpy as np
import pytest

from flashlab import reference, tiled
from flashlab.gpu import (
    _Call,
    backward,
    device,
    host,
    kernel,
    registry,
    traits,
    warp,
)
from helpers import EPS32, max_abs_err, qkv

# 16-bit unit roundoff; for chapter 9's float32 backward, P's ex2.approx
# (2 ulps) and float32 rounding
UNIT = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-21}


def reference_grads(q, k, v, do, scale):
    """(dq, dk, dv) in float64 from reference.scores and softmax:
    dS = P (dP - rowsum(dP P)), chapter 8's formulas, materialized."""
    q, k, v, do = (np.asarray(x, np.float64) for x in (q, k, v, do))
    p = reference.softmax(reference.scores(q, k, scale=scale))
    dp = do @ np.swapaxes(v, -1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    return (scale * ds @ k, scale * np.swapaxes(ds, -1, -2) @ q,
            np.swapaxes(p, -1, -2) @ do)


def call_of(q, k, v, opts):
    """The host's record of a call (flashlab.gpu's _Call) for opts."""
    full = dict(scale=None, causal=False, mask=None, window=None,
                kv_lengths=None, dropout_p=0.0, seed=None, align=None)
    return _Call(q, k, v, full | opts)


def statistics(q, k, lse, **opts):
    """row_statistics' (2 BH, Nq) for float32 q, k and the saved lse."""
    call = call_of(q, k, k, opts)
    bh, nq, d = call.bh, call.nq, q.shape[-1]
    stats, stats_k = call.empty((2 * bh, nq))
    kernel("row_statistics", 0, 0)[
        (math.ceil(nq / device.THREADS), bh), device.THREADS, call.stream](
        call.to_kernel(q, (bh, nq, d)),
        call.to_kernel(k, (call.bh_kv, call.nk, d)),
        call.to_kernel(lse, (bh, nq)), stats_k, *call.args)
    return call.result(stats, (2 * bh, nq))


def backward32(q, k, v, o, lse, do, exact=True, **opts):
    """The float32 backward kernels' (dq, dk, dv), launched as the host
    launches them, with row_statistics' stats (exact) or the saved lse
    (the kernels' old contract, P = exp(S - lse))."""
    call = call_of(q, k, v, opts)
    bh, nq, nk, d, d_v = call.bh, call.nq, call.nk, q.shape[-1], v.shape[-1]
    blocked = max(d, d_v) <= backward.BLOCKED_MAX_DIM
    nt, rows = ((device.THREADS, backward.BLOCK_BWD) if blocked
                else (backward.sizes(d, d_v)[0],) * 2)
    qk = call.to_kernel(q, (bh, nq, d))
    kk = call.to_kernel(k, (call.bh_kv, nk, d))
    vk = call.to_kernel(v, (call.bh_kv, nk, d_v))
    dok = call.to_kernel(do, (bh, nq, d_v))
    stats = statistics(q, k, lse, **opts) if exact else lse.reshape(bh, nq)
    stats_k = call.to_kernel(np.ascontiguousarray(stats), stats.shape)
    delta_k = call.to_kernel(np.ascontiguousarray(
        (do * o).sum(-1, dtype=np.float32).reshape(bh, nq)), (bh, nq))
    dq, dq_k = call.empty((bh, nq, d))
    dk, dk_k = call.empty((bh, nk, d))
    dv, dv_k = call.empty((bh, nk, d_v))  # dk, dv per query head
    suffix = "_blocked" if blocked else ""
    kernel("backward_kv" + suffix, d, d_v)[
        (math.ceil(nk / rows), bh), nt, call.stream](
        qk, kk, vk, dok, stats_k, delta_k, dk_k, dv_k, *call.args)
    kernel("backward_q" + suffix, d, d_v)[
        (math.ceil(nq / rows), bh), nt, call.stream](
        qk, kk, vk, dok, stats_k, delta_k, dq_k, *call.args)
    dk, dv = call.group_sum(dk), call.group_sum(dv)
    return tuple(call.result(g, s) for g, s in (
        (dq, q.shape), (dk, k.shape), (dv, v.shape)))


def equal_scores(rng, value, nq=6, nk=10, d=16, d_v=16, tau=0.5):
    """float32 q, k, v (2, N, d) whose rows of tau q.k are all equal,
    between value / 2 and value, exactly: one nonzero product, q_0 k_0
    tau with k_0 = 1 / tau (a power of two)."""
    q, k, v = qkv(rng, (2,), nq, nk, d, d_v, dtype=np.float32)
    k[:] = k[:, :1]
    k[..., 0] = 1 / tau
    k[..., 1:] = 0
    q[..., 0] = value * rng.uniform(0.5, 1.0, (2, nq))
    return q, k, v


def half_grads(q, k, v, o, do, scale, dtype):
    """(want, allowed) for backward_v5's gradients, float64, elementwise.

    want: chapter 8's gradients with D = rowsum(dO o O) of the stored
    16-bit O, as the backward defines them. allowed: P and dS enter their
    products rounded to 16 bits (u/2 each: u times the sums of absolute
    terms, P^T |dO| and tau |dS| |K|, tau |dS|^T |Q|), and dP - D is a
    difference of float32 sums of d products each (2 d 2**-24 <= 2**-17
    of |dO| |V|), times the same |K| and |Q|."""
    q, k, v, o, do = (np.asarray(x, np.float64) for x in (q, k, v, o, do))
    t = np.swapaxes
    p = reference.softmax(reference.scores(q, k, scale=scale))
    dp = do @ t(v, -1, -2)
    ds = p * (dp - (do * o).sum(-1, keepdims=True))
    want = (scale * ds @ k, scale * t(ds, -1, -2) @ q, t(p, -1, -2) @ do)
    u = UNIT[dtype]
    sums = p * (np.abs(do) @ t(np.abs(v), -1, -2))  # P |dO| |V|
    allowed = (
        scale * (u * np.abs(ds) + 2.0**-17 * sums) @ np.abs(k),
        scale * t(u * np.abs(ds) + 2.0**-17 * sums, -1, -2) @ np.abs(q),
        u * t(p, -1, -2) @ np.abs(do))
    return want, allowed


def check_half(got, want, allowed, rounded=None):
    """Each 16-bit gradient within its allowed error, element by element
    (plus float32's few ulps of the largest value, and the rounding to
    dtype `rounded`, UNIT of it, where the kernel stored the gradients
    rounded to it)."""
    for g, w, a in zip(got, want, allowed):
        if rounded is not None:
            a = a + UNIT[rounded] * (np.abs(w) + a)
            # past the dtype's largest value, inf of w's sign is the
            # right rounding of the float32 sum
            big = float(MAX16[rounded])
            g = np.where((np.abs(w) + a > big) & np.isinf(g)
                         & (np.sign(g) == np.sign(w)), w, g)
        assert np.isfinite(g).all()
        slack = 2.0**-20 * float(np.abs(w).max(initial=0))
        assert np.all(np.abs(g - w) <= a + slack), np.abs(g - w).max()


def check(got, want, tol=1e-5):
    """Each gradient within tol of the largest of its truth (or of 1)."""
    for g, w in zip(got, want):
        assert np.isfinite(g).all()
        err = max_abs_err(g, w) / max(1.0, float(np.abs(w).max()))
        assert err < tol, err


@pytest.mark.parametrize("value", [1.8e7, -3.0e38, 3.0e38])
def test_rows_of_equal_huge_scores_get_the_forward_s_gradient(rng, value):
    # lse = m + log 10 rounds to m: exp(S - lse) would give P = 1, ten
    # times 1/10; the stats give (m, 1/10) and the gradients of the
    # forward that the kernels' own lse came from
    q, k, v = equal_scores(rng, value)
    kw = dict(scale=0.5)
    o, lse = tiled.attention(q, k, v, return_lse=True, **kw)
    p_lse = np.exp(q[..., 0].astype(np.float64) - lse)  # exp(S - lse)
    assert np.abs(10 * p_lse - 1).max() > 0.1  # lse lost log 10
    # dO small enough that dK = tau dS^T Q (Q up to 3e38) stays inside
    # float32's range: the gradients themselves must be representable
    do = rng.standard_normal(o.shape).astype(np.float32) / 16
    want = reference_grads(q, k, v, do, 0.5)
    assert all(np.abs(w).max() < 0.5 * np.finfo(np.float32).max
               for w in want)
    check(backward32(q, k, v, o, lse, do, **kw), want)


def test_the_saved_lse_alone_gives_wrong_gradients_there(rng):
    # what the kernels computed before row_statistics: dv 10 times dO/10
    q, k, v = equal_scores(rng, -3.0e38)
    o, lse = tiled.attention(q, k, v, return_lse=True, scale=0.5)
    do = rng.standard_normal(o.shape).astype(np.float32)
    want = reference_grads(q, k, v, do, 0.5)
    _, _, dv = backward32(q, k, v, o, lse, do, exact=False, scale=0.5)
    assert max_abs_err(dv, 10 * want[2]) < 1e-4 * np.abs(want[2]).max()


@pytest.mark.parametrize("d, opts", [
    (16, dict(causal=True)),  # register-blocked kernels
    (96, dict(causal=True)),  # one thread per row
    (16, dict(dropout_p=0.3, seed=7, window=(30, 5))),
])
def test_lossy_rows_among_ordinary_ones(rng, d, opts):
    # a few rows of scores 2**17 + n, n = 0..3 (exact in float32; |lse|
    # >= 64: recomputed), the others ordinary (the saved lse, bit for
    # bit), masks, dropout and grouped heads: gradients as tiled's float64
    q, k, v = qkv(rng, (1, 4), 40, 40, d, 16, dtype=np.float32)
    k, v = k[:, :2], v[:, :2]  # 2 K/V heads for 4 query heads
    big = np.zeros(d, np.float32)
    big[0] = 2.0**17
    q[0, 1, [3, 17, 31]] = big  # query head 1: K/V head 0
    k[0, 0, :, 0] = 1 + rng.integers(0, 4, 40) * 2.0**-17
    kw = dict(scale=1.0, **opts)
    o, lse = tiled.attention(q, k, v, return_lse=True, **kw)
    stats = statistics(q, k, lse, **kw).reshape(2, 1, 4, 40)
    lossy = np.abs(lse) >= device.LSE_EXACT
    assert lossy.sum() == 3
    assert np.array_equal(stats[0][~lossy], lse[~lossy])
    assert np.all(stats[1][~lossy] == 1)
    do = rng.standard_normal(o.shape).astype(np.float32)
    got = backward32(q, k, v, o, lse, do, **kw)
    want = tiled.attention_backward(*(x.astype(np.float64) for x in (
        q, k, v, o, lse, do)), **kw)
    # an ordinary row's float32 score is off by up to EPS32 sum |q_c k_c|
    # (60 to 90 at d = 96, scale 1): P, and each gradient, moves by that
    # much relative, a few times over (the lossy rows' scores are exact)
    s_abs = np.abs(q) @ np.repeat(np.abs(k), 2, 1).swapaxes(-1, -2)
    check(got, want, max(1e-5, 4 * EPS32 * float(s_abs[~lossy].max())))


def test_row_statistics_are_the_rows_max_and_sum(rng):
    # lossy rows: m and 1/l of the row's own scores (l in float32 sums
    # of at most 10 terms: a few eps); others untouched, NaN and -inf too
    q, k, _ = equal_scores(rng, -3.0e38)
    lse = tiled.attention(q, k, k, return_lse=True, scale=0.5)[1]
    lse[1, 2] = np.nan
    lse[1, 3] = -np.inf
    stats = statistics(q, k, lse, scale=0.5).reshape(2, 2, 6)
    s = q[..., 0]  # every key's score: tau q_0 k_0 = q_0 / 2 * 2
    lossy = np.isfinite(lse)
    assert np.array_equal(stats[0][lossy], s[lossy])
    assert np.allclose(stats[1][lossy], 1 / 10, rtol=4e-7, atol=0)
    assert np.isnan(stats[0, 1, 2]) and stats[0, 1, 3] == -np.inf
    assert np.all(stats[1][~lossy] == 1)


def test_the_torch_op_on_the_gpu_path_has_the_forward_s_gradient(rng):
    # end to end through flashlab.gpu.attention_backward
    from flashlab import gpu

    q, k, v = equal_scores(rng, 1.8e7)
    o, lse = tiled.attention(q, k, v, return_lse=True, scale=0.5)
    do = rng.standard_normal(o.shape).astype(np.float32)
    got = gpu.attention_backward(q, k, v, o, lse, do, scale=0.5)
    check(got, reference_grads(q, k, v, do, 0.5))



def test_backward_exponents_shift_first(rng):
    # backward_v5.p_of's exponent, (s tau - shift) log2 e in float32 as
    # the kernels round it: equal huge scores give exponent 0 (P = 1)
    # where folding log2 e into the shift erred by up to 2**38, no finite
    # score overflows, and for ordinary rows P is the forward's (one FMA,
    # s (tau log2 e) - shift log2 e with both constants rounded,
    # warp.online_softmax) within the rounding warp.WIDE bounds:
    # 2**-12 ln 2 at |shift| = WIDE
    f = np.float32

    def exponent(s, tau, shift):
        return (((s * tau).astype(f) - shift).astype(f) * warp.LOG2E
                ).astype(f)

    tau = f(0.125)
    s = rng.standard_normal(10**5).astype(f) * f(1e4)
    for top in (10.0, float(warp.WIDE)):
        shift = f(top)
        x = s[(s * tau).astype(f) <= shift]  # raw scores of the row
        forward = (x.astype(np.float64) * f(tau * warp.LOG2E)
                   - f(shift * warp.LOG2E)).astype(f)
        p_b, p_f = (np.exp2(e.astype(np.float64)) for e in (
            exponent(x, tau, shift), forward))
        assert np.all(np.abs(p_b - p_f) <= 2.0**-12 * np.log(2) * p_f
                      + 2.0**-30), top
    for huge in (1.8e7, -3.0e38, 6.0e4, 3.0e38):
        s = np.full(10, huge, f)
        assert np.all(exponent(s, f(1), s[0]) == 0), huge
        with np.errstate(over="ignore", invalid="ignore"):
            folded = (s.astype(np.float64) * warp.LOG2E
                      - f(s[0] * warp.LOG2E)).astype(f)
        assert abs(huge) < 4096 or not np.all(folded == 0)
    big = np.array([3.0e38, 2.5e38, -3.0e38], f)
    with np.errstate(over="ignore"):
        e = exponent(big, f(1), big[0])
    assert e[0] == 0 and e[1] < -1e37 and e[2] == -np.inf  # P = 1, 0, 0


HALF = {"bf16": "bfloat16", "f16": "float16"}
MAX16 = {"bfloat16": 3.3895313892515355e38,  # (2 - 2**-7) 2**127
         "float16": 65504.0}


def pairs(x):
    """A 16-bit kernel array (torch or numba) seen as int32 pairs."""
    if hasattr(x, "element_size"):  # torch
        import torch

        return x.view(torch.int32)
    return x.view(np.int32)


def backward16(q, k, v, o, lse, do, version=5, **opts):
    """backward_v<version>'s (dq, dk, dv) of 16-bit q, k, v, o, do (numpy
    float16 or torch CUDA tensors), launched as the host launches them,
    with row_statistics_<kind>'s stats; float32 gradients, or 16-bit ones
    for a kernel with registry `grads16`. Version "8 fused": gpu's
    attention_backward with deterministic=False (dQ by TMA's reductions
    into a float32 sum the host rounds); 9: gpu's (those reductions in
    turn)."""
    if version in ("8 fused", 9):
        from flashlab import gpu

        got = gpu.attention_backward(q, k, v, o, lse, do,
                                     version=int(str(version)[0]),
                                     deterministic=version == 9, **opts)
        return tuple(np.asarray(g.float().cpu()) if hasattr(g, "float")
                     else g for g in got)
    call = call_of(q, k, v, opts)
    bh, nq, nk, d, d_v = call.bh, call.nq, call.nk, q.shape[-1], v.shape[-1]
    kind = "bf16" if "bfloat16" in str(q.dtype) else "f16"
    widen = call.arrays.widen
    delta = (widen(do) * widen(o)).sum(-1).reshape(bh, nq)
    qk = call.to_kernel(q, (bh, nq, d))
    kk = call.to_kernel(k, (call.bh_kv, nk, d))
    stats, stats_k = call.empty((2 * bh, nq))
    kernel(f"row_statistics_{kind}", 0, 0)[
        (math.ceil(nq / device.THREADS), bh), device.THREADS, call.stream](
        qk, kk, call.to_kernel(lse.reshape(bh, nq), (bh, nq)), stats_k,
        *call.args)
    inputs = [qk, kk, call.to_kernel(v, (call.bh_kv, nk, d_v)),
              call.to_kernel(do, (bh, nq, d_v)), stats_k,
              call.to_kernel(delta, (bh, nq))]
    shapes = ((bh, nq, d), (bh, nk, d), (bh, nk, d_v))
    names = dict(zip(("dkv", "dq"), registry.backward_names(version, kind)))
    if registry.get(names["dkv"]).grads16:
        # 16-bit pairs, dK and dV per K/V head
        bh_k = call.bh_kv
        shapes = ((bh, nq, d), (bh_k, nk, d), (bh_k, nk, d_v))
        (dq, dq_k), (dk, dk_k), (dv, dv_k) = (
            (out, pairs(view))
            for out, view in (call.empty(s, HALF[kind]) for s in shapes))
    else:
        bh_k = bh
        (dq, dq_k), (dk, dk_k), (dv, dv_k) = (call.empty(s) for s in shapes)
    for part, b_n, outs in (("dkv", bh_k, (dk_k, dv_k)),
                            ("dq", bh, (dq_k,))):
        tr = traits.traits(names[part], d, d_v)
        grid = host.launch_grid(tr, nq, nk, b_n, call.args[0],
                                keys=part == "dkv")  # placed or not
        kernel(tr.name, d, d_v)[grid, tr.threads, call.stream](
            *inputs, *outs, *call.args)
    if bh_k != call.bh_kv:
        dk, dv = call.group_sum(dk), call.group_sum(dv)
    return tuple(np.asarray(call.result(g, s).float().cpu()) if hasattr(
        g, "float") else call.result(g, s) for g, s in (
        (dq, q.shape), (dk, k.shape), (dv, v.shape)))


def to16(dtype, *arrays):
    """float32 arrays as CUDA tensors of a 16-bit dtype (torch)."""
    import torch

    kind = getattr(torch, dtype)
    return [torch.tensor(x, device="cuda").to(kind) for x in arrays]


def as64(*tensors):
    """float64 numpy copies of tensors (the 16-bit values, exactly)."""
    return [x.double().cpu().numpy() for x in tensors]


@pytest.mark.gpu
@pytest.mark.parametrize("version, d", [(5, 64), (7, 64), (8, 64),
                                        ("8 fused", 64), ("8 fused", 128),
                                        (9, 64), (9, 128)])
@pytest.mark.parametrize("dtype, value, tau, do_scale", [
    ("bfloat16", 1.8e7, 0.5, 1.0), ("bfloat16", -3.0e38, 1.0, 2.0**-6),
    ("float16", 6.0e4, 0.5, 1.0)])
def test_16bit_backward_rows_of_equal_huge_scores(rng, dtype, value, tau,
                                                  do_scale, version, d):
    # the tensor-core backwards with row_statistics_<kind>: the gradients
    # of v5's own forward, P = 1/10 in every row (half_grads' budget).
    # At -3e38, dK = tau dS^T Q is about 8e38 for dO ~ 1, past float32's
    # range (inf is then its right rounding): dO is scaled down there
    from test_gpu_tensor_cores import backward_version

    from flashlab import gpu
    fused = version == "8 fused"
    version = backward_version(8) and version if fused else \
        backward_version(version)

    q, k, v = to16(dtype, *equal_scores(rng, value, d=d, d_v=d, tau=tau))
    o, lse = gpu.attention(q, k, v, scale=tau, version=5, return_lse=True)
    do = to16(dtype, do_scale * rng.standard_normal(o.shape).astype(
        np.float32))[0]
    got = backward16(q, k, v, o, lse, do, version, scale=tau)
    check_half(got, *half_grads(*as64(q, k, v, o, do), tau, dtype),
               rounded=dtype if fused or version >= 7 else None)


@pytest.mark.gpu
@pytest.mark.parametrize("version", [5, None])
def test_v5_forward_scores_beyond_the_fold_limit(rng, version):
    # bf16 q.k up to 2.9e38 with tau = 1: s tau log2 e overflowed to inf
    # and inf - inf gave NaN; now each row attends its largest key (ties
    # share), as the reference says. The other rows of head (0, *) have
    # q_0 = 0: a q_0 of order 1 times a k_0 of 1e19 gives scores near
    # 1e16 that differ by the rest of q.k, a few units, which float64
    # tells apart and float32 (an ulp of 1e9 there) cannot, in any kernel
    from flashlab import gpu

    q, k, v = qkv(rng, (2, 2), 70, 90, 64, 64, dtype=np.float32)
    q[0, :, :, 0] = 0
    q[0, :, ::3] = 0
    q[0, :, ::3, 0] = 1.7e19
    k[0, :, :, 0] = rng.uniform(0.5, 1.0, 90) * 1.7e19
    q, k, v = to16("bfloat16", q, k, v)
    o, lse = gpu.attention(q, k, v, scale=1.0, version=version,
                           return_lse=True)
    q64, k64, v64 = as64(q, k, v)
    o_ref, lse_ref = reference.attention(q64, k64, v64, scale=1.0,
                                         return_lse=True)
    o, lse = (x.double().cpu().numpy() for x in (o, lse))
    assert np.isfinite(o).all() and np.isfinite(lse).all()
    u = UNIT["bfloat16"]
    assert max_abs_err(o, o_ref) <= u * (np.abs(v64).max() + np.abs(
        o_ref).max())  # test_gpu_tensor_cores.half_budget
    assert np.all(np.abs(lse - lse_ref) <= 2**-20 * np.abs(lse_ref) + 1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("version", [5, 7, 8, "8 fused"])
def test_16bit_backward_scores_beyond_the_fold_limit(rng, version):
    # the same scores through the tensor-core backwards (half_grads'
    # budget: P is one at each row's largest key, so dS is float32's
    # cancelling dP - D, times |K| and |Q| of 1.7e19)
    from test_gpu_tensor_cores import backward_version

    from flashlab import gpu
    fused = version == "8 fused"
    version = backward_version(8) and version if fused else \
        backward_version(version)

    q, k, v = qkv(rng, (1, 2), 70, 90, 64, 64, dtype=np.float32)
    q[..., 0] = 1.7e19 * rng.choice([0.0, 1.0], (1, 2, 70))
    k[..., 0] = rng.uniform(0.5, 1.0, (1, 2, 90)) * 1.7e19
    q, k, v = to16("bfloat16", q, k, v)
    o, lse = gpu.attention(q, k, v, scale=1.0, version=5, return_lse=True)
    do = to16("bfloat16", rng.standard_normal(o.shape).astype(np.float32))
    got = backward16(q, k, v, o, lse, do[0], version, scale=1.0)
    check_half(got, *half_grads(*as64(q, k, v, o, do[0]), 1.0, "bfloat16"),
               rounded="bfloat16" if fused or version >= 7 else None)


def fold_inputs(rng):
    """float32 q, k, v (2, 2, 5 or 7, 64) whose head (0, 0) has scores
    3e38 k_j, k_j from 0.5 to 1 (the largest exact); the rest ordinary."""
    q, k, v = qkv(rng, (2, 2), 5, 7, 64, 64, dtype=np.float32)
    q[0, 0, :, 0] = 3e38
    q[0, 0, :, 1:] = 0
    k[0, 0, :, 0] = np.linspace(0.5, 1.0, 7)
    return q, k, v


def fold_budget(q, k, v, o, lse, lse_ref, do):
    """(want, allowed) for chapter 9's float32 gradients of fold_inputs:
    half_grads' budget at float32's unit (dS = P (dP - D) cancels at the
    huge rows' one key, and |Q| is 3e38), plus P's error from the
    backward's own float32 scores, 2 d 2**-24 tau |q||k|, and from the
    saved lse, in the ordinary heads (the huge head's largest score is
    exact, k = 1, and its others give P = 0 however they round)."""
    want, allowed = half_grads(q, k, v, o, do, 1.0, "float32")
    q, k, v, o, do = (np.asarray(x, np.float64) for x in (q, k, v, o, do))
    t = np.swapaxes
    p = reference.softmax(reference.scores(q, k, scale=1.0))
    rel = (2 * q.shape[-1] * 2.0**-24 * (np.abs(q) @ t(np.abs(k), -1, -2))
           + np.abs(lse - lse_ref)[..., None])
    rel[0, 0] = 0
    ds = rel * p * np.abs(do @ t(v, -1, -2) - (do * o).sum(-1,
                                                           keepdims=True))
    extra = (ds @ np.abs(k), t(ds, -1, -2) @ np.abs(q),
             t(rel * p, -1, -2) @ np.abs(do))
    return want, [a + e for a, e in zip(allowed, extra)]


def test_float32_backward_scores_beyond_the_fold_limit(rng):
    # chapter 9's float32 backward kernels (the simulator here, the GPU
    # under -m gpu) from tiled's float32 forward: finite, and within
    # fold_budget of float64
    q, k, v = fold_inputs(rng)
    o, lse = tiled.attention(q, k, v, scale=1.0, return_lse=True)
    _, lse_ref = reference.attention(*(x.astype(np.float64) for x in (
        q, k, v)), scale=1.0, return_lse=True)
    do = rng.standard_normal(o.shape).astype(np.float32)
    check_half(backward32(q, k, v, o, lse, do, scale=1.0),
               *fold_budget(q, k, v, o, lse, lse_ref, do))


@pytest.mark.gpu
def test_v6_float32_scores_beyond_the_fold_limit(rng):
    # float32 tau q.k up to 3e38 on the 3xTF32 forward (warp.tile_softmax
    # as v5's), then chapter 9's backward: finite, and the reference's
    q, k, v = fold_inputs(rng)
    from flashlab import gpu

    o, lse = gpu.attention(q, k, v, scale=1.0, version=6, return_lse=True)
    o_ref, lse_ref = reference.attention(*(x.astype(np.float64) for x in (
        q, k, v)), scale=1.0, return_lse=True)
    assert np.isfinite(o).all() and np.isfinite(lse).all()
    assert max_abs_err(o, o_ref) < 1e-5
    # the huge rows: lse = their largest score within 1e-6 relative; the
    # others (ordinary scores, lse near log Nk, where a relative bound
    # says nothing): float32 sums of Nk terms, and each score's 3xTF32
    # error, 2**-21 of sum |q||k| (chapter 10)
    huge = np.zeros(lse_ref.shape, bool)
    huge[0, 0] = True
    assert max_abs_err(lse[huge] / lse_ref[huge], 1.0) < 1e-6
    eps = float(np.finfo(np.float32).eps)
    sums = (np.abs(q.astype(np.float64))
            @ np.swapaxes(np.abs(k.astype(np.float64)), -1, -2)).max(-1)
    tol = eps * (k.shape[-2] + 8 * (1 + np.abs(lse_ref))) + 2.0**-21 * sums
    assert np.all(np.abs(lse - lse_ref)[~huge] <= tol[~huge])
    do = rng.standard_normal(o.shape).astype(np.float32)
    check_half(backward32(q, k, v, o, lse, do, scale=1.0),
               *fold_budget(q, k, v, o, lse, lse_ref, do))
