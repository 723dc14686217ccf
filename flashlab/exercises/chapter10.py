"""Chapter 10's exercises on the fragment model: no GPU needed."""

import numpy as np

from flashlab import fragments
from flashlab.exercises.checker import Case, Exercise, register

# ---------------------------------------------------------- c_fragment


def _cases_c_fragment(rng):
    return [Case(f"lane {lane}", (lane,), fragments.c_places()[lane])
            for lane in (0, 1, 4, 31, int(rng.integers(2, 31)))]


def c_fragment(lane):
    """Chapter 10: (4, 2) (row, col) of each float32 lane holds of C/D.

    m16n8 C fragment, lane = 4 G + t: registers 0, 1 in row G, registers
    2, 3 in row G + 8, columns 2t and 2t + 1 in each pair.
    """
    row, t = lane // 4, lane % 4  # the lane group G, the place t in it
    return np.array([[row, 2 * t], [row, 2 * t + 1],
                     [row + 8, 2 * t], [row + 8, 2 * t + 1]])


def _c_fragment_a_order(lane):
    row, t = lane // 4, lane % 4  # A's row order G, G + 8, G, G + 8
    return np.array([[row, 2 * t], [row + 8, 2 * t + 1],
                     [row, 2 * t], [row + 8, 2 * t + 1]])


def _c_fragment_swapped(lane):
    row, t = lane % 4, lane // 4  # the lane's group and place swapped
    return np.array([[row, 2 * t], [row, 2 * t + 1],
                     [row + 8, 2 * t], [row + 8, 2 * t + 1]])


register("c_fragment", Exercise(
    10, "c_fragment(lane) -> int array (4, 2): the (row, col) of each "
    "float32 the lane holds in the m16n8 C/D fragment",
    _cases_c_fragment, c_fragment,
    (("in C the first two registers share row G and the last two row "
      "G + 8 (A's order G, G + 8, G, G + 8 is another fragment's)",
      _c_fragment_a_order),
     ("lane = 4 G + t: the row group is lane // 4, the place in it "
      "lane % 4", _c_fragment_swapped))))

# ------------------------------------------------------- swizzled_chunk


def _cases_swizzle(rng):
    out = []
    for name, per_row in (("rows of 8 chunks (64 bf16)", 8),
                          ("rows of 16 chunks (128 bf16)", 16)):
        rows = np.repeat(np.arange(16), per_row)
        chunks = np.tile(np.arange(per_row), 16)
        out.append(Case(name, (rows, chunks),
                        fragments.swizzle(rows, chunks)))
    rows = rng.integers(0, 128, 20)
    chunks = rng.integers(0, 16, 20)
    out.append(Case("random rows and chunks", (rows, chunks),
                    fragments.swizzle(rows, chunks)))
    return out


def swizzled_chunk(rows, chunks):
    """Chapter 10: stored chunk of each 16-byte chunk of a tile row.

    XOR with the row's low three bits: the 8 rows one ldmatrix reads put
    the same logical chunk in 8 different chunk slots, so all 32 banks.
    """
    return chunks ^ (rows & 7)


def _swizzle_whole_row(rows, chunks):
    return chunks ^ rows


def _swizzle_rotate(rows, chunks):
    return (chunks + rows) % 8


register("swizzled_chunk", Exercise(
    10, "swizzled_chunk(rows (n,), chunks (n,)) -> int array (n,): the "
    "stored chunk of each 16-byte chunk under the XOR swizzle",
    _cases_swizzle, swizzled_chunk,
    (("only the row's low three bits take part (row & 7): XOR with the "
      "whole row sends a chunk out of its row", _swizzle_whole_row),
     ("the swizzle is an XOR, which keeps chunks 8-15 among chunks 8-15; "
      "a rotation modulo 8 does not", _swizzle_rotate))))
