"""Ring attention on gloo: 2 and 4 CPU processes started from the test.

Every rank draws the same full q, k, v, runs ring_attention on its own
slice (both layouts, causal and not), and checks its output rows and its
gradients against the float64 reference of the whole sequence, within
the same rounding budget as the tiled path (1e-12 in float64).
"""

import contextlib
import itertools
import os
import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flashlab import costs, distributed, reference, tiled

TOL = 1e-12  # float64 throughout: a merge or two of rounding


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _gloo(rank, world, port):
    """This process as rank of a gloo group of world CPU processes."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _worker(rank, world, port, seed):
    with _gloo(rank, world, port):
        rng = np.random.default_rng(seed)
        n, d = 8 * world, 16
        q, k, v, do = (rng.standard_normal((2, 3, n, d)) for _ in range(4))
        for layout in distributed.LAYOUTS:
            for causal in (False, True):
                o_ref = reference.attention(q, k, v, causal=causal)
                o64, lse64 = tiled.attention(q, k, v, causal=causal,
                                             return_lse=True)
                grads = tiled.attention_backward(q, k, v, o64, lse64, do,
                                                 causal=causal)
                mine = [torch.tensor(distributed.split(x, world,
                                                       layout)[rank],
                                     requires_grad=True)
                        for x in (q, k, v)]
                before = distributed.sent_bytes()
                out = distributed.ring_attention(*mine, causal=causal,
                                                 layout=layout)
                forward = distributed.sent_bytes() - before
                do_r = torch.tensor(distributed.split(do, world,
                                                      layout)[rank])
                got = torch.autograd.grad(out, mine, do_r)
                backward = distributed.sent_bytes() - before - forward
                # every hop counted: exactly the closed form, per head
                per_head = costs.ring_transfers(world, n // world, d)
                assert (forward, backward) == tuple(
                    6 * 8 * x for x in per_head)  # B H = 6, float64
                want = distributed.split(o_ref, world, layout)[rank]
                err = np.max(np.abs(out.detach().numpy() - want))
                assert err < TOL, (layout, causal, "o", err)
                for name, g, w in zip("qkv", got, grads):
                    w_r = distributed.split(w, world, layout)[rank]
                    err = np.max(np.abs(g.numpy() - w_r))
                    assert err < TOL, (layout, causal, "d" + name, err)


@pytest.mark.parametrize("world", [2, 4])
def test_ring_matches_the_reference(world):
    seed = int(np.random.SeedSequence().entropy % 2**32)
    print(f"ring seed {seed}")
    mp.spawn(_worker, args=(world, _free_port(), seed), nprocs=world)


def _hot_worker(rank, world, port, seed):
    with _gloo(rank, world, port):
        rng = np.random.default_rng(seed)
        n, d = 8 * world, 16
        # scores of hundreds: most rows' lse is past merge.LSE_EXACT, where
        # a piece's keys alone would give P its own m and l
        q, k, v, do = (rng.standard_normal((1, 2, n, d)) for _ in range(4))
        for hot in (300.0, -300.0):
            for causal in (False, True):
                o64, lse64 = tiled.attention(hot * q, k, v, causal=causal,
                                             return_lse=True)
                assert np.mean(np.abs(lse64) >= 64) > 0.6
                want = [o64, *tiled.attention_backward(
                    hot * q, k, v, o64, lse64, do, causal=causal)]
                # dK_j sums 0.25 dS_ij (hot q_i) (scale 1/sqrt(16)), with
                # dS = P (dP - D): where P is one-hot dP - D cancels, so dK
                # can be far smaller than its terms, while its rounding,
                # up to eps P (|dP| + |D|) in each dS, is relative to
                # them. Against dK's own size, rng seed 1045 (hot -300)
                # exceeded 1e-12 by 2%, about one run in 600; against its
                # terms' size the error reached 1.2 eps over 600 seeds
                p = reference.softmax(reference.scores(hot * q, k,
                                                       causal=causal))
                dp_d = (np.abs(do @ np.swapaxes(v, -1, -2))
                        + np.abs(np.sum(do * o64, -1))[..., None])
                terms = 0.25 * np.swapaxes(p * dp_d, -1, -2) @ np.abs(
                    hot * q)
                sizes = [1, 1, distributed.split(terms, world, "zigzag")[
                    rank].max(), 1]
                mine = [torch.tensor(distributed.split(x, world,
                                                       "zigzag")[rank],
                                     requires_grad=True)
                        for x in (hot * q, k, v)]
                out = distributed.ring_attention(*mine, causal=causal,
                                                 layout="zigzag")
                got = [out, *torch.autograd.grad(out, mine, torch.tensor(
                    distributed.split(do, world, "zigzag")[rank]))]
                for name, g, w, size in zip(("o", "dq", "dk", "dv"), got,
                                            want, sizes):
                    w_r = distributed.split(w, world, "zigzag")[rank]
                    err = np.max(np.abs(g.detach().numpy() - w_r))
                    assert err < TOL * max(size, np.abs(w_r).max()), (
                        hot, causal, name, err)
        # float32 scores of 1e6, all equal: the output is the mean of the
        # allowed values, which lse = m + log l (log l rounded away next
        # to 1e6) cannot weigh when pieces hold different counts of keys
        q32 = np.zeros((1, 1, n, d), np.float32)
        q32[..., 0] = 1000.0
        v32 = rng.standard_normal((1, 1, n, d)).astype(np.float32)
        mine = [torch.tensor(distributed.split(x, world, "zigzag")[rank])
                for x in (q32, q32, v32)]
        out = distributed.ring_attention(*mine, causal=True,
                                         layout="zigzag", scale=1.0)
        mean = np.cumsum(v32.astype(np.float64), axis=-2) / np.arange(
            1, n + 1)[:, None]  # row i: the mean of V's first i + 1 rows
        want = distributed.split(mean, world, "zigzag")[rank]
        err = np.max(np.abs(out.numpy() - want))
        assert err < 1e-5, err  # float32 rounding of a mean of <= 32


def test_ring_is_exact_at_large_scores():
    seed = int(np.random.SeedSequence().entropy % 2**32)
    print(f"ring seed {seed}")
    mp.spawn(_hot_worker, args=(2, _free_port(), seed), nprocs=2)


def test_split_and_join_are_inverse(rng):
    x = rng.standard_normal((2, 24, 5))
    for layout in distributed.LAYOUTS:
        for world in (1, 2, 3):
            parts = distributed.split(x, world, layout)
            assert all(p.shape == (2, 24 // world, 5) for p in parts)
            assert np.array_equal(distributed.join(parts, layout), x)
    t = torch.tensor(x)
    assert torch.equal(distributed.join(distributed.split(t, 2, "zigzag"),
                                        "zigzag"), t)


@pytest.mark.parametrize("layout", distributed.LAYOUTS)
def test_pieces_cover_the_causal_mask(layout):
    # the pieces of every (rank, owner) pair rebuild its mask exactly,
    # without an (n, n) mask anywhere in the ring
    for world in (1, 2, 3, 4):
        n = 2 * world * 3
        for r in range(world):
            for s in range(world):
                pos_q = distributed.positions(r, world, n, layout)
                pos_k = distributed.positions(s, world, n, layout)
                got = np.zeros((pos_q.size, pos_k.size), int)
                for rows, cols, flag in distributed.pieces(pos_q, pos_k,
                                                           True):
                    block = got[rows, cols]
                    block += (np.tril(np.ones(block.shape, int)) if flag
                              else 1)
                assert np.array_equal(got, pos_k[None] <= pos_q[:, None])
                assert distributed.pieces(pos_q, pos_k, False) == [
                    (slice(0, pos_q.size), slice(0, pos_k.size), False)]
    with pytest.raises(ValueError, match="pos_k: runs must be equal"):
        distributed.pieces(np.arange(4), np.arange(2, 6), True)


def test_zigzag_balances_causal_work():
    # contiguous: rank r computes (r + 1/2)/W of its rows' keys; zigzag:
    # every rank the same number of pairs
    for world in (2, 4, 8):
        n = 16 * world
        plain = distributed.allowed_pairs(world, n, "contiguous")
        zig = distributed.allowed_pairs(world, n, "zigzag")
        assert plain.sum() == zig.sum() == n * (n + 1) // 2
        assert len(set(zig)) == 1
        assert plain.max() / plain.mean() > 1.5 * world / (world + 1)


def test_bad_input():
    x = torch.zeros(4, 4)
    with pytest.raises(ValueError, match="layout: expected one of"):
        distributed.positions(0, 2, 8, "striped")
    with pytest.raises(ValueError, match="n: expected a multiple of 4"):
        distributed.positions(0, 2, 6, "zigzag")
    with pytest.raises(TypeError, match="q: expected a torch.Tensor"):
        distributed.ring_attention(np.zeros((4, 4)), x, x)
    with pytest.raises(TypeError, match="q: expected a CPU tensor of"):
        distributed.ring_attention(*(x.half(),) * 3)
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="init_process_group"):
            distributed.ring_attention(x, x, x)


# ------------------------------------------- NCCL on GPUs (pytest -m gpu)

def _gpu_worker(rank, world, port, seed):
    from flashlab import gpu

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    try:
        rng = np.random.default_rng(seed)
        n, d = 96 * world, 64  # 48-row chunks: ragged against every tile
        q0, k, v, do = (rng.standard_normal((2, 3, n, d)) for _ in range(4))
        # hot = 40: scores of a few hundred, lse past merge.LSE_EXACT, where
        # the pieces merge and recompute P by the rows' (m, l)
        for layout, causal, hot in itertools.product(
                distributed.LAYOUTS, (False, True), (1.0, 40.0)):
            q = hot * q0
            dev = [torch.tensor(x, dtype=torch.float32, device="cuda")
                   for x in (q, k, v, do)]
            o64, lse64 = tiled.attention(q, k, v, causal=causal,
                                         return_lse=True)
            want = [o64, *tiled.attention_backward(
                q, k, v, o64, lse64, do, causal=causal)]
            # the budget: the same kernels on the whole sequence on
            # one GPU, twice their error, floored at 8 float32 ulps
            o1, lse1 = gpu.attention(*dev[:3], causal=causal,
                                     return_lse=True)
            one = [o1, *gpu.attention_backward(
                *dev[:3], o1, lse1, dev[3], causal=causal)]
            mine = [distributed.split(x, world, layout)[rank]
                    .clone().requires_grad_() for x in dev[:3]]
            out = distributed.ring_attention(*mine, causal=causal,
                                             layout=layout)
            got = [out, *torch.autograd.grad(out, mine, distributed.split(
                dev[3], world, layout)[rank])]
            for name, g, w, single in zip(("o", "dq", "dk", "dv"), got,
                                          want, one):
                w_r = distributed.split(w, world, layout)[rank]
                s_r = distributed.split(single.cpu().numpy(), world,
                                        layout)[rank]
                floor = 8 * 2.0**-23 * max(1.0, np.abs(w_r).max())
                budget = max(2 * np.max(np.abs(s_r - w_r)), floor)
                err = np.max(np.abs(g.detach().cpu().numpy() - w_r))
                assert not np.isnan(err) and err <= budget, (
                    layout, causal, hot, name, err, budget)
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
def test_ring_on_gpus_over_nccl():
    # every GPU of the machine, one process each (a ring of one on a
    # single GPU still runs the pieces, the kernels and the combine)
    world = torch.cuda.device_count()
    seed = int(np.random.SeedSequence().entropy % 2**32)
    print(f"nccl ring seed {seed}, {world} GPUs")
    mp.spawn(_gpu_worker, args=(world, _free_port(), seed), nprocs=world)


def test_stored_ring_traffic_matches_the_count():
    # the two-H200 run (bench --ring): every rank sent exactly what
    # costs.ring_transfers predicts, K/V in bf16 and dK/dV in float32
    from flashlab import measured
    from flashlab.bench import ring as bench_ring

    rows = measured.record("ring_h200x2.json")["rows"]
    assert {r["world"] for r in rows} == {1, 2}
    one = measured.record("ring_h200.json")["rows"]  # one GPU, later
    assert {r["world"] for r in one} == {1}
    for r in rows + one:
        want = bench_ring.predicted_bytes(r["world"], r["n"], r["backward"])
        if r in rows and (r["world"], r["backward"]) == (1, True):
            # that run's ring of one still handed dK, dV to itself at
            # the end, a hop the ring (and the count) no longer make:
            # n (d + d_v) float32 values per head
            want = bench_ring.B * bench_ring.H * r["n"] * 2 * bench_ring.D * 4
        assert r["sent_bytes"] == r["predicted_bytes"] == want
    assert "GPUs" in bench_ring.table(rows)


def test_positions_split_and_join_name_bad_ranks_and_parts():
    for rank, world in ((2, 2), (-1, 2), (True, 2)):
        with pytest.raises(ValueError, match="rank: expected an integer"):
            distributed.positions(rank, world, 8)
    for world in (0, -2):
        with pytest.raises(ValueError, match="world: expected an integer"):
            distributed.positions(0, world, 8)
    with pytest.raises(ValueError, match="n: expected an integer >= 0"):
        distributed.positions(0, 2, -4)
    assert distributed.positions(np.int64(1), 2, 8).tolist() == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="x: expected"):
        distributed.split(np.arange(8.0), 2)
    x = np.arange(24.0).reshape(8, 3)
    with pytest.raises(ValueError, match="parts: expected slices of equal"):
        distributed.join([x, x[:4]], "zigzag")
    with pytest.raises(ValueError, match="parts: expected one slice"):
        distributed.join([])
