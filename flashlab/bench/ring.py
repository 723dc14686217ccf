"""Ring attention on GPUs over NCCL: one GPU against all of them.

    python -m flashlab.bench --ring [--out DIR]

For each case (B=1, H=8, d=128, bf16 forward at N = 32K and 128K, full
with the contiguous layout and causal with both; forward and backward at
N = 32K causal zigzag) the ring runs on 1 GPU and on every GPU of the
machine, one process each. The 1-GPU row also times flashlab.gpu on the
whole sequence without the ring and torch's flash kernel, on the same
inputs. Times are the slowest rank's median; bytes are what each rank
sent per call, beside `costs.ring_transfers`. Writes ring.json. Each
rank is a process of its own, so this suite keeps its own loop over
cases; it shares the GPU timer and the table writer with the others.
"""

import json
import os
import socket
import sys

from flashlab import costs
from flashlab.bench import report, timing

CASES = (  # (n, causal, layout, backward)
    (32768, False, "contiguous", False),
    (131072, False, "contiguous", False),
    (131072, True, "contiguous", False),
    (131072, True, "zigzag", False),
    (32768, True, "zigzag", True),
)
B, H, D = 1, 8, 128


def rows(reps=5):
    """One dict per (case, world): times, scaling and bytes."""
    import torch
    import torch.multiprocessing as mp

    worlds = sorted({1, torch.cuda.device_count()})
    out = []
    for world in worlds:
        print(f"ring on {world} GPU(s)", file=sys.stderr, flush=True)
        results = mp.get_context("spawn").SimpleQueue()
        mp.spawn(_rank_main, nprocs=world,
                 args=(world, _free_port(), reps, results))
        out += results.get()  # rank 0 reports for every rank
    single = {(r["n"], r["causal"], r["layout"], r["backward"]): r["ms"]
              for r in out if r["world"] == 1}
    for r in out:
        r["speedup"] = round(single[r["n"], r["causal"], r["layout"],
                                    r["backward"]] / r["ms"], 3)
    return out


def _rank_main(rank, world, port, reps, results):
    """One process: NCCL on GPU `rank`, every case, rank 0 reports."""
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    try:
        got = [_case(rank, world, reps, *case) for case in CASES]
        if rank == 0:
            results.put(got)
    finally:
        dist.destroy_process_group()


def _case(rank, world, reps, n, causal, layout, backward):
    """Time one case on this rank; the slowest rank's numbers."""
    import torch
    import torch.distributed as dist

    from flashlab import distributed

    gen = torch.Generator(device="cuda").manual_seed(n + rank)
    q, k, v, do = (torch.randn(B, H, n // world, D, device="cuda",
                               generator=gen, dtype=torch.bfloat16)
                   for _ in range(4))

    def ring():
        if not backward:
            return distributed.ring_attention(q, k, v, causal=causal,
                                              layout=layout)
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        out = distributed.ring_attention(*x, causal=causal, layout=layout)
        return torch.autograd.grad(out, x, do)

    before = distributed.sent_bytes()
    ring()
    sent = distributed.sent_bytes() - before
    row = dict(world=world, n=n, causal=causal, layout=layout,
               backward=backward, B=B, H=H, d=D, dtype="bfloat16",
               ms=_slowest(_time(ring, reps)), sent_bytes=sent,
               predicted_bytes=predicted_bytes(world, n, backward))
    if world == 1:
        row.update(_single(q, k, v, do, causal, backward, reps))
    dist.barrier()
    return row


def predicted_bytes(world, n, backward, size=2, wide=4):
    """Bytes a rank sends per call by `costs.ring_transfers`: K/V at
    their own size, dK/dV (the backward's extra hops) at the wide one."""
    fwd, bwd = costs.ring_transfers(world, n // world, D)
    kv_hops = fwd * (2 if backward else 1)
    return B * H * (kv_hops * size + (bwd - fwd) * wide * backward)


def _single(q, k, v, do, causal, backward, reps):
    """flashlab.gpu without the ring and torch's flash kernel, ms."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashlab import gpu
    from flashlab import torch as fl_torch

    def flash(x):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(*x, is_causal=causal)

    def run(fn):
        if not backward:
            return lambda: fn((q, k, v))
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        return lambda: torch.autograd.grad(fn(x), x, do)

    direct = (lambda x: gpu.attention(*x, causal=causal)) if not backward \
        else (lambda x: fl_torch.attention(*x, causal=causal))
    return dict(flashlab_ms=_time(run(direct), reps),
                torch_flash_ms=_time(run(flash), reps))


def _time(fn, reps):
    """Median ms of fn() (the GPU suites' timer), the ranks lined up
    before each call so that no rank's clock starts while another still
    works."""
    import torch
    import torch.distributed as dist

    def line_up():
        dist.barrier()
        torch.cuda.synchronize()

    return round(timing.gpu_time(fn, reps, before=line_up), 3)


def _slowest(ms):
    """The largest of every rank's ms: the ring ends with its last rank."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([ms], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return round(float(t.item()), 3)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SHOWN = ("world", "n", "causal", "layout", "pass", "ms", "speedup",
         "sent_mb", "predicted_mb", "flashlab_ms", "torch_flash_ms")


def table(found):
    """The measurements as a fixed-width text table (bytes in MB; the
    1-GPU rows also flashlab.gpu without the ring and torch's flash)."""
    shown = [dict(r, sent_mb=r["sent_bytes"] / 1e6,
                  predicted_mb=r["predicted_bytes"] / 1e6,
                  **{"pass": "fwd+bwd" if r["backward"] else "forward"})
             for r in found]
    return report.table(shown, SHOWN)


def main(out_dir, machine):
    """--ring: measure, print, write ring.json."""
    found = rows()
    with open(os.path.join(out_dir, "ring.json"), "w") as f:
        json.dump(dict(machine=machine, rows=found), f, indent=1)
    print(table(found))
    return found
