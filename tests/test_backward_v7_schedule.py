"""backward_v7's dK/dV schedule on numba's simulator: `next_item` walks a
K/V head's group, query head by query head, through exactly the query
tiles that a block of keys does not skip (flashlab.masks.tile_skipped,
the numpy rule, is the truth), in order, and ends past the last head.
backward v9's `next_item_down` walks the same pairs tile by tile, last
tile first; and the key blocks that visit a query tile are the run of
ranks from tile_range's first on, whose turns v9's counts take."""

import numpy as np
import pytest
from numba import cuda

from flashlab import masks
from flashlab.gpu import _Call, backward_v7, backward_v8

STREAMED = backward_v7.STREAMED


@cuda.jit
def _visit(out, count, groups, nt, nq, j0, j1, rules, kv_len, b0):
    # every pair next_item hands out, from the start, as the kernel asks
    g, it = backward_v7.next_item(0, -1, groups, nt, nq, j0, j1, rules,
                                  kv_len, b0)
    n = 0
    while g < groups:
        out[n, 0] = g
        out[n, 1] = it
        n += 1
        g, it = backward_v7.next_item(g, it, groups, nt, nq, j0, j1, rules,
                                      kv_len, b0)
    count[0] = n
    count[1] = g  # where it stopped


@cuda.jit
def _visit_down(out, count, groups, nt, nq, j0, j1, rules, kv_len, b0):
    # the same, by the ordered kernel's walk
    g, it = backward_v8.next_item_down(-1, nt - 1, groups, nt, nq, j0, j1,
                                       rules, kv_len, b0)
    n = 0
    while g < groups:
        out[n, 0] = g
        out[n, 1] = it
        n += 1
        g, it = backward_v8.next_item_down(g, it, groups, nt, nq, j0, j1,
                                           rules, kv_len, b0)
    count[0] = n
    count[1] = g


def _want(groups, nt, nq, j0, j1, rules, lengths, b0):
    """The pairs in order: head-major, tiles the keys see."""
    return [(g, it) for g in range(groups) for it in range(nt)
            if not masks.tile_skipped(it * STREAMED,
                                      min(it * STREAMED + STREAMED, nq),
                                      j0, j1, rules, lengths[b0 + g])]


@pytest.mark.parametrize("opts", [
    dict(), dict(causal=True), dict(causal="bottom_right"),
    dict(window=(40, 0)), dict(window=(30, 90), causal=True),
    dict(kv_lengths="ragged")])
@pytest.mark.parametrize("heads, kv_heads", [(3, 3), (4, 2), (4, 1)])
def test_next_item_visits_the_unskipped_tiles_of_each_group_head(
        rng, opts, heads, kv_heads):
    nq = int(rng.integers(1, 400))
    nk = int(rng.integers(1, 400))
    q = rng.standard_normal((2, heads, nq, 64)).astype(np.float32)
    k = rng.standard_normal((2, kv_heads, nk, 64)).astype(np.float32)
    full = dict(scale=None, causal=False, mask=None, window=None,
                kv_lengths=None, dropout_p=0.0, seed=None, align=None)
    if opts.get("kv_lengths") == "ragged":  # per head, one with no keys
        lengths = rng.integers(0, nk + 1, (2, heads))
        lengths[0, -1] = 0
        opts = dict(kv_lengths=lengths)
    call = _Call(q, k, k, full | opts)
    rules, kv_len = call.args[0], call.args[1]
    lengths = np.asarray(kv_len.copy_to_host() if hasattr(
        kv_len, "copy_to_host") else kv_len)
    groups, nt = rules.group, -(-nq // STREAMED)
    assert groups == heads // kv_heads
    bk_rows = backward_v7.own("dkv")
    for bk in range(call.bh_kv):
        b0 = bk * groups
        for j0 in range(0, nk, bk_rows):
            j1 = min(j0 + bk_rows, nk)
            want = _want(groups, nt, nq, j0, j1, rules, lengths, b0)
            # v9's order: the same pairs, tile-major, last tile first
            down = sorted(want, key=lambda p: (-p[1], p[0]))
            for visit, pairs in ((_visit, want), (_visit_down, down)):
                out = np.full((groups * nt + 1, 2), -7, np.int64)  # poison
                count = np.full(2, -7, np.int64)
                visit[1, 1](out, count, groups, nt, nq, j0, j1, rules,
                            kv_len, b0)
                assert count[1] == groups  # stopped past the last head
                assert [tuple(x) for x in out[:count[0]]] == pairs, (bk, j0)
                assert (out[count[0]:] == -7).all()  # nothing written past
    # each query tile's visiting key blocks: ranks first, first + 1, ..
    # with no gap (tile_range's run), so rank r's turn is r - first
    for b in range(call.bh):
        for it in range(nt):
            i0, i1 = it * STREAMED, min(it * STREAMED + STREAMED, nq)
            ranks = [r for r in range(-(-nk // bk_rows))
                     if not masks.tile_skipped(i0, i1, r * bk_rows,
                                               min(r * bk_rows + bk_rows,
                                                   nk), rules, lengths[b])]
            first, last = masks.tile_range(i0, i1, nk, bk_rows, rules,
                                           lengths[b])
            assert ranks == list(range(first, last + 1)), (b, it)
