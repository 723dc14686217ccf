"""The merge algebra: exactness, the empty identity, order, huge scores."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashlab import merge, reference
from helpers import max_abs_err

EPS64 = float(np.finfo(np.float64).eps)


def direct(scores, values):
    """Stable softmax-weighted sum of values over all scores at once."""
    return reference.softmax(scores) @ values


def average_tol(v):
    """Two float64 orders of a softmax average of the rows of v (C, d_v):
    each is off by at most C + 2 half-ulps of max |v| (C products, C - 1
    additions and the division, with weights summing to 1), so they
    differ by at most C + 2 ulps of it."""
    return (v.shape[-2] + 2) * EPS64 * float(np.abs(v).max())


def test_summary_output_is_softmax_average(rng):
    # 1e-15 was 2 ulps of values in [2, 4): 6 seeds in 20000 exceeded
    # it (rng seed 4312); the worst of them is 2.5 ulps of max |v|
    s = rng.standard_normal(11) * 3
    v = rng.standard_normal((11, 4))
    err = max_abs_err(merge.summarize(s, v).output(), direct(s, v))
    assert err <= average_tol(v)


def test_merge_of_any_split_is_exact(rng):
    s = rng.standard_normal((5, 20)) * 4  # 5 query rows, 20 keys
    v = rng.standard_normal((20, 3))
    cut = int(rng.integers(1, 20))
    a = merge.summarize(s[:, :cut], v[:cut])
    b = merge.summarize(s[:, cut:], v[cut:])
    both = merge.merge(a, b)
    assert max_abs_err(both.output(), direct(s, v)) < 1e-14
    whole = merge.summarize(s, v)
    assert max_abs_err(both.lse(), whole.lse()) < 1e-14


def test_seed_003_large_scores_without_overflow():
    s = np.array([1000.0, 1001.0, 999.0])
    v = np.array([[2.0], [4.0], [8.0]])
    with np.errstate(over="raise"):
        a = merge.summarize(s[:2], v[:2])
        b = merge.summarize(s[2:], v[2:])
        ab = merge.merge(a, b)
    assert ab.m == 1001.0
    assert round(float(ab.l), 4) == 1.5032
    assert round(float(ab.u[0]), 4) == 5.8184
    assert round(float(ab.output()[0]), 4) == 3.8707
    assert max_abs_err(ab.output(), direct(s, v)) < 1e-14


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_scores_near_1e4_stay_finite(rng, dtype):
    s = (1e4 + rng.standard_normal((3, 8))).astype(dtype)
    s[1] = -s[1]
    v = rng.standard_normal((8, 2)).astype(dtype)
    with np.errstate(all="raise"):
        out = merge.merge(merge.summarize(s[:, :3], v[:3]),
                          merge.summarize(s[:, 3:], v[3:])).output()
    assert out.dtype == dtype
    tol = 1e-5 if dtype == np.float32 else 1e-12
    assert max_abs_err(out, direct(s.astype(np.float64), v)) < tol


def test_empty_block_is_the_identity(rng):
    s = rng.standard_normal((4, 6))
    v = rng.standard_normal((6, 3))
    a = merge.summarize(s, v)
    e = merge.empty((4,), 3, np.float64)
    with np.errstate(all="raise"):  # no (-inf) - (-inf), no 0/0
        for got in (merge.merge(a, e), merge.merge(e, a)):
            assert np.array_equal(got.m, a.m)
            assert np.array_equal(got.l, a.l)
            assert np.array_equal(got.u, a.u)
        none = merge.merge(e, merge.summarize(np.full((4, 2), -np.inf),
                                              v[:2]))
        assert np.all(none.output() == 0)
        assert np.all(none.lse() == -np.inf)


def test_partially_masked_block(rng):
    s = rng.standard_normal((3, 5))
    s[0, :4] = -np.inf  # row 0 sees only the last key
    v = rng.standard_normal((5, 2))
    with np.errstate(all="raise"):
        out = merge.summarize(s, v).output()
    assert np.allclose(out[0], v[4], rtol=0, atol=1e-15)
    assert max_abs_err(out, direct(s, v)) <= average_tol(v)


blocks = st.lists(
    st.lists(st.floats(-50, 50), min_size=0, max_size=5),
    min_size=3, max_size=3,
)


def _summaries(lists, seed):
    rng = np.random.default_rng(seed)
    out = []
    for scores in lists:
        s = np.array(scores, dtype=np.float64).reshape(len(scores))
        v = rng.standard_normal((len(scores), 2))
        if len(scores) == 0:
            out.append(merge.empty((), 2, np.float64))
        else:
            out.append(merge.summarize(s, v))
    return out


def _close(x, y):
    """Same summary up to rounding: a few ulps of the larger numbers."""
    assert np.array_equal(x.m, y.m)
    for p, q in ((x.l, y.l), (x.u, y.u)):
        tol = 1e-14 * max(1.0, float(np.max(np.abs(p))))
        assert np.max(np.abs(p - q)) <= tol


@settings(max_examples=200, deadline=None)
@given(blocks, st.integers(0, 2**32 - 1))
def test_merge_is_associative(lists, seed):
    a, b, c = _summaries(lists, seed)
    _close(merge.merge(merge.merge(a, b), c),
           merge.merge(a, merge.merge(b, c)))


@settings(max_examples=200, deadline=None)
@given(blocks, st.integers(0, 2**32 - 1))
def test_merge_is_commutative(lists, seed):
    a, b, _ = _summaries(lists, seed)
    _close(merge.merge(a, b), merge.merge(b, a))


def test_row_step_is_the_merge_for_one_row(rng):
    lowest = float(np.finfo(np.float64).min)
    s = rng.standard_normal(12) * 4
    s[3:5] = -np.inf
    v = rng.standard_normal((12, 2))
    m, l, u = -np.inf, 0.0, np.zeros(2)
    for j0 in (0, 3, 5, 9):  # tiles [0, 3), [3, 5) (masked), [5, 9), ...
        t = s[j0:{0: 3, 3: 5, 5: 9, 9: 12}[j0]]
        m, shift, alpha = merge.row_step(m, t.max(), lowest)
        p = np.exp(t - shift)
        l = alpha * l + p.sum()
        u = alpha * u + p @ v[j0:j0 + len(t)]
    whole = merge.summarize(s, v)
    assert m == whole.m and abs(l - whole.l) < 1e-14
    assert max_abs_err(u, whole.u) < 1e-14
    # a row that has seen nothing stays empty without NaN
    with np.errstate(all="raise"):
        m0, shift0, alpha0 = merge.row_step(-np.inf, -np.inf, lowest)
        assert (m0, alpha0) == (-np.inf, 0.0)
        assert np.exp(-np.inf - shift0) == 0.0
        assert merge.row_probability(-np.inf, -np.inf, lowest) == 0.0


def test_combine_equals_merging_summaries_and_handles_empty_splits(rng):
    s = rng.standard_normal((3, 40)) * 4  # 3 rows, 40 keys
    v = rng.standard_normal((40, 5))
    s[1, :14] = -np.inf  # row 1 sees nothing in the first split
    s[2] = -np.inf  # row 2 sees nothing at all
    cuts = [0, 14, 15, 33, 40]
    parts = [merge.summarize(s[:, a:b], v[a:b])
             for a, b in zip(cuts, cuts[1:])]
    outs = np.stack([p.output() for p in parts])  # (4, 3, 5)
    lses = np.stack([p.lse() for p in parts])  # (4, 3)
    out, lse = merge.combine(outs, lses)
    whole = merge.summarize(s, v)
    assert np.max(np.abs(out - whole.output())) < 1e-12
    fin = np.isfinite(whole.lse())
    assert np.max(np.abs(lse[fin] - whole.lse()[fin])) < 1e-12
    assert np.all(out[2] == 0) and np.isneginf(lse[2])
    # associative: combining combined halves gives the same answer
    left = merge.combine(outs[:2], lses[:2])
    right = merge.combine(outs[2:], lses[2:])
    again, _ = merge.combine(np.stack([left[0], right[0]]),
                          np.stack([left[1], right[1]]))
    assert np.max(np.abs(again - out)) < 1e-12


def test_combine_with_each_splits_sum_weighs_splits_at_huge_scores(rng):
    # float32 rows whose scores are all 3e38 (or finfo.min, a fully masked
    # row of an additive mask): m + log l rounds to m in every split, so
    # (out, lse) cannot weigh the splits; (out, m, l) can
    for score in (3e38, float(np.finfo(np.float32).min), 1e6):
        s = np.full((2, 40), score, np.float32)
        v = rng.standard_normal((40, 3))
        cuts = [0, 8, 30, 40]  # splits of 8, 22 and 10 keys
        # each split's values centred on 1, -1 and 0: the mean is then
        # (8 - 22) / 40 = -0.35 and the splits weighed equally give 0, a
        # miss of 0.35 for every draw (with raw draws the miss is
        # N(0, 0.07): under 1e-2 in every column about one run in 300)
        for a, b, centre in zip(cuts, cuts[1:], (1.0, -1.0, 0.0)):
            v[a:b] += centre - v[a:b].mean(axis=0)
        v = v.astype(np.float32)
        parts = [merge.summarize(s[:, a:b], v[a:b])
                 for a, b in zip(cuts, cuts[1:])]
        outs = np.stack([p.output() for p in parts])
        want = v.astype(np.float64).mean(axis=0)  # equal scores: the mean
        out, m, l = merge.combine(outs, np.stack([p.m for p in parts]),
                                  np.stack([p.l for p in parts]))
        assert np.max(np.abs(out - want)) < 1e-6, score
        # the (m, l) it returns are the whole row's: every key, one max
        assert np.all(m == np.float32(score)) and np.all(l == 40), score
        if score != 1e6:  # the form with lse alone cannot tell them apart
            lossy, _ = merge.combine(outs, np.stack([p.lse()
                                                     for p in parts]))
            assert np.max(np.abs(lossy - want)) > 1e-2
    # a split with no allowed key (m = -inf, l = 0) adds nothing
    s = rng.standard_normal((3, 12))
    v = rng.standard_normal((12, 2))
    s[:, :5] = -np.inf
    parts = [merge.summarize(s[:, :5], v[:5]), merge.summarize(s[:, 5:],
                                                               v[5:])]
    out, m, l = merge.combine(np.stack([p.output() for p in parts]),
                              np.stack([p.m for p in parts]),
                              np.stack([p.l for p in parts]))
    whole = merge.summarize(s, v)
    assert np.max(np.abs(out - whole.output())) < 1e-12
    assert np.all(m == whole.m)
    assert np.max(np.abs(l / whole.l - 1)) < 1e-12
    with pytest.raises(ValueError, match="ls: expected shape"):
        merge.combine(np.zeros((2, 3, 4)), np.zeros((2, 3)), np.ones(2))


def test_combine_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="lses: expected shape"):
        merge.combine(np.zeros((2, 3, 4)), np.zeros((2, 4)))
