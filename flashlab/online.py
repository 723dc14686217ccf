"""Online softmax with output accumulation: one query, scores in chunks.

Two equivalent forms, both built on `flashlab.merge.merge`:
- `stream` carries the unnormalized numerator a (called u in
  flashlab.merge) and divides once at the end (FlashAttention-2).
- `stream_normalized` carries the normalized output O = a / l and rescales
  it at every chunk, as Algorithm 1 of FlashAttention-1 does.
See chapter 3.
"""

from typing import NamedTuple

import numpy as np

from flashlab import merge
from flashlab._validate import check_count


class Normalized(NamedTuple):
    """FlashAttention-1 state: m (...,), l (...,), normalized o (..., d_v)."""

    m: np.ndarray
    l: np.ndarray
    o: np.ndarray


def _chunks(scores, values, chunk):
    """Yield chunks of `chunk` keys: scores (..., C), values (..., C, d_v)."""
    scores = np.asarray(scores)
    values = np.asarray(values)
    if scores.ndim < 1:
        raise ValueError(f"scores: expected (..., C), one per key, got "
                         f"shape {scores.shape}")
    if values.ndim < 2:
        raise ValueError(f"values: expected (..., C, d_v), a row per key, "
                         f"got shape {values.shape}")
    if scores.shape[-1] != values.shape[-2]:
        raise ValueError(
            f"values: expected {scores.shape[-1]} rows, one per score, got "
            f"{values.shape[-2]}"
        )
    chunk = check_count("chunk", chunk)
    for j0 in range(0, scores.shape[-1], chunk):
        yield scores[..., j0:j0 + chunk], values[..., j0:j0 + chunk, :]


def stream(scores, values, chunk):
    """Running summaries after each chunk. scores (..., N), values (N, d_v)."""
    states = []
    state = None
    for s, v in _chunks(scores, values, chunk):
        block = merge.summarize(s, v)
        state = block if state is None else merge.merge(state, block)
        states.append(state)
    return states


def stream_normalized(scores, values, chunk):
    """FlashAttention-1 form: states (m, l, O = a / l) after each chunk."""
    states = []
    state = None
    for s, v in _chunks(scores, values, chunk):
        block = merge.summarize(s, v)
        if state is not None:
            # Undo the division (a = l O), merge, divide again: the FA1
            # update O <- (l e^(m - m') O + e^(m~ - m') P~ V) / l'.
            carried = merge.Summary(state.m, state.l, state.l[..., None]
                                    * state.o)
            block = merge.merge(carried, block)
        state = Normalized(block.m, block.l, block.output())
        states.append(state)
    return states
