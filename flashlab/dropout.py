"""Reproducible attention dropout from a counter-based generator.

Whether element (b, i, j) of P is kept depends only on (seed, b, i, j),
where b is the flat index of the leading batch/head dims: a hash, not a
stream of random numbers. The backward pass, which recomputes P tile by
tile in another order, regenerates exactly the forward pass's decisions
without storing a mask. See chapter 8.

The rate is represented by 24 random bits per pair: a pair is kept with
probability k / 2**24, within 2**-24 of 1 - dropout_p. That keeps the
kept fraction (and so the mean of the 1 / (1 - p) weights) within
2**-12 of itself for every rate up to MAX_RATE = 1 - 2**-12; rates above
it, where 24 bits cannot represent 1 - p that well (at 1 - 2**-24 they
would drop everything), are refused.
"""

import math
import numbers
from typing import NamedTuple

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_ZERO, _S27, _S30, _S31, _S40 = (np.uint64(x) for x in (0, 27, 30, 31, 40))
BITS = 24  # random bits per pair (keep_bits)
# The largest rate whose kept fraction 24 bits give to 2**-12 of itself
MAX_RATE = 1.0 - 2.0**-12


def keep_bits(seed, b, i, j):
    """24 random bits for pair (i, j) of batch element b; all uint64.

    Each word is folded into the state and scrambled with the splitmix64
    finalizer. uint64 arithmetic wraps by design: numpy callers silence
    the overflow warning, and the numba kernels compile this function as
    it is. A pair is kept when keep_bits >= threshold(p).
    """
    h = seed
    for word in (_ZERO, b, i, j):
        h = h ^ (word + _GOLDEN)
        h = (h ^ (h >> _S30)) * _M1
        h = (h ^ (h >> _S27)) * _M2
        h = h ^ (h >> _S31)
    return h >> _S40


def threshold(p):
    """Smallest 24-bit value that is kept: keep_bits / 2**24 >= p."""
    return np.uint64(math.ceil(p * 2**24))


def uniform(seed, b, i, j):
    """Uniform numbers in [0, 1) for broadcastable index arrays b, i, j."""
    with np.errstate(over="ignore"):
        bits = keep_bits(np.uint64(seed), np.asarray(b, np.uint64),
                         np.asarray(i, np.uint64), np.asarray(j, np.uint64))
    return bits.astype(np.float64) / 2.0**24


class Dropout(NamedTuple):
    """Dropout of one call: its rate, seed and flat batch indices."""

    rate: float  # dropout_p, the probability of dropping an entry
    seed: int
    batch: np.ndarray  # (*batch, 1, 1) flat index of each batch element

    def keep(self, rows, cols):
        """Boolean (*batch, len(rows), len(cols)): which P entries survive."""
        i = np.arange(rows.start, rows.stop)[:, None]
        j = np.arange(cols.start, cols.stop)[None, :]
        return uniform(self.seed, self.batch, i, j) >= self.rate

    def weights(self, rows, cols, dtype):
        """Kept entries scaled by 1 / (1 - p), dropped ones 0."""
        scale = dtype.type(1.0 / (1.0 - self.rate))
        return np.where(self.keep(rows, cols), scale, dtype.type(0))


def make(dropout_p, seed, batch_shape):
    """Validate dropout arguments; None when dropout is off."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p,
                                                     numbers.Real):
        raise TypeError(f"dropout_p: expected a float, got {dropout_p!r}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(
            f"dropout_p: expected 0 <= dropout_p < 1, got {dropout_p!r}"
        )
    if dropout_p > MAX_RATE:
        raise ValueError(
            f"dropout_p: expected at most 1 - 2**-12 = {MAX_RATE!r}: the "
            f"rate is kept to 2**-{BITS} (24 random bits per pair), which "
            f"closer to 1 biases the kept fraction by more than 2**-12 "
            f"of itself; got {dropout_p!r}")
    if dropout_p == 0.0:
        return None
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(
            f"seed: expected an integer when dropout_p > 0, got {seed!r}"
        )
    if not 0 <= seed < 2**64:
        raise ValueError(f"seed: expected 0 <= seed < 2**64, got {seed}")
    flat = np.arange(int(np.prod(batch_shape)), dtype=np.uint64)
    return Dropout(float(dropout_p), int(seed),
                   flat.reshape(*batch_shape, 1, 1))


def keep_mask(dropout_p, seed, shape):
    """The full boolean keep mask of shape (*batch, Nq, Nk), for testing."""
    d = make(dropout_p, seed, shape[:-2])
    if d is None:
        return np.ones(shape, dtype=bool)
    return d.keep(range(shape[-2]), range(shape[-1]))
