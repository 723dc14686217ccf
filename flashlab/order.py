"""The order a grid's blocks start in, and a model of how the GPU fills SMs.

A GPU starts a grid's blocks in the order of their linear index
(blockIdx.x fastest, then y, then z), each on an SM with room for it.
Under a causal mask the last query block of a head visits every key tile
and the first visits one. Started head by head, the work goes long,
shorter, ..., short, then long again for the next head, and when a
launch is a few blocks per SM the last heads' long blocks start late
and finish alone: a ragged tail. Started rank by rank across heads
(every head's longest block, then every head's second longest, ...),
blocks start longest first, the order that leaves the shortest tail
when each goes to the SM that frees first (Graham's rule of longest
processing time first). Heads started together share less of L2,
though: blocks of one head read the same K and V.

`grid` and `place` are the launch's shape and the kernels' map from a
block to its head and rank (they compile it); `finish` and `tail` are
the model; `together` uses it to choose how many heads start at once,
and `for_launch` asks it for a launch's shape.
"""

import functools
import heapq

import numpy as np

from flashlab import masks

# a block's own work besides its tiles (loading Q or K, V, writing its
# outputs), in tiles
OVERHEAD = 1.0
# more heads together are worth it when they cut the modeled time by
# more than this share (each shares L2 with more heads' K and V)
SLACK = 0.02


def grid(ranks, heads, together):
    """The launch grid (x, y, z) = (together, ranks, groups) that starts
    blocks `together` heads at a time, rank by rank: linear index (z
    ranks + y) together + x."""
    return together, ranks, -(-heads // together)


def place(x, y, z, together):
    """(b, rank) of block (x, y, z) of a `grid`: head z together + x, rank
    y (0 starts first). b may pass the last head in the last group: such
    a block has nothing to do."""
    return z * together + x, y


def finish(works, sms):
    """When the last SM is done, blocks of these works started in order,
    each on the SM that frees first, one block an SM at a time."""
    free = [0.0] * sms  # when each SM frees, as a heap
    for work in works:
        heapq.heappush(free, heapq.heappop(free) + work)
    return max(free)


def tail(works, sms):
    """finish over the even share, sum(works) / sms: 1.0 is no tail."""
    return float(finish(works, sms) * sms / np.sum(works))


def works(tiles, heads, together, overhead=0.0):
    """The works of a grid's blocks in starting order (`grid`): every
    head's `tiles` (rank order), each plus `overhead`."""
    w = np.asarray(tiles, dtype=np.float64) + overhead
    out = []
    for z in range(-(-heads // together)):
        n = min(together, heads - z * together)  # heads of this group
        out.append(np.repeat(w, n))  # rank by rank, its heads each
    return np.concatenate(out) if out else w[:0]


def block_tiles(nq, nk, bq, bk, rules, keys=False):
    """(ranks,) int: the tiles each block visits, in rank order. Query
    blocks of bq rows visiting key tiles of bk (the forward, dQ; rank 0
    is the last block), or with keys=True key blocks of bk visiting
    query tiles of bq (dK, dV; rank 0 is the first). rules: an index
    record (masks.Index, kernel_args.KernelRules); every key valid."""
    runs = [masks.tile_range(i0, min(i0 + bq, nq), nk, bk, rules, nk)
            for i0 in range(0, nq, bq)]
    if not keys:
        return np.array([max(last - first + 1, 0)
                         for first, last in runs[::-1]], dtype=np.int64)
    ends = np.zeros(-(-nk // bk) + 1, dtype=np.int64)
    for first, last in runs:  # query tile i visits key blocks first..last
        if first <= last:
            ends[first] += 1
            ends[last + 1] -= 1
    return np.cumsum(ends)[:-1]


def warpgroup_visits(nq, nk, bq, bk, rules, part=64):
    """{"block": (visits, masked), "warpgroup": (visits, masked)}: the
    tile visits of every warpgroup (`part` rows of a query block of bq
    rows, key tiles of bk), and how many of them need a mask, when each
    visits all of its block's tiles and when each stops at
    masks.last_tile of its own rows (forward v8). A tile needs no mask
    when it is whole and tile_full over the rows asked about: the
    block's or the warpgroup's. Every key valid."""
    counts = {"block": [0, 0], "warpgroup": [0, 0]}

    def count(way, i0, i1, j0, j1):
        counts[way][0] += 1
        counts[way][1] += not (j1 - j0 == bk and masks.tile_full(
            i0, i1, j0, j1, rules, nk))

    for i0 in range(0, nq, bq):
        i1 = min(i0 + bq, nq)
        first, last = masks.tile_range(i0, i1, nk, bk, rules, nk)
        for r0 in range(i0, i0 + bq, part):
            r1 = min(r0 + part, nq)
            own = min(last, masks.last_tile(r1, nk, bk, rules, nk))
            for t in range(first, last + 1):
                j0, j1 = t * bk, min(t * bk + bk, nk)
                count("block", i0, i1, j0, j1)
                if r0 < r1 and t <= own:
                    count("warpgroup", r0, r1, j0, j1)
    return {way: tuple(c) for way, c in counts.items()}


def together(tiles, heads, sms, overhead=OVERHEAD):
    """Heads to start together (a divisor of heads): the fewest whose
    modeled time (blocks of `tiles` in rank order, `overhead` tiles each
    besides) is within SLACK of the best divisor's. Equal blocks give
    1."""
    return _together(tuple(int(t) for t in tiles), int(heads), int(sms),
                     float(overhead))


@functools.lru_cache(maxsize=256)
def for_launch(nq, nk, bq, bk, index, heads, sms, keys=False):
    """together for one launch: its blocks' tiles (block_tiles) under the
    index rules `index` (a masks.Index of Python scalars). Kept per shape:
    a call that keeps no plan asks again each time."""
    return together(block_tiles(nq, nk, bq, bk, index, keys=keys), heads,
                    sms)


@functools.lru_cache(maxsize=256)
def _together(tiles, heads, sms, overhead):
    """together, on hashable arguments (a plan asks once a shape)."""
    if not tiles or heads < 2:
        return 1
    # no order ends before the even share, and head by head ends within
    # a block of it (Graham): when that block is within SLACK of the
    # share, 1 is the answer without modeling (a launch of many waves)
    share = (sum(tiles) + overhead * len(tiles)) * heads / sms
    if max(tiles) + overhead <= SLACK * share:
        return 1
    choices = [g for g in range(1, heads + 1) if heads % g == 0]
    ends = [finish(works(tiles, heads, g, overhead), sms) for g in choices]
    best = min(ends)
    return next(g for g, end in zip(choices, ends)
                if end <= best * (1 + SLACK))


def block_parts(nq, br, part=64):
    """(ranks,) int: the parts (consumer warpgroups of `part` query rows)
    that have rows in each query block of br rows, in rank order (rank 0,
    the last block, first). 16384 rows in 192-row blocks: 85 blocks of
    three parts and, at rank 0, one of one."""
    if nq < 1 or br < 1 or part < 1 or br % part:
        raise ValueError(f"nq, br, part: expected positive, br a multiple "
                         f"of part, got {nq}, {br}, {part}")
    rows = [min(i0 + br, nq) - i0 for i0 in range(0, nq, br)]
    return np.array([-(-r // part) for r in rows[::-1]], dtype=np.int64)


def wave_fill(nq, heads, br, cost, sms, part=64):
    """(finish, share): the modeled end of a launch whose blocks all visit
    the same tiles (attention without a mask), `heads` heads of nq rows
    in blocks of br rows started head by head, rank by rank; a block
    with p parts takes cost[p] (a whole block's 1.0). share is the even
    share, sum / sms: share / finish is how full the waves are."""
    parts = block_parts(nq, br, part)
    if any(p not in cost for p in set(parts.tolist())):
        raise ValueError(f"cost: expected a time for blocks of "
                         f"{sorted(set(parts.tolist()))} parts, got "
                         f"{sorted(cost)}")
    one = [float(cost[p]) for p in parts]
    work = np.tile(one, heads)
    return float(finish(work, sms)), float(np.sum(work) / sms)


def key_half_tiles(first, last, half):
    """Half 0 or 1 of key tiles first .. last: the first half (the
    smaller, where they are odd) or the rest."""
    mid = first + (last - first + 1) // 2
    return (first, mid - 1) if half == 0 else (mid, last)


def split_works(nq, heads, br, cost, tail, piece):
    """(whole, halves): the works of the two launches of a split tail, in
    starting order. whole: each head's blocks but its `tail` last ranks
    (cost by their parts, `block_parts`), head by head; halves: every
    head's tail ranks as two pieces each of cost[parts] / 2 + piece (a
    block's own work besides its tiles, as a share of a whole block).
    tail 0: the blocks of a launch without a split tail, and none."""
    one = [float(cost[p]) for p in block_parts(nq, br)]
    whole = np.tile(one[tail:], heads)
    halves = np.tile(np.repeat([c / 2 + piece for c in one[:tail]], 2),
                     heads)
    return whole, halves


def split_tail(nq, heads, br, cost, sms, piece, gain=0.02):
    """(tail, modeled time over the time without): the tail ranks whose
    split ends soonest in the model, the whole blocks' launch (`finish`)
    and then the halves' launch, 0 where none gains more than `gain`."""
    ranks = len(block_parts(nq, br))
    now = finish(split_works(nq, heads, br, cost, 0, piece)[0], sms)
    best, end = 0, now
    for tail in range(1, ranks):
        whole, halves = split_works(nq, heads, br, cost, tail, piece)
        t = finish(whole, sms) + finish(halves, sms)
        if t < end - 1e-9:
            best, end = tail, t
    if end > now * (1 - gain):
        return 0, 1.0
    return best, float(end / now)
