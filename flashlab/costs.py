"""Sizes and operation counts of attention, in closed form. See chapter 1."""

import math

MIB = 2**20


def matrix_bytes(nq, nk, itemsize):
    """Bytes of one (Nq, Nk) score or probability matrix for one head."""
    return nq * nk * itemsize


def flops(nq, nk, d, dv=None, *, causal=False, backward=False):
    """FLOPs of one head's tile products, as benchmarks count them.

    Forward: S = Q K^T and O = P V, 2 Nq Nk (d + dv). Backward: S again,
    dP = dO V^T, dV = P^T dO, dQ = dS K and dK = dS^T Q, 2 Nq Nk (3d + 2dv)
    (2.5 times the forward when d = dv). Causal halves either, the
    convention of the FlashAttention papers.
    """
    dv = d if dv is None else dv
    total = 2 * nq * nk * ((3 * d + 2 * dv) if backward else (d + dv))
    return total / 2 if causal else total


def input_output_transfers(n, d, dv=None, *, block_q):
    """Elements moved for Q, K, V and O when each query block rereads K, V.

    Q is read once, K and V once per query block of block_q rows, and O is
    written once. Both the fused and the materialized path pay this.
    """
    dv = d if dv is None else dv
    query_blocks = math.ceil(n / block_q)
    return n * d + query_blocks * n * (d + dv) + n * dv


def dense_transfers(n, d, dv=None, *, block_q):
    """Materialized path: inputs and output, plus S and P written and read."""
    return input_output_transfers(n, d, dv, block_q=block_q) + 4 * n * n


def fused_transfers(n, d, dv=None, *, block_q):
    """Fused tiled path: S and P never leave the chip."""
    return input_output_transfers(n, d, dv, block_q=block_q)
