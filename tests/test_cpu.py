"""The numba CPU kernels against the reference and the tiled path."""

import subprocess
import sys

import numpy as np
import pytest

from flashlab import cpu, reference, tiled
from helpers import float32_budget, max_abs_err, qkv

OPTIONS = [
    dict(),
    dict(causal=True, block_q=16, block_k=8),
    dict(causal="bottom_right", block_q=7, block_k=5),
    dict(window=(6, 2), block_q=8, block_k=8),
    dict(dropout_p=0.3, seed=11, block_q=16, block_k=16),
]


def _random(rng, dtype):
    nq, nk = (int(x) for x in rng.integers(1, 70, size=2))
    return qkv(rng, (2, 2), nq, nk, 16, 8, dtype=dtype), nq, nk


@pytest.mark.parametrize("opts", OPTIONS)
def test_float64_forward_and_backward_match_tiled(rng, opts):
    (q, k, v), nq, nk = _random(rng, np.float64)
    mask = rng.random((2, 1, nq, nk)) < 0.8
    lengths = rng.integers(0, nk + 1, size=(2, 1))
    for extra in (dict(), dict(mask=mask, kv_lengths=lengths)):
        o, lse = cpu.attention(q, k, v, return_lse=True, **opts, **extra)
        o_ref, lse_ref = reference.attention(
            q, k, v, return_lse=True,
            **{x: y for x, y in {**opts, **extra}.items()
               if x not in ("block_q", "block_k")})
        assert max_abs_err(o, o_ref) < 1e-12
        finite = np.isfinite(lse_ref)
        assert np.array_equal(finite, np.isfinite(lse))
        assert max_abs_err(lse[finite], lse_ref[finite]) < 1e-12
        do = rng.standard_normal(o.shape)
        got = cpu.attention_backward(q, k, v, o, lse, do, **opts, **extra)
        want = tiled.attention_backward(q, k, v, o, lse, do, **opts,
                                        **extra)
        for g, w in zip(got, want):
            assert max_abs_err(g, w) < 1e-12


@pytest.mark.parametrize("opts", OPTIONS[:3])
def test_float32_within_twice_naive_error(rng, opts):
    (q, k, v), nq, nk = _random(rng, np.float32)
    o = cpu.attention(q, k, v, **opts)
    plain = {x: y for x, y in opts.items() if x not in ("block_q",
                                                        "block_k")}
    o_ref = reference.attention(q, k, v, **plain)
    err_naive = max_abs_err(reference.naive(q, k, v, **plain), o_ref)
    assert o.dtype == np.float32
    merges = -(-nk // opts.get("block_k", 64))
    assert max_abs_err(o, o_ref) <= float32_budget(err_naive, o_ref, merges)


def test_fully_masked_rows_and_huge_scores(rng):
    q, k, v = qkv(rng, (), 9, 13, 4, 3)
    q *= 100  # scores of order 1e4
    mask = rng.random((9, 13)) < 0.5
    mask[3] = False
    o, lse = cpu.attention(q, k, v, mask=mask, return_lse=True,
                           block_q=4, block_k=4)
    assert np.all(o[3] == 0) and lse[3] == -np.inf
    assert np.all(np.isfinite(o))
    assert max_abs_err(o, reference.attention(q, k, v, mask=mask)) < 1e-12


def test_deterministic_across_thread_counts(rng):
    import numba

    q, k, v = qkv(rng, (3,), 50, 50, 8, 8, dtype=np.float32)
    do = rng.standard_normal((3, 50, 8)).astype(np.float32)
    results = []
    for threads in (1, numba.config.NUMBA_NUM_THREADS):
        numba.set_num_threads(threads)
        o, lse = cpu.attention(q, k, v, return_lse=True, block_q=8)
        results.append((o, *cpu.attention_backward(q, k, v, o, lse, do,
                                                   block_q=8)))
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    for a, b in zip(*results):
        assert np.array_equal(a, b)


def test_bad_input():
    x = np.zeros((4, 4))
    with pytest.raises(ValueError, match="block_k"):
        cpu.attention(x, x, x, block_k=0)
    with pytest.raises(ValueError, match="do: expected shape"):
        cpu.attention_backward(x, x, x, x, np.zeros(4), np.zeros((3, 4)))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("opts", OPTIONS[:4])
def test_both_backward_schedules(rng, monkeypatch, threads, opts):
    # 4 heads: one pass with a head per thread when there are at least as
    # many heads as threads (1 thread), else (8 threads) the two passes
    monkeypatch.setattr(cpu.numba, "get_num_threads",
                        lambda: 1 if threads == 1 else 8)
    q, k, v = qkv(rng, (2, 2), 45, 37, 16, 8)
    o, lse = tiled.attention(q, k, v, return_lse=True, **opts)
    do = rng.standard_normal(o.shape)
    got = cpu.attention_backward(q, k, v, o, lse, do, **opts)
    want = tiled.attention_backward(q, k, v, o, lse, do, **opts)
    for g, w in zip(got, want):
        assert max_abs_err(g, w) < 1e-12


def test_default_tiles_cover_long_rows(rng):
    # N past one 256 x 512 tile in both directions, float32 budget
    q, k, v = qkv(rng, (1, 2), 700, 1100, 64, 64, dtype=np.float32)
    o = cpu.attention(q, k, v, causal=True)
    o_ref = reference.attention(q, k, v, causal=True)
    err_naive = max_abs_err(reference.naive(q, k, v, causal=True), o_ref)
    assert max_abs_err(o, o_ref) <= float32_budget(err_naive, o_ref, 3)


def test_long_sequence_in_linear_memory():
    # N = 32768: an (N, N) float32 matrix would be 4 GiB; the kernel keeps
    # one score tile per thread. Measured in a fresh process by its peak
    # resident memory before and after.
    code = (
        "import resource, numpy as np\n"
        "from flashlab import cpu\n"
        "rng = np.random.default_rng(0)\n"
        "small = [rng.standard_normal((1, 300, 64), dtype=np.float32)] * 3\n"
        "cpu.attention(*small, causal=True)\n"
        "q, k, v = (rng.standard_normal((1, 32768, 64), dtype=np.float32)\n"
        "           for _ in range(3))\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "o = cpu.attention(q, k, v, causal=True)\n"
        "after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "assert np.isfinite(o).all()\n"
        "print((after - before) * 1024)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True,
                          text=True, timeout=300, check=True)
    grown = int(done.stdout.split()[-1])
    io_bytes = 4 * 32768 * 64 * 4  # q, k, v and o
    assert grown < 2 * io_bytes + 64 * 2**20  # not N^2 (4 GiB)


def _reference_grads(q, k, v, do, **rules):
    """(dq, dk, dv) in float64 from flashlab.reference's materialized P:
    dV = P^T dO, dS = P (dP - rowsum(dP P)), dQ = tau dS K, dK = tau dS^T Q.
    """
    q, k, v, do = (np.asarray(x, np.float64) for x in (q, k, v, do))
    tau = rules.get("scale") or 1 / np.sqrt(q.shape[-1])
    p = reference.softmax(reference.scores(q, k, **rules))  # (..., Nq, Nk)
    dp = do @ np.swapaxes(v, -1, -2)
    ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True))
    return (tau * ds @ k, tau * np.swapaxes(ds, -1, -2) @ q,
            np.swapaxes(p, -1, -2) @ do)


def _relative(x, ref):
    """max |x - ref| over max(1, max |ref|)."""
    return max_abs_err(x, ref) / max(1.0, float(np.abs(ref).max()))


@pytest.mark.parametrize("value", [1.8e7, -1e30])
def test_backward_of_huge_equal_scores_float32(rng, value):
    # every score of a row equal and huge: lse = m + log Nk rounds to m in
    # float32, so P recomputed from lse alone would be 1 for every key
    # (Nk times too large); the gradients must still be those of P = 1/Nk
    q, k, v = qkv(rng, (2,), 6, 10, 4, 3, dtype=np.float32)
    k[:] = k[:, :1]  # every key the same: every score of a row equal
    q[:, :, 0] = value / (k[:, :1, 0] / 2)  # tau = 1/2: scores ~value
    do = rng.standard_normal((2, 6, 3)).astype(np.float32)
    o, lse = cpu.attention(q, k, v, return_lse=True, block_q=4, block_k=4)
    assert np.isfinite(lse).all()
    for g, w in zip(cpu.attention_backward(q, k, v, o, lse, do, block_q=4,
                                           block_k=4),
                    _reference_grads(q, k, v, do)):
        assert _relative(g, w) < 1e-5  # float32: a few ulps of |w|


@pytest.mark.parametrize("opts", OPTIONS[:4])
def test_backward_of_huge_scores_float64(rng, opts):
    # scores of order 1e17 in float64 (ulp 16 > log Nk): rows whose lse
    # has lost log l, beside ordinary rows, under every mask rule; plus
    # one row of scores near -1e300 (as a whole row masked by a large
    # finite fill)
    q, k, v = qkv(rng, (2, 2), 33, 21, 8, 5)
    k[..., 0] = 1.0
    q[0, 1, :, 1:] = 0
    q[0, 1, :, 0] = 1e17 * np.sqrt(8)  # every score of those rows 1e17
    q[1, 0, 4, 1:] = 0
    q[1, 0, 4, 0] = -1e300
    do = rng.standard_normal((2, 2, 33, 5))
    o, lse = cpu.attention(q, k, v, return_lse=True, **opts)
    rules = {x: y for x, y in opts.items() if x not in ("block_q",
                                                        "block_k")}
    want = _reference_grads(q, k, v, do, **rules)
    for g, w in zip(cpu.attention_backward(q, k, v, o, lse, do, **opts),
                    want):
        assert np.isfinite(g).all()
        assert _relative(g, w) < 1e-12  # float64: sums of Nk terms


def test_backward_of_stride_zero_broadcast_inputs(rng):
    # q and k broadcast over a batch dim by np.broadcast_to (stride 0, as
    # torch's expand hands them over): dq must not inherit the stride
    q, k, v = qkv(rng, (), 5, 6, 4, 3)
    v = rng.standard_normal((3, 6, 3))
    q3, k3 = np.broadcast_to(q, (3, 5, 4)), np.broadcast_to(k, (3, 6, 4))
    do = rng.standard_normal((3, 5, 3))
    o, lse = cpu.attention(q3, k3, v, return_lse=True)
    want = _reference_grads(q3, k3, v, do)
    for g, w in zip(cpu.attention_backward(q3, k3, v, o, lse, do), want):
        assert max_abs_err(g, w) < 1e-12


@pytest.mark.parametrize("causal, window, align", [
    (False, None, None), (True, None, None),
    ("bottom_right", None, None), (False, (3, 0), None),
    (True, (4, 2), "bottom_right"), (False, (0, 5), None)])
def test_row_span_is_pair_allowed(rng, causal, window, align):
    # the span the softmax and the backward loop over, against the
    # per-pair rule, for every row, tile offset and padded length
    from flashlab import kernel_args, masks

    nq, nk = (int(x) for x in rng.integers(1, 40, size=2))
    if align == "bottom_right":
        nk = max(nk, nq)
    q, k = np.zeros((1, nq, 2)), np.zeros((1, nk, 2))
    *_, a = kernel_args.flatten(q, k, k, dict(
        block_q=8, block_k=8, scale=None, causal=causal, mask=None,
        window=window, kv_lengths=None, dropout_p=0.0, seed=None,
        align=align))
    r = a.rules
    for kv_len in (nk, int(rng.integers(0, nk + 1))):
        for j0 in range(0, nk, 5):
            bc = min(5, nk - j0)
            for i in range(nq):
                lo, hi = cpu._row_span(i, j0, bc, r, kv_len)
                want = [masks.pair_allowed(i, j0 + c, r, kv_len)
                        for c in range(bc)]
                got = [lo <= c < hi for c in range(bc)]
                assert got == want, (i, j0, kv_len)
