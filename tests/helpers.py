"""Input makers and error measures shared by the tests."""

import numpy as np

EPS32 = float(np.finfo(np.float32).eps)


def qkv(rng, batch, nq, nk, d, dv, dtype=np.float64, spread=1.0):
    """Random q (*batch, Nq, d), k (*batch, Nk, d), v (*batch, Nk, dv)."""
    q = rng.standard_normal((*batch, nq, d)) * spread
    k = rng.standard_normal((*batch, nk, d)) * spread
    v = rng.standard_normal((*batch, nk, dv))
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)


def max_abs_err(x, ref):
    """Largest elementwise |x - ref|, computed in float64 (0 if empty)."""
    diff = np.abs(np.asarray(x, np.float64) - ref)
    return float(diff.max()) if diff.size else 0.0


def float32_budget(err_naive, ref, merges=0):
    """Allowed float32 error: twice naive float32's, floored at 8 ulps,
    plus 2 ulps for every merge of a key block into the running state.

    Both errors are a few ulps of the output, so their ratio is noise when
    naive float32 happens to be nearly exact; the floor absorbs that.
    Each merge rounds the rescale factor and the sum once more than the
    materialized program does, so tiny key blocks earn a little slack.
    """
    scale = max(1.0, float(np.max(np.abs(ref))))
    return max(2 * err_naive, 8 * EPS32 * scale) + 2 * merges * EPS32 * scale
