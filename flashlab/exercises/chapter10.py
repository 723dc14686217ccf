"""Chapter 10's exercises on the fragment model: no GPU needed.

A C fragment's places, the swizzle, the passes of one ldmatrix, and a
model of the tensor core's truncating float32 sums.
"""

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

# ------------------------------------------------------- ldmatrix_passes


def _cases_passes(rng):
    lane = fragments.LANES
    out = []
    for name, per_row, (rows, chunks) in (
            ("A operand, d = 64", 8, fragments.ldmatrix_a(lane, 0)),
            ("K^T's B operands, d = 128", 16,
             fragments.ldmatrix_b(lane, 1, 3)),
            ("V's B operands (.trans), d = 64", 8,
             fragments.ldmatrix_b_trans(lane, 0, 1))):
        plain = (rows * per_row + chunks) * 16
        swizzled = fragments.swizzled_offset(rows, chunks, per_row)
        out += [Case(f"{name}, plain", (plain,), ldmatrix_passes(plain)),
                Case(f"{name}, swizzled", (swizzled,),
                     ldmatrix_passes(swizzled))]
    same = np.full(32, 16 * int(rng.integers(0, 64)))
    out.append(Case("every lane the same row (a broadcast)", (same,),
                    ldmatrix_passes(same)))
    scattered = 16 * rng.integers(0, 3072, 32)  # rows anywhere in 48 KiB
    out.append(Case("random rows", (scattered,),
                    ldmatrix_passes(scattered)))
    return out


def ldmatrix_passes(byte_addresses):
    """Chapter 10: shared-memory passes of one ldmatrix.x4.

    byte_addresses (32,): the 16-byte row each lane gives. The rows are
    read in 4 phases of 8 lanes; a phase takes as many passes as the
    most distinct 4-byte words one bank must serve. 4 is conflict-free.
    """
    words = byte_addresses[:, None] // 4 + np.arange(4)  # (32, 4)
    passes = 0
    for phase in range(4):
        distinct = np.unique(words[8 * phase:8 * phase + 8])
        passes += int(np.bincount(distinct % 32, minlength=32).max())
    return passes


def _passes_one_phase(byte_addresses):
    words = np.unique(byte_addresses[:, None] // 4 + np.arange(4))
    return int(np.bincount(words % 32, minlength=32).max())


def _passes_no_broadcast(byte_addresses):
    words = byte_addresses[:, None] // 4 + np.arange(4)
    return sum(int(np.bincount(words[8 * p:8 * p + 8].ravel() % 32,
                               minlength=32).max()) for p in range(4))


register("ldmatrix_passes", Exercise(
    10, "ldmatrix_passes(byte_addresses (32,)) -> int: the shared-memory "
    "passes of one ldmatrix.x4 whose lanes give these row addresses",
    _cases_passes, ldmatrix_passes,
    (("ldmatrix.x4 reads its 32 rows in 4 phases of 8 lanes (8 rows of 16 "
      "bytes fill the 32 banks once): count each phase apart and add",
      _passes_one_phase),
     ("lanes that read the very same word share one read (a broadcast): "
      "count distinct words per bank, not lanes", _passes_no_broadcast))))

# --------------------------------------------------------- truncated_sum


def _cases_truncated(rng):
    out = []
    for name, t, n in (("8 terms, 4 columns", 8, 4),
                       ("one term", 1, 3),
                       ("256 terms, 16 columns", 256, 16)):
        terms = rng.standard_normal((t, n)).astype(np.float32)
        out.append(Case(name, (terms,), truncated_sum(terms)))
    terms = rng.random((64, 8)).astype(np.float32)
    terms[:, :4] *= -1  # sums of one sign, both signs
    out.append(Case("64 terms of one sign per column", (terms,),
                    truncated_sum(terms)))
    return out


def to_float32_rz(x):
    """float64 x rounded toward zero to float32 (a model of how the tensor
    core's float32 sums round); inf and nan unchanged."""
    y = np.asarray(x, np.float64).astype(np.float32)
    over = np.abs(y.astype(np.float64)) > np.abs(x)  # rounded away: back
    return np.where(over, np.nextafter(y, np.float32(0)), y)


def truncated_sum(terms):
    """Chapter 10: the float32 running sum of terms (T, n) -> (n,), each
    addition rounded toward zero, starting from 0.

    Two float32 numbers of similar size add exactly in float64, so one
    rounding of that sum is the unit's one truncation per addition.
    """
    acc = np.zeros(terms.shape[1], np.float32)
    for row in terms:
        acc = to_float32_rz(acc.astype(np.float64) + row)
    return acc


def _truncated_nearest(terms):
    acc = np.zeros(terms.shape[1], np.float32)
    for row in terms:
        acc = (acc.astype(np.float64) + row).astype(np.float32)
    return acc


def _truncated_once(terms):
    return to_float32_rz(terms.astype(np.float64).sum(axis=0))


def _truncated_down(terms):
    acc = np.zeros(terms.shape[1], np.float32)
    for row in terms:
        exact = acc.astype(np.float64) + row
        y = exact.astype(np.float32)
        acc = np.where(y > exact, np.nextafter(y, np.float32(-np.inf)), y)
    return acc


register("truncated_sum", Exercise(
    10, "truncated_sum(terms (T, n) float32) -> (n,): the running float32 "
    "sum, each addition rounded toward zero, as the tensor core's sums "
    "round (a model)", _cases_truncated, truncated_sum,
    (("astype(np.float32) rounds to nearest; the unit truncates: round "
      "toward zero after every addition", _truncated_nearest),
     ("the unit rounds after every addition, not once at the end",
      _truncated_once),
     ("toward zero, not toward minus infinity: a negative sum rounds up",
      _truncated_down))))
