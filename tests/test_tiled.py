"""Tiled attention against the float64 reference, edges and bad input."""

import numpy as np
import pytest

from flashlab import reference, tiled
from helpers import float32_budget, max_abs_err, qkv

CAUSAL = [False, True, "top_left", "bottom_right"]


def random_case(rng):
    """A random batch shape, sizes and block sizes (often non-dividing)."""
    batch = tuple(rng.integers(1, 4, size=rng.integers(0, 3)))
    nq, nk = (int(x) for x in rng.integers(1, 70, size=2))
    d, dv = (int(x) for x in rng.integers(1, 20, size=2))
    bq, bk = (int(x) for x in rng.integers(1, 80, size=2))
    return batch, nq, nk, d, dv, bq, bk


@pytest.mark.parametrize("order", ["fa2", "fa1"])
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("trial", range(5))
def test_float64_matches_reference(rng, causal, trial, order):
    batch, nq, nk, d, dv, bq, bk = random_case(rng)
    q, k, v = qkv(rng, batch, nq, nk, d, dv)
    o, lse = tiled.attention(q, k, v, block_q=bq, block_k=bk, causal=causal,
                             return_lse=True, order=order)
    o_ref, lse_ref = reference.attention(q, k, v, causal=causal,
                                         return_lse=True)
    assert o.dtype == np.float64
    assert max_abs_err(o, o_ref) < 1e-12  # float64: only summation order
    finite = np.isfinite(lse_ref)
    assert np.array_equal(finite, np.isfinite(lse))
    assert max_abs_err(lse[finite], lse_ref[finite]) < 1e-12


@pytest.mark.parametrize("order", ["fa2", "fa1"])
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("trial", range(3))
def test_float32_within_twice_naive_error(rng, causal, trial, order):
    batch, nq, nk, d, dv, bq, bk = random_case(rng)
    q, k, v = qkv(rng, batch, nq, nk, d, dv, dtype=np.float32, spread=2.0)
    # Exact scores: q and k on a grid of 1/16 (|x| < 16 in any draw a
    # run meets) make each product a multiple of 1/256 and each sum of
    # d <= 19 of them one below 2**16, exact in float32 in any order; a
    # power-of-two scale near 1/sqrt(d) keeps them exact. Rounded
    # scores move P by up to |s| eps relatively, each program its own
    # way, so twice naive's error is no bound where a row's top two
    # scores nearly tie; even widened to eps s_max max |v| for that,
    # the budget was 0.95 used up once in 150000 draws.
    q, k = (np.rint(x * 16) / 16 for x in (q, k))
    scale = 2.0 ** -np.round(np.log2(d) / 2)
    o = tiled.attention(q, k, v, block_q=bq, block_k=bk, causal=causal,
                        order=order, scale=scale)
    o_ref = reference.attention(q, k, v, causal=causal, scale=scale)
    err_naive = max_abs_err(reference.naive(q, k, v, causal=causal,
                                            scale=scale), o_ref)
    assert o.dtype == np.float32
    merges = -(-nk // bk)
    # over 150000 draws at most 0.59 of the budget
    assert max_abs_err(o, o_ref) <= float32_budget(err_naive, o_ref,
                                                   merges)


def test_boolean_mask_with_fully_masked_rows(rng):
    q, k, v = qkv(rng, (2, 3), 20, 33, 8, 5)
    mask = rng.random((2, 1, 20, 33)) < 0.3  # broadcast over heads
    mask[0, 0, 4] = False  # a row with no allowed key
    mask[1, 0, :, 8:16] = False  # a tile column with nothing allowed
    with np.errstate(all="raise"):
        o, lse = tiled.attention(q, k, v, block_q=6, block_k=8, mask=mask,
                                 return_lse=True)
    o_ref, lse_ref = reference.attention(q, k, v, mask=mask,
                                         return_lse=True)
    assert np.all(o[0, :, 4] == 0) and np.all(lse[0, :, 4] == -np.inf)
    assert max_abs_err(o, o_ref) < 1e-12
    assert np.array_equal(np.isneginf(lse), np.isneginf(lse_ref))


def test_causal_with_more_queries_than_keys_leaves_rows_empty(rng):
    q, k, v = qkv(rng, (), 10, 4, 3, 3)
    o, lse = tiled.attention(q, k, v, block_q=3, block_k=3,
                             causal="bottom_right", return_lse=True)
    # Bottom-right: query i sees keys j <= i - 6, so rows 0..5 see nothing.
    assert np.all(o[:6] == 0) and np.all(lse[:6] == -np.inf)
    assert max_abs_err(o, reference.attention(
        q, k, v, causal="bottom_right")) < 1e-12


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_huge_scores(rng, dtype):
    q, k, v = qkv(rng, (), 9, 13, 4, 3, dtype=dtype)
    # Scores of order 1e4, from whole-number q and k: every product and
    # sum of d = 4 of them is an integer below 2**24, exact in float32
    # whatever the order, and the scale 1/2 is exact too. Rounded
    # scores err by up to half an ulp of 1e4 (5e-4) each, so in a row
    # whose top two scores nearly tie, the program and naive float32,
    # rounding them differently, can differ by 1e-4: with correct code
    # 5 draws in 20000 of normal q, k times 100 missed the budget below,
    # by up to 3.9 times.
    q, k = (np.rint(x * 100) for x in (q, k))
    with np.errstate(over="raise", invalid="raise"):
        o = tiled.attention(q, k, v, block_q=4, block_k=5)
    o_ref = reference.attention(q, k, v)
    # Exact scores, near-one-hot or nearly tied: float32 error is a few
    # ulps of |v| from the exponentials and sums, as naive float32's.
    err_naive = max_abs_err(reference.naive(q, k, v), o_ref)
    assert max_abs_err(o, o_ref) <= float32_budget(err_naive, o_ref, 3)


def test_single_query_and_single_key(rng):
    q, k, v = qkv(rng, (), 1, 1, 4, 3)
    assert max_abs_err(tiled.attention(q, k, v), v) < 1e-15


def test_seed_000_figure_3():
    q = np.array([[1.0, 0.0], [0.0, 1.0]])
    k = np.array([[1.0, 2.0], [2.0, 1.0], [3.0, 0.0], [2.0, 1.0]])
    v = np.array([[2.0, 0.0], [0.0, 2.0], [0.0, 2.0], [1.0, 1.0]])
    o = tiled.attention(q, k, v, block_q=2, block_k=2, scale=1.0)
    assert np.round(o, 3).tolist() == [[0.341, 1.659], [1.266, 0.734]]
    steps = tiled.trace(q, k, v, block_q=2, block_k=2, scale=1.0)
    second = steps[1]
    alpha = np.exp(second.before.m - second.after.m)
    assert np.round(alpha, 3).tolist() == [0.368, 1.0]  # per-row rescale


@pytest.mark.parametrize("block_k", [1, 2, 3, 4, 7])
def test_seed_001_key_tiles(block_k):
    q = np.array([[1, 0], [0, 1], [1, 1], [-1, 0], [0, -1], [1, -1.0]])
    k = np.array([[-1, 0], [0, 1], [2, 0], [1, 1], [3, -1], [-1, 2.0]])
    v = np.array([[1, 0], [0, 2], [-1, 1], [2, -1], [0.5, 3], [-2, 0.5]])
    o = tiled.attention(q, k, v, block_q=2, block_k=block_k)
    assert max_abs_err(o, reference.attention(q, k, v)) < 1e-12


def test_trace_holds_one_tile_and_skips_masked_ones(rng):
    q, k, v = qkv(rng, (), 64, 64, 4, 4)
    steps = tiled.trace(q, k, v, block_q=16, block_k=16, causal=True)
    assert all(t.scores.shape == (16, 16) for t in steps)
    assert len(steps) == 10  # 4 x 4 tiles, the 6 above the diagonal skipped
    assert len(tiled.trace(q, k, v, block_q=16, block_k=16)) == 16


BAD = [
    (dict(k=np.zeros((5, 3))), ValueError, "k: expected head dim d=4"),
    (dict(v=np.zeros((6, 4))), ValueError, "v: expected Nk=5"),
    (dict(q=np.zeros((2, 5, 4)), k=np.zeros((3, 5, 4))), ValueError,
     "k: expected leading dims"),
    (dict(q=np.zeros((5, 4), dtype=int)), TypeError, "q: expected a float"),
    (dict(v=np.zeros((5, 4), np.float32)), TypeError, "v: expected dtype"),
    (dict(q=np.zeros(4)), ValueError, "q: expected at least 2 dims"),
    (dict(block_q=0), ValueError, "block_q"),
    (dict(block_k=2.5), TypeError, "block_k"),
    (dict(mask=np.ones((5, 6), bool)), ValueError, "mask: expected a shape"),
    (dict(mask=np.ones((3, 5, 5), bool)), ValueError, "mask"),
    (dict(mask=np.ones((5, 5), int)), TypeError, "mask: expected a boolean"),
    (dict(causal="diagonal"), ValueError, "causal"),
    (dict(scale=float("nan")), ValueError, "scale"),
    (dict(scale="1"), TypeError, "scale"),
    (dict(window=(2,)), ValueError, "window"),
    (dict(window=(-1, 2)), ValueError, "window"),
    (dict(kv_lengths=np.array([2.0])), TypeError, "kv_lengths"),
    (dict(kv_lengths=np.array([6])), ValueError, "kv_lengths"),
    (dict(kv_lengths=np.array([1, 2])), ValueError, "kv_lengths"),
    (dict(order="fa3"), ValueError, "order"),
]


@pytest.mark.parametrize("change, error, message", BAD)
def test_bad_input_names_the_argument(change, error, message):
    args = dict(q=np.zeros((5, 4)), k=np.zeros((5, 4)), v=np.zeros((5, 4)))
    args.update(change)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with pytest.raises(error, match=message):
        tiled.attention(q, k, v, **args)
    if not {"block_q", "block_k", "order"} & set(args):
        with pytest.raises(error, match=message):
            reference.attention(q, k, v, **args)
