"""Ring attention at its edges, on gloo with CPU processes.

A ring of one (forward and backward), keys longer than queries without a
causal mask, and ranks that disagree on shapes or dtypes: those must get
one clear error, the same on every rank, before any K/V moves (gloo
aborts the process when the sizes of a send and its receive differ).
"""

import os
import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flashlab import distributed, reference, tiled

TOL = 1e-12  # float64 throughout, as tests/test_distributed.py


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(world, case, seed):
    """Run _worker in `world` processes; each rank's (rank, result)."""
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.spawn(_worker, args=(world, _free_port(), case, seed, results),
             nprocs=world)
    return sorted((results.get() for _ in range(world)),
                  key=lambda r: r[0])


def _worker(rank, world, port, case, seed, results):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    try:
        results.put((rank, CASES[case](rank, world, seed)))
    finally:
        dist.destroy_process_group()


def _errors(rank, world, q, k, v, do, causal, layout="contiguous"):
    """Max errors of this rank's output and gradients against the float64
    reference of the whole sequences q (.., N, d), k, v (.., N_k, .)."""
    o_ref, lse = reference.attention(q, k, v, causal=causal,
                                     return_lse=True)
    grads = tiled.attention_backward(q, k, v, o_ref, lse, do,
                                     causal=causal)
    mine = [torch.tensor(distributed.split(x, world, layout)[rank],
                         requires_grad=True) for x in (q, k, v)]
    out = distributed.ring_attention(*mine, causal=causal, layout=layout)
    got = torch.autograd.grad(out, mine, torch.tensor(
        distributed.split(do, world, layout)[rank]))
    return [float(np.max(np.abs(g.detach().numpy() - distributed.split(
        w, world, layout)[rank]))) for g, w in zip((out, *got),
                                                   (o_ref, *grads))]


def _ring_of_one(rank, world, seed):
    rng = np.random.default_rng(seed)
    q, k, v, do = (rng.standard_normal((2, 3, 12, 8)) for _ in range(4))
    return [_errors(rank, world, q, k, v, do, causal, layout)
            for causal in (False, True) for layout in distributed.LAYOUTS]


def _longer_keys(rank, world, seed):
    rng = np.random.default_rng(seed)
    q, do = (rng.standard_normal((2, 3, 4 * world, 8)) for _ in range(2))
    k, v = (rng.standard_normal((2, 3, 12 * world, 8)) for _ in range(2))
    errs = [_errors(rank, world, q, k, v, do, False, layout)
            for layout in distributed.LAYOUTS]
    mine = [torch.tensor(distributed.split(x, world)[rank])
            for x in (q, k, v)]
    try:  # under a causal mask positions pair them: refused
        distributed.ring_attention(*mine, causal=True)
        refused = None
    except ValueError as e:
        refused = str(e)
    return errs, refused


def _disagree(rank, world, seed):
    """Each rank's error message for arguments only rank 1 gets wrong."""
    rng = np.random.default_rng(seed)
    x = torch.tensor(rng.standard_normal((2, 8, 4)))
    wrong = {
        "rows": torch.tensor(rng.standard_normal((2, 10, 4))),
        "dtype": x.float(),
        "causal": None,
        "half": x.half(),
    }
    messages = {}
    for name, odd in wrong.items():
        q = odd if rank == 1 and odd is not None else x
        causal = rank == 1 and name == "causal"
        try:
            distributed.ring_attention(q, q, q, causal=causal)
            messages[name] = None
        except (ValueError, TypeError) as e:
            messages[name] = f"{type(e).__name__}: {e}"
    return messages


CASES = {"one": _ring_of_one, "longer": _longer_keys,
         "disagree": _disagree}


def _seed():
    seed = int(np.random.SeedSequence().entropy % 2**32)
    print(f"ring seed {seed}")
    return seed


def test_a_ring_of_one_runs_forward_and_backward():
    # world 1 used to send the gradients' last hop to itself (gloo:
    # "Pair is not connected")
    ((_, errs),) = _run(1, "one", _seed())
    for e in errs:
        assert max(e) < TOL, errs


def test_keys_longer_than_queries_without_a_causal_mask():
    # each rank holds 4 query rows and 12 keys: every key counts (once
    # only the first n_q of each slice did)
    for _, (errs, refused) in _run(2, "longer", _seed()):
        for e in errs:
            assert max(e) < TOL, errs
        assert refused is not None and refused.startswith(
            "k: expected 4 rows like q under a causal mask")


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_that_disagree_get_one_error_on_every_rank(world):
    runs = _run(world, "disagree", _seed())
    first = runs[0][1]
    for _, messages in runs:
        assert messages == first  # the same words on every rank
    assert first["rows"].startswith("ValueError: q: expected the same on "
                                    "every rank")
    assert "torch.float64 (2, 10, 4) on cpu on rank 1" in first["rows"]
    assert first["dtype"].startswith("ValueError: q: expected the same")
    assert "torch.float32" in first["dtype"]
    assert first["causal"].startswith(
        "ValueError: causal: expected the same on every rank")
    assert first["half"].startswith(
        "TypeError: q: expected a CPU tensor of") and first["half"].endswith(
        "on rank 1")
