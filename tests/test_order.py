"""flashlab.order: the blocks' places and the model of their dispatch."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashlab import masks, order


@given(ranks=st.integers(1, 12), heads=st.integers(1, 12),
       together=st.integers(1, 12))
def test_place_gives_every_block_its_own_head_and_rank(ranks, heads,
                                                       together):
    # the kernels compute this map: every (head, rank) exactly once, the
    # blocks past the last head have nothing to do, and in linear index
    # order (x fastest) a group's heads go rank by rank
    gx, gy, gz = order.grid(ranks, heads, together)
    assert (gx, gy) == (together, ranks) and gz * together >= heads
    placed = [order.place(x, y, z, gx) for z, y, x in itertools.product(
        range(gz), range(gy), range(gx))]
    kept = [(b, r) for b, r in placed if b < heads]
    assert sorted(kept) == list(itertools.product(range(heads),
                                                  range(ranks)))
    assert len(placed) - len(kept) < ranks * together
    for z in range(gz):  # group z: ranks ascending, heads within each
        group = [p for p in kept if p[0] // together == z]
        assert group == sorted(group, key=lambda p: (p[1], p[0]))


def test_together_is_the_fewest_heads_near_the_best_modeled_time():
    sms = 132
    assert order.together([7] * 40, 16, sms) == 1  # equal blocks
    assert order.together([], 16, sms) == order.together([5], 1, sms) == 1
    for tiles, heads in (([32 - r for r in range(32)], 16),
                         ([86 - r for r in range(86)], 16),
                         ([40, 9, 3], 12), ([128 - r for r in range(128)], 6)):
        g = order.together(tiles, heads, sms)
        assert heads % g == 0
        time = {h: order.finish(order.works(tiles, heads, h,
                                            order.OVERHEAD), sms)
                for h in range(1, heads + 1) if heads % h == 0}
        near = min(time.values()) * (1 + order.SLACK)
        assert time[g] <= near
        assert all(time[h] > near for h in time if h < g)
    # 4K causal at 128-row blocks: head by head leaves a tail, 4 do not
    assert order.together([32 - r for r in range(32)], 16, sms) == 4
    # the overhead counts: 4K causal at 192-row blocks (v8 at d = 64)
    # starts 8 heads together at one tile a block, 4 at ten (chapter 12)
    index = masks.rules(True, None, None, None, (), 4096, 4096).index()
    tiles = order.block_tiles(4096, 4096, 192, 128, index)
    assert [order.together(tiles, 16, sms, overhead=x)
            for x in (order.OVERHEAD, 10)] == [8, 4]
    # many waves: 1 by Graham's bound, without the model, as the model says
    tiles, heads = [64 - r for r in range(64)], 96
    assert order.together(tiles, heads, sms) == 1
    time = [order.finish(order.works(tiles, heads, h, order.OVERHEAD), sms)
            for h in (1, 2, 3, 96)]
    assert time[0] <= min(time) * (1 + order.SLACK)


def test_finish_is_greedy_dispatch():
    # two SMs: 3 | 3, then 2 on SM 0 (frees at 3, ties to the first),
    # 2 on SM 1, 2 on SM 0 again: 3 + 2 + 2
    assert order.finish([3, 3, 2, 2, 2], 2) == 7
    # the same works, longest last: it starts at 2 and ends alone
    assert order.finish([1, 1, 1, 1, 4], 2) == 6
    assert order.finish([4, 1, 1, 1, 1], 2) == 4
    assert order.tail([4, 1, 1, 1, 1], 2) == 1.0


@settings(max_examples=60, deadline=None)
@given(works=st.lists(st.integers(1, 50), min_size=1, max_size=40),
       sms=st.integers(1, 9))
def test_finish_bounds(works, sms):
    # never under the even share nor the longest block; greedy is
    # within one block of the even share (Graham's bound)
    end = order.finish(works, sms)
    assert end >= max(max(works), sum(works) / sms) - 1e-9
    assert end <= sum(works) / sms + max(works) + 1e-9


@settings(max_examples=60, deadline=None)
@given(nq=st.integers(1, 70), nk=st.integers(1, 70), br=st.integers(1, 16),
       bc=st.integers(1, 16),
       causal=st.sampled_from([False, True, "bottom_right"]))
def test_block_tiles_counts_the_tiles_not_skipped(nq, nk, br, bc, causal):
    rules = masks.rules(causal, None, None, None, (), nq, nk).index()
    want = []
    for i0 in range(0, nq, br):
        i1 = min(i0 + br, nq)
        want.append(sum(not masks.tile_skipped(
            i0, i1, j0, min(j0 + bc, nk), rules, nk)
            for j0 in range(0, nk, bc)))
    got = order.block_tiles(nq, nk, br, bc, rules)
    assert got.tolist() == want[::-1]  # rank 0 is the last block


def test_works_follow_the_grid():
    w = order.works([3, 2, 1], 2, together=1, overhead=0.5)
    assert w.tolist() == [3.5, 2.5, 1.5, 3.5, 2.5, 1.5]
    assert order.works([3, 2, 1], 2, together=2).tolist() == [
        3, 3, 2, 2, 1, 1]
    # three heads two at a time: the second group has one head
    assert order.works([2, 1], 3, together=2).tolist() == [2, 2, 1, 1, 2, 1]
    # the same works as placing each block of the grid
    tiles, heads, g = [5, 4, 2, 1], 5, 2
    grid = order.grid(len(tiles), heads, g)
    want = [tiles[r] for z, y, x in itertools.product(
        *(range(n) for n in grid[::-1]))
        for b, r in [order.place(x, y, z, g)] if b < heads]
    assert order.works(tiles, heads, g).tolist() == want


def test_causal_tail_at_4k_is_the_heads_order():
    # the chapter's case: B2 H8, 4K causal, 128-row blocks, 132 SMs
    rules = masks.rules(True, None, None, None, (), 4096, 4096).index()
    tiles = order.block_tiles(4096, 4096, 128, 128, rules)
    assert tiles.tolist() == list(range(32, 0, -1))
    heads = order.tail(order.works(tiles, 16, 1), 132)
    ranks = order.tail(order.works(tiles, 16, 16), 132)
    assert heads > 1.2 and ranks < 1.05
    assert np.isclose(sum(order.works(tiles, 16, 16)), 16 * 528)


def test_launch_grid_spreads_only_placed_kernels_with_unequal_blocks(
        monkeypatch):
    from flashlab.gpu import host, traits

    monkeypatch.setattr(host, "_multiprocessors", lambda: 132)
    causal = masks.rules(True, None, None, None, (), 4096, 4096).index()
    full = masks.rules(None, None, None, None, (), 4096, 4096).index()
    v8 = traits.traits("forward_v8_bf16", 128, 128)
    assert v8.placed and v8.blocks_per_sm == 1
    # 32 ranks of 32..1 tiles: 4 heads together leave no tail (the
    # model's choice, measured best with 8 and 16 in chapter 12)
    assert host.launch_grid(v8, 4096, 4096, 16, causal) == (4, 32, 4)
    assert host.launch_grid(v8, 4096, 4096, 16, full) == (1, 32, 16)
    assert host.launch_grid(v8, 16384, 16384, 16, causal) == (1, 128, 16)
    # the dK/dV kernels own keys: ranks over Nk, tiles of queries
    dkv = traits.traits("backward_v7_dkv_bf16", 128, 128)
    assert host.launch_grid(dkv, 1000, 4096, 16, causal,
                            keys=True)[1] == 4096 // dkv.br
    # v7's dQ kernel fits two blocks an SM: twice the slots
    assert traits.traits("backward_v7_dq_bf16", 128, 128).blocks_per_sm == 2
    # asked again for the same shape (a call without a plan), the choice
    # is kept, not modeled again
    monkeypatch.setattr(order, "block_tiles", None)
    assert host.launch_grid(v8, 4096, 4096, 16, causal) == (4, 32, 4)
    v5 = traits.traits("forward_v5_bf16", 64, 64)
    assert not v5.placed
    assert host.launch_grid(v5, 4096, 4096, 16, causal) == (64, 16)


@settings(max_examples=40, deadline=None)
@given(nq=st.integers(1, 400), nk=st.integers(1, 400),
       causal=st.sampled_from([True, "bottom_right"]))
def test_warpgroup_visits_are_the_pairs_with_an_allowed_key(nq, nk, causal):
    # under a causal mask a warpgroup's visits (its own rows' tiles) are
    # exactly the (warpgroup, tile) pairs that hold an allowed pair,
    # counted from the reference's mask; the block-wide way visits at
    # least those, and needs a mask at least as often
    bq, bk = 192, 128
    rules = masks.rules(causal, None, None, None, (), nq, nk)
    allowed = rules.allowed(range(nq), range(nk))  # (nq, nk) bool
    got = order.warpgroup_visits(nq, nk, bq, bk, rules.index())
    want = sum(bool(allowed[r0:r0 + 64, j0:j0 + bk].any())
               for r0 in range(0, nq, 64) for j0 in range(0, nk, bk))
    assert got["warpgroup"][0] == want
    assert got["block"][0] >= got["warpgroup"][0]
    assert got["block"][1] >= got["warpgroup"][1]


def test_warpgroup_visits_at_1k():
    # chapter 12's counts: 1K causal, forward v8 at d = 64 (192-row
    # blocks of three warpgroups)
    index = masks.rules(True, None, None, None, (), 1024, 1024).index()
    assert order.warpgroup_visits(1024, 1024, 192, 128, index) == {
        "block": (96, 33), "warpgroup": (72, 16)}


def test_block_parts_count_the_warpgroups_with_rows():
    # 16K rows in 192-row blocks: the last block (rank 0) has 64 rows
    assert order.block_parts(16384, 192).tolist() == [1] + [3] * 85
    assert order.block_parts(200, 128).tolist() == [2, 2]  # 72 rows: 2
    assert order.block_parts(1, 192).tolist() == [1]
    for bad in ((0, 192), (64, 100), (64, -64)):
        with pytest.raises(ValueError, match="br"):
            order.block_parts(*bad)


def test_wave_fill_at_16k():
    # B2 H8 at 16K, d = 64: 1376 blocks on 132 SMs, 10.4 waves of work
    # that end at 11 whole blocks; 23 heads fill 15 waves (chapter 12)
    cost = {1: 0.6, 3: 1.0}
    end, share = order.wave_fill(16384, 16, 192, cost, 132)
    assert end == 11.0
    assert share == pytest.approx(16 * (85 + 0.6) / 132)
    end, share = order.wave_fill(16384, 23, 192, cost, 132)
    assert end == 15.0 and share / end > 0.99
    # by hand: two SMs, blocks 0.5, 1, 1 of one head, then again
    end, share = order.wave_fill(300, 2, 128, {1: 0.5, 2: 1.0}, 2)
    assert (end, share) == (2.5, 2.5)
    with pytest.raises(ValueError, match="cost"):
        order.wave_fill(300, 2, 128, {2: 1.0}, 2)
