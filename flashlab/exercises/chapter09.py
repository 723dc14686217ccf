"""Chapter 9's exercises: a thread's piece of S, arithmetic intensity,
races between barriers, the width numba gives a float32 line."""

import functools
import math

import numpy as np

from flashlab import costs
from flashlab.exercises.checker import Case, Exercise, register

# ---------------------------------------------------------- thread_piece


def gpu_tiles():
    """The v3/v4 layout at d = 64 (the GPU package's own, no GPU needed)."""
    from flashlab.gpu.device import tiles

    return tiles(64, 64)


def _cases_thread_piece(rng):
    tl = gpu_tiles()
    return [Case(f"thread {t} of the d=64 layout", (t, tl.TX, tl.RM, tl.CN),
                 thread_piece(t, tl.TX, tl.RM, tl.CN))
            for t in (0, 1, tl.TX, 127, int(rng.integers(2, 127)))]


def thread_piece(t, tx_n, rm, cn):
    """Chapter 9: (rows, cols) of S that thread t holds in v3 and v4."""
    ty, tx = t // tx_n, t % tx_n
    return (tuple(range(ty * rm, ty * rm + rm)),
            tuple(range(tx * cn, tx * cn + cn)))


def _piece_swapped(t, tx_n, rm, cn):
    ty, tx = t % tx_n, t // tx_n
    return (tuple(range(ty * rm, ty * rm + rm)),
            tuple(range(tx * cn, tx * cn + cn)))


def _piece_strided(t, tx_n, rm, cn):
    ty, tx = t // tx_n, t % tx_n
    return (tuple(range(ty * rm, ty * rm + rm)),
            tuple(tx + tx_n * c for c in range(cn)))


register("thread_piece", Exercise(
    9, "thread_piece(t, tx_n, rm, cn) -> (rows, cols) of the S tile "
    "that thread t holds in forward v3/v4", _cases_thread_piece,
    thread_piece,
    (("t = ty * tx_n + tx: the row of threads is t // tx_n",
      _piece_swapped),
     ("a thread's S columns are contiguous (tx * cn ...); only its "
      "output columns are strided", _piece_strided))))

# --------------------------------------------------------- fa2_intensity


def _cases_intensity(rng):
    return [Case(f"n={n}, d={d}, block_q={bq}", (n, d, bq),
                 fa2_intensity(n, d, bq))
            for n, d, bq in ((16384, 64, 64), (1024, 128, 128),
                             (int(rng.integers(100, 5000)), 32, 16))]


def fa2_intensity(n, d, block_q):
    """Chapter 9: FLOPs per HBM byte of the float32 FA2 forward."""
    return costs.flops(n, n, d) / (4 * costs.fused_transfers(
        n, d, block_q=block_q))


def _intensity_elements(n, d, block_q):
    return costs.flops(n, n, d) / costs.fused_transfers(n, d,
                                                        block_q=block_q)


def _intensity_dense(n, d, block_q):
    return costs.flops(n, n, d) / (4 * costs.dense_transfers(
        n, d, block_q=block_q))


register("fa2_intensity", Exercise(
    9, "fa2_intensity(n, d, block_q) -> FLOPs per HBM byte of the "
    "float32 FA2 forward", _cases_intensity, fa2_intensity,
    (("a float32 element is 4 bytes", _intensity_elements),
     ("the fused schedule does not move S and P", _intensity_dense))))

# ------------------------------------------------------ racing_addresses

THREAD, INTERVAL, ADDRESS, WRITE = range(4)  # the columns of an event


def v2_accesses(barriers=(True, True), rows=4, keys=2, d=2, tiles=2):
    """(n, 4) int events (thread, interval, address, write) of v2's loop.

    A small model of forward v2's shared memory: per tile, thread t
    copies elements t, t + rows, ... of K_j and then of V_j (`stage`);
    after the first barrier every thread reads all of both; the second
    barrier ends the tile. barriers says which of the two are kept; an
    interval is the stretch between two barriers the block passes.
    """
    n = keys * d  # K_j at addresses 0..n-1, V_j at n..2n-1
    events, interval = [], 0
    for _ in range(tiles):
        for t in range(rows):
            events += [(t, interval, a, 1) for base in (0, n)
                       for a in range(base + t, base + n, rows)]
        interval += barriers[0]
        events += [(t, interval, a, 0) for t in range(rows)
                   for a in range(2 * n)]
        interval += barriers[1]
    return np.array(events, dtype=np.int64)


def _cases_races(rng):
    small = {  # thread, interval, address, write
        "a write and a read ordered by a barrier": [(0, 0, 5, 1),
                                                    (1, 1, 5, 0)],
        "two threads reading one address": [(0, 0, 5, 0), (1, 0, 5, 0)],
        "a thread reading its own write": [(3, 0, 7, 1), (3, 0, 7, 0),
                                           (1, 0, 8, 1), (2, 0, 8, 0)]}
    out = [Case(name, (np.array(e),), racing_addresses(np.array(e)))
           for name, e in small.items()]
    for name, kept in (("v2, both barriers", (True, True)),
                       ("v2 without the barrier after the copy",
                        (False, True)),
                       ("v2 without the barrier at the end of a tile",
                        (True, False))):
        events = v2_accesses(kept)
        out.append(Case(name, (events,), racing_addresses(events)))
    events = np.column_stack([rng.integers(0, 6, 40), rng.integers(0, 3, 40),
                              rng.integers(0, 10, 40),
                              rng.integers(0, 2, 40)])
    out.append(Case("random accesses of 6 threads", (events,),
                    racing_addresses(events)))
    return out


def racing_addresses(events):
    """Chapter 9: the shared addresses on which two threads race.

    events (n, 4): thread, interval, address, write (1) or read (0). A
    race is two threads touching one address in one interval (nothing
    orders them), at least one of them writing.
    """
    races = set()
    for interval, address in {(int(e[INTERVAL]), int(e[ADDRESS]))
                              for e in events}:
        here = events[(events[:, INTERVAL] == interval)
                      & (events[:, ADDRESS] == address)]
        writers = set(here[here[:, WRITE] == 1, THREAD])
        if writers and len(set(here[:, THREAD])) > 1:
            races.add(address)
    return races


def _races_reads_too(events):
    return {int(a) for a in set(events[:, ADDRESS])
            for i in set(events[:, INTERVAL])
            if len(set(events[(events[:, ADDRESS] == a)
                              & (events[:, INTERVAL] == i), THREAD])) > 1}


def _races_no_barriers(events):
    flat = events.copy()
    flat[:, INTERVAL] = 0
    return racing_addresses(flat)


def _races_own_writes(events):
    return {int(a) for a in set(events[:, ADDRESS])
            for i in set(events[:, INTERVAL])
            if np.any(events[(events[:, ADDRESS] == a)
                             & (events[:, INTERVAL] == i), WRITE] == 1)
            and np.sum((events[:, ADDRESS] == a)
                       & (events[:, INTERVAL] == i)) > 1}


register("racing_addresses", Exercise(
    9, "racing_addresses(events (n, 4): thread, interval, address, write) "
    "-> set of the shared addresses on which two threads race",
    _cases_races, racing_addresses,
    (("two threads that only read an address do not race: a race needs "
      "at least one write", _races_reads_too),
     ("a barrier orders everything before it against everything after "
      "it: compare accesses within one interval only", _races_no_barriers),
     ("a thread reading what it wrote itself is ordered (one thread runs "
      "in order): a race needs two threads", _races_own_writes))))

# ------------------------------------------------------------ float_bits

F0 = np.float32(0)  # as flashlab.gpu.device writes its zero
F0_LITERAL = 0.0  # what exercise 2 changes it to
EXPRESSIONS = {  # kernel-like lines, x and y float32 as in the kernels
    "x + y": lambda x, y: x + y,
    "x + 0.0": lambda x, y: x + 0.0,
    "x * 2": lambda x, y: x * 2,
    "x + np.float32(1.0)": lambda x, y: x + np.float32(1.0),
    "max(x, 0.0)": lambda x, y: max(x, 0.0),
    "max(x, y)": lambda x, y: max(x, y),
    "math.exp(x - y)": lambda x, y: math.exp(x - y),
    "F0 + x * y  (F0 = np.float32(0))": lambda x, y: F0 + x * y,
    "F0 + x * y  (F0 = 0.0)": lambda x, y: F0_LITERAL + x * y,
    "x / 2": lambda x, y: x / 2,
}


def _cases_bits(rng):
    names = list(EXPRESSIONS)
    return [Case(expr, (expr,), _numba_bits(expr))
            for expr in rng.permutation(names)]


def float_bits(expr):
    """Chapter 9: 32 or 64, the float width numba gives `expr`.

    numba types a Python float or int literal, and a module constant
    holding one, as 64 bits, so float32 x op 0.0 is float64; float32
    constants (np.float32(...)) and math functions of float32 arguments
    stay float32. Compiling the line says which, with no GPU: numba's CPU
    compiler types it as numba.cuda does. numba is imported here, not at
    the top, since chapter 9 chooses the CUDA target before numba loads.
    """
    import numba

    fn = numba.njit((numba.float32, numba.float32))(EXPRESSIONS[expr])
    return fn.nopython_signatures[0].return_type.bitwidth


_numba_bits = functools.cache(float_bits)  # compile each line once


def _bits_numpy(expr):
    got = EXPRESSIONS[expr](np.float32(1.5), np.float32(0.25))
    return 32 if isinstance(got, np.float32) else 64


def _bits_any_constant(expr):
    line = expr.split("  ")[0]  # the line, without its note
    return 64 if any(ch.isdigit() for ch in line) else 32


register("float_bits", Exercise(
    9, "float_bits(expr) -> 32 or 64: the float width numba gives a kernel "
    "line, x and y float32 (expr is a key of chapter09.EXPRESSIONS)",
    _cases_bits, float_bits,
    (("that is numpy's rule (NumPy 2 keeps float32 beside a Python float); "
      "numba types every Python float literal float64, and math.exp of "
      "a float32 stays float32", _bits_numpy),
     ("a constant is float64 only if it holds a Python float or int: "
      "np.float32(1.0), or F0 = np.float32(0), stays float32",
      _bits_any_constant))))
