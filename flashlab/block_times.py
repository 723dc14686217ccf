"""Where an SM's time goes in a launch, from each block's own clock.

A kernel built to read %globaltimer at a few points of each block and
%smid (chapter 12 stores one such run of forward v8) gives per block:
start, take (its consumers past setmaxnreg), first (its first tile
landed, before the first product; -1 where it visits none), loop_end
(its last product done) and end (its epilogue's stores issued), in ns.
`summarize` turns them into the medians a block spends in each part
and, per SM (the mean over SMs), the time in prologues, loops,
epilogues, between one block's end and the next one's start on the
same SM, and idle at the launch's end.
"""

import numpy as np

PARTS = ("sm", "start", "take", "first", "loop_end", "end")


def summarize(blocks):
    """Medians a block (µs) and means an SM (µs) of `blocks` ({part:
    list} over PARTS, one entry a block)."""
    missing = [p for p in PARTS if p not in blocks]
    if missing:
        raise ValueError(f"blocks: expected the parts {PARTS}, missing "
                         f"{missing}")
    sm, start, take, first, loop_end, end = (
        np.asarray(blocks[p], dtype=np.int64) for p in PARTS)
    if not len(start) or len({len(x) for x in (sm, take, first, loop_end,
                                                end)} | {len(start)}) > 1:
        raise ValueError("blocks: expected lists of one length, at least "
                         "one block")
    visits = first >= 0  # blocks that met a tile
    t0, span = start.min(), end.max()
    gaps = tail = 0
    for s in np.unique(sm):
        mine = np.argsort(start[sm == s])
        b, e = start[sm == s][mine], end[sm == s][mine]
        gaps += int(np.sum(b[1:] - e[:-1]))
        tail += int(span - e.max())
    sms = len(np.unique(sm))
    ns = 1e3  # ns an µs

    def per_sm(x):
        return float(np.sum(x)) / sms / ns

    return dict(
        blocks=len(start), sms=sms, span_us=float(span - t0) / ns,
        to_take_us=float(np.median(take - start)) / ns,
        to_first_us=float(np.median((first - take)[visits])) / ns,
        loop_us=float(np.median((loop_end - first)[visits])) / ns,
        epilogue_us=float(np.median(end - loop_end)) / ns,
        sm_prologue_us=per_sm(np.where(visits, first, loop_end) - start),
        sm_loop_us=per_sm(np.where(visits, loop_end - first, 0)),
        sm_epilogue_us=per_sm(end - loop_end),
        sm_gaps_us=gaps / sms / ns, sm_tail_us=tail / sms / ns)
