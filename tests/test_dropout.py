"""The counter-based dropout generator."""

import numpy as np
import pytest

from flashlab import dropout


def test_rate_and_independence():
    keep = dropout.keep_mask(0.2, 99, (4, 256, 256))
    rate = 1 - keep.mean()
    # 262144 Bernoulli(0.2) draws: standard deviation 7.8e-4, allow 6 sd
    assert abs(rate - 0.2) < 5e-3
    other = dropout.keep_mask(0.2, 100, (4, 256, 256))
    agree = (keep == other).mean()
    assert abs(agree - (0.8**2 + 0.2**2)) < 5e-3


def test_tiles_regenerate_the_same_decisions():
    d = dropout.make(0.5, 7, (2, 3))
    whole = d.keep(range(0, 40), range(0, 50))
    tile = d.keep(range(13, 27), range(31, 50))
    assert np.array_equal(whole[..., 13:27, 31:50], tile)


def test_weights_scale_kept_entries():
    d = dropout.make(0.25, 3, ())
    w = d.weights(range(8), range(8), np.dtype(np.float32))
    assert w.dtype == np.float32
    assert set(np.unique(w).tolist()) <= {0.0, np.float32(1 / 0.75)}


@pytest.mark.parametrize("p, seed, error", [
    (1.0, 1, ValueError), (-0.1, 1, ValueError), ("0.1", 1, TypeError),
    (0.1, None, TypeError), (0.1, -1, ValueError),
])
def test_bad_arguments(p, seed, error):
    with pytest.raises(error, match="dropout_p|seed"):
        dropout.make(p, seed, ())


def test_zero_rate_is_off():
    assert dropout.make(0.0, None, (2,)) is None
