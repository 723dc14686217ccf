"""flashlab attention as a torch op a model can call, eager or compiled.

The forward and the backward are two opaque ops (torch.library
custom_op, flashlab::attention and flashlab::attention_backward) with
fake implementations for shapes and an autograd formula, so
torch.compile(model, fullgraph=True) keeps them whole in its graph and
CUDA graphs capture them. CPU tensors (float32, float64) run the numba
kernels of flashlab.cpu (the tiled numpy path where they cannot, see
`_cpu_backend`), CUDA tensors the kernels of flashlab.gpu in place, launched
through the driver on torch's current stream: float32 on v6 (3xTF32),
bf16 and float16 on the tensor cores (v8 and backward v9, v8 or v7 on
Hopper, v5 and backward_v5 elsewhere). The forward saves q, k, v, o and the row
log-sum-exp only; the backward recomputes score tiles from them, so no
(Nq, Nk) tensor lives between the two passes. The backward is itself not
differentiable: asking for a second derivative raises instead of
returning a wrong one. See chapters 8 and 9.
"""

import json
from typing import Optional

import numpy as np
import torch

from flashlab import masks, tiled, varlen
from flashlab._validate import check_flag

_DTYPES = {"cpu": (torch.float32, torch.float64),
           "cuda": (torch.float32, torch.bfloat16, torch.float16)}


_SECOND_ORDER = (
    "flashlab.torch.attention is differentiable once: its backward has no "
    "derivative of its own, so create_graph=True (double backward, "
    "gradient penalties) is refused rather than answered without the "
    "second-order term")


@torch.library.custom_op("flashlab::attention", mutates_args=())
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 mask: Optional[torch.Tensor],
                 kv_lengths: Optional[torch.Tensor],
                 seed: Optional[torch.Tensor],
                 options: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward as one opaque op: (o, lse). options: `_encode`'s JSON
    of the keywords that are not tensors; seed a CPU int64 scalar."""
    return _forward(q, k, v, mask, kv_lengths, seed, options)


def _forward(q, k, v, mask, kv_lengths, seed, options, with_lse=True):
    """(o, lse) on q's device: flashlab.gpu for CUDA, tiled for CPU; lse
    may be None where with_lse is False."""
    key = None
    if mask is None and kv_lengths is None:
        # a call like one before runs its GPU plan without the checks
        key = _plan_key(options, q, k, v)
        ready = _plans.get(key)
        if ready is not None:
            plan, fixed_seed = ready
            out = plan.run(q, k, v, fixed_seed if seed is None
                           else int(seed), with_lse)
            if out is not None:  # else unaligned: the checked path
                return out
    kw = _decode(options, mask, kv_lengths, seed)
    splits = kw.pop("num_splits")
    del kw["deterministic"]  # the backward's choice
    if q.is_cuda:
        from flashlab import gpu

        out = gpu.attention(q, k, v, return_lse=True, num_splits=splits,
                            **kw)
        plan = None if key is None else gpu.host.forward_plan(
            q, k, v, num_splits=splits, **kw)
        if plan is not None:
            seed_of = (_decoded.get(options) or json.loads(options))["seed"]
            _remember(_plans, key, (plan, seed_of), gpu.host.PLANS)
        return out
    o, lse = _cpu_backend(q, k, v, kw, splits).attention(
        *_numpy(q, k, v), return_lse=True, num_splits=splits, **kw)
    return torch.from_numpy(o), torch.from_numpy(lse)


def _plan_key(options, q, k, v):
    """What `_plans` knows a call by: everything a plan's checks read."""
    return (options, q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype,
            type(q), type(k), type(v), q.get_device(), k.get_device(),
            v.get_device())


def _cpu_backend(q, k, v, kw, num_splits=1):
    """flashlab.cpu (the numba kernels) for a CPU call they can run;
    flashlab.tiled, the numpy program, for the rest: the FA1 order and
    split-KV (the kernels run FA2's order in one pass), and k, v
    broadcasts the kernels do not index (`cpu.unsupported`)."""
    from flashlab import cpu  # numba loads with the first CPU call

    why = cpu.unsupported(q.shape, k.shape, v.shape, mask=kw["mask"],
                          order=kw["order"], num_splits=num_splits)
    return tiled if why else cpu


@attention_op.register_fake
def _attention_fake(q, k, v, mask, kv_lengths, seed, options):
    lse_dtype = torch.float32 if q.is_cuda else q.dtype
    return (q.new_empty((*q.shape[:-1], v.shape[-1])),
            q.new_empty(q.shape[:-1], dtype=lse_dtype))


@torch.library.custom_op("flashlab::attention_backward", mutates_args=())
def attention_backward_op(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        o: torch.Tensor, lse: torch.Tensor, do: torch.Tensor,
        mask: Optional[torch.Tensor], kv_lengths: Optional[torch.Tensor],
        seed: Optional[torch.Tensor],
        options: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward as one opaque op: (dq, dk, dv) in q, k, v's dtypes,
    recomputing score tiles from q, k, v, o and lse."""
    return _backward_of(q, k, v, o, lse, do, mask, kv_lengths, seed,
                        options)


def _backward_of(q, k, v, o, lse, do, mask, kv_lengths, seed, options):
    """(dq, dk, dv) on q's device, each in its input's dtype."""
    key = None
    if mask is None and kv_lengths is None and q.is_cuda:
        # a call like one before runs its GPU plan without the checks,
        # as `_forward` does
        key = (_plan_key(options, q, k, v), o.shape, lse.shape, do.shape,
               o.dtype, lse.dtype, do.dtype, type(o), type(lse), type(do),
               o.get_device(), lse.get_device(), do.get_device())
        ready = _backward_plans.get(key)
        if ready is not None:
            plan, fixed_seed = ready
            grads = plan.run(q, k, v, o, lse, do, fixed_seed if seed is None
                             else int(seed))
            if grads is not None:  # else unaligned: the checked path
                return _in_dtypes(grads, (q, k, v))
    kw = _decode(options, mask, kv_lengths, seed)
    del kw["num_splits"]  # one backward loop follows any split forward
    deterministic = kw.pop("deterministic")
    if q.is_cuda:
        from flashlab import gpu

        saved = (q, k, v, o, lse, do.contiguous())
        if q.dtype != torch.float32 and not all(
                size in gpu.backward_v5.HEAD_DIMS
                for size in (q.shape[-1], v.shape[-1])):
            # no tensor-core backward at these head dims: the float32
            # kernels on widened copies
            saved = [x.float() for x in saved]
        grads = gpu.attention_backward(*saved, deterministic=deterministic,
                                       **kw)
        plan = None if key is None else gpu.host.backward_plan(
            *saved, deterministic=deterministic, **kw)
        if plan is not None:
            seed_of = (_decoded.get(options) or json.loads(options))["seed"]
            _remember(_backward_plans, key, (plan, seed_of), gpu.host.PLANS)
        return _in_dtypes(grads, (q, k, v))
    # the backward has one loop order for both forward orders
    backend = _cpu_backend(q, k, v, dict(kw, order="fa2"))
    grads = backend.attention_backward(*_numpy(q, k, v, o, lse, do), **kw)
    return tuple(torch.from_numpy(g) for g in grads)


def _in_dtypes(grads, inputs):
    """Each gradient in its input's dtype."""
    return tuple(g if g.dtype == x.dtype else g.to(x.dtype)
                 for g, x in zip(grads, inputs))


@attention_backward_op.register_fake
def _attention_backward_fake(q, k, v, o, lse, do, mask, kv_lengths, seed,
                             options):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, mask, kv_lengths, seed, options = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.rest = (mask, kv_lengths, seed, options)
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)  # lse's gradient is never read


def _backward(ctx, do, _dlse, backward=None):
    """Gradients of q, k, v (None for the rest) by the backward op, or
    by `backward` (the same computation, called directly)."""
    if torch.is_grad_enabled():  # create_graph=True: a 2nd derivative
        raise RuntimeError(_SECOND_ORDER)
    if do is None:  # o took no part in the loss
        return (None,) * 7
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = (backward or attention_backward_op)(q, k, v, o, lse, do,
                                                     *ctx.rest)
    return dq, dk, dv, None, None, None, None


def _no_second_order(ctx, *grads):
    raise RuntimeError(_SECOND_ORDER)


def _no_vmap(info, in_dims, *args):
    raise NotImplementedError(
        "flashlab.torch.attention: torch.func.vmap is not supported (the "
        "kernels take a batch of their own: pass the batch as a leading "
        "dim instead)")


class _Eager(torch.autograd.Function):
    """The same forward and backward for eager calls, which skip the
    custom op's dispatch (its own host time is several times a launch);
    torch.compile and torch.func see the ops instead."""

    @staticmethod
    def forward(ctx, q, k, v, mask, kv_lengths, seed, options):
        o, lse = _forward(q, k, v, mask, kv_lengths, seed, options)
        _setup_context(ctx, (q, k, v, mask, kv_lengths, seed, options),
                       (o, lse))
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        return _backward(ctx, do, _dlse, _backward_of)


def _call(*args, with_lse=True):
    """attention_op inside torch.compile and torch.func, _Eager outside,
    and the forward alone where no gradient is wanted (inference, where
    lse may be None unless with_lse)."""
    if torch.compiler.is_compiling() or \
            torch._C._are_functorch_transforms_active():
        return attention_op(*args)
    if torch.is_grad_enabled() and (args[0].requires_grad
                                    or args[1].requires_grad
                                    or args[2].requires_grad):
        return _Eager.apply(*args)
    return _forward(*args, with_lse=with_lse)


attention_op.register_autograd(_backward, setup_context=_setup_context)
attention_backward_op.register_autograd(
    _no_second_order, setup_context=lambda ctx, inputs, output: None)
attention_op.register_vmap(_no_vmap)
attention_backward_op.register_vmap(_no_vmap)

# the JSON of each options tuple, and back: a call of a shape seen before
# pays two dict look-ups instead of a json round trip; _seen maps the
# keywords' values, in attention's order, to the JSON without the dict
_encoded = {}
_decoded = {}
_seen = {}
_plans = {}  # (options, q, k, v's shapes, dtypes, types, devices) ->
# (the GPU's forward plan, the options' seed): `_forward`
_backward_plans = {}  # that key and o, lse, dO's -> (the GPU's backward
# plan, the options' seed): `_backward_of`
CACHED = 4096  # entries each; a new seed a call (dropout) must not grow
# them without end


def forget_plans():
    """Drop every plan kept here and in flashlab.gpu.host, so that the
    next calls make theirs again (after a setting the plans read, such
    as host.SPLIT_TAIL, has changed)."""
    from flashlab import gpu  # numba, on first use only

    _plans.clear()
    _backward_plans.clear()
    gpu.host._plans.clear()


def _remember(cache, key, value, limit=None):
    """cache[key] = value, emptying a cache that holds `limit` (CACHED
    unless given) first."""
    if len(cache) >= (CACHED if limit is None else limit):
        cache.clear()
    cache[key] = value


# torch.compile calls this at trace time and keeps the text as a constant
@torch._dynamo.assume_constant_result
def _encode(options):
    """options (keywords that are not tensors) as the op's JSON string."""
    key = (tuple(options), tuple(map(_hashable, options.values())),
           tuple(map(type, options.values())))  # 1 is not True
    try:
        text = _encoded.get(key)
    except TypeError:  # an unhashable value: the checks below name it
        text, key = None, None
    if text is None:
        for name, x in options.items():
            try:
                json.dumps(x, default=_plain)
            except (TypeError, ValueError):
                raise TypeError(
                    f"{name}: expected a number, string, None or a list of"
                    f" them, got {type(x).__name__} {x!r}") from None
        text = json.dumps(dict(options), sort_keys=True, default=_plain)
        if key is not None:
            _remember(_encoded, key, text)
        _remember(_decoded, text, json.loads(text))
    return text


def _plain(x):
    """A numpy scalar as the Python number JSON takes."""
    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(f"not a JSON value: {type(x).__name__}")


def _hashable(x):
    return tuple(_hashable(e) for e in x) if isinstance(x, list) else x


def _decode(options, mask, kv_lengths, seed):
    """The keywords of tiled.attention from the op's arguments."""
    kw = dict(_decoded.get(options) or json.loads(options))
    if kw["window"] is not None:
        kw["window"] = tuple(kw["window"])
    kw["mask"] = None if mask is None else _mask_numpy(mask)
    kw["kv_lengths"] = (None if kv_lengths is None
                        else _host_numpy("kv_lengths", kv_lengths))
    if seed is not None:
        kw["seed"] = int(seed)
    return kw


def attention(query, key, value, attn_mask=None, dropout_p=0.0,
              is_causal=False, scale=None, enable_gqa=False, *,
              causal=None, mask=None, window=None, align=None,
              kv_lengths=None, block_q=None, block_k=None, seed=None,
              return_lse=False, order="fa2", num_splits=1,
              deterministic=True):
    """Differentiable attention with the signature of torch's
    scaled_dot_product_attention: query (..., L, E), key (..., S, E),
    value (..., S, Ev) -> (..., L, Ev).

    As SDPA: attn_mask boolean (True = may attend) or float (added to the
    scores), broadcast to (..., L, S); is_causal top-left; scale default
    1/sqrt(E); enable_gqa lets key and value have fewer heads (dim -3)
    than query, each shared by H_q / H_kv query heads (without copying
    them); leading dims broadcast. Keyword-only extras as
    `tiled.attention`: causal (True, "top_left", "bottom_right"), mask
    (a second name for attn_mask), window, align, kv_lengths, blocks,
    seed, order, num_splits; with return_lse also the row log-sum-exp
    (..., L), which carries no gradient. deterministic=False lets the
    backward add dQ by atomics where a kernel does (on Hopper backward
    v8's fused kernel, whose additions TMA makes; dQ's last bits vary run
    to run); the default gives the same bits every run (on Hopper
    backward v9, that kernel with the additions in a fixed order, from
    2048 keys on: gpu.registry.ordered_pays; elsewhere v8's two
    kernels).
    With dropout_p > 0 and no seed, a seed is drawn from torch's
    generator, so torch.manual_seed makes runs repeatable. Rows that no
    key may attend give 0 (and lse -inf) where SDPA gives NaN. See
    chapters 7 and 8.
    """
    return_lse = check_flag("return_lse", return_lse)
    deterministic = check_flag("deterministic", deterministic)
    is_causal = check_flag("is_causal", is_causal)  # as SDPA: a bool
    q, k, v = query, key, value
    # dynamo traces the plain checks and the JSON, not the fast paths
    compiling = torch.compiler.is_compiling()
    if compiling or not _plain_inputs(q, k, v):  # named checks
        for name, x in (("query", q), ("key", k), ("value", v)):
            _check_tensor(name, x, q)
    if attn_mask is not None and mask is not None:
        raise ValueError("mask: given with attn_mask, which is the same "
                         "thing; pass one")
    mask = attn_mask if attn_mask is not None else mask
    if is_causal:
        if causal is not None:
            raise ValueError("causal: given with is_causal=True; pass one")
        if mask is not None:
            raise ValueError("attn_mask: expected None with is_causal="
                             "True (as torch's SDPA), got a mask")
        causal = True
    if isinstance(mask, torch.Tensor):
        if mask.requires_grad:
            raise ValueError("attn_mask: expected a mask that needs no "
                             "gradient; flashlab computes none for it")
        _check_mask_dtype(mask, q)
        _host_numpy("attn_mask", mask.reshape(-1)[:0])  # device check
    elif mask is not None:  # numpy or nested lists, as tiled takes
        host = np.asarray(mask)
        if host.dtype != np.bool_ and host.dtype.kind != "f":
            raise TypeError(f"attn_mask: expected a boolean or float "
                            f"mask, got dtype {host.dtype}")
        mask = torch.as_tensor(host)
    if kv_lengths is not None:
        if isinstance(kv_lengths, torch.Tensor):  # device check; a 0-d
            # tensor (one length for all) has no slice of its own
            _host_numpy("kv_lengths", kv_lengths.reshape(-1)[:0])
        kv_lengths = torch.as_tensor(kv_lengths)
    if window is not None:  # named here: the options travel as JSON
        window = masks.check_window(window)
    q, k, v = _broadcast(q, k, v, check_flag("enable_gqa", enable_gqa))
    seed_t = None
    if dropout_p and seed is None:  # torch's generator: manual_seed
        # repeats runs; a CPU tensor, so drawing it never syncs a GPU
        seed_t = torch.randint(0, 2**62, (), dtype=torch.int64)
    causal = False if causal is None else causal
    values = (block_q, block_k, scale, causal, window, align, dropout_p,
              order, num_splits, seed, deterministic)
    options = key = None
    if not compiling:
        # with the types: 1 and True (num_splits, causal) are equal keys
        key = (values, tuple(map(type, values)))
        try:
            options = _seen.get(key)
        except TypeError:  # a list (window): through the dict below
            key = None
    if options is None:
        options = _encode(dict(
            block_q=block_q, block_k=block_k, scale=scale, causal=causal,
            window=window, align=align, dropout_p=dropout_p, order=order,
            num_splits=num_splits, seed=seed, deterministic=deterministic))
        if key is not None:
            _remember(_seen, key, options)
    o, lse = _call(q, k, v, mask, kv_lengths, seed_t, options,
                   with_lse=return_lse)
    return (o, lse) if return_lse else o


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, *, scale=None,
                     causal=False, window=None, align=None, dropout_p=0.0,
                     seed=None, block_q=None, block_k=None,
                     deterministic=True):
    """Differentiable attention over a packed batch (`flashlab.varlen`):
    q (total_q, H, d), k (total_k, H_kv, d), v (total_k, H_kv, d_v), each
    sequence on its own lengths; -> (total_q, H, d_v). deterministic as
    `attention`'s."""
    deterministic = check_flag("deterministic", deterministic)
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, x, q)
        if x.dim() != 3:
            raise ValueError(f"{name}: expected (total, heads, d), got "
                             f"shape {tuple(x.shape)}")
    cu = [_host_numpy(name, c) if isinstance(c, torch.Tensor) else c
          for name, c in (("cu_seqlens_q", cu_seqlens_q),
                          ("cu_seqlens_k", cu_seqlens_k))]
    spans = varlen.check_packed(q, k, v, *cu, {})
    if dropout_p and seed is None:
        seed = int(torch.randint(0, 2**62, ()).item())
    options = dict(scale=scale, causal=causal, window=window, align=align,
                   dropout_p=dropout_p, seed=seed, block_q=block_q,
                   block_k=block_k)
    outs = []
    for b, (rq, rk) in enumerate(spans):
        if rk.stop == rk.start:  # no keys: its rows are 0
            outs.append(_zeros_of(q, k, v, (rq.stop - rq.start, q.shape[1],
                                            v.shape[2])))
            continue
        if rq.stop == rq.start:
            continue
        o_b = attention(*(x[r].transpose(0, 1) for x, r in (
            (q, rq), (k, rk), (v, rk))), enable_gqa=k.shape[1] !=
            q.shape[1], deterministic=deterministic,
            **varlen.sequence_options(options, b))
        outs.append(o_b.transpose(0, 1))
    return torch.cat(outs, 0) if outs else _zeros_of(
        q, k, v, (0, q.shape[1], v.shape[2]))


def _plain_inputs(q, k, v):
    """Whether q, k, v pass _check_tensor for certain, read fast: torch
    tensors of one CPU or CUDA device, dtypes it takes, >= 2 dims."""
    tensor = torch.Tensor
    if not (isinstance(q, tensor) and isinstance(k, tensor)
            and isinstance(v, tensor)):
        return False
    if q.is_cuda:
        if not (k.is_cuda and v.is_cuda
                and q.get_device() == k.get_device() == v.get_device()):
            return False
        dtypes = _DTYPES["cuda"]
    elif q.is_cpu and k.is_cpu and v.is_cpu:
        dtypes = _DTYPES["cpu"]
    else:
        return False
    return (q.dtype in dtypes and k.dtype in dtypes and v.dtype in dtypes
            and q.dim() >= 2 and k.dim() >= 2 and v.dim() >= 2)


def _check_tensor(name, x, q):
    """x: a torch tensor of a dtype flashlab takes, on q's device."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got "
                        f"{type(x).__name__}")
    if x.device.type not in _DTYPES:
        raise ValueError(f"{name}: expected a CPU or CUDA tensor, got "
                         f"one on {x.device} (no data to compute on)")
    if x.dtype not in _DTYPES[x.device.type]:
        raise TypeError(
            f"{name}: expected a dtype in {_DTYPES[x.device.type]} on "
            f"{x.device.type}, got {x.dtype}")
    if x.device != q.device:
        raise ValueError(f"{name}: expected device {q.device} like query, "
                         f"got {x.device}")
    if x.dim() < 2:
        raise ValueError(f"{name}: expected at least 2 dims (..., N, d), "
                         f"got shape {tuple(x.shape)}")


def _broadcast(q, k, v, enable_gqa):
    """q, k, v with SDPA's broadcasting of their leading dims, as views.

    Heads (dim -3) may differ under enable_gqa: k and v keep theirs
    (every backend reads K/V head h // g for query head h, no copy).
    Otherwise the leading dims broadcast as SDPA's do, aligned from the
    right (k and v may have fewer), and every backend takes k and v with
    q's leading dims: expand() only views them (the GPU's to_kernel
    copies), and autograd sums their gradients back to the caller's
    shapes.
    """
    if q.shape[:-2] == k.shape[:-2] == v.shape[:-2]:
        return q, k, v  # nothing to broadcast (the common case)
    grouped = (enable_gqa and q.dim() >= 3 and k.dim() >= 3
               and k.shape[-3] != q.shape[-3])
    if grouped:
        for name, x in (("key", k), ("value", v)):
            if x.dim() < 3 or x.shape[-3] == 0 or (
                    q.shape[-3] % x.shape[-3]) or (
                    x.shape[-3] != k.shape[-3]):
                raise ValueError(
                    f"{name}: expected a number of heads (dim -3) dividing"
                    f" query's {q.shape[-3]} (enable_gqa), got shape "
                    f"{tuple(x.shape)}")
        lead = torch.broadcast_shapes(*(x.shape[:-3] for x in (q, k, v)))
        q = q.expand(*lead, *q.shape[-3:])
        k, v = (x.expand(*lead, *x.shape[-3:]) for x in (k, v))
        return q, k, v
    try:
        lead = torch.broadcast_shapes(*(x.shape[:-2] for x in (q, k, v)))
    except RuntimeError:
        raise ValueError(
            f"key: expected leading dims that broadcast with query's "
            f"{tuple(q.shape[:-2])} (or fewer heads with enable_gqa=True),"
            f" got {tuple(k.shape[:-2])} (key) and {tuple(v.shape[:-2])} "
            f"(value)") from None
    q, k, v = (x.expand(*lead, *x.shape[-2:]) for x in (q, k, v))
    return q, k, v


def saved_shapes(fn, *args):
    """Shapes of every tensor autograd saves for the backward of fn(*args)."""
    shapes = []

    def keep(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        fn(*args)
    return shapes


def _numpy(*tensors):
    """Detached CPU numpy views of tensors (no copies for CPU tensors)."""
    return [np.asarray(t.detach().cpu().numpy()) for t in tensors]


def _host_numpy(name, x):
    """A CPU numpy copy of a small tensor argument (mask, lengths)."""
    if x.device.type not in _DTYPES:
        raise ValueError(f"{name}: expected a CPU or CUDA tensor, got one "
                         f"on {x.device} (no data to read)")
    return x.detach().cpu().numpy()


def _check_mask_dtype(mask, q):
    """attn_mask: bool, or a float dtype SDPA takes with q's (float32 or
    q's own)."""
    if mask.is_floating_point() and mask.dtype not in (torch.float32,
                                                       q.dtype):
        raise TypeError(f"attn_mask: expected a bool mask or a float one "
                        f"of dtype float32 or query's {q.dtype} (as "
                        f"SDPA), got {mask.dtype}")


def _mask_numpy(mask):
    """attn_mask as numpy; 16-bit values widen to float32 exactly."""
    if mask.dtype in (torch.bfloat16, torch.float16):
        mask = mask.float()  # numpy has no bfloat16
    return _host_numpy("attn_mask", mask)


def _zeros_of(q, k, v, shape):
    """Zeros of q's dtype in `shape` that backpropagate zero gradients to
    q, k and v (rows with no key): sums over no elements are exactly 0,
    whatever NaN or inf q, k and v hold."""
    zero = sum(x[:0].sum() for x in (q, k, v))
    return q.new_zeros(shape) + zero
