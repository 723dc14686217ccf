"""What non-finite input does to the output: one rule, every backend.

Rows that the masks leave with no key to attend output 0 with lse -inf;
they are the only rows that do, and `masks.Rules.empty_rows` finds them.
Everything else that is not finite comes out as NaN:

- NaN or +-inf in q or k reaches the scores. A row with a NaN score, or
  a score that overflows to +inf, is NaN through the merge itself
  (`merge.Summary` reads a NaN denominator as NaN, not as "no key"). A
  row whose allowed scores are all -inf (q_i holding -inf, say) has a
  zero denominator like an empty row, but is not one: `finish` makes it
  NaN, as the reference's 0 / 0 does.
- NaN or +-inf anywhere in column x of V makes column x of every
  non-empty row NaN, masked key or not, as in the product P V of the
  materialized reference (0 * NaN is NaN). Which tiles a backend visits
  therefore never decides which rows turn NaN.

`finish` applies the rule to a computed (o, lse) in place (numpy);
`mark_bad` and `finish_row` are its kernel form (flashlab.gpu's
`find_bad_parts` finds bad columns in the 16-bit bits of V),
compiled by flashlab.gpu.
See chapter 7.
"""

import math

import numpy as np


def finish(o, lse, v, empty):
    """Apply the rule in place to o (..., Nq, d_v) and lse (..., Nq).

    v (..., Nk, d_v) is the input; empty (..., Nq) bool marks the rows the
    masks leave without keys.
    """
    full = ~empty
    unreached = np.isneginf(lse) & full  # (..., Nq): 0 / 0 rows
    bad = ~np.isfinite(v).all(axis=-2)  # (..., d_v)
    nan_o = unreached[..., None] | (bad[..., None, :] & full[..., None])
    o[...] = np.where(nan_o, np.nan, np.where(empty[..., None], 0, o))
    lse[...] = np.where(unreached, np.nan, np.where(empty, -np.inf, lse))
    return o, lse


def mark_bad(v, bad, b, j, x):
    """Kernel form, one element: flag column x of V[b] if v[b, j, x] is
    not finite (bad starts all False; every writer writes True)."""
    if not math.isfinite(v[b, j, x]):
        bad[b, x] = True


def finish_row(o, lse, bad, empty, b, i, o_nan, lse_nan, neg_inf):
    """Kernel form of `finish` for row i of batch element b.

    empty may be (1, 1) standing for "no row is empty"; o_nan, lse_nan
    and neg_inf come in the dtypes of o and lse (a NaN bit pattern for a
    16-bit o stored as int16), so no float64 constant appears.
    """
    if empty[min(b, empty.shape[0] - 1), min(i, empty.shape[1] - 1)]:
        return
    if lse[b, i] == neg_inf:  # allowed scores all -inf: 0 / 0
        lse[b, i] = lse_nan
        for x in range(o.shape[2]):
            o[b, i, x] = o_nan
        return
    for x in range(o.shape[2]):
        if bad[b, x]:
            o[b, i, x] = o_nan

