"""The (max, denominator, numerator) summary of a block of keys, and its merge.

A summary of keys with scores s_j and values v_j, for one query row, is

    m = max_j s_j,   l = sum_j exp(s_j - m),   u = sum_j exp(s_j - m) v_j

and the attention output over those keys is u / l. Two summaries put on a
common maximum add up, so any split of the keys can be summarized piece by
piece and merged. This is the only place in flashlab that does that
algebra; the online update, the tiled loops and the split-KV paths all
call `merge`. See chapters 2-5.

An empty block (no allowed key) has m = -inf, l = 0, u = 0: the identity
of `merge`. The code never forms (-inf) - (-inf), so no NaN appears from
masking; a NaN that the input brings stays NaN (l == 0, never l > 0, is
what marks an empty row). See `flashlab.nonfinite`.

`row_step` and `row_probability` are the same algebra for one row in
scalar form; the numba CPU and CUDA kernels compile these very functions.
"""

import math
from typing import NamedTuple

import numpy as np


class Summary(NamedTuple):
    """Row summaries: m (...,), l (...,), u (..., d_v). See chapter 4."""

    m: np.ndarray
    l: np.ndarray  # the paper's name for the denominator
    u: np.ndarray

    def output(self):
        """Attention output u / l (..., d_v); 0 for rows with no keys."""
        l = self.l[..., None]
        none = l == 0  # NaN is not "no keys": it must stay NaN
        return np.where(none, 0, self.u / np.where(none, 1, l)).astype(
            self.u.dtype)

    def lse(self):
        """Log-sum-exp of the scores (...,); -inf for rows with no keys."""
        none = self.l == 0
        return np.where(none, -np.inf,
                        self.m + np.log(np.where(none, 1, self.l))).astype(
            self.l.dtype)


def empty(rows_shape, d_v, dtype):
    """Summary of no keys at all, for rows_shape rows: the merge identity."""
    return Summary(
        m=np.full(rows_shape, -np.inf, dtype=dtype),
        l=np.zeros(rows_shape, dtype=dtype),
        u=np.zeros((*rows_shape, d_v), dtype=dtype),
    )


def summarize(scores, values, weights=None):
    """Summary of one block: scores (..., C), values (..., C, d_v).

    Masked keys carry score -inf and contribute nothing. weights (..., C),
    if given, multiply the terms of the numerator only: dropout removes a
    key from the weighted sum of values but not from the softmax
    denominator.
    """
    scores = np.asarray(scores)
    values = np.asarray(values)
    m = scores.max(axis=-1)  # (...,)
    p = np.exp(scores - _finite(m)[..., None])  # (..., C), all <= 1
    l = p.sum(axis=-1)
    u = _rows_times(p if weights is None else p * weights, values)
    return Summary(m, l, u)


def merge(a, b):
    """Summary of the union of the keys behind summaries a and b."""
    _check_same_rows(a, b)
    m = np.maximum(a.m, b.m)
    alpha = rescale(a.m, m)  # (...,) moves a onto the new maximum
    beta = rescale(b.m, m)
    return Summary(
        m=m,
        l=alpha * a.l + beta * b.l,
        u=alpha[..., None] * a.u + beta[..., None] * b.u,
    )


def _check_same_rows(a, b):
    """Summaries merge row by row: their shapes must agree exactly."""
    for name, x in (("a", a), ("b", b)):
        if not isinstance(x, Summary):
            raise TypeError(f"{name}: expected a merge.Summary, got "
                            f"{type(x).__name__}")
    for name in Summary._fields:
        sa, sb = np.shape(getattr(a, name)), np.shape(getattr(b, name))
        if sa != sb:
            raise ValueError(
                f"b: expected {name} of shape {sa} to match a, got {sb} "
                f"(summaries of different rows do not merge)")


def combine(outs, lses, ls=None):
    """One output from partial results in the form kernels return them.

    outs (S, ..., d_v) holds each split's normalized output u_s / l_s and
    lses (S, ...) its log-sum-exp m_s + log l_s (-inf for a split with no
    allowed key). Each is a `Summary` with m = lse, l = 1, u = out, so the
    splits fold with `merge`; returns (out (..., d_v), lse (...)).

    Where |lse| is large (`lse_loses_l`) m_s + log l_s keeps too few of
    log l_s's digits to weigh the splits (a fully masked row of
    finfo.min scores has lse == m in every split, whatever its l). With
    ls (S, ...), lses holds each split's row max m_s instead and ls its
    l_s: each split is the Summary (m_s, l_s, l_s out_s), exact at any
    size, and the result is (out, m, l) in that form, so that a running
    fold (ring attention's) stays exact too.
    """
    outs, lses = _float_array("outs", outs), _float_array("lses", lses)
    if ls is not None:
        ls = _float_array("ls", ls)
        if ls.shape != lses.shape:
            raise ValueError(f"ls: expected shape {lses.shape} (one per "
                             f"split and row, as lses), got {ls.shape}")
        if (ls < 0).any():  # a sum of exponentials; NaN passes as NaN
            raise ValueError(f"ls: expected denominators >= 0, got "
                             f"{ls[ls < 0].min()!r} among them")
    if outs.ndim < 2:
        raise ValueError(f"outs: expected (S, ..., d_v), one normalized "
                         f"output per split, got shape {outs.shape}")
    if lses.shape != outs.shape[:-1]:
        raise ValueError(
            f"lses: expected shape {outs.shape[:-1]} (one per split and "
            f"row of outs {outs.shape}), got {lses.shape}")
    if len(outs) == 0:
        raise ValueError("outs: expected at least one split, got none")
    total = None
    for s, (out, lse) in enumerate(zip(outs, lses)):
        if ls is None:
            part = Summary(lse, np.where(np.isneginf(lse), 0, 1).astype(
                out.dtype), np.where(np.isneginf(lse)[..., None], 0, out))
        else:  # a split with no allowed key (l = 0) adds nothing
            l = ls[s].astype(out.dtype)
            part = Summary(lse, l, np.where((l == 0)[..., None], 0,
                                            out * l[..., None]))
        total = part if total is None else merge(total, part)
    if ls is not None:
        return total.output(), total.m, total.l
    return total.output(), total.lse()


def _float_array(name, x):
    """x as a float ndarray, or an error that names it."""
    try:
        arr = np.asarray(x)
    except ValueError:  # ragged nesting
        raise ValueError(f"{name}: expected an array of one shape, got "
                         f"ragged sequences") from None
    if arr.dtype.kind != "f":
        raise TypeError(f"{name}: expected a float array, got dtype "
                        f"{arr.dtype}")
    return arr


def probabilities(scores, lse, l=None):
    """P = exp(S - lse) (..., R, C) recomputed from the saved row lse (..., R).

    Rows that saw no key (lse = -inf) have only -inf scores and give 0.
    With l (..., R), lse is a row's max m instead and P = exp(S - m) / l:
    the form for rows where `lse_loses_l` holds.
    """
    p = np.exp(scores - _finite(lse)[..., None])
    return p if l is None else p / l[..., None]


# Above this |lse|, lse = m + log l keeps too few of log l's digits for
# exp(S - lse) to be P: its rounding, up to |lse| eps / 2, becomes P's
# relative error (at |lse| = 64 that is 32 eps, as summing 64 terms).
LSE_EXACT = 64.0


def lse_loses_l(lse):
    """Boolean (...,): rows whose finite lse is too large for exp(S - lse)
    to recompute P (a fully masked row of finfo.min scores has lse == m,
    so every P would be 1); their m and l must be recomputed instead."""
    with np.errstate(invalid="ignore"):
        return np.isfinite(lse) & (np.abs(lse) >= LSE_EXACT)


def rescale(m_old, m_new):
    """exp(m_old - m_new), taken as 0 when m_old is -inf (an empty block)."""
    return np.exp(m_old - _finite(m_new))


def _finite(m):
    """m with -inf (rows that saw no key yet) replaced by 0."""
    return np.where(np.isneginf(m), 0, m).astype(m.dtype)


def _rows_times(p, values):
    """sum_j p[..., j] values[..., j, :]; p (..., C), values (..., C, d_v).

    p may carry more leading dims than values (several query rows against
    one block of values), so this is a matmul when it can be one.
    """
    if p.ndim == values.ndim:  # p (..., R, C) @ values (..., C, d_v)
        return p @ values
    return (p[..., None, :] @ values)[..., 0, :]


def row_step(m_run, tile_max, lowest):
    """One row's merge with a new tile, kernel form: (m_new, shift, alpha).

    The tile's terms are taken as exp(s - shift) and the running l and u
    are multiplied by alpha = exp(m_run - shift). shift is m_new, or the
    finite `lowest` of the dtype while the row has seen no allowed key, so
    that exp(-inf - shift) = 0 and (-inf) - (-inf) never happens.
    """
    m_new = max(m_run, tile_max)
    shift = max(m_new, lowest)
    return m_new, shift, math.exp(m_run - shift)


def row_step2(m_run, tile_max, lowest):
    """row_step in base 2, for scores already multiplied by log2(e).

    Tensor-core kernels fold log2(e) into the scale so that each term is
    one exp2 (a single special-function instruction) instead of exp's
    multiply and exp2. m, shift and the running maximum are in those
    units: lse = ln(2) (m + log2(l)).
    """
    m_new = max(m_run, tile_max)
    shift = max(m_new, lowest)
    return m_new, shift, math.exp2(m_run - shift)


def row_probability(score, lse, lowest):
    """P_ij = exp(S_ij - lse_i) for one pair, kernel form; 0 for empty rows."""
    return math.exp(score - max(lse, lowest))
