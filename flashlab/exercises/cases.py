"""Inputs and hints that several chapters' exercises share."""

import numpy as np

from flashlab import reference

NO_MAX = ("exp of a score near 1000 overflows to inf: subtract the maximum "
          "m before exponentiating (chapter 2)")
NO_RESCALE = ("when the running maximum grows from m to m', what was summed "
              "against m must be multiplied by alpha = exp(m - m') before "
              "the new terms are added")


def rows(rng, with_masked=True):
    """(name, scores (N,), values (N, d_v), chunk) for the row exercises.

    The edges that break careless code: one key, ragged chunks, scores
    near 1000, a rising maximum, and (with_masked) a masked first chunk.
    """
    out = []
    for name, n, chunk, shift in (
            ("random, N=12 in chunks of 4", 12, 4, 0.0),
            ("a single key", 1, 3, 0.0),
            ("ragged: N=10 in chunks of 4", 10, 4, 0.0),
            ("scores near 1000", 9, 2, 1000.0),
            ("rising scores, chunks of 1", 6, 1, 0.0)):
        s = rng.standard_normal(n) * 3 + shift
        if name.startswith("rising"):
            s = np.sort(s) * 4
        out.append((name, s, rng.standard_normal((n, 3)), chunk))
    if with_masked:
        s = rng.standard_normal(8)
        s[:3] = -np.inf  # the whole first chunk is masked
        out.append(("first chunk masked (-inf)", s,
                    rng.standard_normal((8, 3)), 3))
    return out


def softmax_output(scores, values):
    """The float64 truth for one row: softmax(scores) @ values."""
    return reference.softmax(scores) @ values
