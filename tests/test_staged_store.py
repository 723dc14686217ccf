"""Forward v8's epilogue: O_i through shared memory, 16 bytes a store.

The kernel runs fragments.staged_chunk and fragments.stage_place (and
fragments.swizzled_offset) compiled; these tests run the same functions
on numpy: every value reaches its place in O, once, with no bank
conflict, and no warp writes over rows of Q_i that another still reads.
"""

import numpy as np
import pytest

from flashlab import fragments
from flashlab.gpu import forward_v8

TILES = (8, 16)  # 8-column groups of O: d_v 64 and 128


def staged_words(n_tiles):
    """A warp's 16 rows of O staged as the kernel stages them: (16 x
    4 n_tiles) int words, each the (row, column / 2) it stands for, from
    the C fragment layout of fragments.c_places."""
    places = fragments.c_places()  # (lane, element, (row, column))
    smem = np.full(16 * 16 * n_tiles // 4, -1, np.int64)
    for lane in range(32):
        t, g = lane % 4, lane // 4
        for h in range(2):
            row, col = places[lane, 2 * h]
            assert row == g + 8 * h and col % 2 == 0
            for n in range(n_tiles):
                at = fragments.swizzled_offset(g + 8 * h, n, n_tiles) + 4 * t
                assert smem[at // 4] == -1, "two values in one word"
                smem[at // 4] = row * 4 * n_tiles + (8 * n + col) // 2
    assert (smem >= 0).all(), "a staged word left unwritten"
    return smem


@pytest.mark.parametrize("n_tiles", TILES)
def test_staged_rows_come_back_whole_and_in_order(n_tiles):
    smem = staged_words(n_tiles)
    seen = np.zeros((16, n_tiles), int)
    for k in range(n_tiles // 2):
        for lane in range(32):
            r, c = fragments.staged_chunk(k, lane, n_tiles)
            seen[r, c] += 1
            at = fragments.swizzled_offset(r, c, n_tiles)
            assert at % 16 == 0
            # the 16 bytes hold words 4 c .. 4 c + 3 of row r, in order:
            # what st.global.v4 writes at O[row, 8 c ..]
            got = smem[at // 4: at // 4 + 4]
            want = r * 4 * n_tiles + 4 * c + np.arange(4)
            assert (got == want).all(), (k, lane, got, want)
    assert (seen == 1).all(), "a chunk read twice or never"


@pytest.mark.parametrize("n_tiles", TILES)
def test_a_warp_store_writes_whole_rows(n_tiles):
    # one 16-byte store of the warp: 32 / n_tiles rows, every chunk of
    # each, so 512 contiguous bytes of O when rows are contiguous
    for k in range(n_tiles // 2):
        places = [fragments.staged_chunk(k, lane, n_tiles)
                  for lane in range(32)]
        rows = {r for r, _ in places}
        assert len(rows) == 32 // n_tiles
        assert sorted(places) == [(r, c) for r in sorted(rows)
                                  for c in range(n_tiles)]
        assert places == sorted(places)  # lane order is row order
        assert [divmod(lane + 32 * k, n_tiles) for lane in range(32)] \
            == places


@pytest.mark.parametrize("n_tiles", TILES)
def test_staging_has_no_bank_conflict(n_tiles):
    # a four-byte store of the warp (one n-tile, one half) hits 32 banks;
    # a 16-byte load is served 8 lanes at a time, which hit 32 banks too
    for h in range(2):
        for n in range(n_tiles):
            at = [fragments.swizzled_offset(lane // 4 + 8 * h, n, n_tiles)
                  + 4 * (lane % 4) for lane in range(32)]
            assert len(set(fragments.banks(at))) == 32, (h, n)
    for k in range(n_tiles // 2):
        for quarter in range(4):
            banks = []
            for lane in range(8 * quarter, 8 * quarter + 8):
                r, c = fragments.staged_chunk(k, lane, n_tiles)
                at = fragments.swizzled_offset(r, c, n_tiles)
                banks += list(fragments.banks(at + 4 * np.arange(4)))
            assert len(set(banks)) == 32, (k, quarter)


@pytest.mark.parametrize("d, d_v", [(64, 64), (128, 128), (128, 64),
                                    (64, 128)])
def test_warps_stage_in_their_own_rows_of_q(d, d_v):
    # staged in Q_i's tile (2 d >= 2 d_v: two warpgroups, or three at
    # d = d_v = 64, 192 rows), each warp's bytes lie in rows of Q_i that
    # only its warpgroup's products read (rows 64 wg .. of every 128-byte
    # panel), and no two warps share a byte; elsewhere the staging has
    # its own room past V_j's stages
    br, groups = forward_v8.block_rows(d, d_v), forward_v8.groups(d, d_v)
    extra = forward_v8.stage_bytes(d, d_v)
    staged = 16 * 2 * d_v
    if 2 * d < 2 * d_v:
        assert extra == 2 * br * d_v
        assert forward_v8.shared_bytes(d, d_v) <= 227 * 1024
        return
    assert extra == 0
    owner = np.full(2 * br * d, -1)  # Q_i's bytes: the warpgroup reading
    for p in range(2 * d // 128):
        for wg in range(groups):
            at = p * br * 128 + wg * 64 * 128
            owner[at: at + 64 * 128] = wg
    used = np.zeros(2 * br * d, int)
    for wg in range(groups):
        for u in range(4):
            at = fragments.stage_place(u, wg, br, staged)
            assert (owner[at: at + staged] == wg).all(), (wg, u)
            used[at: at + staged] += 1
    assert used.max() == 1
    assert used.sum() == 4 * groups * staged  # every warp of every group


def test_e4m3_stages_past_its_tiles():
    # e4m3's Q_i has a byte a value: half of a 16-bit O's rows
    assert forward_v8.stage_bytes(128, 128, 1) == 2 * 128 * 128
    assert forward_v8.shared_bytes(128, 128, 1) <= 227 * 1024
