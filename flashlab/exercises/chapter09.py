"""Chapter 9's exercises: a thread's piece of S, arithmetic intensity."""

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
