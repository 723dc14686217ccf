"""The fragment layouts and addresses the tensor-core kernels rely on.

CI has no GPU and the simulator cannot run inline PTX, so what v5, v6
and backward_v5 assume about mma.sync, ldmatrix and shared-memory banks,
and how the backward chains them, is checked here on flashlab.fragments'
numpy model, with the index functions the kernels themselves call
(fragments.ldmatrix_a, ..., swizzle, forward_v6.strides).
"""

import numpy as np
import pytest

from flashlab import fragments as fr
from flashlab.gpu import forward_v6
from flashlab.gpu.warp import THREADS

LANE = np.arange(32)


@pytest.mark.parametrize("k", [16, 8])
def test_places_cover_each_operand_once(k):
    for places, shape in ((fr.a_places(k), (16, k)),
                          (fr.b_places(k), (k, 8)),
                          (fr.c_places(), (16, 8))):
        flat = places.reshape(-1, 2)
        assert len({tuple(p) for p in flat}) == flat.shape[0] == np.prod(
            shape)
        assert flat.min() == 0 and tuple(flat.max(0) + 1) == shape


@pytest.mark.parametrize("k", [16, 8])
def test_mma_model_is_the_matrix_product(rng, k):
    a, b, c = (rng.standard_normal(s) for s in ((16, k), (k, 8), (16, 8)))
    d = fr.mma(fr.gather(a, fr.a_places(k)), fr.gather(b, fr.b_places(k)),
               fr.gather(c, fr.c_places()), k)
    assert np.allclose(fr.scatter(d, fr.c_places(), (16, 8)), a @ b + c,
                       rtol=0, atol=1e-12)  # float64 sums of 16 terms


def test_a_wrong_layout_is_caught(rng):
    # the check above must be able to fail: B's two registers swapped
    a, b = rng.standard_normal((16, 16)), rng.standard_normal((16, 8))
    d = fr.mma(fr.gather(a, fr.a_places()),
               fr.gather(b, fr.b_places()[:, ::-1]), np.zeros((32, 4)))
    assert not np.allclose(fr.scatter(d, fr.c_places(), (16, 8)), a @ b)


def _tile(rows, cols):
    """A tile of distinct values and its swizzled SRAM image (v5)."""
    tile = np.arange(rows * cols).reshape(rows, cols)
    per_row = cols // 8
    sram = np.empty(rows * cols, tile.dtype)
    for r in range(rows):
        for c in range(per_row):
            at = (r * per_row + fr.swizzle(r, c)) * 8
            sram[at:at + 8] = tile[r, 8 * c:8 * c + 8]
    return tile, sram


def _address(rows_chunks, cols):
    """Element index in swizzled SRAM of each lane's (row, chunk)."""
    r, c = rows_chunks
    return (r * (cols // 8) + fr.swizzle(r, c)) * 8


@pytest.mark.parametrize("d", [64, 128])
def test_ldmatrix_gives_q_its_a_fragments(d):
    tile, sram = _tile(64, d)
    for warp in range(4):
        for ks in range(d // 16):
            r, c = fr.ldmatrix_a(LANE, ks)
            got = fr.ldmatrix(sram, _address((r + 16 * warp, c), d))
            want = fr.gather(tile[16 * warp:16 * warp + 16,
                                  16 * ks:16 * ks + 16], fr.a_places())
            assert np.array_equal(got, want)


@pytest.mark.parametrize("d", [64, 128])
def test_ldmatrix_gives_k_transposed_its_b_fragments(d):
    tile, sram = _tile(64, d)  # K_j: 64 keys x d
    for ks in range(d // 16):
        for pair in range(4):
            got = fr.ldmatrix(sram, _address(fr.ldmatrix_b(LANE, pair, ks),
                                             d))
            for y in range(2):  # n-tiles 2 pair, 2 pair + 1
                keys = slice(16 * pair + 8 * y, 16 * pair + 8 * y + 8)
                b = tile[keys, 16 * ks:16 * ks + 16].T  # B = K^T (k x n)
                assert np.array_equal(got[:, 2 * y:2 * y + 2],
                                      fr.gather(b, fr.b_places()))


@pytest.mark.parametrize("d_v", [64, 128])
def test_ldmatrix_trans_gives_v_its_b_fragments(d_v):
    tile, sram = _tile(64, d_v)  # V_j: 64 keys x d_v
    for kp in range(4):
        for pair in range(d_v // 16):
            got = fr.ldmatrix(sram, _address(
                fr.ldmatrix_b_trans(LANE, kp, pair), d_v), trans=True)
            for y in range(2):
                cols = slice(16 * pair + 8 * y, 16 * pair + 8 * y + 8)
                b = tile[16 * kp:16 * kp + 16, cols]  # B = V (k x n)
                assert np.array_equal(got[:, 2 * y:2 * y + 2],
                                      fr.gather(b, fr.b_places()))


def test_s_fragments_are_p_v_a_fragments(rng):
    # v5 packs P's A fragment from S's C fragments with no shuffle
    s = rng.standard_normal((16, 16))
    c = [fr.gather(s[:, 8 * n:8 * n + 8], fr.c_places()) for n in (0, 1)]
    packed = np.empty((32, 4, 2))
    for r in range(4):
        n, e = fr.a_from_c(r)
        packed[:, r] = c[n][:, e:e + 2]
    assert np.array_equal(packed, fr.gather(s, fr.a_places()))


@pytest.mark.parametrize("d", [64, 128])
def test_swizzled_ldmatrix_reads_are_free_of_bank_conflicts(d):
    # ldmatrix serves 8 lanes (one matrix) per phase: 8 rows of 16 bytes
    # must fall in 8 different 4-bank groups
    def conflicts(addresses):
        out = 0
        for phase in range(4):
            banks = fr.banks(2 * addresses[8 * phase:8 * phase + 8])
            out += 8 - len(set(banks // 4))
        return out

    for ks in range(d // 16):
        assert conflicts(_address(fr.ldmatrix_a(LANE, ks), d)) == 0
        assert conflicts(_address(fr.ldmatrix_b(LANE, 1, ks), d)) == 0
        assert conflicts(_address(fr.ldmatrix_b_trans(LANE, 1, ks), d)) == 0
    # and without the swizzle the same reads conflict 8 ways
    r, c = fr.ldmatrix_a(LANE, 0)
    plain = (r * (d // 8) + c) * 8
    assert conflicts(plain) == 4 * 7


@pytest.mark.parametrize("d", [64, 128])
def test_v6_fragment_reads_hit_32_banks(d):
    G, t = fr.G, fr.T
    sk, sv, sp = forward_v6.strides(d, d)
    reads = {"K row G, col t": G * sk + t, "K col t+4": G * sk + t + 4,
             "V row t, col G": t * sv + G, "V row t+4": (t + 4) * sv + G,
             "P row G, col t": G * sp + t, "P row G+8": (G + 8) * sp + t}
    for name, words in reads.items():
        assert len(set(fr.banks(4 * words))) == 32, name


def test_v6_p_v_uses_the_a_and_b_layouts(rng):
    # v6 reads P (16 x 8 keys) as A with fragments (G, t), (G+8, t), (G,
    # t+4), (G+8, t+4) and V's rows t, t + 4 as B: the product P V
    p, v = rng.random((16, 8)), rng.standard_normal((8, 8))
    G, t = fr.G, fr.T
    a = np.stack([p[G, t], p[G + 8, t], p[G, t + 4], p[G + 8, t + 4]], 1)
    b = np.stack([v[t, G], v[t + 4, G]], 1)
    d = fr.mma(a[..., None], b[..., None], np.zeros((32, 4)), k=8)
    assert np.allclose(fr.scatter(d, fr.c_places(), (16, 8)), p @ v,
                       rtol=0, atol=1e-12)


def test_tf32_rounding_model(rng):
    x = rng.standard_normal(10000).astype(np.float32) * 1e3
    hi, lo = fr.split_tf32(x)
    assert np.all(hi.view(np.uint32) & 0x1FFF == 0)  # 10 mantissa bits
    assert np.all(np.abs(x - hi) <= np.abs(x) * 2.0**-11)  # nearest
    assert np.all(np.abs(x - hi - lo) <= np.abs(x) * 2.0**-21)
    # ties go away from zero: 1 + 2**-11 is halfway between tf32 values
    tie = np.float32(1 + 2.0**-11)
    assert fr.to_tf32(tie) == np.float32(1 + 2.0**-10)
    assert fr.to_tf32(-tie) == -np.float32(1 + 2.0**-10)
    assert np.isnan(fr.to_tf32(np.float32(np.nan)))
    assert fr.to_tf32(np.float32(-np.inf)) == -np.inf


def test_3xtf32_product_error_is_float32_like(rng):
    # the error model behind v6: three tf32 products recover float32
    a = rng.standard_normal((64, 256)).astype(np.float32)
    b = rng.standard_normal((256, 64)).astype(np.float32)
    exact = a.astype(np.float64) @ b
    (ah, al), (bh, bl) = fr.split_tf32(a), fr.split_tf32(b)
    f64 = np.float64
    three = ah.astype(f64) @ bh + ah.astype(f64) @ bl + al.astype(f64) @ bh
    one = ah.astype(f64) @ bh
    scale = np.abs(a).astype(f64) @ np.abs(b)
    eps = float(np.finfo(np.float32).eps)
    assert np.max(np.abs(three - exact) / scale) < 2 * eps
    assert np.max(np.abs(one - exact) / scale) > 100 * eps


@pytest.mark.parametrize("per_row", [8, 16])
def test_kernel_offsets_are_the_model_addresses(per_row):
    # the kernels address ldmatrix as one of four bases per lane plus a
    # constant step; it must equal the swizzled place of the (row, chunk)
    # the model reads, for every step a kernel takes
    places = ((fr.ldmatrix_b, lambda pair, ks: (16 * pair, 2 * ks)),
              (fr.ldmatrix_b_trans, lambda kp, pair: (16 * kp, 2 * pair)),
              (lambda lane, w, ks: fr.ldmatrix_a(lane, ks) + np.array(
                  [[16 * w], [0]]), lambda w, ks: (16 * w, 2 * ks)))
    for place, step in places:
        row, chunk = place(LANE, 0, 0)
        for i in range(4):
            for j in range(per_row // 2):
                rows, chunks = step(i, j)
                want = fr.swizzled_offset(*place(LANE, i, j), per_row)
                got = fr.swizzle_base(row, chunk, chunks % 8 // 2,
                                      per_row) + fr.swizzle_step(
                                          rows, chunks, per_row)
                assert np.array_equal(got, want)
    # and a step of 4 rows would not be a plain offset: the test can fail
    row, chunk = fr.ldmatrix_b(LANE, 0, 0)
    moved = fr.swizzled_offset(row + 4, chunk, per_row)
    assert not np.array_equal(moved, fr.swizzle_base(
        row, chunk, 0, per_row) + fr.swizzle_step(4, 0, per_row))


@pytest.mark.parametrize("per_row", [8, 16])
def test_tile_copies_land_in_the_swizzled_places(per_row):
    # warp.load_tile16: thread t copies chunk t % per_row of rows t //
    # per_row + p step, to its first place plus p THREADS 16 bytes; every
    # chunk of a 64-row tile must be copied once, to its swizzled place
    step = THREADS // per_row
    t = np.arange(THREADS)
    r, c = t // per_row, t % per_row
    first = fr.swizzled_offset(r, c, per_row)
    seen = []
    for p in range(64 // step):
        assert np.array_equal(first + p * THREADS * 16,
                              fr.swizzled_offset(r + p * step, c, per_row))
        seen += list(zip(r + p * step, c))
    assert sorted(seen) == [(i, j) for i in range(64)
                            for j in range(per_row)]


def _image(tile):
    """The swizzled SRAM image of a (rows, cols) tile of any values."""
    rows, cols = tile.shape
    per_row = cols // 8
    sram = np.empty(rows * cols, tile.dtype)
    for r in range(rows):
        for c in range(per_row):
            at = (r * per_row + fr.swizzle(r, c)) * 8
            sram[at:at + 8] = tile[r, 8 * c:8 * c + 8]
    return sram


def _a_from_c(c_tiles, kp):
    """backward_v5's re-pack: k-step kp's A fragment from C n-tiles."""
    packed = np.empty((32, 4, 2))
    for r in range(4):
        n, e = fr.a_from_c(r)
        packed[:, r] = c_tiles[2 * kp + n][:, e:e + 2]
    return packed


def test_backward_dkv_warp_in_the_model(rng):
    # one warp of backward_v5's dK/dV kernel (d = d_v = 64, a 64-query
    # tile) run on the model: K, V as A fragments by ldmatrix, S^T and
    # dP^T from Q, dO read as B, P^T and dS^T formed on C fragments and
    # re-packed as A fragments against Q, dO read transposed. The result
    # must be the warp's 16 rows of dV = P^T dO and dK = tau dS^T Q.
    d, warp, tau = 64, 2, 0.125
    k, v, q, do = (rng.standard_normal((64, d)) for _ in range(4))
    lse = rng.standard_normal(64) + 4
    delta = rng.standard_normal(64)
    images = {name: _image(x) for name, x in (("k", k), ("v", v),
                                              ("q", q), ("do", do))}

    def a_frags(name):
        out = []
        for ks in range(d // 16):
            r, c = fr.ldmatrix_a(LANE, ks)
            out.append(fr.ldmatrix(images[name], _address((r + 16 * warp,
                                                           c), d)))
        return out

    def times_bt(frags, name):
        acc = [np.zeros((32, 4)) for _ in range(8)]
        for ks, a in enumerate(frags):
            for ip in range(4):
                bb = fr.ldmatrix(images[name], _address(
                    fr.ldmatrix_b(LANE, ip, ks), d))
                for y in range(2):
                    n = 2 * ip + y
                    acc[n] = fr.mma(a, bb[:, 2 * y:2 * y + 2], acc[n])
        return acc

    def c_times_b(c_tiles, name):
        acc = [np.zeros((32, 4)) for _ in range(d // 8)]
        for kp in range(4):
            a = _a_from_c(c_tiles, kp)
            for op in range(d // 16):
                bb = fr.ldmatrix(images[name], _address(
                    fr.ldmatrix_b_trans(LANE, kp, op), d), trans=True)
                for y in range(2):
                    n = 2 * op + y
                    acc[n] = fr.mma(a, bb[:, 2 * y:2 * y + 2], acc[n])
        return np.concatenate([fr.scatter(x, fr.c_places(), (16, 8))
                               for x in acc], axis=1)

    s_t = times_bt(a_frags("k"), "q")  # S^T n-tiles (16 keys, 8 queries)
    dp_t = times_bt(a_frags("v"), "do")
    places = fr.c_places()
    p_t, ds_t = [], []
    for n in range(8):
        col = 8 * n + places[..., 1]  # each element's query
        p = np.exp(tau * s_t[n] - lse[col])
        p_t.append(p)
        ds_t.append(p * (dp_t[n] - delta[col]))
    rows = slice(16 * warp, 16 * warp + 16)
    p_want = np.exp(tau * k[rows] @ q.T - lse)  # (16 keys, 64 queries)
    ds_want = p_want * (v[rows] @ do.T - delta)
    assert np.allclose(c_times_b(p_t, "do"), p_want @ do, atol=1e-10)
    assert np.allclose(tau * c_times_b(ds_t, "q"), tau * ds_want @ q,
                       atol=1e-10)
