"""Chapter 8's exercises: the softmax backward and the row term D."""

import numpy as np

from flashlab import reference
from flashlab.exercises.checker import Case, Exercise, register

# ------------------------------------------------------ softmax_backward


def _cases_softmax_backward(rng):
    out = []
    for name, n in (("random row of 7", 7), ("a single key", 1),
                    ("row of 20", 20)):
        s = rng.standard_normal(n) * 2
        p = reference.softmax(s)
        dp = rng.standard_normal(n)
        out.append(Case(name, (p, dp), p * (dp - p @ dp)))
    return out


def softmax_backward(p, dp):
    """Chapter 8: dS = P (dP - D) for one row, D = sum_j P_j dP_j."""
    return p * (dp - p @ dp)


def _softmax_backward_no_d(p, dp):
    return p * dp


def _softmax_backward_sum_dp(p, dp):
    return p * (dp - dp.sum())


register("softmax_backward", Exercise(
    8, "softmax_backward(p (N,), dp (N,)) -> dS (N,) for one row",
    _cases_softmax_backward, softmax_backward,
    (("the softmax Jacobian has a -p p^T part: subtract D = sum_j p_j "
      "dp_j", _softmax_backward_no_d),
     ("D weights dP by P: D = sum_j p_j dp_j, not sum_j dp_j",
      _softmax_backward_sum_dp))))

# ------------------------------------------------------------- row_delta


def _cases_delta(rng):
    return [Case(f"{nq} rows, d_v={dv}", (do, o), (do * o).sum(axis=1))
            for nq, dv in ((5, 3), (1, 1), (12, 8))
            for do, o in [(rng.standard_normal((nq, dv)),
                           rng.standard_normal((nq, dv)))]]


def row_delta(do, o):
    """Chapter 8: D_i = rowsum(dO_i * O_i), (Nq, d_v) -> (Nq,)."""
    return (do * o).sum(axis=1)


def _delta_total(do, o):
    return np.full(len(do), (do * o).sum())


def _delta_do_only(do, o):
    return do.sum(axis=1)


register("row_delta", Exercise(
    8, "row_delta(do (Nq, d_v), o (Nq, d_v)) -> D (Nq,)",
    _cases_delta, row_delta,
    (("D is one number per row: sum over the row only", _delta_total),
     ("D_i = dO_i . O_i: multiply by O before summing",
      _delta_do_only))))
