"""The three-kernel materialized path computes attention."""

import numpy as np
import pytest

from flashlab import dense, reference
from helpers import max_abs_err, qkv


@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
def test_matches_reference(rng, causal):
    q, k, v = qkv(rng, (2,), 23, 31, 5, 3)
    mask = rng.random((2, 23, 31)) < 0.8
    o, lse = dense.attention(q, k, v, block_q=7, block_k=9, causal=causal,
                             mask=mask, return_lse=True)
    o_ref, lse_ref = reference.attention(q, k, v, causal=causal, mask=mask,
                                         return_lse=True)
    assert max_abs_err(o, o_ref) < 1e-12
    assert np.array_equal(np.isneginf(lse), np.isneginf(lse_ref))
    finite = np.isfinite(lse_ref)
    assert max_abs_err(lse[finite], lse_ref[finite]) < 1e-12
