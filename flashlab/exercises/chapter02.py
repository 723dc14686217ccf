"""Chapter 2's exercises: divide last, and the log-sum-exp."""

import numpy as np

from flashlab import reference
from flashlab.exercises.cases import NO_MAX, rows, softmax_output
from flashlab.exercises.checker import Case, Exercise, register

# ----------------------------------------------------- deferred_division


def _cases_deferred(rng):
    return [Case(n, (s, v), softmax_output(s, v))
            for n, s, v, _ in rows(rng, with_masked=False)]


def deferred_division(scores, values):
    """Chapter 2: exp-weighted sum of values first, one division at the end.

    scores (N,), values (N, d_v) -> output (d_v,).
    """
    m = scores.max()
    p = np.exp(scores - m)  # every term <= 1: no overflow
    return (p @ values) / p.sum()


def _deferred_no_max(scores, values):
    p = np.exp(scores)
    return (p @ values) / p.sum()


def _deferred_no_division(scores, values):
    return np.exp(scores - scores.max()) @ values


register("deferred_division", Exercise(
    2, "deferred_division(scores (N,), values (N, d_v)) -> (d_v,): "
    "sum the exp-weighted values, then divide once",
    _cases_deferred, deferred_division,
    ((NO_MAX, _deferred_no_max),
     ("the exp-weighted sum of values still needs one division by "
      "l = sum_j exp(s_j - m) at the end", _deferred_no_division))))

# ----------------------------------------------------------- log_sum_exp


def _cases_lse(rng):
    return [Case(n, (s,), float(reference.logsumexp(s)))
            for n, s, _, _ in rows(rng)]


def log_sum_exp(scores):
    """Chapter 2: log sum_j exp(s_j) = m + log sum_j exp(s_j - m)."""
    m = scores.max()
    if m == -np.inf:
        return -np.inf
    return float(m + np.log(np.exp(scores - m).sum()))


def _lse_no_max(scores):
    return float(np.log(np.exp(scores).sum()))


def _lse_m_dropped(scores):
    m = scores.max()
    return float(np.log(np.exp(scores - m).sum()))


register("log_sum_exp", Exercise(
    2, "log_sum_exp(scores (N,)) -> float, stable for large scores",
    _cases_lse, log_sum_exp,
    ((NO_MAX, _lse_no_max),
     ("log sum_j exp(s_j - m) is lse - m: add m back", _lse_m_dropped))))
