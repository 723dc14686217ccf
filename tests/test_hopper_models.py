"""The wgmma layouts forward_v7 relies on, on flashlab.fragments' model.

CI has no Hopper GPU, so what v7 assumes about wgmma's descriptors, the
core-matrix tiles in shared memory and the accumulator and register-A
layouts is checked here, with the functions the kernel itself calls
(core_copy_place, descriptor, k_major, mn_major, a_from_c): a tile copied
as the kernel copies it and read through the kernel's descriptors must
give the matrix products numpy computes from the original matrices.
"""

import numpy as np
import pytest

from flashlab import fragments as fr
from flashlab.gpu.forward_v7 import BLOCK_K, THREADS  # THREADS copy tiles

BC = BLOCK_K[64]
BR = 64  # rows of one wgmma: a warpgroup's share of the block
WG = 128  # threads of a warpgroup, which hold the accumulator

KP = BC // 16  # k-steps of P V


def copied(tile, per_row):
    """16-bit values of `tile` (rows, 8 per_row) laid out in shared memory
    the way forward_v7.load_cores copies them (1-D, element e at byte 2
    e)."""
    rows = tile.shape[0]
    shared = np.full(tile.size, np.nan)
    for t in range(THREADS):
        r, c, step = fr.core_copy_place(t, per_row, THREADS)
        for p in range(rows // step):
            at = (16 * (t + p * THREADS)) // 2
            shared[at:at + 8] = tile[r + p * step, 8 * c:8 * c + 8]
    return shared


def kernel_descriptors(address, major, per_row, steps):
    """The descriptors of k-steps 0.. as wgmma.mma_ss/rs make them: the
    k-step 0 word plus step >> 4 (the start address's field)."""
    lbo, sbo, step = major(per_row)
    first = fr.descriptor(address, lbo, sbo)
    return [first + (s * step >> 4) for s in range(steps)]


def test_descriptor_bits():
    # address 0x1230, LBO 128, SBO 256: 0x123, 8 and 16 in their fields
    assert fr.descriptor(0x1230, 128, 256) == 0x123 | 8 << 16 | 16 << 32
    # a shared address keeps its low 18 bits, in 16-byte units
    assert fr.descriptor(0x41230, 0, 0) == 0x123
    for address in (0, 16, 0x3FFF0, 49152 - 1024):
        for lbo, sbo in ((128, 1024), (2048, 128)):
            assert fr.descriptor_fields(fr.descriptor(address, lbo, sbo)) \
                == (address, lbo, sbo)


@pytest.mark.parametrize("per_row", [8, 16])
def test_kernel_steps_are_descriptors_of_the_moved_address(per_row):
    for major in (fr.k_major, fr.mn_major):
        lbo, sbo, step = major(per_row)
        got = kernel_descriptors(0x2000, major, per_row, 8)
        assert got == [fr.descriptor(0x2000 + s * step, lbo, sbo)
                       for s in range(8)]


@pytest.mark.parametrize("per_row", [8, 16])
def test_core_copy_fills_each_chunk_once_at_its_offset(per_row):
    rows = BR
    seen = set()
    for t in range(THREADS):
        r, c, step = fr.core_copy_place(t, per_row, THREADS)
        assert rows % step == 0 and step % 8 == 0
        for p in range(rows // step):
            assert fr.core_offset(r + p * step, c, per_row) == \
                16 * (t + p * THREADS)
            seen.add((r + p * step, c))
    assert seen == {(r, c) for r in range(rows) for c in range(per_row)}


def test_eight_threads_fill_one_core_matrix():
    # 16-byte copies of threads 8i..8i+7 are one contiguous 128 bytes:
    # the 32 banks once, no conflict
    for per_row in (8, 16):
        for i in range(THREADS // 8):
            at = {fr.core_offset(*fr.core_copy_place(t, per_row,
                                                     THREADS)[:2], per_row)
                  for t in range(8 * i, 8 * i + 8)}
            assert sorted(at) == list(range(128 * i, 128 * i + 128, 16))


def test_accumulator_places_cover_the_tile_once():
    for n in (64, 128):
        flat = fr.wgmma_c_places(n).reshape(-1, 2)
        assert len({tuple(p) for p in flat}) == 64 * n == len(flat)
        assert tuple(flat.max(0) + 1) == (64, n)
    flat = fr.wgmma_a_places().reshape(-1, 2)
    assert len({tuple(p) for p in flat}) == 64 * 16 == len(flat)


@pytest.mark.parametrize("d", [64, 128])
def test_s_is_q_k_transposed_through_descriptors(rng, d):
    q, k = rng.standard_normal((BR, d)), rng.standard_normal((BC, d))
    per_row = d // 8
    q_at, k_at = 0, BR * d * 2  # byte addresses of the two tiles
    shared = np.concatenate([copied(q, per_row), copied(k, per_row)])
    acc = np.zeros((WG, BC // 2))
    for da, db in zip(kernel_descriptors(q_at, fr.k_major, per_row, d // 16),
                      kernel_descriptors(k_at, fr.k_major, per_row,
                                         d // 16)):
        a = fr.wgmma_operand(shared, da, BR, transposed=False)  # (64, 16)
        bt = fr.wgmma_operand(shared, db, BC, transposed=False)  # (n, 16)
        acc = fr.wgmma(a, bt.T, acc)
    want = fr.gather(q @ k.T, fr.wgmma_c_places(BC))
    assert np.allclose(acc, want, rtol=0, atol=1e-12)  # float64, d terms


def p_fragments(sf):
    """(128, KP, 4, 2) the A pairs forward_v7 packs from S's
    accumulator sf (128, NS, 4), by fragments.a_from_c."""
    pf = np.empty((WG, KP, 4, 2))
    for kp in range(KP):
        for x in range(4):
            n, e = fr.a_from_c(x)
            pf[:, kp, x] = sf[:, 2 * kp + n, e:e + 2]
    return pf


@pytest.mark.parametrize("d_v", [64, 128])
def test_o_is_p_v_with_p_from_registers(rng, d_v):
    p, v = rng.standard_normal((BR, BC)), rng.standard_normal((BC, d_v))
    o = rng.standard_normal((BR, d_v))
    sf = fr.gather(p, fr.wgmma_c_places(BC)).reshape(WG, BC // 8, 4)
    pf = p_fragments(sf)
    shared = copied(v, d_v // 8)
    acc = fr.gather(o, fr.wgmma_c_places(d_v))
    descs = kernel_descriptors(0, fr.mn_major, d_v // 8, KP)
    for kp, db in enumerate(descs):
        a = fr.scatter(pf[:, kp], fr.wgmma_a_places(), (BR, 16))
        assert np.array_equal(a, p[:, 16 * kp:16 * kp + 16])
        b = fr.wgmma_operand(shared, db, d_v, transposed=True)  # (16, n)
        acc = fr.wgmma(a, b, acc)
    want = fr.gather(p @ v + o, fr.wgmma_c_places(d_v))
    assert np.allclose(acc, want, rtol=0, atol=1e-12)


def test_a_wrong_descriptor_is_caught(rng):
    # LBO and SBO swapped read the tile's core matrices in another order:
    # the model must see it, or the checks above could not fail
    q = rng.standard_normal((BR, 64))
    shared = copied(q, 8)
    lbo, sbo, _ = fr.k_major(8)
    right = fr.wgmma_operand(shared, fr.descriptor(0, lbo, sbo), BR, False)
    assert np.array_equal(right, q[:, :16])
    wrong = fr.wgmma_operand(shared, fr.descriptor(0, sbo, lbo), BR, False)
    assert not np.array_equal(wrong, q[:, :16])


# the 128-byte swizzle (v7's tiles; SWIZZLE = False reads the core
# matrices above)


def panels(tile):
    """A tile's 16-bit values stored by fragments.panel_offset (1-D)."""
    rows, cols = tile.shape
    shared = np.full(tile.size, np.nan)
    for r in range(rows):
        for c in range(cols // 8):
            at = fr.panel_offset(r, c, rows) // 2
            shared[at:at + 8] = tile[r, 8 * c:8 * c + 8]
    assert not np.isnan(shared).any()  # every place written once
    return shared


def test_swizzled_rows_are_the_tma_and_v5_placement():
    # chunk c of row r at chunk c ^ (r % 8): what TMA's 128-byte swizzle
    # delivered on the H200 and v5's swizzled_offset at 8 chunks per row
    for r in range(64):
        for c in range(8):
            assert fr.swizzle_address(128 * r + 16 * c) == \
                128 * r + 16 * (c ^ (r % 8)) == fr.swizzled_offset(r, c, 8)
    desc = fr.descriptor_128b(0x2400, 16, 1024)
    assert desc >> 62 == fr.SWIZZLE_128B
    assert fr.descriptor_fields(desc) == (0x2400, 16, 1024)


@pytest.mark.parametrize("d", [64, 128])
def test_s_through_swizzled_descriptors(rng, d):
    q, k = rng.standard_normal((BR, d)), rng.standard_normal((BC, d))
    k_at = BR * d * 2  # a multiple of 1024, as the swizzle needs
    shared = np.concatenate([panels(q), panels(k)])
    lbo, sbo, step, panel = fr.k_major_128b(BR)
    k_panel = fr.k_major_128b(BC)[3]
    acc = np.zeros((WG, BC // 2))
    for ks in range(d // 16):
        at = (ks % 4) * step  # 4 k-steps a panel
        a = fr.wgmma_operand(shared, fr.descriptor_128b(
            at + (ks // 4) * panel, lbo, sbo), BR, False)
        bt = fr.wgmma_operand(shared, fr.descriptor_128b(
            k_at + at + (ks // 4) * k_panel, lbo, sbo), BC, False)
        acc = fr.wgmma(a, bt.T, acc)
    want = fr.gather(q @ k.T, fr.wgmma_c_places(BC))
    assert np.allclose(acc, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("d_v", [64, 128])
def test_p_v_through_swizzled_descriptors(rng, d_v):
    p, v = rng.standard_normal((BR, BC)), rng.standard_normal((BC, d_v))
    shared = panels(v)
    lbo, sbo, step = fr.mn_major_128b(BC)
    acc = np.zeros((WG, d_v // 2))
    for kp in range(KP):
        b = fr.wgmma_operand(
            shared, fr.descriptor_128b(kp * step, lbo, sbo), d_v, True)
        assert np.array_equal(b, v[16 * kp:16 * kp + 16])
        acc = fr.wgmma(p[:, 16 * kp:16 * kp + 16], b, acc)
    assert np.allclose(acc, fr.gather(p @ v, fr.wgmma_c_places(d_v)),
                       rtol=0, atol=1e-12)


def test_a_swizzled_tile_read_without_the_swizzle_is_caught(rng):
    # the same byte offsets without the mode bits read other elements:
    # the model honours the descriptor's mode, or the checks above could
    # not fail
    q = rng.standard_normal((BR, 64))
    shared = panels(q)
    lbo, sbo, _, _ = fr.k_major_128b(BR)
    swizzled = fr.descriptor_128b(0, lbo, sbo)
    assert np.array_equal(fr.wgmma_operand(shared, swizzled, BR, False),
                          q[:, :16])
    plain = fr.descriptor(0, lbo, sbo)
    assert not np.array_equal(fr.wgmma_operand(shared, plain, BR, False),
                              q[:, :16])


def _fill_panels(matrix, threads):
    """A swizzled tile filled as v7's threads fill it (panel_copy_place),
    every value written exactly once (poisoned with -1 before)."""
    from flashlab.gpu import forward_v7 as v7

    rows, cols = matrix.shape
    tile = np.full(rows * cols, -1, np.int64)
    writes = np.zeros(rows * cols, np.int64)
    for t in range(threads):
        offset, r, c, step = v7.panel_copy_place(t, cols // 8, rows, threads)
        for p in range(rows // step):
            at = (offset + p * step * 128) // 2
            tile[at:at + 8] = matrix[r + p * step, 8 * c:8 * c + 8]
            writes[at:at + 8] += 1
    assert (writes == 1).all()
    return tile


@pytest.mark.parametrize("d, d_v", [(64, 64), (128, 128), (64, 128)])
def test_v7_swizzled_tiles_are_the_operands_its_descriptors_read(d, d_v):
    # v7's copy places, descriptors and k-step offsets, on the model of
    # what wgmma reads: every k-step of S = Q K^T gets its 16 columns of
    # each warpgroup's Q rows and of K, every k-step of P V 16 rows of V
    from flashlab.gpu import forward_v7 as v7

    rng = np.random.default_rng(d + d_v)
    bc = v7.BLOCK_K[d]
    q, k = (rng.integers(0, 2 ** 15, (n, d)) for n in (v7.BR, bc))
    v = rng.integers(0, 2 ** 15, (bc, d_v))
    tiles = [_fill_panels(x, v7.THREADS) for x in (q, k, v)]
    lbo, sbo, _, _ = fr.k_major_128b(v7.BR)
    for wg in range(v7.GROUPS):
        for s, at in enumerate(v7.k_steps_128b(v7.BR, d // 16)):
            desc = fr.descriptor_128b(wg * 64 * 128 + at, lbo, sbo)
            np.testing.assert_array_equal(
                fr.wgmma_operand(tiles[0], desc, 64, False),
                q[64 * wg:64 * wg + 64, 16 * s:16 * s + 16])
    lbo, sbo, _, _ = fr.k_major_128b(bc)
    for s, at in enumerate(v7.k_steps_128b(bc, d // 16)):
        desc = fr.descriptor_128b(at, lbo, sbo)
        np.testing.assert_array_equal(
            fr.wgmma_operand(tiles[1], desc, bc, False),
            k[:, 16 * s:16 * s + 16])
    lbo, sbo, step = fr.mn_major_128b(bc)
    for s in range(bc // 16):
        desc = fr.descriptor_128b(s * step, lbo, sbo)
        np.testing.assert_array_equal(
            fr.wgmma_operand(tiles[2], desc, d_v, True),
            v[16 * s:16 * s + 16])


@pytest.mark.parametrize("part", ["dq", "dkv"])
@pytest.mark.parametrize("d, d_v", [(64, 64), (128, 128), (64, 128)])
def test_backward_v7_tiles_are_the_operands_its_descriptors_read(part, d,
                                                                  d_v):
    # backward_v7's copies (its block's threads), descriptors and k-step
    # offsets on the model: each warpgroup's own rows are the A operand of
    # S (or S^T) over d and of dP (dP^T) over d_v; the streamed tile is
    # B of those, read K-major, and B of dQ (K_j) or of dK, dV (Q_i,
    # dO_i), read MN-major, 16 rows a k-step
    from flashlab.gpu import backward_v7 as b7
    from flashlab.gpu import forward_v7 as v7

    rng = np.random.default_rng(d + d_v + len(part))
    own, rows = b7.own(part), b7.STREAMED
    threads = b7.threads(part)
    for width in (d, d_v):
        mine = rng.integers(0, 2 ** 15, (own, width))
        other = rng.integers(0, 2 ** 15, (rows, width))
        tile, streamed = (_fill_panels(x, threads) for x in (mine, other))
        lbo, sbo, _, _ = fr.k_major_128b(own)
        for wg in range(b7.GROUPS[part]):
            for s, at in enumerate(v7.k_steps_128b(own, width // 16)):
                desc = fr.descriptor_128b(wg * b7.WG_ROWS + at, lbo, sbo)
                np.testing.assert_array_equal(
                    fr.wgmma_operand(tile, desc, 64, False),
                    mine[64 * wg:64 * wg + 64, 16 * s:16 * s + 16])
        lbo, sbo, _, _ = fr.k_major_128b(rows)
        for s, at in enumerate(v7.k_steps_128b(rows, width // 16)):
            np.testing.assert_array_equal(
                fr.wgmma_operand(streamed, fr.descriptor_128b(at, lbo, sbo),
                                 rows, False),
                other[:, 16 * s:16 * s + 16])
        lbo, sbo, step = fr.mn_major_128b(rows)
        for s in range(rows // 16):
            np.testing.assert_array_equal(
                fr.wgmma_operand(streamed, fr.descriptor_128b(
                    s * step, lbo, sbo), width, True),
                other[16 * s:16 * s + 16])


def test_e4m3_tiles_and_packed_p_give_s_and_p_v():
    # v8's e4m3 form on the model: Q, K and V^T (forward_v8.to_v_t's key
    # order) as TMA lands them, read through the kernel's descriptors and
    # k-step offsets as 8-bit k32 operands, and P packed from S's C
    # fragments by a8_from_c into an 8-bit wgmma's A places: S = Q K^T
    # and O = P V come out as numpy's, with no byte moved between lanes
    import torch

    from flashlab.gpu import forward_v8 as v8

    rng = np.random.default_rng(8)
    d = d_v = 128
    br, bc, ks = v8.block_rows(d, d_v), v8.BLOCK_K[d], 32
    q = rng.integers(0, 256, (br, d), dtype=np.uint8)
    k = rng.integers(0, 256, (bc, d), dtype=np.uint8)
    v = rng.integers(0, 256, (bc, d_v), dtype=np.uint8)
    v_t = v8.to_v_t(torch.from_numpy(v)).numpy()  # (d_v, keys)
    assert v_t.shape == (d_v, bc)
    tiles = [fr.tma_box(x) for x in (q, k, v_t)]
    lbo, sbo, _, _ = fr.k_major_128b(br)
    for wg in range(v8.groups(d, d_v)):
        acc = np.zeros((WG, bc // 2))
        for s, at in enumerate(v8.k_steps_128b(br, d // ks)):
            a = fr.wgmma_operand8(
                tiles[0], fr.descriptor_128b(wg * 64 * 128 + at, lbo, sbo),
                64)
            b = fr.wgmma_operand8(tiles[1], fr.descriptor_128b(
                v8.k_steps_128b(bc, d // ks)[s], lbo, sbo), bc)
            acc = fr.wgmma(a.astype(float), b.T.astype(float), acc)
        want = q[64 * wg:64 * wg + 64].astype(float) @ k.T.astype(float)
        assert np.array_equal(acc, fr.gather(want, fr.wgmma_c_places(bc)))
    p = rng.standard_normal((64, bc))  # a warpgroup's P, as S's fragments
    sf = fr.gather(p, fr.wgmma_c_places(bc)).reshape(WG, bc // 8, 4)
    acc = np.zeros((WG, d_v // 2))
    for kp, at in enumerate(v8.k_steps_128b(d_v, bc // ks)):
        a = np.empty((WG, 4, 4))
        for r in range(4):
            for y in range(4):
                n, e = fr.a8_from_c(r, y)
                a[:, r, y] = sf[:, 4 * kp + n, e]
        b = fr.wgmma_operand8(tiles[2], fr.descriptor_128b(at, lbo, sbo),
                              d_v)
        acc = fr.wgmma(fr.scatter(a, fr.wgmma_a8_places(), (64, ks)),
                       b.T.astype(float), acc)
    want = fr.gather(p @ v.astype(float), fr.wgmma_c_places(d_v))
    assert np.allclose(acc, want, rtol=1e-12, atol=1e-9)
    # V in its own key order instead: the check above can fail
    plain = fr.tma_box(np.ascontiguousarray(v.T))
    b = fr.wgmma_operand8(plain, fr.descriptor_128b(0, lbo, sbo), d_v)
    assert not np.array_equal(b, fr.wgmma_operand8(
        tiles[2], fr.descriptor_128b(0, lbo, sbo), d_v))


def test_e4m3_key_order_is_a_permutation_within_32():
    order = fr.key_order_8bit()
    assert sorted(order) == list(range(32))
    # lane t's bytes are 4 consecutive A columns: keys 2t, 2t + 1 of two
    # n-tiles, the pairs its C fragments hold
    places = fr.wgmma_a8_places()
    for lane in range(4):
        cols = places[lane, 0, :, 1]
        assert list(order[cols]) == [2 * lane, 2 * lane + 1,
                                     8 + 2 * lane, 9 + 2 * lane]


@pytest.mark.parametrize("nk, d_v", [(70, 128), (64, 128), (5, 64)])
def test_transpose_keys8_is_to_v_t(nk, d_v):
    # the kernel the host runs (here on numba's simulator) against its
    # torch model: V^T in key_of_column8's order, zeros past Nk
    import torch

    from flashlab.gpu import forward_v8 as v8

    rng = np.random.default_rng(nk + d_v)
    v = rng.integers(0, 256, (3, nk, d_v), dtype=np.uint8)
    keys = -(-nk // 32) * 32
    v_t = np.full((3, d_v, keys), 0xAA, np.uint8)  # poisoned
    v8.transpose_keys8[(keys // 32, 3), v8.transpose_threads(d_v)](
        v.view(np.uint32), v_t.view(np.uint32))
    want = v8.to_v_t(torch.from_numpy(v)).numpy()
    np.testing.assert_array_equal(v_t, want)
    column = np.arange(keys)
    key = 32 * (column // 32) + fr.key_of_column8(column % 32)
    assert not v_t[:, :, key >= nk].any()  # past Nk: zeros
    np.testing.assert_array_equal(v_t[:, :, key < nk],
                                  v.transpose(0, 2, 1)[:, :, key[key < nk]])


@pytest.mark.parametrize("d", [64, 128])
def test_fused_backward_dq_reads_ds_and_k_through_its_descriptors(d):
    # the fused backward keeps dS^T (128 keys x 64 queries) where each
    # thread's A registers of dK's product go (fragments.a_pair_offset),
    # then dQ = dS K reads it MN-major as A, and K_j MN-major as B: every
    # place written once, each warpgroup's k-steps the right 16 keys, and
    # the warpgroups' products (columns or keys, dq_split) sum to dS K
    from flashlab.gpu import backward_v7 as b7

    rng = np.random.default_rng(d)
    keys, queries = b7.own("dkv"), b7.STREAMED
    ds_t = rng.integers(-2 ** 10, 2 ** 10, (keys, queries)).astype(float)
    k = rng.integers(-2 ** 10, 2 ** 10, (keys, d)).astype(float)
    places = fr.wgmma_a_places()  # (128, 4, 2, 2): row, column per half
    tile = np.full(keys * queries, np.nan)
    for t in range(b7.threads("fused")):
        wg, tl = divmod(t, WG)
        for kp in range(queries // 16):
            for r in range(4):
                at = fr.a_pair_offset(t, kp, r)
                assert at % 4 == 0 and np.isnan(tile[at // 2:at // 2 + 2]
                                                 ).all()
                for h in range(2):  # dS^T's pair as the register holds it
                    row, col = places[tl, r, h]
                    tile[at // 2 + h] = ds_t[64 * wg + row, 16 * kp + col]
    assert not np.isnan(tile).any()
    k_tile = _fill_panels(k, b7.threads("fused")).astype(float)
    steps, own_keys = b7.dq_split(d)
    lbo, sbo, step = fr.mn_major_128b(keys)
    dq = np.zeros((queries, d))
    for wg in range(b7.GROUPS["fused"]):
        mine = wg * b7.WG_ROWS if own_keys else 0
        panel = 0 if own_keys else keys * 128 * wg
        cols = slice(0, 64) if own_keys else slice(64 * wg, 64 * wg + 64)
        acc = np.zeros((WG, 32))
        for s in range(steps):
            a = fr.wgmma_operand(tile, fr.descriptor_128b(
                mine + s * step, lbo, sbo), 64, True).T  # (64, 16) of dS
            b = fr.wgmma_operand(k_tile, fr.descriptor_128b(
                panel + mine + s * step, lbo, sbo), 64, True)
            first = mine // 128 + 16 * s  # the k-step's first key
            np.testing.assert_array_equal(a, ds_t[first:first + 16].T)
            np.testing.assert_array_equal(b, k[first:first + 16, cols])
            acc = fr.wgmma(a, b, acc)
        dq[:, cols] += fr.scatter(acc, fr.wgmma_c_places(64), (64, 64))
    np.testing.assert_array_equal(dq, ds_t.T @ k)


def test_backward_v8_stages_dq_as_tma_boxes_lie():
    # the fused backward v8 stages a warpgroup's float32 dQ_i (64 x 64 C
    # fragments) where fragments.c_pair_offset32 puts each pair: two
    # boxes of 32 columns, each as TMA's 128-byte swizzle lays a box it
    # reads for its reduction, every place written once; and a warp's
    # stores of one (n, h) land on every bank twice (two wavefronts, no
    # conflict beyond them)
    rng = np.random.default_rng(5)
    dq = rng.standard_normal((64, 64)).astype(np.float32)
    places = fr.wgmma_c_places(64)  # (128, 32, 2): row, column
    staged = np.full(64 * 64, np.nan, np.float32)
    for t in range(WG):
        for n in range(8):
            for h in range(2):
                at = fr.c_pair_offset32(t, n, h)
                assert at % 8 == 0
                for x in range(2):
                    row, col = places[t, 4 * n + 2 * h + x]
                    assert np.isnan(staged[at // 4 + x])
                    staged[at // 4 + x] = dq[row, col]
    boxes = [fr.tma_box(np.ascontiguousarray(dq[:, 32 * p:32 * p + 32])
                        .view(np.uint8)).view(np.float32) for p in range(2)]
    np.testing.assert_array_equal(staged, np.concatenate(boxes))
    for warp in range(4):
        for n in range(8):
            for h in range(2):
                at = np.array([fr.c_pair_offset32(32 * warp + lane, n, h)
                               for lane in range(32)])
                words = np.concatenate([at, at + 4])
                assert np.bincount(fr.banks(words), minlength=32).tolist() \
                    == [2] * 32


def test_backward_v8_fused_columns_read_through_half_panel_descriptors():
    # the fused kernel's dQ product: warpgroup c multiplies dS (all 128
    # keys, from dS^T MN-major) by K_j's columns 32 c.. (MN-major, N =
    # 32: a descriptor 64 c bytes into the swizzled rows); on the model
    # each k-step reads its 16 keys of those 32 columns
    from flashlab.gpu import backward_v7 as b7

    rng = np.random.default_rng(32)
    keys = b7.own("dkv")
    k = rng.integers(-2 ** 10, 2 ** 10, (keys, 64)).astype(float)
    k_tile = _fill_panels(k, b7.threads("dkv")).astype(float)
    lbo, sbo, step = fr.mn_major_128b(keys)
    for c in range(2):
        for s in range(keys // 16):
            b = fr.wgmma_operand(k_tile, fr.descriptor_128b(
                64 * c + s * step, lbo, sbo), 32, True)
            np.testing.assert_array_equal(
                b, k[16 * s:16 * s + 16, 32 * c:32 * c + 32])


def test_forward_v8_refuses_key_tiles_its_mask_bits_cannot_hold(
        monkeypatch):
    # a lane's allowed pairs are one int64: 2 rows x Bc / 4 keys, so
    # 160 keys a tile would shift past bit 63 and unmask pairs silently
    from flashlab.gpu import forward_v8

    monkeypatch.setitem(forward_v8.BLOCK_K, 128, 160)
    with pytest.raises(ValueError, match="BLOCK_K: at most 128 keys"):
        forward_v8.make(128, 128)
    assert 2 * forward_v8.MAX_BLOCK_K // 4 == 64  # bits a lane holds
