"""warp.row_dot16, the backward's D = rowsum(dO o O), and prepare16, which
sums it as row_dot16 does beside its other work: in CI, the places
its lanes load and store (fragments.row_dot_place, which the kernel runs)
cover every 16-byte piece of every row once and store every row once;
on a GPU, each row's float32 sum against numpy's float64 of the same
16-bit values, every entry of D written (it starts as NaN). The kernel's
shuffles have no simulator form."""

import numpy as np
import pytest

from flashlab import fragments
from flashlab.gpu import warp


def places(rows, d_v, blocks):
    """Every (row, piece) row_dot16 loads and every row it stores, as the
    kernel's loop visits them (grid of `blocks`)."""
    lanes = fragments.row_dot_lanes(d_v)
    place = fragments.row_dot_place
    quads = d_v // 8
    warps = blocks * warp.THREADS // 32
    loads, stores = [], []
    for w in range(warps):
        turn = 0
        while place(w, turn, 0, 0, lanes, warps)[0] < rows:
            for u in range(fragments.ROW_DOT_UNROLL):
                for lane in range(32):
                    r, x = place(w, turn, u, lane, lanes, warps)
                    if r < rows and x < quads:
                        loads.append((r, x))
                    if r < rows and x == 0:
                        stores.append(r)
            turn += 1
    return loads, stores


@pytest.mark.parametrize("rows, d_v, blocks", [
    (1, 16, None), (37, 48, None), (70, 64, None), (1000, 128, None),
    (1000, 128, 1), (333, 112, 2), (129, 32, 3)])
def test_every_piece_loaded_and_row_stored_once(rows, d_v, blocks):
    blocks = blocks or warp.dot_grid(rows, d_v, 132)[0]
    loads, stores = places(rows, d_v, blocks)
    want = [(r, x) for r in range(rows) for x in range(d_v // 8)]
    assert sorted(loads) == want
    assert sorted(stores) == list(range(rows))


def test_dot_grid():
    # 16 lanes a row at d_v = 128: 2 rows a warp's load, 4 loads, 4 warps
    assert fragments.row_dot_lanes(128) == 16
    assert fragments.row_dot_lanes(48) == 8
    assert warp.dot_grid(32, 128, 132) == (1,)
    assert warp.dot_grid(33, 128, 132) == (2,)
    # no more blocks than the GPU holds at once: they take turns
    assert warp.dot_grid(10**8, 64, 132) == (132 * warp.DOT_BLOCKS_PER_SM,)
    assert warp.dot_grid(10**8, 64, 1) == (warp.DOT_BLOCKS_PER_SM,)


@pytest.mark.parametrize("d_v", [4, 12, 264])
def test_dot_lanes_names_d_v(d_v):
    with pytest.raises(ValueError, match="d_v: expected a multiple of 8"):
        fragments.row_dot_lanes(d_v)


def bits(x, kind):
    """float64 x rounded to bf16 or float16: (the values as float64, their
    16-bit patterns as int16)."""
    if kind == "f16":
        h = x.astype(np.float16)
        return h.astype(np.float64), h.view(np.int16)
    f = x.astype(np.float32).view(np.uint32)
    top = ((f + 0x7FFF + ((f >> 16) & 1)) >> 16).astype(np.uint16)
    wide = (top.astype(np.uint32) << 16).view(np.float32)
    return wide.astype(np.float64), top.view(np.int16)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["bf16", "f16"])
@pytest.mark.parametrize("rows, d_v, blocks", [
    (1, 16, None), (37, 48, None), (70, 64, None), (4099, 128, None),
    (4099, 128, 1), (3000, 112, 5), (2**17 + 3, 64, None)])
def test_rows_match_numpy(rng, kind, rows, d_v, blocks):
    from numba import cuda

    do, do_bits = bits(rng.standard_normal((rows, d_v)) * 3, kind)
    o, o_bits = bits(rng.standard_normal((rows, d_v)), kind)
    delta = cuda.to_device(np.full(rows, np.nan, np.float32))  # poison
    grid = warp.dot_grid(rows, d_v, 132) if blocks is None else (blocks,)
    kernel = getattr(warp, f"row_dot_{kind}")
    kernel[grid, warp.THREADS](cuda.to_device(do_bits.view(np.int32)),
                               cuda.to_device(o_bits.view(np.int32)),
                               delta)
    got = delta.copy_to_host()
    want = (do * o).sum(axis=1)
    # float32 products of 16-bit values are exact; d_v float32 additions
    # err by at most d_v ulps of the sum of |terms| (2^-24 each)
    bound = d_v * 2.0**-24 * np.abs(do * o).sum(axis=1)
    assert np.all(np.abs(got - want) <= bound)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["bf16", "f16"])
@pytest.mark.parametrize("heads, nq, nk, d, causal, tiles", [
    (1, 1, 5, 64, False, 1), (3, 77, 130, 128, True, 2),
    (4, 300, 257, 64, False, 0), (2, 1000, 1000, 128, True, 16)])
def test_prepare_is_row_dot_and_statistics(rng, kind, heads, nq, nk, d,
                                           causal, tiles):
    # prepare16 against the two kernels it stands for, bit for bit: D as
    # row_dot16 sums it, each row's shift and norm as row_statistics
    # finds them (rows whose lse loses l among them, so its pass over the
    # keys runs too), on poisoned outputs; and every count zeroed
    import torch

    from flashlab.gpu import build, host

    dtype = torch.bfloat16 if kind == "bf16" else torch.float16
    q, k, do, o = (torch.tensor(rng.standard_normal(shape) * 2,
                                dtype=dtype, device="cuda")
                   for shape in ((heads, nq, d), (heads, nk, d),
                                 (heads, nq, d), (heads, nq, d)))
    lse = torch.tensor(rng.standard_normal((heads, nq)) * 4 + 5,
                       dtype=torch.float32, device="cuda")
    lse.view(-1)[::7] = 80.0  # lse_loses_l: found again from q and k
    lse.view(-1)[3::11] = float("-inf")  # a row with no key: kept
    options = dict(scale=None, causal=causal, mask=None, window=None,
                   kv_lengths=None, dropout_p=0.0, seed=None, align=None)
    call = host._Call(q, k, k, options)
    pairs = [x.view(torch.int32).view(heads * nq, d // 2) for x in (do, o)]
    bits = [x.view(torch.int16) for x in (q, k)]
    grid = warp.dot_grid(heads * nq, d, 132, warp.PREPARE_BLOCKS_PER_SM)
    stream = call.stream

    def poisoned(shape):
        return torch.full(shape, float("nan"), device="cuda")

    delta_ref, stats_ref = poisoned((heads * nq,)), poisoned((2 * heads, nq))
    build.kernel(f"row_dot_{kind}", 0, 0)[grid, warp.THREADS, stream](
        *pairs, delta_ref)
    build.kernel(f"row_statistics_{kind}", 0, 0)[
        (-(-nq // 128), heads), 128, stream](
        *bits, lse, stats_ref, *call.args)
    delta, stats = poisoned((heads * nq,)), poisoned((2 * heads, nq))
    counts = torch.full((heads, tiles), 7, dtype=torch.int32,
                        device="cuda")
    build.kernel(f"prepare_{kind}", 0, 0)[grid, warp.THREADS, stream](
        *pairs, delta, *bits, lse.view(-1), stats.view(2, -1),
        counts.view(-1), *call.args)
    torch.cuda.synchronize()
    assert not delta.isnan().any() and not stats.isnan().any()
    assert torch.equal(delta, delta_ref)
    assert torch.equal(stats, stats_ref)
    assert not counts.any()
