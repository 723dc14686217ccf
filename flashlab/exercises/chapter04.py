"""Chapter 4's exercises: merging summaries and split outputs."""

import math

import numpy as np

from flashlab import merge
from flashlab.exercises.cases import NO_MAX, rows, softmax_output
from flashlab.exercises.checker import Case, Exercise, register

# ------------------------------------------------------- merge_summaries


def _summary_of(s, v):
    sm = merge.summarize(s, v)
    return float(sm.m), float(sm.l), sm.u


def _cases_merge(rng):
    out = []
    for name, s, v, _ in rows(rng, with_masked=False):
        cut = len(s) // 2
        b = _summary_of(s[cut:], v[cut:])
        if cut:
            a = _summary_of(s[:cut], v[:cut])
        else:
            a = (-math.inf, 0.0, np.zeros(v.shape[1]))  # an empty block
            name += " (first block empty)"
        out.append(Case(name, (a, b), _summary_of(s, v)))
    empty = (-math.inf, 0.0, np.zeros(3))
    out.append(Case("both blocks empty", (empty, empty), empty))
    return out


def merge_summaries(a, b):
    """Chapter 4: (m, l, u) of the union of two blocks' keys."""
    (ma, la, ua), (mb, lb, ub) = a, b
    m = max(ma, mb)
    if m == -np.inf:
        return m, 0.0, np.zeros_like(ua)  # both empty: still empty
    alpha, beta = np.exp(ma - m), np.exp(mb - m)  # exp(-inf) = 0 if empty
    return m, alpha * la + beta * lb, alpha * ua + beta * ub


def _merge_no_rescale(a, b):
    (ma, la, ua), (mb, lb, ub) = a, b
    return max(ma, mb), la + lb, ua + ub


def _merge_inverted(a, b):
    (ma, la, ua), (mb, lb, ub) = a, b
    m = max(ma, mb)
    alpha, beta = np.exp(m - ma), np.exp(m - mb)
    return m, alpha * la + beta * lb, alpha * ua + beta * ub


register("merge_summaries", Exercise(
    4, "merge_summaries((m_a, l_a, u_a), (m_b, l_b, u_b)) -> (m, l, u) "
    "of the union of the two blocks",
    _cases_merge, merge_summaries,
    (("two summaries on different maxima cannot be added as they are: "
      "put both on m = max(m_a, m_b) first", _merge_no_rescale),
     ("alpha = exp(m_a - m), not exp(m - m_a): moving onto a larger "
      "maximum shrinks a block's terms", _merge_inverted))))

# ------------------------------------------------------- combine_outputs


def _cases_combine(rng):
    out = []
    for name, s, v, _ in rows(rng):
        cuts = [0, len(s) // 3, 2 * len(s) // 3, len(s)]
        outs, lses = [], []
        for j0, j1 in zip(cuts, cuts[1:]):
            sm = (merge.summarize(s[j0:j1], v[j0:j1]) if j1 > j0
                  else merge.empty((), v.shape[1], np.float64))
            outs.append(sm.output())
            lses.append(sm.lse())
        out.append(Case(name + ", three splits",
                        (np.array(outs), np.array(lses)),
                        softmax_output(s, v)))
    return out


def combine_outputs(outs, lses):
    """Chapter 4: one output from normalized split outputs and their lse.

    outs (S, d_v), lses (S,): split s holds o_s = u_s / l_s and
    lse_s = m_s + log l_s, so l_s e^(m_s - M) = e^(lse_s - M).
    """
    top = lses.max()
    w = np.exp(lses - top)  # each split's share of the denominator
    return (w @ np.where(np.isneginf(lses)[:, None], 0, outs)) / w.sum()


def _combine_mean(outs, lses):
    return outs.mean(axis=0)


def _combine_no_max(outs, lses):
    w = np.exp(lses)
    return (w @ outs) / w.sum()


register("combine_outputs", Exercise(
    4, "combine_outputs(outs (S, d_v), lses (S,)) -> (d_v,): the output "
    "of all splits from each split's normalized output and lse",
    _cases_combine, combine_outputs,
    (("splits are not equally important: weight split s by its share "
      "of the denominator, exp(lse_s - max lse)", _combine_mean),
     (NO_MAX.replace("a score", "an lse"), _combine_no_max))))
