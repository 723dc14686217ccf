"""Which (query, key) pairs may attend: causal, window, padding, masks.

Every backend asks this module, so the mask semantics live in one place.
Query i may attend to key j when all of the given rules allow it:

- causal: j <= i + offset;
- window=(left, right): i + offset - left <= j <= i + offset + right; None
  on either side means unbounded;

with one diagonal offset for both, chosen by align: 0 for "top_left" (the
first query sits on the first key, as torch's is_causal=True) and Nk - Nq
for "bottom_right" (the last query sits on the last key, as when decoding
with a KV cache, and as flash-attn's causal and window_size). With
kv_lengths, "bottom_right" aligns each batch element to its own last
valid key, kv_lengths[b] - Nq, as flash-attn's unpadded sequences and
xformers' bottom-right block-diagonal masks do. causal="top_left" or
"bottom_right" is causal=True with that align;
- kv_lengths: j < kv_lengths[b] for batch element b (key padding);
- mask: mask[..., i, j] is True; or, for a float mask (torch's additive
  attn_mask), mask[..., i, j] > -inf, and the score gains mask[..., i, j].
See chapters 5 and 7.
"""

import numbers
from typing import NamedTuple

import numpy as np

CAUSAL_MODES = (False, True, "top_left", "bottom_right")
ALIGNS = ("top_left", "bottom_right")


class Rules(NamedTuple):
    """The attention pattern of one call, in the form tiles ask about."""

    causal: bool
    offset: int | np.ndarray  # 0, Nk - Nq, or (*batch, 1, 1) per element
    window: tuple | None  # (left, right), either may be None
    kv_lengths: np.ndarray | None  # (*batch, 1, 1) valid key counts
    mask: np.ndarray | None  # boolean, broadcastable to (*batch, Nq, Nk)
    bias: np.ndarray | None = None  # float, added to the scores, or None

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

    def added(self, rows, cols):
        """The float mask's (..., len(rows), len(cols)) tile, or None."""
        if self.bias is None:
            return None
        b = self.bias
        return b[..., _span(rows, b.shape[-2]), :][
            ..., _span(cols, b.shape[-1])]

    def index(self):
        """The index rules as the record the scalar forms below take
        (with per-element offsets, an (*batch, 1, 1) offset array)."""
        left, right = (-1 if w is None else w
                       for w in (self.window or (None, None)))
        return Index(self.causal, self.offset, left, right)

    def skips(self, rows, cols):
        """True if no pair of the tile is allowed: its work can be skipped.

        Decided from the tile's corners when only index rules apply, so a
        skipped tile costs O(1) instead of O(Br Bc).
        """
        if np.ndim(self.offset):  # a diagonal per element: ask every pair
            keep = self.allowed(rows, cols)
            return keep is not None and not keep.any()
        kv = (self.kv_lengths.max() if self.kv_lengths is not None
              else cols.stop)
        if tile_skipped(rows.start, rows.stop, cols.start, cols.stop,
                        self.index(), kv):
            return True
        if self.mask is None and (self.kv_lengths is None
                                  or self.kv_lengths.min() == kv):
            return False
        keep = self.allowed(rows, cols)
        return keep is not None and not keep.any()

    def empty_rows(self, batch_shape, nq, nk):
        """Boolean (*batch, Nq): rows that no key may be attended by.

        Only these rows output 0 with lse -inf; see `flashlab.nonfinite`.
        From closed-form bounds per row, plus one pass over a boolean mask.
        """
        index = self.index()
        # each row's diagonal (Nq,), or (*batch, Nq) with per-element ones
        diag = np.arange(nq) + (index.offset[..., 0] if np.ndim(
            index.offset) else index.offset)
        lo = np.zeros(nq, dtype=np.int64)  # first allowed key, ...
        hi = np.full(nq, nk - 1, dtype=np.int64)  # ... and the last
        if index.causal:
            hi = np.minimum(hi, diag)
        if index.left >= 0:
            lo = np.maximum(lo, diag - index.left)
        if index.right >= 0:
            hi = np.minimum(hi, diag + index.right)
        if self.kv_lengths is not None:
            hi = np.minimum(hi, self.kv_lengths[..., 0] - 1)
        empty = np.broadcast_to(lo > hi, (*batch_shape, nq))
        if self.mask is not None:
            keep = self.allowed(range(nq), range(nk))
            empty = empty | ~np.broadcast_to(keep, (*batch_shape, nq, nk)
                                             ).any(axis=-1)
        return empty


class Index(NamedTuple):
    """The index rules in scalar form: window sides -1 when unbounded."""

    causal: bool
    offset: int
    left: int
    right: int


# Scalar forms of the index rules, compiled by the numba kernels. `r` is
# any record with the fields of `Index` (the kernels pass their
# kernel_args.KernelRules); kv_len is the batch element's number of
# valid keys.

def pair_allowed(i, j, r, kv_len):
    """Whether query i may attend to key j under the index rules."""
    diag = i + r.offset
    if r.causal and j > diag:
        return False
    if r.left >= 0 and j < diag - r.left:
        return False
    if r.right >= 0 and j > diag + r.right:
        return False
    return j < kv_len


def tile_skipped(i0, i1, j0, j1, r, kv_len):
    """No pair of rows i0..i1-1 and keys j0..j1-1 is allowed."""
    if r.causal and j0 > i1 - 1 + r.offset:
        return True
    if r.left >= 0 and j1 - 1 < i0 + r.offset - r.left:
        return True
    if r.right >= 0 and j0 > i1 - 1 + r.offset + r.right:
        return True
    return j0 >= kv_len


def last_tile(i1, nk, bc, r, kv_len):
    """The last tile of bc keys that rows up to i1 - 1 may visit (-1 if
    none): the upper end of tile_range, the same for rows from any i0."""
    hi = min(nk, kv_len) - 1  # tile t is visited when t bc <= hi
    if r.causal:
        hi = min(hi, i1 - 1 + r.offset)
    if r.right >= 0:
        hi = min(hi, i1 - 1 + r.offset + r.right)
    return max(hi, -1) // bc


def tile_range_of(last_tile):
    """tile_range over `last_tile` (the function above, or its device
    function: the kernels compile this same code)."""

    def tile_range(i0, i1, nk, bc, r, kv_len):
        """(first, last): the tiles of bc keys that rows i0..i1-1 visit,
        the run on which tile_skipped is false; (n_tiles, n_tiles - 1)
        if none.

        Each bound of tile_skipped holds for every tile up to one or from
        one, so the run's ends follow from the bounds in a few integer
        steps instead of a call per skipped tile (a causal block of 16K
        keys would otherwise test, on average, half of its 128 tiles).
        """
        n_tiles = (nk + bc - 1) // bc
        lo = 0  # tile t's last key, min(t bc + bc, nk) - 1, is >= lo
        if r.left >= 0:
            lo = max(lo, i0 + r.offset - r.left)
        first, last = lo // bc, last_tile(i1, nk, bc, r, kv_len)
        if lo >= nk or first > last:
            return n_tiles, n_tiles - 1
        return first, last

    return tile_range


tile_range = tile_range_of(last_tile)


def tile_full(i0, i1, j0, j1, r, kv_len):
    """Every pair of the tile is allowed: no per-element masking needed."""
    if r.causal and j1 - 1 > i0 + r.offset:
        return False
    if r.left >= 0 and j0 < i1 - 1 + r.offset - r.left:
        return False
    if r.right >= 0 and j1 - 1 > i0 + r.offset + r.right:
        return False
    return j1 <= kv_len


def full_run_of(full):
    """full_run over the predicate `full` (tile_full, or its device
    function: the kernels compile this same scan)."""

    def full_run(i0, i1, first, last, nk, bc, r, kv_len):
        """(lo, hi): the tiles first..last of bc keys (tile t holds keys
        t bc..t bc + bc - 1) that lie below nk and in which every pair
        with rows i0..i1-1 is allowed; hi < lo when there is none.

        Each of tile_full's bounds holds for every j0 up to a limit, or
        for every j0 from one, so the full tiles are one run: scanning in
        from both ends costs a call per tile that is not full.
        """
        lo, hi = first, last
        while lo <= hi and not (lo * bc + bc <= nk and full(
                i0, i1, lo * bc, lo * bc + bc, r, kv_len)):
            lo += 1
        while hi >= lo and not (hi * bc + bc <= nk and full(
                i0, i1, hi * bc, hi * bc + bc, r, kv_len)):
            hi -= 1
        return lo, hi

    return full_run


full_run = full_run_of(tile_full)


def allowed_range(x, keys_in_rows, nq, nk, r, kv_len):
    """(lo, hi): the columns row x may pair with, lo..hi inclusive (hi <
    lo: none). Every index rule keeps an interval (pair_allowed), so the
    pairs a row allows are one run: x is a query and the columns keys,
    or, where keys_in_rows, x is a key and the columns queries."""
    if keys_in_rows:  # key x; queries i with pair_allowed(i, x)
        lo, hi = 0, nq - 1
        if x >= nk or x >= kv_len:
            hi = -1
        if r.causal:  # x <= i + offset
            lo = max(lo, x - r.offset)
        if r.left >= 0:  # x >= i + offset - left
            hi = min(hi, x - r.offset + r.left)
        if r.right >= 0:  # x <= i + offset + right
            lo = max(lo, x - r.offset - r.right)
        return lo, hi
    diag = x + r.offset
    lo, hi = 0, min(nk, kv_len) - 1
    if x >= nq:
        hi = -1
    if r.causal:
        hi = min(hi, diag)
    if r.left >= 0:
        lo = max(lo, diag - r.left)
    if r.right >= 0:
        hi = min(hi, diag + r.right)
    return lo, hi


def rules(causal, window, kv_lengths, mask, batch_shape, nq, nk,
          align=None):
    """Validate the masking arguments of an attention call into `Rules`."""
    if isinstance(causal, np.bool_):  # numpy's bools, as check_flag takes
        causal = bool(causal)
    if not any(causal is c or (isinstance(causal, str) and causal == c)
               for c in (None, *CAUSAL_MODES)):
        raise ValueError(
            f"causal: expected one of {CAUSAL_MODES}, got {causal!r}"
        )
    if align is not None and align not in ALIGNS:
        raise ValueError(f"align: expected one of {ALIGNS}, got {align!r}")
    if isinstance(causal, str):
        if align is not None and align != causal:
            raise ValueError(f"align: {align!r} contradicts causal="
                             f"{causal!r}; pass causal=True with align")
        align = causal
    is_causal = causal is not None and causal is not False
    kv_lengths = _check_lengths(kv_lengths, batch_shape, nk)
    offset = nk - nq if align == "bottom_right" else 0
    window = check_window(window)
    if window is not None:  # a side past both lengths bounds nothing
        window = tuple(None if w is not None and w >= nq + nk else w
                       for w in window)
    if align == "bottom_right" and kv_lengths is not None and (
            is_causal or window is not None):
        offset = kv_lengths.astype(np.int64) - nq  # each its own last key
    bias = None
    if mask is not None and np.asarray(mask).dtype.kind == "f":
        bias = _check_mask(mask, batch_shape, nq, nk, np.asarray(
            mask).dtype)
        mask = ~np.isneginf(bias)  # NaN stays allowed: it must show
    return Rules(
        causal=is_causal,
        offset=offset,
        window=window,
        kv_lengths=kv_lengths,
        mask=_check_mask(mask, batch_shape, nq, nk),
        bias=bias,
    )


def _and(keep, extra):
    return extra if keep is None else keep & extra


def _span(span, size):
    """Index a mask axis of length `size` (1 = broadcast) by `span`."""
    return slice(None) if size == 1 else slice(span.start, span.stop)


def check_window(window):
    """Return window as (left, right), each an int >= 0 or None; None
    stays None; anything else is refused, naming `window`."""
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


def _check_mask(mask, batch_shape, nq, nk, dtype=np.bool_):
    if mask is None:
        return None
    mask = np.asarray(mask)
    if mask.dtype != dtype:
        raise TypeError(
            f"mask: expected a boolean array (True = may attend) or a "
            f"float one (added to the scores), got dtype {mask.dtype}"
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
