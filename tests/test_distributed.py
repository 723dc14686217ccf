"""Ring attention on gloo: 2 and 4 CPU processes started from the test.

Every rank draws the same full q, k, v, runs ring_attention on its own
slice (both layouts, causal and not), and checks its output rows and its
gradients against the float64 reference of the whole sequence, within
the same rounding budget as the tiled path (1e-12 in float64).
"""

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


def _worker(rank, world, port, seed):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    try:
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
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_ring_matches_the_reference(world):
    seed = int(np.random.SeedSequence().entropy % 2**32)
    print(f"ring seed {seed}")
    mp.spawn(_worker, args=(world, _free_port(), seed), nprocs=world)


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
    with pytest.raises(TypeError, match="q: expected a CPU torch.Tensor"):
        distributed.ring_attention(np.zeros((4, 4)), x, x)
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="init_process_group"):
            distributed.ring_attention(x, x, x)
