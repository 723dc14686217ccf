"""Ring attention: exact attention over a sequence split across processes.

Each rank of a torch.distributed group holds one slice of the sequence:
its rows of q, k and v. The K/V slices travel round the ring, one hop per
step, sent while the rank computes on the slice it holds; each rank turns
every slice that reaches it into a partial (out, lse) for its own query
rows and folds it in with `merge.combine`, the same merge as the tiles of
chapter 4 and the splits of `tiled.forward_split`. After world - 1 hops
every query has met every key. The backward pass is exact too: dK and dV
of a slice travel round the ring with it, every rank adding what its
queries contribute, and a last hop brings them home.

Layouts: "contiguous" gives rank r the r-th slice of the sequence; under
a causal mask rank 0 then has almost nothing to do and the last rank
everything. "zigzag" cuts the sequence into 2 world chunks and gives rank
r chunks r and 2 world - 1 - r, which balances the causal work exactly.
`split` lays a sequence out, `join` puts it back. Runs on gloo (CPU
tensors); see chapter 11.
"""

import os
import socket
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flashlab import merge, reference, tiled

LAYOUTS = ("contiguous", "zigzag")


def positions(rank, world, n, layout="contiguous"):
    """Global indices (n // world,) of the sequence rows rank r holds."""
    _check_layout(layout)
    chunks = world if layout == "contiguous" else 2 * world
    if n % chunks:
        raise ValueError(f"n: expected a multiple of {chunks} (the {layout}"
                         f" layout's chunks over {world} ranks), got {n}")
    if layout == "contiguous":
        size = n // world
        return np.arange(rank * size, (rank + 1) * size)
    size = n // (2 * world)
    return np.concatenate([np.arange(rank * size, (rank + 1) * size),
                           np.arange((2 * world - 1 - rank) * size,
                                     (2 * world - rank) * size)])


def split(x, world, layout="contiguous"):
    """The per-rank slices of a full sequence x (..., N, d), rank order."""
    return [x[..., positions(r, world, x.shape[-2], layout), :]
            for r in range(world)]


def join(parts, layout="contiguous"):
    """The full sequence from its per-rank slices (the inverse of split)."""
    world = len(parts)
    n = sum(p.shape[-2] for p in parts)
    order = np.concatenate([positions(r, world, n, layout)
                            for r in range(world)])
    stacked = (torch.cat(list(parts), -2) if isinstance(parts[0],
                                                        torch.Tensor)
               else np.concatenate(parts, -2))
    return stacked[..., np.argsort(order), :]


def allowed_pairs(world, n, layout="contiguous", causal=True):
    """(world,) number of (query, key) pairs each rank computes."""
    out = []
    for r in range(world):
        pos_q = positions(r, world, n, layout)
        total = 0
        for s in range(world):
            pos_k = positions(s, world, n, layout)
            total += int(_causal(pos_q, pos_k).sum() if causal
                         else pos_q.size * pos_k.size)
        out.append(total)
    return np.array(out)


def ring_attention(q, k, v, *, causal=False, scale=None,
                   layout="contiguous", group=None):
    """This rank's rows of exact attention over the whole ring's sequence.

    q (..., n, d), k (..., n, d), v (..., n, d_v): this rank's slice, as
    `split` lays it out; every rank passes the same shapes. Returns this
    rank's output rows (..., n, d_v), differentiable in q, k and v.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.device.type != "cpu":
            raise TypeError(
                f"{name}: expected a CPU torch.Tensor (gloo), got "
                f"{type(x).__name__}" + (f" on {x.device}" if isinstance(
                    x, torch.Tensor) else ""))
    if not dist.is_initialized():
        raise RuntimeError("ring_attention needs torch.distributed: call "
                           "dist.init_process_group first")
    _check_layout(layout)
    return _Ring.apply(q, k, v, bool(causal), scale, layout, group)


class _Ring(torch.autograd.Function):
    """Forward and backward of ring attention (autograd)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, layout, group):
        ring = _Peers(group, q.shape[-2], layout)
        k_cur, v_cur = k.detach().contiguous(), v.detach().contiguous()
        qn = q.detach().numpy()
        o = lse = None
        for step in range(ring.world):
            if step < ring.world - 1:  # next slice travels while we work
                pending = ring.pass_on(k_cur, v_cur)
            mask = ring.mask(step, causal)
            if mask is None or mask.any():  # else: no pair to compute
                o_s, lse_s = tiled.attention(
                    qn, k_cur.numpy(), v_cur.numpy(), scale=scale,
                    mask=mask, return_lse=True)
                if o is None:
                    o, lse = o_s, lse_s
                else:
                    o, lse = merge.combine(np.stack([o, o_s]),
                                           np.stack([lse, lse_s]))
            if step < ring.world - 1:
                k_cur, v_cur = ring.receive(pending)
        if o is None:  # this rank's queries met no allowed key at all
            o = np.zeros((*q.shape[:-1], v.shape[-1]), qn.dtype)
            lse = np.full(q.shape[:-1], -np.inf, qn.dtype)
        o, lse = torch.from_numpy(o), torch.from_numpy(lse)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.options = (causal, scale, layout, group)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        causal, scale, layout, group = ctx.options
        ring = _Peers(group, q.shape[-2], layout)
        qn, on, lsen = q.numpy(), o.numpy(), lse.numpy()
        don = do.contiguous().numpy()
        dq = np.zeros_like(qn)
        k_cur, v_cur = k.detach().contiguous(), v.detach().contiguous()
        dk_cur, dv_cur = torch.zeros_like(k_cur), torch.zeros_like(v_cur)
        for step in range(ring.world):
            mask = ring.mask(step, causal)
            if mask is None or mask.any():
                # the global o and lse make each slice's share exact
                g_q, g_k, g_v = tiled.attention_backward(
                    qn, k_cur.numpy(), v_cur.numpy(), on, lsen, don,
                    scale=scale, mask=mask)
                dq += g_q
                dk_cur += torch.from_numpy(g_k)
                dv_cur += torch.from_numpy(g_v)
            # K/V and their gradients move on; the last hop takes the
            # gradients home to the slice's own rank
            tensors = ((k_cur, v_cur, dk_cur, dv_cur)
                       if step < ring.world - 1 else (dk_cur, dv_cur))
            got = ring.receive(ring.pass_on(*tensors))
            if step < ring.world - 1:
                k_cur, v_cur, dk_cur, dv_cur = got
            else:
                dk_cur, dv_cur = got
        return torch.from_numpy(dq), dk_cur, dv_cur, None, None, None, None


class _Peers:
    """One rank's view of the ring: neighbours, positions, traffic."""

    sent_bytes = 0  # every byte this process has sent round a ring

    def __init__(self, group, n_local, layout):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        n = n_local * self.world
        self.layout = layout
        self.pos = [positions(r, self.world, n, layout)
                    for r in range(self.world)]
        self.next = self._global((self.rank + 1) % self.world)
        self.prev = self._global((self.rank - 1) % self.world)

    def _global(self, rank):
        """The global rank of a rank of this ring's group."""
        return rank if self.group is None else dist.get_global_rank(
            self.group, rank)

    def mask(self, step, causal):
        """Allowed (query, key) pairs against the slice held at `step`."""
        if not causal:
            return None
        owner = (self.rank - step) % self.world
        return _causal(self.pos[self.rank], self.pos[owner])

    def pass_on(self, *tensors):
        """Send tensors to the next rank, receive their like from the
        previous one; returns the pending (requests, buffers)."""
        buffers = [torch.empty_like(t) for t in tensors]
        ops = ([dist.P2POp(dist.isend, t, self.next, self.group)
                for t in tensors]
               + [dist.P2POp(dist.irecv, b, self.prev, self.group)
                  for b in buffers])
        _Peers.sent_bytes += sum(t.numel() * t.element_size()
                                 for t in tensors)
        return dist.batch_isend_irecv(ops), buffers

    @staticmethod
    def receive(pending):
        """Wait for a pass_on to complete; the received buffers."""
        requests, buffers = pending
        for r in requests:
            r.wait()
        return buffers


def demo(world=4, n=256, d=32, causal=True, layout="zigzag", seed=0):
    """Run ring attention forward and backward in `world` gloo processes
    on this machine; per rank a dict of the max error of o, dq, dk, dv
    against the float64 reference, the bytes sent, pairs computed and
    seconds taken (batch 1, 4 heads, float64)."""
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_demo_rank, nprocs=world, args=(
        world, port, n, d, causal, layout, seed, results))
    out = [results.get() for _ in range(world)]
    return sorted(out, key=lambda r: r["rank"])


def _demo_rank(rank, world, port, n, d, causal, layout, seed, results):
    """One process of `demo`."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    try:
        rng = np.random.default_rng(seed)
        q, k, v, do = (rng.standard_normal((1, 4, n, d)) for _ in range(4))
        o64, lse64 = tiled.attention(q, k, v, causal=causal,
                                     return_lse=True)
        want = [reference.attention(q, k, v, causal=causal),
                *tiled.attention_backward(q, k, v, o64, lse64, do,
                                          causal=causal)]
        mine = [torch.tensor(split(x, world, layout)[rank],
                             requires_grad=True) for x in (q, k, v)]
        before = sent_bytes()
        t0 = time.perf_counter()
        out = ring_attention(*mine, causal=causal, layout=layout)
        forward_bytes = sent_bytes() - before
        got = torch.autograd.grad(out, mine, torch.tensor(
            split(do, world, layout)[rank]))
        seconds = time.perf_counter() - t0
        errors = {name: float(np.max(np.abs(
            g.detach().numpy() - split(w, world, layout)[rank])))
            for name, g, w in zip(("o", "dq", "dk", "dv"), (out, *got),
                                  want)}
        results.put(dict(rank=rank, errors=errors,
                         forward_bytes=forward_bytes,
                         backward_bytes=sent_bytes() - before
                         - forward_bytes,
                         pairs=int(allowed_pairs(world, n, layout,
                                                 causal)[rank]),
                         seconds=seconds))
    finally:
        dist.destroy_process_group()


def sent_bytes():
    """Bytes this process has sent round rings so far (all calls)."""
    return _Peers.sent_bytes


def _causal(pos_q, pos_k):
    """(n_q, n_k) bool: the key's position is not after the query's."""
    return pos_k[None, :] <= pos_q[:, None]


def _check_layout(layout):
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got "
                         f"{layout!r}")
