"""Ring attention: exact attention over a sequence split across processes.

Each rank of a torch.distributed group holds one slice of the sequence:
its rows of q, k and v. The K/V slices travel round the ring, one hop per
step, sent while the rank computes on the slice it holds; each rank turns
every slice that reaches it into a partial (out, m, l) for its own query
rows (the rows' max and sum, exact where m + log l would round log l
away) and folds it in with `merge.combine`, the same merge as the tiles
of chapter 4 and the splits of `tiled.forward_split`. After world - 1
hops every query has met every key. The backward pass is exact too: each
piece's P comes from the whole rows' (m, l); dK and dV of a slice travel
round the ring with it, every rank adding what its queries contribute,
and a last hop brings them home.

Layouts: "contiguous" gives rank r the r-th slice of the sequence; under
a causal mask rank 0 then has almost nothing to do and the last rank
everything. "zigzag" cuts the sequence into 2 world chunks and gives rank
r chunks r and 2 world - 1 - r, which balances the causal work exactly.
`split` lays a sequence out, `join` puts it back. Runs on gloo with CPU
tensors and on NCCL with CUDA tensors; see chapter 11.
"""

import numbers
import os
import socket
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flashlab import merge, reference, tiled
from flashlab._validate import check_count

LAYOUTS = ("contiguous", "zigzag")


def positions(rank, world, n, layout="contiguous"):
    """Global indices (n // world,) of the sequence rows rank r holds."""
    _check_layout(layout)
    world = check_count("world", world)
    if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) \
            or not 0 <= rank < world:
        raise ValueError(f"rank: expected an integer in [0, {world}), got "
                         f"{rank!r}")
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
        raise ValueError(f"n: expected an integer >= 0, got {n!r}")
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
    if len(np.shape(x)) < 2:
        raise ValueError(f"x: expected (..., N, d), got shape "
                         f"{tuple(np.shape(x))}")
    world = check_count("world", world)
    return [x[..., positions(r, world, x.shape[-2], layout), :]
            for r in range(world)]


def join(parts, layout="contiguous"):
    """The full sequence from its per-rank slices (the inverse of split)."""
    world = len(parts)
    if world == 0:
        raise ValueError("parts: expected one slice per rank, got none")
    rows = {p.shape[-2] for p in parts}
    if len(rows) != 1:  # split gives every rank as many rows
        raise ValueError(f"parts: expected slices of equal length (dim "
                         f"-2), got {[p.shape[-2] for p in parts]}")
    n = world * rows.pop()
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

    q (..., n, d), k (..., n_k, d), v (..., n_k, d_v): this rank's slice,
    as `split` lays it out; every rank passes the same shapes and dtypes.
    n_k may differ from n without a causal mask (each rank holds a slice
    of a longer or shorter key sequence); under one, the positions pair
    queries with keys, so n_k = n. CPU tensors (float32, float64) need a
    gloo group and run `flashlab.tiled`; CUDA tensors (float32, bfloat16,
    float16) need NCCL and run `flashlab.gpu`. Returns this rank's output
    rows (..., n, d_v), differentiable in q, k and v.

    The arguments of every rank are gathered and checked before any K/V
    moves, so a rank that holds other shapes or dtypes gets the same
    error on every rank rather than a collective that hangs or aborts.
    Over NCCL that gather waits for the GPU (all_gather_object copies
    to the host), once a call; a ring of one has no peers to ask.
    """
    mine = _describe(q, k, v, causal, scale, layout)
    if not dist.is_initialized():
        _check_ring([mine])  # bad input first: it needs no peers
        raise RuntimeError("ring_attention needs torch.distributed: call "
                           "dist.init_process_group first")
    everyone = [mine]
    if dist.get_world_size(group) > 1:
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
    _check_ring(everyone, dist.get_backend(group))
    return _Ring.apply(q, k, v, bool(causal), scale, layout, group)


def _describe(q, k, v, causal, scale, layout):
    """What every rank must agree on, as plain values to gather."""
    def tensor(x):
        if not isinstance(x, torch.Tensor):
            return dict(type=type(x).__name__)
        return dict(type="Tensor", device=str(x.device),
                    dtype=x.dtype, shape=tuple(x.shape))

    return dict(q=tensor(q), k=tensor(k), v=tensor(v), causal=bool(
        causal), scale=scale, layout=layout)


def _check_ring(ranks, backend=None):
    """Raise the first problem in the gathered arguments of all ranks,
    in rank order: every rank runs this on the same list, so every rank
    raises the same error."""
    where = (lambda r: f" on rank {r}") if len(ranks) > 1 else (
        lambda r: "")
    for r, a in enumerate(ranks):
        q = a["q"]
        for name in "qkv":
            x = a[name]
            if x["type"] != "Tensor" or x["device"] != q.get("device"):
                raise TypeError(
                    f"{name}: expected a torch.Tensor on q's device, got "
                    f"{x['type']}" + (f" on {x['device']}" if "device" in x
                                      else "") + where(r))
        local = _LOCAL.get(q["device"].split(":")[0])
        if local is None or q["dtype"] not in local.dtypes:
            raise TypeError(
                f"q: expected a CPU tensor of {_CPU.dtypes} or a CUDA "
                f"tensor of {_Cuda.dtypes}, got {q['dtype']} on "
                f"{q['device']}{where(r)}")
        if backend is not None and backend != local.backend:
            raise ValueError(
                f"group: expected a {local.backend} process group for "
                f"{q['device']} tensors, got {backend}")
        _check_layout(a["layout"])
        _check_slices(a, len(ranks), where(r))
    for name in ("q", "k", "v", "causal", "scale", "layout"):
        values = [a[name] for a in ranks]
        same = [_agreed(x) for x in values]
        if any(x != same[0] for x in same):
            raise ValueError(
                f"{name}: expected the same on every rank of the ring, "
                f"got " + ", ".join(f"{_shown(x)} on rank {r}" for r, x in
                                    enumerate(values)))


def _check_slices(a, world, where):
    """One rank's q, k and v fit together as slices of the ring."""
    q, k, v = (a[n]["shape"] for n in "qkv")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if len(x) < 2:
            raise ValueError(f"{name}: expected (..., n, d), got shape "
                             f"{x}{where}")
    for name, x in (("k", k), ("v", v)):
        if a[name]["dtype"] != a["q"]["dtype"]:
            raise TypeError(f"{name}: expected q's dtype {a['q']['dtype']}"
                            f", got {a[name]['dtype']}{where}")
        if x[:-2] != q[:-2]:
            raise ValueError(f"{name}: expected q's leading dims {q[:-2]},"
                             f" got shape {x}{where}")
    if k[-1] != q[-1] or v[-2] != k[-2]:
        raise ValueError(f"k, v: expected k (..., n_k, {q[-1]}) and v "
                         f"(..., n_k, d_v), got {k} and {v}{where}")
    if a["causal"] and k[-2] != q[-2]:
        raise ValueError(
            f"k: expected {q[-2]} rows like q under a causal mask (each "
            f"key's position is its query's), got shape {k}{where}")
    chunks = world if a["layout"] == "contiguous" else 2 * world
    if q[-2] * world % chunks:
        raise ValueError(f"q: expected a whole number of {a['layout']} "
                         f"chunks per rank, got {q[-2]} rows over {world} "
                         f"ranks{where}")


def _agreed(x):
    """The part of a gathered value every rank must share: a tensor's
    device type, not its index (each rank has its own GPU)."""
    if isinstance(x, dict) and "device" in x:
        return {**x, "device": x["device"].split(":")[0]}
    return x


def _shown(x):
    """A gathered value as an error message shows it."""
    if isinstance(x, dict):
        return (f"{x['dtype']} {x['shape']} on {x['device']}"
                if "shape" in x else x["type"])
    return repr(x)


class _Ring(torch.autograd.Function):
    """Forward and backward of ring attention (autograd)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, layout, group):
        ring = _Peers(group, q.shape[-2], layout)
        local = _LOCAL[q.device.type]
        k_cur, v_cur = k.detach().contiguous(), v.detach().contiguous()
        q = q.detach()
        # the merge identity: every row starts as "no key seen yet"; the
        # rows carry their max m and sum l, not m + log l, whose rounding
        # at large |m| would misweigh the pieces (merge.combine)
        o = torch.zeros((*q.shape[:-1], v.shape[-1]), dtype=local.wide(
            q.dtype), device=q.device)
        m = torch.full(q.shape[:-1], -torch.inf, dtype=o.dtype,
                       device=q.device)
        l = torch.zeros_like(m)
        for step in range(ring.world):
            if step < ring.world - 1:  # next slice travels while we work
                pending = ring.pass_on(k_cur, v_cur)
            for rows, cols, flag in ring.pieces(step, causal):
                piece = (q[..., rows, :], k_cur[..., cols, :],
                         v_cur[..., cols, :])
                o_s, lse_s = local.forward(*piece, scale=scale,
                                           causal=flag)
                m_s, l_s = local.statistics(*piece, lse_s, scale=scale,
                                            causal=flag)
                o[..., rows, :], m[..., rows], l[..., rows] = \
                    local.combine(*(torch.stack([x, y.to(o.dtype)]) for
                                    x, y in ((o[..., rows, :], o_s),
                                             (m[..., rows], m_s),
                                             (l[..., rows], l_s))))
            if step < ring.world - 1:
                k_cur, v_cur = ring.receive(pending)
        o = o.to(q.dtype)
        ctx.save_for_backward(q, k, v, o, m, l)
        ctx.options = (causal, scale, layout, group)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, m, l = ctx.saved_tensors
        causal, scale, layout, group = ctx.options
        ring = _Peers(group, q.shape[-2], layout)
        local = _LOCAL[q.device.type]
        wide = local.wide(q.dtype)  # gradients add up at this width
        # the kernels' inputs: 16-bit ones stay 16-bit where a tensor-core
        # backward takes them (its gradients, float32 or 16-bit, add up
        # at the wide width)
        runs = local.backward_dtype(q.dtype, q.shape[-1], v.shape[-1])
        q, o, do = (x.to(runs).contiguous() for x in (q, o, do))
        m, l = m.to(wide), l.to(wide)
        dq = torch.zeros_like(q, dtype=wide)
        # K/V travel at their own width, their gradients at the wide one
        k_cur, v_cur = k.detach().contiguous(), v.detach().contiguous()
        dk_cur, dv_cur = (torch.zeros_like(x, dtype=wide)
                          for x in (k_cur, v_cur))
        for step in range(ring.world):
            for rows, cols, flag in ring.pieces(step, causal):
                # the global o, m and l make each piece's share exact
                # (the piece's keys alone would give its own m and l)
                g_q, g_k, g_v = local.backward(
                    q[..., rows, :], k_cur[..., cols, :].to(runs),
                    v_cur[..., cols, :].to(runs), o[..., rows, :],
                    m[..., rows], do[..., rows, :], scale=scale,
                    causal=flag, l=l[..., rows])
                dq[..., rows, :] += g_q
                dk_cur[..., cols, :] += g_k
                dv_cur[..., cols, :] += g_v
            if ring.world == 1:  # the slice is home: no hop to make
                break
            # K/V and their gradients move on; the last hop takes the
            # gradients home to the slice's own rank
            tensors = ((k_cur, v_cur, dk_cur, dv_cur)
                       if step < ring.world - 1 else (dk_cur, dv_cur))
            got = ring.receive(ring.pass_on(*tensors))
            if step < ring.world - 1:
                k_cur, v_cur, dk_cur, dv_cur = got
            else:
                dk_cur, dv_cur = got
        return (dq.to(k.dtype), dk_cur.to(k.dtype), dv_cur.to(k.dtype),
                None, None, None, None)


def pieces(pos_q, pos_k, causal):
    """The work between query rows at pos_q and keys at pos_k.

    A list of (rows, cols, flag): slices of the two and the mask between
    them, flag False for every pair, True for the causal triangle of a
    run of positions against itself; pairs the causal mask forbids are
    left out. Both layouts cut the sequence into equal chunks, so a run
    of consecutive query positions and a run of key positions are either
    the same chunk or wholly ordered: these cases cover every pair
    without building an (n, n) mask.
    """
    whole = slice(0, len(pos_q)), slice(0, len(pos_k))
    if not causal:
        return [(*whole, False)]
    out = []
    for rows in _runs(pos_q):
        for cols in _runs(pos_k):
            q0, q1 = pos_q[rows.start], pos_q[rows.stop - 1]
            k0, k1 = pos_k[cols.start], pos_k[cols.stop - 1]
            if k1 <= q0:  # every key before every query
                out.append((rows, cols, False))
            elif (k0, k1) == (q0, q1):
                out.append((rows, cols, True))
            elif k0 <= q1:
                raise ValueError(
                    f"pos_k: runs must be equal to or apart from the query"
                    f" runs, got keys {k0}..{k1} against {q0}..{q1}")
    return out


def _runs(pos):
    """Slices of the maximal runs of consecutive values in pos."""
    breaks = np.flatnonzero(np.diff(pos) != 1) + 1
    edges = [0, *breaks.tolist(), len(pos)]
    return [slice(a, b) for a, b in zip(edges[:-1], edges[1:])]


class _CPU:
    """Local work on CPU tensors: the tiled numpy path, over gloo."""

    backend = "gloo"
    dtypes = (torch.float32, torch.float64)

    @staticmethod
    def wide(dtype):
        return dtype

    @staticmethod
    def backward_dtype(dtype, d, d_v):
        return dtype

    @staticmethod
    def forward(q, k, v, **options):
        o, lse = tiled.attention(*_numpy(q, k, v), return_lse=True,
                                 **options)
        return torch.from_numpy(o), torch.from_numpy(lse)

    @staticmethod
    def statistics(q, k, v, lse, **options):
        return (torch.from_numpy(x) for x in tiled.attention_statistics(
            *_numpy(q, k, v, lse), **options))

    @staticmethod
    def backward(*tensors, l, **options):
        return [torch.from_numpy(g) for g in tiled.attention_backward(
            *_numpy(*tensors), l=_numpy(l)[0], **options)]

    @staticmethod
    def combine(outs, ms, ls):
        return (torch.from_numpy(x) for x in merge.combine(
            *_numpy(outs, ms, ls)))


class _Cuda:
    """Local work on CUDA tensors: flashlab.gpu's kernels, over NCCL.

    Partial outputs stay float32 whatever the inputs: each rank merges
    world of them. The backward runs 16-bit inputs on the tensor-core
    kernels (float32 gradients, summed over the hops in float32), other
    inputs in float32.
    """

    backend = "nccl"
    dtypes = (torch.float32, torch.bfloat16, torch.float16)

    @staticmethod
    def wide(dtype):
        return torch.float32

    @staticmethod
    def backward_dtype(dtype, d, d_v):
        from flashlab.gpu import backward_v5

        tensor_cores = (dtype in (torch.bfloat16, torch.float16)
                        and d in backward_v5.HEAD_DIMS
                        and d_v in backward_v5.HEAD_DIMS)
        return dtype if tensor_cores else torch.float32

    @staticmethod
    def forward(q, k, v, **options):
        from flashlab import gpu

        with _on_gpu(q):
            return gpu.attention(q, k, v, return_lse=True, **options)

    @staticmethod
    def statistics(q, k, v, lse, **options):
        from flashlab import gpu

        with _on_gpu(q):
            return gpu.attention_statistics(q, k, v, lse, **options)

    @staticmethod
    def backward(*tensors, **options):
        from flashlab import gpu

        with _on_gpu(tensors[0]):
            return gpu.attention_backward(*tensors, **options)

    @staticmethod
    def combine(outs, ms, ls):
        from flashlab import gpu

        with _on_gpu(outs):
            return gpu.combine(outs, ms, ls)


_LOCAL = {"cpu": _CPU, "cuda": _Cuda}


def _on_gpu(x):
    """numba's context for the GPU that holds x (a process may see
    several; torch and numba must launch on the same one)."""
    from numba import cuda

    return cuda.gpus[x.device.index]


def _numpy(*tensors):
    """numpy views of CPU tensors (contiguous copies where sliced)."""
    return [t.detach().contiguous().numpy() for t in tensors]


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

    def pieces(self, step, causal):
        """`pieces` of this rank's queries and the slice held at `step`."""
        if not causal:  # every pair, whatever the slices' lengths
            return [(slice(None), slice(None), False)]
        owner = (self.rank - step) % self.world
        return pieces(self.pos[self.rank], self.pos[owner], causal)

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
