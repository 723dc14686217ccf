"""Chapter 1's exercises: the materialized program and what it stores."""

import numpy as np

from flashlab import costs, reference
from flashlab.exercises.checker import Case, Exercise, register

# ------------------------------------------------ materialized_attention


def _cases_materialized(rng):
    out = []
    for name, nq, nk, shift in (("random 6 x 9", 6, 9, 0.0),
                                ("one query, one key", 1, 1, 0.0),
                                ("large scores", 5, 7, 40.0)):
        q = rng.standard_normal((nq, 4)) + shift / 4
        k = rng.standard_normal((nk, 4)) + shift / 4
        v = rng.standard_normal((nk, 3))
        out.append(Case(name, (q, k, v), reference.attention(q, k, v)))
    return out


def materialized_attention(q, k, v):
    """Chapter 1: S = tau Q K^T, P = softmax of each row, O = P V."""
    s = q @ k.T / np.sqrt(q.shape[1])  # (Nq, Nk)
    p = np.exp(s - s.max(axis=1, keepdims=True))
    return (p / p.sum(axis=1, keepdims=True)) @ v


def _materialized_no_scale(q, k, v):
    return materialized_attention(q * np.sqrt(q.shape[1]), k, v)


def _materialized_columns(q, k, v):
    s = q @ k.T / np.sqrt(q.shape[1])
    p = np.exp(s - s.max(axis=0, keepdims=True))
    return (p / p.sum(axis=0, keepdims=True)) @ v


register("materialized_attention", Exercise(
    1, "materialized_attention(q (Nq, d), k (Nk, d), v (Nk, d_v)) -> "
    "(Nq, d_v): S, softmax of each row, P V; scale 1/sqrt(d)",
    _cases_materialized, materialized_attention,
    (("the scores are tau Q K^T with tau = 1/sqrt(d)",
      _materialized_no_scale),
     ("the softmax normalizes each query's row of S (axis 1), not each "
      "key's column", _materialized_columns))))

# ---------------------------------------------------- intermediate_bytes


def _cases_bytes(rng):
    # integers: compared exactly, so 8 bytes off 8.6e9 is wrong
    return [Case(f"n={n}, {h} heads, batch {b}, {s} bytes", (n, h, b, s),
                 int(2 * b * h * costs.matrix_bytes(n, n, s)))
            for n, h, b, s in ((1024, 8, 2, 2), (4096, 32, 4, 2),
                               (1, 1, 1, 4), (int(rng.integers(2, 500)),
                                              3, 5, 4))]


def intermediate_bytes(n, heads, batch, itemsize):
    """Chapter 1: bytes of S and P (n x n each) for a layer's heads."""
    return 2 * batch * heads * n * n * itemsize


def _bytes_s_only(n, heads, batch, itemsize):
    return batch * heads * n * n * itemsize


def _bytes_no_heads(n, heads, batch, itemsize):
    return 2 * batch * n * n * itemsize


register("intermediate_bytes", Exercise(
    1, "intermediate_bytes(n, heads, batch, itemsize) -> bytes of S and "
    "P for one layer (an integer)", _cases_bytes, intermediate_bytes,
    (("both S and P are n x n per head: count two matrices",
      _bytes_s_only),
     ("every head of every batch element has its own S and P",
      _bytes_no_heads))))
