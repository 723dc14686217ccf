"""Chapter 11's exercises: the zigzag layout and a ring step's work."""

import numpy as np

from flashlab import distributed
from flashlab.exercises.checker import Case, Exercise, register

# ------------------------------------------------------ zigzag_positions


def _cases_zigzag(rng):
    return [Case(f"rank {r} of {w}, N = {n}", (r, w, n),
                 distributed.positions(r, w, n, "zigzag"))
            for r, w, n in ((0, 2, 8), (1, 2, 8), (3, 4, 32), (0, 1, 6),
                            (int(rng.integers(0, 8)), 8, 64))]


def zigzag_positions(rank, world, n):
    """Chapter 11: the rows rank r holds in the zigzag layout, (n / W,).

    The sequence is cut into 2W chunks; rank r takes chunk r and chunk
    2W - 1 - r, so every rank holds an early and a late piece.
    """
    size = n // (2 * world)
    return np.concatenate([np.arange(rank * size, (rank + 1) * size),
                           np.arange((2 * world - 1 - rank) * size,
                                     (2 * world - rank) * size)])


def _zigzag_contiguous(rank, world, n):
    size = n // world
    return np.arange(rank * size, (rank + 1) * size)


def _zigzag_mirror_off_by_one(rank, world, n):
    size = n // (2 * world)
    return np.concatenate([np.arange(rank * size, (rank + 1) * size),
                           np.arange((2 * world - rank) * size,
                                     (2 * world + 1 - rank) * size)])


register("zigzag_positions", Exercise(
    11, "zigzag_positions(rank, world, n) -> int array (n / world,): the "
    "sequence rows rank holds in the zigzag layout",
    _cases_zigzag, zigzag_positions,
    (("zigzag cuts the sequence into 2W chunks and gives each rank two of "
      "them, not one contiguous slice", _zigzag_contiguous),
     ("rank r's second chunk is chunk 2W - 1 - r (rank 0 takes the last "
      "one)", _zigzag_mirror_off_by_one))))

# ---------------------------------------------------------- causal_pairs


def _cases_pairs(rng):
    out = []
    for r, step, w, n, layout in ((0, 0, 2, 8, "contiguous"),
                                  (1, 1, 4, 16, "contiguous"),
                                  (0, 1, 4, 16, "contiguous"),
                                  (2, 3, 4, 32, "zigzag"),
                                  (int(rng.integers(0, 4)), 2, 4, 64,
                                   "zigzag")):
        q = distributed.positions(r, w, n, layout)
        k = distributed.positions((r - step) % w, w, n, layout)
        want = int(np.sum(k[None, :] <= q[:, None]))
        out.append(Case(f"rank {r}, step {step} of {w}, N = {n}, {layout}",
                        (r, step, w, n, layout), want))
    return out


def causal_pairs(rank, step, world, n, layout):
    """Chapter 11: causal (query, key) pairs rank r computes at a step.

    At step s rank r holds the K/V slice of rank (r - s) mod W; a pair is
    allowed when the key's position is at or before the query's.
    """
    q = distributed.positions(rank, world, n, layout)
    k = distributed.positions((rank - step) % world, world, n, layout)
    return int(np.sum(k[None, :] <= q[:, None]))


def _pairs_wrong_direction(rank, step, world, n, layout):
    return causal_pairs((rank + 2 * step) % world, step, world, n, layout)


def _pairs_strict(rank, step, world, n, layout):
    q = distributed.positions(rank, world, n, layout)
    k = distributed.positions((rank - step) % world, world, n, layout)
    return int(np.sum(k[None, :] < q[:, None]))


register("causal_pairs", Exercise(
    11, "causal_pairs(rank, step, world, n, layout) -> int: the allowed "
    "causal pairs rank computes at that ring step",
    _cases_pairs, causal_pairs,
    (("slices travel one rank forward per step: at step s rank r holds "
      "the K/V of rank (r - s) mod W", _pairs_wrong_direction),
     ("a query may attend to its own position: key <= query, not <",
      _pairs_strict))))
