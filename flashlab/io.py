"""A slow memory that counts: measured HBM traffic of attention schedules.

`Counted` wraps an array standing for a tensor in HBM. Every slice read
from it counts as that many elements moved HBM -> chip, every slice
written as elements moved chip -> HBM. `ledger` runs the real loops of
`flashlab.dense` and `flashlab.tiled` on such arrays, so the counts come
from executing the algorithms, and `predicted` gives the closed forms the
chapter derives. Caches, register spills and the backward pass are not
modelled. See chapter 6.
"""

import math
from typing import NamedTuple

import numpy as np

from flashlab import costs, dense, tiled
from flashlab._validate import check_count

SCHEDULES = costs.SCHEDULES
TENSORS = ("Q", "K", "V", "S", "P", "O", "m", "l", "lse")


class Counted:
    """An array in slow memory whose slice reads and writes are counted."""

    def __init__(self, name, data, ledger):
        self.name, self.data, self._ledger = name, data, ledger

    shape = property(lambda self: self.data.shape)
    dtype = property(lambda self: self.data.dtype)
    ndim = property(lambda self: self.data.ndim)

    def __getitem__(self, index):
        out = np.array(self.data[index])  # a copy: now it is on chip
        self._ledger.count("read", self.name, out.size)
        return out

    def __setitem__(self, index, value):
        target = self.data[index]
        self._ledger.count("write", self.name, target.size)
        self.data[index] = value


class Ledger(NamedTuple):
    """Elements read and written per tensor (and, if kept, in order)."""

    reads: dict
    writes: dict
    events: list | None = None  # (direction, tensor, elements), in order

    def count(self, direction, tensor, elements):
        """Record one transfer: direction "read" or "write"."""
        (self.reads if direction == "read" else self.writes)[tensor] += \
            elements
        if self.events is not None:
            self.events.append((direction, tensor, elements))

    @property
    def total(self):
        """All element transfers, both directions, every tensor."""
        return sum(self.reads.values()) + sum(self.writes.values())

    def table(self):
        """A plain-text table: one row per tensor that moved."""
        lines = [f"{'tensor':<6} {'reads':>12} {'writes':>12}"]
        for t in TENSORS:
            if self.reads[t] or self.writes[t]:
                lines.append(
                    f"{t:<6} {self.reads[t]:>12,} {self.writes[t]:>12,}"
                )
        lines.append(f"{'total':<6} {self.total:>25,}")
        return "\n".join(lines)


def _empty_ledger(record=False):
    return Ledger({t: 0 for t in TENSORS}, {t: 0 for t in TENSORS},
                  [] if record else None)


def ledger(schedule, n, d, d_v=None, *, block_q, block_k, causal=False,
           save_lse=False, seed=0, record=False):
    """Measured traffic of one head, n queries and n keys, by running it.

    schedule: "dense" (three kernels, S and P in HBM), "fa1" (K/V blocks
    outer, O, l, m in HBM) or "fa2" (query blocks outer). save_lse: also
    store the row log-sum-exp for a backward pass (fa1 always stores l, m).
    record: also keep every transfer in order (`Ledger.events`).
    Returns the `Ledger` and checks the output against the reference.
    """
    if schedule not in SCHEDULES:
        raise ValueError(
            f"schedule: expected one of {SCHEDULES}, got {schedule!r}"
        )
    d_v = d if d_v is None else d_v
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal(shape)
               for shape in ((n, d), (n, d), (n, d_v)))
    q, k, v, plan = tiled.plan(q, k, v, block_q=block_q, block_k=block_k,
                               causal=causal)
    book = _empty_ledger(record)

    def hbm(name, shape, fill=np.nan):
        return Counted(name, np.full(shape, fill), book)

    Q, K, V = (Counted(t, x, book) for t, x in zip("QKV", (q, k, v)))
    O = hbm("O", (n, d_v))
    if schedule == "dense":
        lse = hbm("lse", (n,)) if save_lse else None
        dense.forward(Q, K, V, hbm("S", (n, n)), hbm("P", (n, n)), O, lse,
                      plan)
    elif schedule == "fa2":
        lse = hbm("lse", (n,)) if save_lse else None
        tiled.forward_fa2(Q, K, V, O, lse, plan)
    else:
        tiled.forward_fa1(Q, K, V, O, hbm("l", (n,)), hbm("m", (n,)), plan)
    _check(O.data, q, k, v, causal)
    return book


def _check(o, q, k, v, causal):
    """The counted run must still compute attention (float64, 1e-12)."""
    from flashlab import reference

    err = np.max(np.abs(o - reference.attention(q, k, v, causal=causal)))
    if not err < 1e-12:
        raise AssertionError(f"counted run gave wrong output: err {err}")


def predicted(schedule, n, d, d_v=None, *, block_q, block_k, save_lse=False):
    """Closed-form `Ledger` of full (unmasked) attention; see chapter 6.

    The counts are `costs.transfers`, put in the form `ledger` measures.
    """
    reads, writes = costs.transfers(schedule, n, d, d_v, block_q=block_q,
                                    block_k=block_k, save_lse=save_lse)
    book = _empty_ledger()
    book.reads.update(reads)
    book.writes.update(writes)
    return book


def fa1_blocks(sram, d):
    """Block sizes of Algorithm 1 for an SRAM of `sram` elements: (Br, Bc).

    Bc = ceil(M / 4d) leaves room for K_j, V_j, Q_i and O_i on chip; the
    paper also caps Br at d.
    """
    check_count("d", d)
    check_count("sram", sram)
    if sram < 4 * d:
        raise ValueError(f"sram: expected at least 4 d = {4 * d}, got {sram}")
    bc = math.ceil(sram / (4 * d))
    return min(bc, d), bc
