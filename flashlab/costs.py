"""Sizes and operation counts of attention, in closed form. See chapter 1."""

import math

from flashlab._validate import check_count

MIB = 2**20


def matrix_bytes(nq, nk, itemsize):
    """Bytes of one (Nq, Nk) score or probability matrix for one head."""
    return nq * nk * itemsize


def flops(nq, nk, d, d_v=None, *, causal=False, backward=False):
    """FLOPs of one head's tile products, as benchmarks count them.

    Forward: S = Q K^T and O = P V, 2 Nq Nk (d + d_v). Backward: S again,
    dP = dO V^T, dV = P^T dO, dQ = dS K and dK = dS^T Q, 2 Nq Nk (3d + 2dv)
    (2.5 times the forward when d = d_v). Causal halves either, the
    convention of the FlashAttention papers.
    """
    d_v = d if d_v is None else d_v
    total = 2 * nq * nk * ((3 * d + 2 * d_v) if backward else (d + d_v))
    return total / 2 if causal else total


SCHEDULES = ("dense", "fa1", "fa2")


def transfers(schedule, n, d, d_v=None, *, block_q, block_k=None,
              save_lse=False):
    """Closed-form element transfers per tensor: (reads, writes) dicts.

    One head, n queries and n keys, no mask. "dense": three kernels with
    S and P in HBM; "fa2": query blocks outer, S and P never leave the
    chip; "fa1": K/V blocks (block_k keys) outer, O, l, m in HBM between
    visits. `flashlab.io` measures the same counts by running the loops.
    """
    d_v = d if d_v is None else d_v
    for name, size in (("n", n), ("d", d), ("d_v", d_v),
                       ("block_q", block_q)):
        check_count(name, size)
    r, w = {}, {}
    if schedule == "fa1":
        tc = math.ceil(n / check_count("block_k", block_k))  # K/V blocks
        r["Q"] = tc * n * d  # every K/V block revisits every query block
        r["K"], r["V"] = n * d, n * d_v  # each K/V block loaded once
        r["O"], w["O"] = tc * n * d_v, (tc + 1) * n * d_v  # +1: zero-fill
        for stat in ("m", "l"):
            r[stat], w[stat] = tc * n, (tc + 1) * n
        return r, w
    if schedule not in SCHEDULES:
        raise ValueError(
            f"schedule: expected one of {SCHEDULES}, got {schedule!r}")
    tr = math.ceil(n / block_q)  # query blocks
    r["Q"] = n * d  # each query block loaded once
    r["K"], r["V"] = tr * n * d, tr * n * d_v  # reread per query block
    w["O"] = n * d_v  # written once
    if save_lse:
        w["lse"] = n
    if schedule == "dense":
        for inter in ("S", "P"):  # written by one kernel, read by the next
            r[inter] = w[inter] = n * n
    return r, w


def dense_transfers(n, d, d_v=None, *, block_q):
    """Materialized path: inputs and output, plus S and P written and read."""
    reads, writes = transfers("dense", n, d, d_v, block_q=block_q)
    return sum(reads.values()) + sum(writes.values())


def fused_transfers(n, d, d_v=None, *, block_q):
    """Fused tiled path (FlashAttention-2 order): S and P stay on chip."""
    reads, writes = transfers("fa2", n, d, d_v, block_q=block_q)
    return sum(reads.values()) + sum(writes.values())


def ring_transfers(world, n_local, d, d_v=None):
    """Elements each rank sends in ring attention: (forward, backward).

    Forward: world - 1 hops of a K/V slice, n_local (d + d_v) each.
    Backward: world - 1 hops of K, V, dK, dV, and one last hop of dK, dV
    back to their own rank (none in a ring of one: they are home). Times
    batch x heads for the whole call; the same for every rank and layout.
    See chapter 11.
    """
    d_v = d if d_v is None else d_v
    kv = n_local * (d + d_v)
    return (world - 1) * kv, (2 * (world - 1) + (world > 1)) * kv
