"""The reference against an independent scalar loop and against torch."""

import math

import numpy as np
import pytest
import torch

from flashlab import reference
from helpers import max_abs_err, qkv


def loop_attention(q, k, v, scale, keep):
    """Row by row with Python floats: the definition, nothing shared."""
    nq, nk = keep.shape
    out = np.zeros((nq, v.shape[1]))
    for i in range(nq):
        s = [scale * float(q[i] @ k[j]) for j in range(nk) if keep[i, j]]
        js = [j for j in range(nk) if keep[i, j]]
        if not js:
            continue
        m = max(s)
        w = [math.exp(x - m) for x in s]
        out[i] = sum(wj * v[j] for wj, j in zip(w, js)) / sum(w)
    return out


@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
def test_matches_scalar_loop(rng, causal):
    nq, nk = rng.integers(1, 12, size=2)
    q, k, v = qkv(rng, (), nq, nk, 5, 3)
    mask = rng.random((nq, nk)) < 0.7
    offset = {False: None, True: 0, "bottom_right": nk - nq}[causal]
    keep = mask.copy()
    if offset is not None:
        keep &= np.arange(nk)[None, :] <= np.arange(nq)[:, None] + offset
    got = reference.attention(q, k, v, causal=causal, mask=mask)
    want = loop_attention(q, k, v, 1 / math.sqrt(5), keep)
    assert max_abs_err(got, want) < 1e-13  # same float64 math, other order


@pytest.mark.parametrize("causal", [False, True])
def test_matches_torch_sdpa(rng, causal):
    q, k, v = qkv(rng, (2, 3), 17, 17, 8, 8)
    want = torch.nn.functional.scaled_dot_product_attention(
        *(torch.from_numpy(x) for x in (q, k, v)), is_causal=causal
    ).numpy()
    got = reference.attention(q, k, v, causal=causal)
    assert max_abs_err(got, want) < 1e-13


def test_bool_mask_matches_torch_sdpa(rng):
    q, k, v = qkv(rng, (2,), 9, 13, 4, 6)
    mask = rng.random((2, 9, 13)) < 0.5
    mask[:, :, 0] = True  # torch's math path gives NaN for empty rows
    want = torch.nn.functional.scaled_dot_product_attention(
        *(torch.from_numpy(x) for x in (q, k, v)),
        attn_mask=torch.from_numpy(mask),
    ).numpy()
    got = reference.attention(q, k, v, mask=mask)
    assert max_abs_err(got, want) < 1e-13


def test_lse_is_log_of_row_sums(rng):
    q, k, v = qkv(rng, (3,), 6, 10, 4, 4)
    _, lse = reference.attention(q, k, v, scale=0.7, return_lse=True)
    s = 0.7 * q @ np.swapaxes(k, -1, -2)
    want = np.log(np.exp(s).sum(axis=-1))  # small scores: no overflow
    assert max_abs_err(lse, want) < 1e-13


def test_empty_rows_give_zero_and_minus_inf(rng):
    q, k, v = qkv(rng, (), 4, 5, 3, 2)
    mask = np.ones((4, 5), dtype=bool)
    mask[2] = False
    with np.errstate(all="raise"):
        o, lse = reference.attention(q, k, v, mask=mask, return_lse=True)
    assert np.all(o[2] == 0) and lse[2] == -np.inf
    assert np.all(np.isfinite(o)) and np.isfinite(lse[[0, 1, 3]]).all()


def test_naive_keeps_input_precision(rng):
    q, k, v = qkv(rng, (), 8, 8, 4, 4, dtype=np.float32)
    assert reference.naive(q, k, v).dtype == np.float32
    assert reference.attention(q, k, v).dtype == np.float64
