"""Chapter 6's exercises: counted transfers and Algorithm 1's blocks."""

from flashlab import costs, io
from flashlab.exercises.checker import Case, Exercise, register

# --------------------------------------------------------- fa2_transfers


def _cases_fa2_transfers(rng):
    return [Case(f"n={n}, d={d}, block_q={bq}", (n, d, bq),
                 int(costs.fused_transfers(n, d, block_q=bq)))
            for n, d, bq in ((6, 2, 2), (1, 4, 8), (100, 16, 32),
                             (int(rng.integers(50, 300)), 8, 7))]


def fa2_transfers(n, d, block_q):
    """Chapter 6: elements moved by the FA2 forward (d_v = d, one head)."""
    query_blocks = -(-n // block_q)
    return n * d + query_blocks * 2 * n * d + n * d  # Q; K, V per block; O


def _fa2_no_reread(n, d, block_q):
    return 4 * n * d


def _fa2_with_s_and_p(n, d, block_q):
    return fa2_transfers(n, d, block_q) + 4 * n * n


register("fa2_transfers", Exercise(
    6, "fa2_transfers(n, d, block_q) -> elements moved by the FA2 "
    "forward of one head (d_v = d), an integer", _cases_fa2_transfers,
    fa2_transfers,
    (("each query block rereads all of K and V: ceil(n / block_q) "
      "passes", _fa2_no_reread),
     ("S and P never leave the chip in the fused schedule",
      _fa2_with_s_and_p))))

# ------------------------------------------------------- fa1_block_sizes


def _cases_fa1_blocks(rng):
    return [Case(f"M={m}, d={d}", (m, d),
                 tuple(int(x) for x in io.fa1_blocks(m, d)))
            for m, d in ((1024, 32), (1000, 32), (65536, 64), (256, 64),
                         (int(rng.integers(300, 20000)), 16))]


def fa1_block_sizes(sram, d):
    """Chapter 6: Algorithm 1's (Br, Bc) for an SRAM of `sram` elements."""
    bc = -(-sram // (4 * d))  # ceil(M / 4d)
    return min(bc, d), bc


def _fa1_floor(sram, d):
    bc = sram // (4 * d)
    return min(bc, d), bc


def _fa1_no_cap(sram, d):
    bc = -(-sram // (4 * d))
    return bc, bc


register("fa1_block_sizes", Exercise(
    6, "fa1_block_sizes(sram, d) -> (Br, Bc) of Algorithm 1, integers",
    _cases_fa1_blocks, fa1_block_sizes,
    (("Bc = ceil(M / 4d): round up", _fa1_floor),
     ("the paper caps Br at d: Br = min(Bc, d)", _fa1_no_cap))))
