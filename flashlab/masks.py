"""Which (query, key) pairs may attend: causal alignment and boolean masks.

Every backend asks this module, so the mask semantics live in one place.
"""

import numpy as np

CAUSAL_MODES = (False, True, "top_left", "bottom_right")


def causal_offset(causal, nq, nk):
    """Key offset of the causal diagonal, or None for no causal mask.

    Query i may see key j when j <= i + offset. Top-left alignment (offset
    0) matches torch's is_causal=True; bottom-right aligns the last query
    with the last key, as when decoding with a KV cache.
    """
    if causal is False or causal is None:
        return None
    if causal is True or causal == "top_left":
        return 0
    if causal == "bottom_right":
        return nk - nq
    raise ValueError(
        f"causal: expected one of {CAUSAL_MODES}, got {causal!r}"
    )


def allowed(rows, cols, offset, mask):
    """Boolean (..., len(rows), len(cols)) of allowed pairs, or None if all.

    rows, cols: ranges of query and key indices; offset from
    causal_offset; mask broadcastable to (..., Nq, Nk) or None.
    """
    keep = None
    if offset is not None:
        r = np.asarray(rows)[:, None]
        c = np.asarray(cols)[None, :]
        keep = c <= r + offset  # (Br, Bc)
    if mask is not None:
        tile = mask[..., _index(rows, mask.shape[-2]), :]
        tile = tile[..., _index(cols, mask.shape[-1])]
        keep = tile if keep is None else keep & tile
    return keep


def _index(span, size):
    """Index a mask axis of length `size` (1 = broadcast) by `span`."""
    if size == 1:
        return slice(None)
    return slice(span.start, span.stop)


def visits(keep):
    """True if a tile has any allowed pair, so it must be computed."""
    return keep is None or bool(keep.any())
