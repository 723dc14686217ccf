"""Chapter 7's exercises: the causal mask in both alignments, windows."""

import numpy as np

from flashlab import masks
from flashlab.exercises.checker import Case, Exercise, register


def _mask_case(nq, nk, **rules):
    """flashlab's own bool (Nq, Nk) pattern; compared exactly."""
    keep = masks.rules(rules.get("causal", False), rules.get("window"),
                       None, None, (), nq, nk).allowed(range(nq), range(nk))
    return (np.ones((nq, nk), bool) if keep is None
            else np.broadcast_to(keep, (nq, nk)).copy())

# ----------------------------------------------------------- causal_mask


def _cases_causal_mask(rng):
    out = []
    for nq, nk in ((4, 4), (3, 6), (6, 3), (1, 1),
                   (int(rng.integers(2, 9)), int(rng.integers(2, 9)))):
        for align in ("top_left", "bottom_right"):
            causal = True if align == "top_left" else "bottom_right"
            out.append(Case(f"Nq={nq}, Nk={nk}, {align}", (nq, nk, align),
                            _mask_case(nq, nk, causal=causal)))
    return out


def causal_mask(nq, nk, align):
    """Chapter 7: bool (Nq, Nk), True where query i may see key j.

    align "top_left": j <= i; "bottom_right": j <= i + Nk - Nq.
    """
    offset = 0 if align == "top_left" else nk - nq
    return np.arange(nk)[None, :] <= np.arange(nq)[:, None] + offset


def _causal_ignores_align(nq, nk, align):
    return np.arange(nk)[None, :] <= np.arange(nq)[:, None]


def _causal_strict(nq, nk, align):
    offset = 0 if align == "top_left" else nk - nq
    return np.arange(nk)[None, :] < np.arange(nq)[:, None] + offset


register("causal_mask", Exercise(
    7, "causal_mask(nq, nk, align) -> bool (Nq, Nk), align "
    "'top_left' or 'bottom_right'", _cases_causal_mask, causal_mask,
    (("bottom-right alignment shifts the diagonal by Nk - Nq: the last "
      "query sees the last key", _causal_ignores_align),
     ("a query may attend to its own position: j <= i + offset, not <",
      _causal_strict))))

# ----------------------------------------------------------- window_mask


def _cases_window_mask(rng):
    return [Case(f"Nq={nq}, Nk={nk}, window ({lt}, {rt})",
                 (nq, nk, lt, rt), _mask_case(nq, nk, window=(lt, rt)))
            for nq, nk, lt, rt in ((6, 6, 2, 0), (5, 8, 1, 3), (1, 1, 0, 0),
                                   (7, 4, 3, 1),
                                   (9, 9, int(rng.integers(0, 4)), 2))]


def window_mask(nq, nk, left, right):
    """Chapter 7: bool (Nq, Nk), i - left <= j <= i + right (top-left)."""
    i, j = np.arange(nq)[:, None], np.arange(nk)[None, :]
    return (j >= i - left) & (j <= i + right)


def _window_exclusive(nq, nk, left, right):
    i, j = np.arange(nq)[:, None], np.arange(nk)[None, :]
    return (j > i - left) & (j < i + right)


def _window_swapped(nq, nk, left, right):
    return window_mask(nq, nk, right, left)


register("window_mask", Exercise(
    7, "window_mask(nq, nk, left, right) -> bool (Nq, Nk) for "
    "i - left <= j <= i + right", _cases_window_mask, window_mask,
    (("both window edges are inclusive", _window_exclusive),
     ("left bounds the keys before i, right the keys after",
      _window_swapped))))
