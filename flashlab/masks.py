"""Which (query, key) pairs may attend: causal, window, padding, masks.

Every backend asks this module, so the mask semantics live in one place.
Query i may attend to key j when all of the given rules allow it:

- causal: j <= i + offset, where offset is 0 for top-left alignment (as
  torch's is_causal=True) and Nk - Nq for bottom-right alignment (the last
  query sees the last key, as when decoding with a KV cache);
- window=(left, right): i + offset - left <= j <= i + offset + right, with
  the same offset (bottom-right only when causal="bottom_right"); None on
  either side means unbounded;
- kv_lengths: j < kv_lengths[b] for batch element b (key padding);
- mask: mask[..., i, j] is True.
See chapters 5 and 7.
"""

import numbers
from typing import NamedTuple

import numpy as np

CAUSAL_MODES = (False, True, "top_left", "bottom_right")


class Rules(NamedTuple):
    """The attention pattern of one call, in the form tiles ask about."""

    causal: bool
    offset: int  # diagonal offset: 0 or Nk - Nq
    window: tuple | None  # (left, right), either may be None
    kv_lengths: np.ndarray | None  # (*batch, 1, 1) valid key counts
    mask: np.ndarray | None  # boolean, broadcastable to (*batch, Nq, Nk)

    def allowed(self, rows, cols):
        """Boolean (..., len(rows), len(cols)) of allowed pairs, or None.

        None means every pair of the tile is allowed (no mask work needed).
        """
        r = np.arange(rows.start, rows.stop)[:, None]  # (Br, 1)
        c = np.arange(cols.start, cols.stop)[None, :]  # (1, Bc)
        keep = None
        if self.causal:
            keep = _and(keep, c <= r + self.offset)
        if self.window is not None:
            left, right = self.window
            if left is not None:
                keep = _and(keep, c >= r + self.offset - left)
            if right is not None:
                keep = _and(keep, c <= r + self.offset + right)
        if self.kv_lengths is not None:
            keep = _and(keep, c < self.kv_lengths)
        if self.mask is not None:
            m = self.mask
            m = m[..., _span(rows, m.shape[-2]), :]
            keep = _and(keep, m[..., _span(cols, m.shape[-1])])
        return keep

    def skips(self, rows, cols):
        """True if no pair of the tile is allowed: its work can be skipped.

        Decided from the tile's corners when only index rules apply, so a
        skipped tile costs O(1) instead of O(Br Bc).
        """
        left, right = self.window if self.window is not None else (-1, -1)
        kv = (self.kv_lengths.max() if self.kv_lengths is not None
              else cols.stop)
        if tile_skipped(rows.start, rows.stop, cols.start, cols.stop,
                        self.causal, self.offset, _bound(left),
                        _bound(right), kv):
            return True
        if self.mask is None and (self.kv_lengths is None
                                  or self.kv_lengths.min() == kv):
            return False
        keep = self.allowed(rows, cols)
        return keep is not None and not keep.any()


def _bound(w):
    """Window side for the scalar rules: -1 for unbounded."""
    return -1 if w is None else w


# Scalar forms of the index rules, compiled by the numba kernels. Window
# sides are ints with -1 for unbounded; kv_len is the batch element's
# number of valid keys.

def pair_allowed(i, j, causal, offset, left, right, kv_len):
    """Whether query i may attend to key j under the index rules."""
    diag = i + offset
    if causal and j > diag:
        return False
    if left >= 0 and j < diag - left:
        return False
    if right >= 0 and j > diag + right:
        return False
    return j < kv_len


def tile_skipped(i0, i1, j0, j1, causal, offset, left, right, kv_len):
    """No pair of rows i0..i1-1 and keys j0..j1-1 is allowed."""
    if causal and j0 > i1 - 1 + offset:
        return True
    if left >= 0 and j1 - 1 < i0 + offset - left:
        return True
    if right >= 0 and j0 > i1 - 1 + offset + right:
        return True
    return j0 >= kv_len


def tile_full(i0, i1, j0, j1, causal, offset, left, right, kv_len):
    """Every pair of the tile is allowed: no per-element masking needed."""
    if causal and j1 - 1 > i0 + offset:
        return False
    if left >= 0 and j0 < i1 - 1 + offset - left:
        return False
    if right >= 0 and j1 - 1 > i0 + offset + right:
        return False
    return j1 <= kv_len


def rules(causal, window, kv_lengths, mask, batch_shape, nq, nk):
    """Validate the masking arguments of an attention call into `Rules`."""
    if causal is None or causal is False:
        is_causal, offset = False, 0
    elif causal is True or causal == "top_left":
        is_causal, offset = True, 0
    elif causal == "bottom_right":
        is_causal, offset = True, nk - nq
    else:
        raise ValueError(
            f"causal: expected one of {CAUSAL_MODES}, got {causal!r}"
        )
    return Rules(
        causal=is_causal,
        offset=offset,
        window=_check_window(window),
        kv_lengths=_check_lengths(kv_lengths, batch_shape, nk),
        mask=_check_mask(mask, batch_shape, nq, nk),
    )


def _and(keep, extra):
    return extra if keep is None else keep & extra


def _span(span, size):
    """Index a mask axis of length `size` (1 = broadcast) by `span`."""
    return slice(None) if size == 1 else slice(span.start, span.stop)


def _check_window(window):
    if window is None:
        return None
    ok = isinstance(window, (tuple, list)) and len(window) == 2 and all(
        w is None or (isinstance(w, numbers.Integral)
                      and not isinstance(w, bool) and w >= 0)
        for w in window
    )
    if not ok:
        raise ValueError(
            "window: expected (left, right) with integers >= 0 or None, "
            f"got {window!r}"
        )
    return tuple(None if w is None else int(w) for w in window)


def _check_lengths(kv_lengths, batch_shape, nk):
    if kv_lengths is None:
        return None
    lengths = np.asarray(kv_lengths)
    if lengths.dtype.kind not in "iu":
        raise TypeError(
            f"kv_lengths: expected integers, got dtype {lengths.dtype}"
        )
    try:
        shape = np.broadcast_shapes(lengths.shape, batch_shape)
    except ValueError:
        shape = None
    if shape != tuple(batch_shape):
        raise ValueError(
            f"kv_lengths: expected a shape broadcastable to the batch "
            f"shape {tuple(batch_shape)}, got {lengths.shape}"
        )
    if lengths.size and (lengths.min() < 0 or lengths.max() > nk):
        raise ValueError(
            f"kv_lengths: expected values in [0, Nk={nk}], got "
            f"{lengths.min()}..{lengths.max()}"
        )
    return lengths[..., None, None]  # (*batch, 1, 1) against (Br, Bc)


def _check_mask(mask, batch_shape, nq, nk):
    if mask is None:
        return None
    mask = np.asarray(mask)
    if mask.dtype != np.bool_:
        raise TypeError(
            f"mask: expected a boolean array (True = may attend), got dtype "
            f"{mask.dtype}"
        )
    target = (*batch_shape, nq, nk)
    try:
        shape = np.broadcast_shapes(mask.shape, target)
    except ValueError:
        shape = None
    if shape != target:
        raise ValueError(
            f"mask: expected a shape broadcastable to {target}, got "
            f"{mask.shape}"
        )
    return mask.reshape((1,) * max(0, 2 - mask.ndim) + mask.shape)
