"""The host side of flashlab.gpu: `attention`, `attention_backward` and
`combine`, with the keywords of `tiled.attention`.

A call checks its arrays and options once, picks the version the device
runs (`registry.best_version`) and launches the kernels with the tiles
and threads of their traits (`traits`). `_Call` holds one call's
arrays through the adapter of their kind (`adapters`: torch, numpy or
numba device arrays); a tensor-core call on torch tensors of a shape
seen before runs a prepared plan (`_ForwardPlan`, `_BackwardPlan`) with
no checks and no numba dispatch. flashlab.gpu re-exports the public
names. See chapters 9 to 11.
"""

import functools
import math
import numbers
import operator
import sys

import numpy as np
from numba import config

from flashlab import kernel_args, masks, tiled
from flashlab import order as block_order  # `order` names a loop order
from flashlab._validate import check_flag
from flashlab.gpu import (
    _numpy_compat,  # noqa: F401  (before any kernel)
    adapters,
    backward,
    backward_v5,
    device,
    forward_v3,
    forward_v6,
    launch,
    registry,
    traits,
    warp,
)
from flashlab.gpu.adapters import (
    HALF_BITS,
    dtype_name,
    is_torch,
    stream_reader,
)
from flashlab.gpu.build import kernel

VERSIONS = registry.versions()
FORWARDS = {v: traits.module_of(registry.forwards(v)[0])  # the modules
            for v in VERSIONS}
FLOAT32_VERSIONS = tuple(  # take float32 inputs
    v for v in VERSIONS
    if any("float32" in k.dtypes for k in registry.forwards(v)))
HALF_VERSIONS = tuple(  # take bf16 or float16 inputs
    v for v in VERSIONS
    if any("bfloat16" in k.dtypes for k in registry.forwards(v)))
TENSOR_CORE_VERSIONS = tuple(  # inline PTX: a GPU, never the simulator
    v for v in VERSIONS
    if registry.forwards(v)[0].min_cc >= registry.MMA_CC)
SPLIT_VERSIONS = (3,)  # take num_splits > 1 (split-KV), or "auto"
PRECISIONS = tuple(forward_v6.PRECISIONS)  # v6's choices
DEFAULT_VERSION = 3  # float32 without tensor cores (bench_h200, simulator)
ORDERS = ("fa2",)  # the loop order the forward kernels run


def _poisoned():
    """Whether tests asked for outputs filled with NaN before a kernel
    runs (flashlab.gpu.POISON_OUTPUTS, which they set on the package)."""
    return sys.modules["flashlab.gpu"].POISON_OUTPUTS  # imported: we are


def tile_shape(version, d, d_v):
    """(Br, Bc) of forward `version` for head dims d, d_v."""
    if isinstance(version, bool) or version not in VERSIONS:
        raise ValueError(f"version: expected one of {VERSIONS}, got "
                         f"{version!r}")
    return traits.forward(version, d, d_v).tile


def attention(q, k, v, *, block_q=None, block_k=None, scale=None,
              causal=False, mask=None, window=None, kv_lengths=None,
              dropout_p=0.0, seed=None, return_lse=False, order="fa2",
              num_splits=1, version=None, precision=None, align=None):
    """GPU attention. q (..., Nq, d), k (..., Nk, d), v (..., Nk, dv).

    Keywords as tiled.attention. Arrays may be torch CUDA tensors (used in
    place), numba device arrays, or numpy arrays (copied over and back);
    the result is of the same kind and dtype, lse float32. version None
    picks v5 for bf16/float16 and, for float32, v6 (3xTF32: float32
    accuracy on the tensor cores, 2-3x v3 on the H200) where it runs,
    else DEFAULT_VERSION; precision ("3xtf32" or "tf32") belongs to v6.
    num_splits > 1 (or "auto": `choose_splits`) runs split-KV, on v3.
    Each version fixes its tile sizes
    (`tile_shape`): block_q and block_k may only restate them.
    """
    options = dict(block_q=block_q, block_k=block_k, scale=scale,
                   causal=causal, mask=mask, window=window,
                   kv_lengths=kv_lengths, dropout_p=dropout_p, align=align)
    fast = _fast_key(q, k, v, (version, precision, order, num_splits),
                     options)
    plan = _plans.get(fast) if fast is not None else None
    if plan is not None:  # checked when the plan was made: same key
        o, lse = plan.run(q, k, v, seed, return_lse is True)
        return (o, lse) if return_lse is True else o
    tiled.check_order(order, ORDERS)
    return_lse = check_flag("return_lse", return_lse)
    d, d_v, dtype = _check_device_inputs((("q", q), ("k", k), ("v", v)))
    version = _check_version(version, dtype, d, d_v)
    if version is None:  # 16-bit inputs on a GPU without bf16 mma
        return _widened(attention, (q, k, v), dtype, return_lse,
                        block_q=block_q, block_k=block_k, scale=scale,
                        causal=causal, mask=mask, window=window,
                        kv_lengths=kv_lengths, dropout_p=dropout_p,
                        seed=seed, return_lse=return_lse, order=order,
                        num_splits=num_splits, version=DEFAULT_VERSION,
                        align=align)
    if fast is not None and version in TENSOR_CORE_VERSIONS \
            and num_splits == 1:
        plan = _new_plan(fast, _ForwardPlan(
            q, k, v, version, dtype, precision, dict(
                scale=scale, causal=causal, mask=None, window=window,
                kv_lengths=None, dropout_p=dropout_p, seed=seed,
                align=align), block_q, block_k))
        o, lse = plan.run(q, k, v, seed, return_lse)
        return (o, lse) if return_lse else o
    if num_splits == "auto" and version in SPLIT_VERSIONS:
        num_splits = choose_splits(q.shape[-2], k.shape[-2],
                                   int(np.prod(q.shape[:-2])), d, d_v)
    splits = tiled.check_splits(
        num_splits, supported=None if version in SPLIT_VERSIONS else 1)
    name = _forward_name(version, dtype, precision, d, d_v)
    if version in TENSOR_CORE_VERSIONS:
        _refuse_simulator(f"version: v{version}")
    tr = traits.traits(name, d, d_v)
    br, bc, threads = tr.br, tr.bc, tr.threads
    _check_fixed_blocks(f"v{version}", block_q, br, block_k, bc)
    call = _Call(q, k, v, dict(scale=scale, causal=causal, mask=mask,
                               window=window, kv_lengths=kv_lengths,
                               dropout_p=dropout_p, seed=seed,
                               align=align))
    o, o_k = call.empty((call.bh, call.nq, d_v), dtype)
    lse, lse_k = call.empty((call.bh, call.nq))
    vk = call.to_kernel(v, (call.bh_kv, call.nk, d_v))
    if splits > 1 and call.bh and call.nq:
        _split_forward(call, name, q, k, vk, o_k, lse_k, d, d_v, splits)
        call.finish(o_k, lse_k, vk)
    elif call.bh and call.nq:
        arrays = [call.to_kernel(q, (call.bh, call.nq, d)),
                  call.to_kernel(k, (call.bh_kv, call.nk, d)), vk, o_k,
                  lse_k]
        if version in TENSOR_CORE_VERSIONS:  # they apply the rule of
            # flashlab.nonfinite themselves, given V's bad columns
            if dtype in HALF_BITS:
                arrays[3] = _pairs(o_k)  # 16-bit pairs
            arrays.append(call.bad_parts(vk, dtype))
        kernel(name, d, d_v)[
            launch_grid(tr, call.nq, call.nk, call.bh, call.args[0]), threads,
            call.stream](*arrays, *call.args)
        if version not in TENSOR_CORE_VERSIONS:
            call.finish(o_k, lse_k, vk)
    o = call.result(o, (*call.heads, call.nq, d_v))
    return ((o, call.result(lse, (*call.heads, call.nq))) if return_lse
            else o)


def choose_splits(nq, nk, bh, d, d_v, sms=None):
    """Split count for v3 at this shape: enough blocks to fill the GPU.

    v3 fits BLOCKS_PER_SM blocks on a multiprocessor (registers capped at
    128, its shared memory); a launch of fewer blocks than sms times that
    leaves multiprocessors idle, as decoding does (Nq of 1 to 16 rows: one
    query block per head). Splitting the keys multiplies the blocks; no
    split gets fewer than 4 key tiles, whose partial results the combine
    step would otherwise spend more on than they save. See chapter 11.
    """
    if sms is None:
        sms = _multiprocessors()
    br, bc = tile_shape(3, d, d_v)
    blocks = math.ceil(nq / br) * bh
    tiles = math.ceil(nk / bc)
    want = math.ceil(sms * forward_v3.BLOCKS_PER_SM / max(blocks, 1))
    return max(1, min(want, tiles // 4))


def launch_grid(tr, nq, nk, heads, rules, keys=False):
    """tr.grid of `heads` elements of nq queries and nk keys, its own
    rows the queries (or with keys=True the keys); for a placed kernel,
    as many heads started together as flashlab.order's model of this
    GPU chooses for the blocks' tiles under these rules (KernelRules)."""
    together = 1
    if tr.placed:
        bq, bk = (tr.bc, tr.br) if keys else (tr.br, tr.bc)
        index = masks.Index(bool(rules.causal), int(rules.offset),
                            int(rules.left), int(rules.right))
        together = block_order.for_launch(
            nq, nk, bq, bk, index, heads,
            _multiprocessors() * tr.blocks_per_sm, keys)
    return tr.grid(nk if keys else nq, heads, together)


def _multiprocessors():
    """Multiprocessors of the current GPU (132 on an H200)."""
    from numba import config, cuda

    if config.ENABLE_CUDASIM:
        return 132
    return cuda.get_current_device().MULTIPROCESSOR_COUNT


def _split_forward(call, name, q, k, vk, o_k, lse_k, d, d_v, splits):
    """Split-KV: partial results of `splits` key ranges, then combined,
    each range's rows as (m, l), exact at any |m| (`merge.combine`)."""
    br = tile_shape(3, d, d_v)[0]
    rows = splits * call.bh
    parts, parts_k = call.empty((rows, call.nq, d_v))
    stats, stats_k = call.empty((2 * rows, call.nq))  # maxes, then sums
    kernel(name, d, d_v)[
        (math.ceil(call.nq / br), call.bh, splits), device.THREADS,
        call.stream](call.to_kernel(q, (call.bh, call.nq, d)),
                     call.to_kernel(k, (call.bh_kv, call.nk, d)), vk,
                     parts_k, stats_k, *call.args)
    _, none_k = call.empty((0, 0))  # lse_k takes m + log l
    kernel("combine_splits", 0, 0)[
        (math.ceil(call.nq * d_v / device.THREADS), call.bh),
        device.THREADS, call.stream](parts_k, stats_k[:rows],
                                     stats_k[rows:], o_k, lse_k, none_k,
                                     call.args[0].lowest)


def combine(outs, lses, ls=None):
    """`merge.combine` on the GPU: outs (S, ..., d_v), lses (S, ...).

    The partial results of S key ranges, float32 torch CUDA tensors (or
    numpy arrays, copied), folded by the kernel split-KV uses; returns
    (out (..., d_v), lse (...)) of the same kind. With ls (S, ...), lses
    holds each range's row max and ls its sum, and the result is (out, m,
    l): exact at any size, as ring attention's running fold needs.
    """
    arrays_in = (("outs", outs), ("lses", lses)) + (
        () if ls is None else (("ls", ls),))
    for name, x in arrays_in:
        if str(getattr(x, "dtype", "")).removeprefix("torch.") \
                != "float32":
            raise TypeError(f"{name}: expected a float32 array, got "
                            f"{getattr(x, 'dtype', type(x).__name__)}")
    shape = tuple(outs.shape)
    if len(shape) < 3 or tuple(lses.shape) != shape[:-1] or not shape[0]:
        raise ValueError(
            f"lses: expected shape {shape[:-1]} (one per split and row of "
            f"outs {shape}, at least one split), got {tuple(lses.shape)}")
    if ls is not None and tuple(ls.shape) != shape[:-1]:
        raise ValueError(f"ls: expected shape {shape[:-1]} (one per split "
                         f"and row, as lses), got {tuple(ls.shape)}")
    splits, *batch, nq, d_v = shape
    bh = int(np.prod(batch))
    lowest = np.float32(np.finfo(np.float32).min)
    arrays = adapters.of("outs", outs)
    out, out_k = arrays.empty((bh, nq, d_v), "float32")
    m, m_k = arrays.empty((bh, nq), "float32")
    l, l_k = arrays.empty((bh, nq) if ls is not None else (0, 0),
                          "float32")
    if bh and nq and d_v:
        ls_k = (arrays.empty((0, 0), "float32")[1] if ls is None
                else arrays.to_kernel(ls, (splits * bh, nq)))
        kernel("combine_splits", 0, 0)[
            (math.ceil(nq * d_v / device.THREADS), bh), device.THREADS,
            arrays.stream](arrays.to_kernel(outs, (splits * bh, nq, d_v)),
                           arrays.to_kernel(lses, (splits * bh, nq)), ls_k,
                           out_k, m_k, l_k, lowest)
    out = arrays.result(out, shape[1:])
    if ls is None:
        return out, arrays.result(m, shape[1:-1])
    return out, arrays.result(m, shape[1:-1]), arrays.result(l, shape[1:-1])


def attention_backward(q, k, v, o, lse, do, *, block_q=None, block_k=None,
                       scale=None, causal=False, mask=None, window=None,
                       kv_lengths=None, dropout_p=0.0, seed=None,
                       order="fa2", align=None, version=None,
                       deterministic=True, l=None):
    """GPU gradients (dq, dk, dv). Keywords as the forward.

    float32 inputs run chapter 9's kernels; bf16 and float16 ones (head
    dims in backward_v5.HEAD_DIMS) the tensor-core kernels, with lse
    float32 as the forward returns it: `version` 9 (`backward_v8`'s fused
    kernel with dQ's additions in a fixed order, d = d_v), 8 (v7's
    kernels with a warp-specialized dK/dV), 7 (`backward_v7`, wgmma; all
    three Hopper only, gradients in the inputs' dtype, rounded once from
    float32) or 5 (`backward_v5`, mma.sync; float32 gradients), None for
    the newest the GPU runs at these head dims (v9 where
    registry.ordered_pays, v8 elsewhere). Deterministic by default: the
    same bits every run. deterministic=False lets v7, v8 and v9 (v8's at
    d = d_v) run their fused kernels, which add each tile pair's dQ to a
    float32 dQ by atomics (v8's by TMA's reductions; five products a tile
    pair instead of seven; the order of the additions, so dQ's last bits,
    vary from run to run); elsewhere it changes nothing. With l (float32,
    lse's shape), lse holds the rows' max m and l their sum, as
    `tiled.attention_backward` takes them.
    """
    deterministic = check_flag("deterministic", deterministic)
    _check_norms(l, lse)
    options = dict(scale=scale, causal=causal, mask=mask, window=window,
                   kv_lengths=kv_lengths, dropout_p=dropout_p, seed=seed,
                   align=align)
    fast = _backward_key(q, k, v, o, lse, do, options, order, version,
                         deterministic, block_q,
                         block_k) if l is None else None
    plan = _plans.get(fast) if fast is not None else None
    if plan is not None:  # checked when the plan was made: same key
        return plan(q, k, v, o, lse, do, seed)
    tiled.check_order(order)  # one backward loop follows either forward
    d, d_v, dtype = _check_device_inputs((("q", q), ("k", k), ("v", v)))
    if version is not None and dtype not in HALF_BITS:
        raise ValueError(f"version: the float32 backward has one version; "
                         f"pass None, got {version!r}")
    if dtype in HALF_BITS and not _device_runs("backward_v5_dq_bf16"):
        # no 16-bit tensor-core backward on this GPU: float32 kernels
        widen = adapters.kind_of("q", q).widen
        return attention_backward(
            *(widen(x) for x in (q, k, v, o, lse, do)), block_q=block_q,
            block_k=block_k, order=order, l=l, **options)
    if dtype in HALF_BITS:
        if d not in backward_v5.HEAD_DIMS or d_v not in backward_v5.HEAD_DIMS:
            raise ValueError(
                f"q: the 16-bit backward runs head dims "
                f"{backward_v5.HEAD_DIMS}, got d={d}, d_v={d_v}; pass "
                f"float32 copies")
        names = _backward16_names(version, dtype, d, d_v, deterministic,
                                  k.shape[-2])
        keys_tr = traits.traits(names[0], d, d_v)
        # queries a tile: dQ's own rows, or the fused kernel's streamed
        rows = keys_tr.bc if names[1] is None else traits.traits(
            names[1], d, d_v).br
        _check_fixed_blocks(names[0].rsplit("_", 2)[0], block_q, rows,
                            block_k, keys_tr.br)
        if fast is not None:
            _check_saved16(o, lse, do, q, dtype, d_v)
            plan = _new_plan(fast, _BackwardPlan(q, k, v, o, lse, do,
                                                 dtype, options, names))
            return plan(q, k, v, o, lse, do, seed)
        return _backward16(q, k, v, o, lse, do, d, d_v, dtype, options,
                           names, l)
    if dtype != "float32":
        raise TypeError(f"q: expected float32, bfloat16 or float16 for "
                        f"the backward, got {dtype}")
    blocked = max(d, d_v) <= backward.BLOCKED_MAX_DIM
    suffix = "_blocked" if blocked else ""
    kv_tr, q_tr = (traits.traits(name + suffix, d, d_v)
                   for name in ("backward_kv", "backward_q"))
    _check_fixed_blocks("backward", block_q, q_tr.br, block_k, kv_tr.br)
    tiled.check_saved(*(kernel_args.proxy(x) for x in (q, v, o, lse, do)))
    call = _Call(q, k, v, options)
    bh, nq, nk = call.bh, call.nq, call.nk
    qk = call.to_kernel(q, (bh, nq, d))
    kk = call.to_kernel(k, (call.bh_kv, nk, d))
    vk = call.to_kernel(v, (call.bh_kv, nk, d_v))
    ok = call.to_kernel(o, (bh, nq, d_v))
    dok = call.to_kernel(do, (bh, nq, d_v))
    rows = (math.ceil(nq / device.THREADS), bh)
    stats_k = _statistics(call, "row_statistics", qk, kk, lse, rows, l)
    delta, delta_k = call.empty((bh, nq))
    kernel("row_dot", 0, 0)[rows, device.THREADS, call.stream](
        dok, ok, delta_k)
    dq, dq_k = call.empty((bh, nq, d))
    # dK, dV per query head; a K/V head's is the sum over its group
    dk, dk_k = call.empty((bh, nk, d))
    dv, dv_k = call.empty((bh, nk, d_v))
    kernel(kv_tr.name, d, d_v)[
        (math.ceil(nk / kv_tr.br), bh), kv_tr.threads, call.stream](
        qk, kk, vk, dok, stats_k, delta_k, dk_k, dv_k, *call.args)
    kernel(q_tr.name, d, d_v)[
        (math.ceil(nq / q_tr.br), bh), q_tr.threads, call.stream](
        qk, kk, vk, dok, stats_k, delta_k, dq_k, *call.args)
    dk, dv = call.group_sum(dk), call.group_sum(dv)
    return (call.result(dq, (*call.heads, nq, d)),
            call.result(dk, (*k.shape[:-2], nk, d)),
            call.result(dv, (*v.shape[:-2], nk, d_v)))


def _statistics(call, name, q_k, k_k, lse, rows, l=None):
    """The backward kernels' row statistics (2 BH, Nq) on the device:
    shifts and norms of P, by helper kernel `name` (device.row_statistics
    or a 16-bit twin) from the saved lse, or from the rows' own (m, l)
    where l is given (lse then holds m)."""
    stats, stats_k = call.empty((2 * call.bh, call.nq))
    lse_k = call.to_kernel(lse, (call.bh, call.nq))
    if l is not None:
        kernel("norms_from_sums", 0, 0)[rows, device.THREADS, call.stream](
            lse_k, call.to_kernel(l, (call.bh, call.nq)), stats_k)
    else:
        kernel(name, 0, 0)[rows, device.THREADS, call.stream](
            q_k, k_k, lse_k, stats_k, *call.args)
    return stats_k


def _check_norms(l, lse):
    """l, where given, float32 of lse's shape."""
    if l is None:
        return
    if tuple(np.shape(l)) != tuple(np.shape(lse)):
        raise ValueError(f"l: expected shape {tuple(np.shape(lse))} (one "
                         f"per row, as lse), got {tuple(np.shape(l))}")
    if str(getattr(l, "dtype", "")).removeprefix("torch.") != "float32":
        raise TypeError(f"l: expected dtype float32, got "
                        f"{getattr(l, 'dtype', type(l).__name__)}")


def attention_statistics(q, k, v, lse, *, scale=None, causal=False, mask=None,
                   window=None, kv_lengths=None, align=None):
    """`tiled.attention_statistics` on the GPU: (m, l) (..., Nq), float32
    like lse, with the 16-bit kernels' way of forming S for 16-bit
    inputs. Keywords as the forward; torch tensors or numpy arrays."""
    d, d_v, dtype = _check_device_inputs((("q", q), ("k", k), ("v", v)))
    call = _Call(q, k, v, dict(scale=scale, causal=causal, mask=mask,
                               window=window, kv_lengths=kv_lengths,
                               dropout_p=0.0, seed=None, align=align))
    if call.arrays.kind == "numba":
        raise TypeError("q: attention_statistics takes torch tensors or numpy "
                        "arrays")
    if tuple(np.shape(lse)) != (*call.heads, call.nq):
        raise ValueError(f"lse: expected shape {(*call.heads, call.nq)}, "
                         f"got {tuple(np.shape(lse))}")
    bh, nq = call.bh, call.nq
    m, m_k = call.empty((bh, nq))
    l, l_k = call.empty((bh, nq))
    if bh and nq:
        name = ("row_statistics" if dtype == "float32" else
                "row_statistics_" + ("bf16" if dtype == "bfloat16"
                                     else "f16"))
        rows = (math.ceil(nq / device.THREADS), bh)
        stats_k = _statistics(
            call, name, call.to_kernel(q, (bh, nq, d)),
            call.to_kernel(k, (call.bh_kv, call.nk, d)), lse, rows)
        kernel("sums_from_norms", 0, 0)[rows, device.THREADS, call.stream](
            stats_k, m_k, l_k)
    return (call.result(m, (*call.heads, nq)),
            call.result(l, (*call.heads, nq)))


def _backward16_names(version, dtype, d, d_v, deterministic=True,
                      nk=None):
    """(dK/dV, dQ) kernel names of the 16-bit backward `version` (5, 7, 8,
    9; None: registry.backward_version, at nk keys) for this GPU; (fused,
    None) for v9, and for v7 and v8 (v8's for v9) where atomics are
    allowed (not deterministic) and the fused kernel takes d, d_v (v8's:
    d = d_v)."""
    from numba import config

    simulator = config.ENABLE_CUDASIM
    cc = (9, 0) if simulator else launch.device_cc()  # refused later
    kind = "bf16" if dtype == "bfloat16" else "f16"
    if version is None:
        # v9 where it runs (d = d_v), else v8, else v7; the fused
        # kernels where atomics are allowed
        version = registry.backward_version(dtype, d, d_v, cc, nk)
    elif isinstance(version, bool) or \
            version not in registry.BACKWARD_VERSIONS:
        raise ValueError(f"version: expected one of "
                         f"{registry.BACKWARD_VERSIONS} or None for the "
                         f"16-bit backward, got {version!r}")
    else:
        spec = registry.get(registry.backward_names(version, kind)[0])
        if not simulator and not spec.runs_on(cc):
            raise ValueError(
                f"version: backward v{version} does not run on compute "
                f"capability {cc[0]}.{cc[1]} (pass None for the best it "
                f"runs)")
        if not spec.takes(d, d_v):
            raise ValueError(
                f"version: backward v{version} is built for head dims "
                f"{spec.head_dims}"
                f"{' with d = d_v' if spec.same_dims else ''}, got d={d}, "
                f"d_v={d_v} (pass None for the best that takes them)")
    # where atomics are allowed: v7's and v8's fused kernels (v9's
    # additions in any order are v8's fused kernel)
    fused = f"backward_v{min(version, 8)}_fused_{kind}"
    if version in (7, 8, 9) and not deterministic and \
            registry.get(fused).takes(d, d_v):
        return fused, None
    return registry.backward_names(version, kind)


def _backward16(q, k, v, o, lse, do, d, d_v, dtype, options, names,
                l=None):
    """The tensor-core backward (kernels `names`: dK/dV, dQ, or the fused
    kernel and None) of 16-bit q, k, v, o, dO."""
    _check_saved16(o, lse, do, q, dtype, d_v)
    _refuse_simulator("q: the 16-bit backward (backward_v5)")
    call = _Call(q, k, v, options)
    if call.arrays.kind == "numba":
        raise TypeError("q: the 16-bit backward takes torch tensors or "
                        "numpy arrays")
    bh, nq, nk = call.bh, call.nq, call.nk
    # D_i = rowsum(dO_i o O_i) in float32, by the array library
    widen = call.arrays.widen
    delta = (widen(do) * widen(o)).sum(-1).reshape(bh, nq)
    kind = "bf16" if dtype == "bfloat16" else "f16"
    q_k = call.to_kernel(q, (bh, nq, d))
    k_k = call.to_kernel(k, (call.bh_kv, nk, d))
    stats_k = _statistics(call, f"row_statistics_{kind}", q_k, k_k,
                          lse.reshape(bh, nq),
                          (math.ceil(nq / device.THREADS), bh),
                          None if l is None else l.reshape(bh, nq))
    arrays = [q_k, k_k, call.to_kernel(v, (call.bh_kv, nk, d_v)),
              call.to_kernel(do, (bh, nq, d_v)), stats_k,
              call.to_kernel(delta, (bh, nq))]
    keys_tr = traits.traits(names[0], d, d_v)
    if names[1] is None:  # fused: tau dS K summed in float32 by atomics
        return _fused16(call, arrays, keys_tr, q, k, v, d, d_v, dtype)
    if registry.get(names[0]).grads16:  # 16-bit pairs, per K/V head
        bh_k = call.bh_kv
        (dq, dq_k), (dk, dk_k), (dv, dv_k) = (
            (out, _pairs(view)) for out, view in (
                call.empty(shape, dtype) for shape in (
                    (bh, nq, d), (bh_k, nk, d), (bh_k, nk, d_v))))
    else:  # float32, per query head: dK, dV summed below
        bh_k = bh
        dq, dq_k = call.empty((bh, nq, d))
        dk, dk_k = call.empty((bh, nk, d))
        dv, dv_k = call.empty((bh, nk, d_v))
    if bh and nq and nk:
        dq_tr = traits.traits(names[1], d, d_v)
        rules = call.args[0]
        kernel(keys_tr.name, d, d_v)[
            launch_grid(keys_tr, nq, nk, bh_k, rules, keys=True),
            keys_tr.threads, call.stream](*arrays, dk_k, dv_k, *call.args)
        kernel(dq_tr.name, d, d_v)[
            launch_grid(dq_tr, nq, nk, bh, rules), dq_tr.threads,
            call.stream](*arrays, dq_k, *call.args)
    if bh_k != call.bh_kv:
        dk, dv = call.group_sum(dk), call.group_sum(dv)
    return (call.result(dq, (*call.heads, nq, d)),
            call.result(dk, (*k.shape[:-2], nk, d)),
            call.result(dv, (*v.shape[:-2], nk, d_v)))


def _fused16(call, arrays, keys_tr, q, k, v, d, d_v, dtype):
    """_backward16 by a fused kernel: dK, dV as 16-bit pairs per K/V
    head, tau dS K added to a zeroed float32 dQ (in turn, by the counts
    of an ordered kernel), then rounded once to q's dtype."""
    bh, nq, nk = call.bh, call.nq, call.nk
    (dk, dk_k), (dv, dv_k) = (
        (out, _pairs(view)) for out, view in (
            call.empty(shape, dtype) for shape in (
                (call.bh_kv, nk, d), (call.bh_kv, nk, d_v))))
    dq32 = call.arrays.zeros((bh, nq, d))
    counts = [call.arrays.counts(_count_shape(keys_tr, bh, nq))] \
        if _ordered(keys_tr.name) else []
    if bh and nq and nk:
        kernel(keys_tr.name, d, d_v)[
            launch_grid(keys_tr, nq, nk, call.bh_kv, call.args[0],
                        keys=True),
            keys_tr.threads, call.stream](*arrays, dk_k, dv_k, dq32,
                                          *counts, *call.args)
    dq32 = call.result(dq32, (*call.heads, nq, d))
    return (call.arrays.narrow(dq32, q),
            call.result(dk, (*k.shape[:-2], nk, d)),
            call.result(dv, (*v.shape[:-2], nk, d_v)))


def _ordered(name):
    """Whether kernel `name` adds to dQ in turn (it takes the counts)."""
    return registry.get(name).args == "backward16_ordered_tma"


def _stores_every_tile(keys_tr, nq, nk, rules):
    """Whether every query tile of an ordered kernel has a key block under
    the index rules, every key valid: then the tile's first turn stores
    it (backward_v8's drain), and dQ's float32 sum needs no zeros."""
    return all(operator.le(*masks.tile_range(
        i0, min(i0 + keys_tr.bc, nq), nk, keys_tr.br, rules, nk))
        for i0 in range(0, nq, keys_tr.bc))


def _count_shape(keys_tr, bh, nq):
    """The ordered kernel's counts: one per query head and tile of the
    queries it streams."""
    return bh, -(-nq // keys_tr.bc)


def _check_saved16(o, lse, do, q, dtype, d_v):
    """o and do of q's 16-bit dtype and shape (d_v wide), lse float32."""
    out_shape = (*q.shape[:-1], d_v)
    for name, x, shape in (("o", o, out_shape), ("do", do, out_shape),
                           ("lse", lse, tuple(q.shape[:-1]))):
        if tuple(x.shape) != tuple(shape):
            raise ValueError(f"{name}: expected shape {shape}, got "
                             f"{tuple(x.shape)}")
        want = "float32" if name == "lse" else dtype
        if str(x.dtype).removeprefix("torch.") != want:
            raise TypeError(f"{name}: expected dtype {want}, got {x.dtype}")


def _device_runs(name):
    """Whether this GPU (any, on the simulator) runs kernel `name`."""
    from numba import config

    return config.ENABLE_CUDASIM or registry.get(name).runs_on(
        launch.device_cc())


def _refuse_simulator(what):
    """Inline PTX runs on a GPU only: say so before numba's simulator
    fails inside a kernel."""
    from numba import config

    if config.ENABLE_CUDASIM:
        raise RuntimeError(
            f"{what} runs mma.sync and ldmatrix as inline PTX, which "
            f"numba's CUDA simulator cannot execute: run it on a GPU, or "
            f"pass float32 inputs (chapter 9's kernels run here); chapter "
            f"10 shows the stored GPU results")


def _check_version(version, dtype, d, d_v):
    """The forward version for inputs of `dtype` on this device (None:
    the fastest one that is as accurate as float32 arithmetic,
    `registry.best_version`; it returns None for 16-bit inputs that the
    device has no kernel for, which the caller widens to float32)."""
    from numba import config

    simulator = config.ENABLE_CUDASIM
    if version is None:
        if simulator and dtype in HALF_BITS:
            return HALF_VERSIONS[0]  # refused with its reason later
        cc = None if simulator else launch.device_cc()
        return registry.best_version(dtype, d, d_v, cc, simulator)
    if isinstance(version, bool) or version not in VERSIONS:
        raise ValueError(f"version: expected one of {VERSIONS} or None, "
                         f"got {version!r}")
    takes = HALF_VERSIONS if dtype in HALF_BITS else FLOAT32_VERSIONS
    if version not in takes:
        raise ValueError(
            f"version: v{version} does not take {dtype} inputs; versions "
            f"{takes} do (or pass None)")
    if not simulator:
        cc = launch.device_cc()
        need = min(k.min_cc for k in registry.forwards(version))
        if cc < need:
            raise ValueError(
                f"version: v{version} needs compute capability "
                f"{need[0]}.{need[1]} or newer; this GPU is "
                f"{cc[0]}.{cc[1]} (pass None for the best it runs)")
    return version


def _widened(fn, arrays, dtype, with_lse, **options):
    """fn on float32 copies of 16-bit arrays, the output back in dtype
    (lse stays float32): for GPUs without 16-bit tensor-core kernels."""
    kind = adapters.kind_of("q", arrays[0])
    out = fn(*(kind.widen(x) for x in arrays), **options)
    o = kind.narrow(out[0] if with_lse else out, arrays[0])
    return (o, out[1]) if with_lse else o


def _forward_name(version, dtype, precision, d, d_v):
    """The registry name of the forward kernel of one call."""
    if version != 6 and precision is not None:
        raise ValueError(f"precision: only v6 has a precision choice, got "
                         f"{precision!r} for v{version}")
    kernels = [k for k in registry.forwards(version) if dtype in k.dtypes]
    for name, size in (("q", d), ("v", d_v)):
        if size not in kernels[0].head_dims:
            raise ValueError(f"{name}: v{version} runs head dims "
                             f"{kernels[0].head_dims}, got {size}")
    if version == 6:
        precision = PRECISIONS[0] if precision is None else precision
        if precision not in PRECISIONS:
            raise ValueError(f"precision: expected one of {PRECISIONS}, "
                             f"got {precision!r}")
        return "forward_v6_" + precision
    return kernels[0].name


def _check_fixed_blocks(what, block_q, br, block_k, bc):
    """block_q/block_k may be None or restate the kernel's own tiles."""
    for name, given, fixed in (("block_q", block_q, br),
                               ("block_k", block_k, bc)):
        if given is not None and given != fixed:
            raise ValueError(
                f"{name}: flashlab.gpu {what} runs tiles of {fixed} for "
                f"these head dims; pass None or {fixed}, got {given!r}")


def _check_device_inputs(named, dtypes=("float32", *HALF_BITS)):
    """Arrays of one dtype with head dims 16..128 in steps of 16: (d, d_v,
    dtype name)."""
    first = adapters.kind_of(*named[0])
    for name, x in named:
        if adapters.kind_of(name, x) is not first:
            raise TypeError(f"{name}: expected {first.kind} arrays as q, "
                            f"got {type(x).__name__}")
        dtype = dtype_name(x)
        if dtype not in dtypes:
            raise TypeError(f"{name}: expected a dtype in {dtypes} for "
                            f"flashlab.gpu, got {x.dtype}")
        if dtype != str(named[0][1].dtype).removeprefix("torch."):
            raise TypeError(f"{name}: expected dtype {named[0][1].dtype} "
                            f"to match q, got {x.dtype}")
        if x.ndim < 2:
            raise ValueError(f"{name}: expected at least 2 dims (..., N, "
                             f"d), got shape {tuple(x.shape)}")
    d, d_v = named[0][1].shape[-1], named[2][1].shape[-1]
    for name, size in (("q", d), ("v", d_v)):
        if size % 16 or not 16 <= size <= 128:
            raise ValueError(
                f"{name}: expected a head dim in 16, 32, ..., 128 for "
                f"flashlab.gpu, got {size}")
    return d, d_v, dtype


def find_bad_name(dtype):
    """The find_bad_parts kernel for V of `dtype`."""
    return f"find_bad_parts{device.WIDTHS[dtype]}"


def words(x):
    """Device array or tensor x seen as int32 words (its last dim's bytes
    a multiple of 4), as find_bad_parts reads V."""
    if is_torch(x):
        import torch

        return x.view(torch.int32)
    return x.view(np.int32)


class _Call:
    """One call's arrays of one kind (numpy, numba device, torch)."""

    def __init__(self, q, k, v, options):
        # the kernels compute in float32 whatever they store: rules too
        _, _, _, self.batch, plan, a = kernel_args.flatten(
            *(kernel_args.proxy(x, np.float32) for x in (q, k, v)),
            options)
        self.bh = int(np.prod(self.batch))
        self.group = a.rules.group  # query heads per K/V head
        self.bh_kv = self.bh // self.group
        self.heads = tuple(q.shape[:-2])  # the caller's leading dims
        self.nq, self.nk = plan.nq, plan.nk
        self.plan = plan
        self.arrays = adapters.of("q", q)  # q's kind: k, v are too
        self.stream = self.arrays.stream
        default_lengths = options["kv_lengths"] is None
        self.args = (a.rules, _on_device(a.kv_len, default_lengths),
                     _on_device(a.mask.astype(np.uint8), not
                                a.rules.use_mask))

    def to_kernel(self, x, shape):
        """A device view (or copy, for numpy) of x with the given shape;
        16-bit values as their int16 bits, 16-byte aligned for cp.async."""
        return self.arrays.to_kernel(x, shape)

    def empty(self, shape, dtype="float32"):
        """An uninitialized output of `dtype` and its device view (int16
        bits for a 16-bit dtype)."""
        return self.arrays.empty(shape, dtype, _poisoned())

    def bad_columns(self, v_k):
        """(BH, d_v) bool on the device: column x of float32 V[b] holds a
        NaN or an inf (flashlab.nonfinite), for v1-v4's finish_rows."""
        nk, d_v = v_k.shape[1:]
        bad = self.arrays.zeros_bool((self.bh_kv, d_v))
        grid = (math.ceil(nk * d_v / device.THREADS), self.bh_kv)
        if nk:
            kernel("find_bad_columns", 0, 0)[
                grid, device.THREADS, self.stream](v_k, bad)
        return self.per_query_head(bad)

    def bad_parts(self, v_k, dtype):
        """(BH_kv, chunks, QUADS) int32 words on the device, one
        launch, no memset: device.find_bad_parts, which the tensor-core
        kernels read for the rule of flashlab.nonfinite."""
        shape = device.bad_parts_shape(self.bh_kv, *v_k.shape[1:])
        parts, parts_k = self.empty(shape, "int32")
        kernel(find_bad_name(dtype), 0, 0)[
            shape[1::-1], device.FIND_THREADS, self.stream](
            words(v_k), parts_k, device.EXPONENT_BITS[dtype])
        return parts_k

    def per_query_head(self, bad):
        """(BH_kv, d_v) flags as (BH, d_v): one row per query head (a
        small copy, only with grouped heads)."""
        if self.group == 1:
            return bad
        return self.arrays.repeat_rows(bad, self.group)

    def group_sum(self, grad):
        """(BH, N, d) per query head summed over each group: (BH_kv, N,
        d), in the kind of `grad`."""
        if self.group == 1:
            return grad
        return self.arrays.group_sum(grad, self.bh_kv, self.group)

    def finish(self, o_k, lse_k, v_k):
        """Apply flashlab.nonfinite's rule to the output of v1-v4."""
        from numba import cuda

        bad = self.bad_columns(v_k)
        empty = self.plan.empty_rows(self.batch).reshape(self.bh, self.nq)
        empty_k = _on_device(np.zeros((1, 1), np.bool_), True)
        if empty.any():  # else a (1, 1) stand-in: no row is empty
            empty_k = cuda.to_device(np.ascontiguousarray(empty))
        kernel("finish_rows", 0, 0)[
            (math.ceil(self.nq / device.THREADS), self.bh), device.THREADS,
            self.stream](o_k, lse_k, bad, empty_k)

    def result(self, out, shape):
        """The output in the caller's kind, with the caller's shape."""
        return self.arrays.result(out, shape)


_constants = {}


def forward_plan(q, k, v, *, block_q=None, block_k=None, scale=None,
                 causal=False, mask=None, window=None, kv_lengths=None,
                 dropout_p=0.0, seed=None, return_lse=False, order="fa2",
                 num_splits=1, version=None, precision=None, align=None):
    """The prepared plan that `attention` runs for these arguments (seed
    and return_lse do not choose it), once a call has made it; else None.
    A caller that keeps it (flashlab.torch does, by its own key) calls
    `plan.run(q, k, v, seed, with_lse)` with arrays of the same shapes,
    dtypes and device, skipping the checks."""
    fast = _fast_key(q, k, v, (version, precision, order, num_splits),
                     dict(block_q=block_q, block_k=block_k, scale=scale,
                          causal=causal, mask=mask, window=window,
                          kv_lengths=kv_lengths, dropout_p=dropout_p,
                          align=align))
    return None if fast is None else _plans.get(fast)


def backward_plan(q, k, v, o, lse, do, *, block_q=None, block_k=None,
                  scale=None, causal=False, mask=None, window=None,
                  kv_lengths=None, dropout_p=0.0, seed=None, order="fa2",
                  align=None, version=None, deterministic=True):
    """The prepared plan that `attention_backward` runs for these
    arguments (seed does not choose it), once a call has made it; else
    None. A caller that keeps it calls `plan.run(q, k, v, o, lse, do,
    seed)` with arrays of the same shapes, dtypes and device."""
    options = dict(scale=scale, causal=causal, mask=mask, window=window,
                   kv_lengths=kv_lengths, dropout_p=dropout_p, seed=seed,
                   align=align)
    fast = _backward_key(q, k, v, o, lse, do, options, order, version,
                         check_flag("deterministic", deterministic),
                         block_q, block_k)
    return None if fast is None else _plans.get(fast)


def _backward_key(q, k, v, o, lse, do, options, order, version,
                  deterministic, block_q, block_k):
    """_fast_key of a backward call (its saved tensors are in the key)."""
    return _fast_key(q, k, v, ("backward", order, version, deterministic),
                     dict(options, block_q=block_q, block_k=block_k),
                     saved=(o, lse, do))


def _on_device(x, constant):
    """x on the device; copied once and kept when it is a default value.

    The kv_len of unpadded batches, the unused mask and the "no empty
    row" flag are the same for every call of a shape, so only the first
    call pays for the copy.
    """
    from numba import cuda

    if not constant:
        return cuda.to_device(x)
    key = (x.dtype.str, x.shape, x.tobytes())
    if key not in _constants:
        _constants[key] = cuda.to_device(x)
    return _constants[key]


# One plan per (shapes, dtype, options) of a torch call: see _ForwardPlan
_plans = {}
PLANS = 512  # plans kept: a model of many shapes (every prompt length)
# must not grow them, and the buffers they keep, without end


def _new_plan(key, plan):
    """_plans[key] = plan, emptying a table that holds PLANS first (the
    plans' kept buffers go back to their streams' pools: `_keep`)."""
    if len(_plans) >= PLANS:
        _plans.clear()
    _plans[key] = plan
    return plan


def _fast_key(q, k, v, choice, options, saved=()):
    """The plan key of a call a cached plan may run, else None.

    Plans run the tensor-core kernels on torch CUDA tensors with no mask
    or padding arrays (their values would be part of the key); strided
    views (a model's heads transposed out of one projection) are copied
    contiguous per call (`_dense`), contiguous tensors must be 16-byte
    aligned. Everything else takes the general path, which validates
    every call from scratch. The key holds everything the checks read,
    so a call that finds a plan needs none of them. Every call pays for
    this function: one pass over the tensors, reading each property once.
    """
    if (config.ENABLE_CUDASIM or options["mask"] is not None
            or options["kv_lengths"] is not None or not is_torch(q)):
        return None
    where = q.get_device()  # the CUDA index (-1 off a GPU)
    tensor = type(q)  # others of another class take the general path
    shapes, dtypes = [], []
    for x in (q, k, v, *saved):
        if type(x) is not tensor:
            return None
        shape = x.shape  # a torch.Size: a tuple, hashed as one
        if (0 in shape or x.get_device() != where
                or (x.is_contiguous() and x.data_ptr() % 16)):
            return None
        shapes.append(shape)
        dtypes.append(x.dtype)
    window = options["window"]
    try:
        key = (*shapes, *dtypes, where, choice,
               None if window is None else tuple(window),
               options["block_q"], options["block_k"], options["scale"],
               options["causal"], options["dropout_p"], options["align"])
        hash(key)
    except TypeError:  # an unhashable option: validated the long way
        return None
    return key


def _pairs(x):
    """A 16-bit output seen as int32 pairs, as v5 stores it."""
    import torch

    if isinstance(x, torch.Tensor):
        return x.view(torch.int32)
    return x.view(np.int32)


# forward v8's split tail: None lets the model choose (`split_tail`); a
# number forces that many tail ranks (0: none), as tests and benchmarks do
SPLIT_TAIL = None
# a block's time by its consumer warpgroups with rows, over a whole
# block's, and a block's own work besides its tiles: forward v8 at
# d = 64 (three warpgroups) on the H200 (python -m flashlab.bench
# --waves, chapter 12)
PART_COST = {1: 0.61, 2: 0.85, 3: 1.0}
PIECE_COST = 0.02


def split_tail(name, br, nq, bh, rules, sms=None):
    """The last ranks of each head whose keys forward v8 (`name`) runs as
    two halves, in a launch after the whole blocks', so that the last
    wave is short pieces on every SM (0: none). Without a mask, causal
    or window, dropout, the model (`order.split_tail`) chooses, where
    its costs were measured (three consumer warpgroups); SPLIT_TAIL
    overrides."""
    if not name.startswith("forward_v8_") or name.endswith("e4m3"):
        return 0
    ranks = -(-nq // br)
    if SPLIT_TAIL is not None:
        return max(0, min(int(SPLIT_TAIL), ranks - 1))
    if rules.causal or rules.left >= 0 or rules.right >= 0 \
            or rules.use_mask or rules.use_dropout or br != 192:
        return 0
    return _split_tail(nq, bh, br, sms or _multiprocessors())


@functools.lru_cache(maxsize=64)
def _split_tail(nq, bh, br, sms):
    """split_tail's model, once a shape."""
    return block_order.split_tail(nq, bh, br, PART_COST, sms,
                                  PIECE_COST)[0]


class _ForwardPlan:
    """A tensor-core forward of one (shapes, dtype, options), prepared.

    The first call validates everything (`_Call`) and packs both
    launches' parameters (launch.Packed); a call then launches V's
    bad-column flags first, so the GPU works while the host allocates o
    (and lse, if the caller wants it), writes the data pointers (and the
    dropout seed) into the packed buffers and launches the forward: no
    numba dispatch, no host-device copy, no synchronization, so CUDA
    graphs capture it. The flags, and the lse of a caller that wants
    none, go to buffers the plan keeps for each stream: only the kernels
    of this call read them, and the stream's next call runs after them.
    """

    tail = 0  # ranks of each head split into halves (`split_tail`)

    def __init__(self, q, k, v, version, dtype, precision, options,
                 block_q, block_k):
        import torch

        q, k, v = _dense(q, k, v)
        d, d_v = q.shape[-1], v.shape[-1]
        name = _forward_name(version, dtype, precision, d, d_v)
        tr = traits.traits(name, d, d_v)
        br, bc, self.threads = tr.br, tr.bc, tr.threads
        _check_fixed_blocks(f"v{version}", block_q, br, block_k, bc)
        call = _Call(q, k, v, options)
        self.half = dtype in HALF_BITS
        self.o_shape = (*call.heads, call.nq, d_v)
        self.lse_shape = (*call.heads, call.nq)
        self.bad_shape = device.bad_parts_shape(call.bh_kv, call.nk, d_v)
        self.grid = launch_grid(tr, call.nq, call.nk, call.bh, call.args[0])
        self.find_grid = self.bad_shape[1::-1]  # (chunks, BH_kv)
        self.rules, self.constants = call.args[0], call.args[1:]
        # read once: each reading of q.device makes a new object
        self.device, self.dtype = q.device, q.dtype
        self.stream_of = stream_reader(q)
        o, lse = self._outputs()
        bad = self._flags()
        v3 = self._bits(v).view(call.bh_kv, call.nk, d_v)
        self.find = kernel(find_bad_name(dtype), 0, 0).pack(
            words(v3), bad, device.EXPONENT_BITS[dtype])
        o3 = o.view(call.bh, call.nq, d_v)
        if self.half:
            o3 = o3.view(torch.int32)  # 16-bit pairs
        self.main = kernel(name, d, d_v).pack(
            self._bits(q).view(call.bh, call.nq, d),
            self._bits(k).view(call.bh_kv, call.nk, d), v3, o3,
            lse.view(call.bh, call.nq), bad, *call.args)
        self.find_slots = tuple(self.find.slot(a) for a in range(2))
        self.main_slots = tuple(self.main.slot(a) for a in range(6))
        self.tail = split_tail(name, br, call.nq, call.bh, self.rules)
        if self.tail:
            self._plan_tail(name, q, k, v3, o3, lse, bad, call, br, d_v)
        self._scratch = {}  # stream -> (bad-column flags, spare lse)
        self._capturing = capture_reader()
        self._empty, self._float32 = torch.empty, torch.float32
        self._int32 = torch.int32

    def _plan_tail(self, name, q, k, v3, o3, lse, bad, call, br, d_v):
        """The split tail's launches: the main grid without the last
        `tail` ranks of each head; their pieces (v8 again, each block
        over half of its keys, `key_half`), into halves (2 BH, tail Br,
        d_v / 2) and their lse; then merge_halves into o and lse."""
        import torch

        ranks, tail = -(-call.nq // br), self.tail
        self.grid = (self.grid[0], ranks - tail, self.grid[2])
        self.piece_grid = (2, tail, call.bh)
        self.halves_shape = (2 * call.bh, tail * br, d_v // 2)
        halves = torch.empty(self.halves_shape, dtype=torch.int32,
                             device=self.device)
        lse_halves = torch.empty(self.halves_shape[:2],
                                 dtype=torch.float32, device=self.device)
        rules = self.rules._replace(block_shift=ranks - tail,
                                    key_half=True)
        self.pieces = kernel(name, q.shape[-1], d_v).pack(
            self._bits(q).view(call.bh, call.nq, q.shape[-1]),
            self._bits(k).view(call.bh_kv, call.nk, k.shape[-1]), v3,
            halves, lse_halves, bad, rules, *self.constants)
        merge_name = name.replace("forward_v8_", "merge_halves_")
        self.merge = kernel(merge_name, 0, 0).pack(
            halves, lse_halves, o3, lse.view(call.bh, call.nq),
            (ranks - tail) * br, self.rules.lowest)
        self.merge_grid = (-(-tail * br * (d_v // 2) // device.THREADS),
                           call.bh)
        self.piece_slots = tuple(self.pieces.slot(a) for a in range(6))
        self.merge_slots = tuple(self.merge.slot(a) for a in range(4))

    def _run_tail(self, q, k, v, o, lse, bad, seed, stream, poison):
        """Launch the tail's pieces, after the main grid on the stream,
        and their merge into o and lse."""
        halves = self._empty(self.halves_shape, dtype=self._int32,
                             device=self.device)
        lse_halves = self._empty(self.halves_shape[:2], dtype=self._float32,
                                 device=self.device)
        if poison:
            halves.fill_(-1)  # NaN pairs
            lse_halves.fill_(float("nan"))
        pieces, words = self.pieces, self.pieces.words
        for at, x in zip(self.piece_slots,
                         (q, k, v, halves, lse_halves, bad)):
            words[at] = x.data_ptr()
        if self.rules.use_dropout:
            pieces.put(6, self.rules._fields.index("seed"), "Q", int(seed))
        pieces.launch(self.piece_grid, self.threads, stream)
        merge, words = self.merge, self.merge.words
        for at, x in zip(self.merge_slots, (halves, lse_halves, o, lse)):
            words[at] = x.data_ptr()
        merge.launch(self.merge_grid, device.THREADS, stream)

    def _bits(self, x):
        """x as the kernels read it: 16-bit values as int16 bits."""
        import torch

        return x.view(torch.int16) if self.half else x

    def _outputs(self):
        """Fresh o and lse on the plan's device."""
        import torch

        o = torch.empty(self.o_shape, dtype=self.dtype, device=self.device)
        lse = torch.empty(self.lse_shape, dtype=torch.float32,
                          device=self.device)
        if _poisoned():
            o.fill_(float("nan"))
            lse.fill_(float("nan"))
        return o, lse

    def _flags(self):
        """Fresh bad-column flags (find_bad_parts writes every word)."""
        import torch

        return torch.empty(self.bad_shape, dtype=torch.int32,
                           device=self.device)

    def run(self, q, k, v, seed, with_lse):
        """(o, lse) of one call, lse None unless `with_lse` (the kernel
        then writes it into a buffer of the plan's); None where q, k or v
        is contiguous but not 16-byte aligned, which the general path
        takes (`_fast_key`)."""
        if self.rules.use_dropout:
            _check_seed(seed)
        if not q.is_contiguous():
            q = q.contiguous()  # a copy starts aligned
        elif q.data_ptr() & 15:
            return None
        if not k.is_contiguous():
            k = k.contiguous()
        elif k.data_ptr() & 15:
            return None
        if not v.is_contiguous():
            v = v.contiguous()
        elif v.data_ptr() & 15:
            return None
        stream = self.stream_of()
        poison = _poisoned()
        # a graph's capture gets buffers of the graph's own pool: kept
        # ones could be freed (or used by an eager call) under a replay
        fresh = poison or self._capturing()
        scratch = None if fresh else self._scratch.get(stream)
        if scratch is None:
            scratch = self._new_scratch(stream, fresh)
        bad, spare_lse = scratch
        find = self.find
        find.words[self.find_slots[0]] = v.data_ptr()
        find.words[self.find_slots[1]] = bad.data_ptr()
        find.launch(self.find_grid, device.FIND_THREADS, stream)
        o = self._empty(self.o_shape, dtype=self.dtype, device=self.device)
        lse = spare_lse if not with_lse else self._empty(
            self.lse_shape, dtype=self._float32, device=self.device)
        if poison:
            o.fill_(float("nan"))
            lse.fill_(float("nan"))
        main, words = self.main, self.main.words
        for at, x in zip(self.main_slots, (q, k, v, o, lse, bad)):
            words[at] = x.data_ptr()
        if self.rules.use_dropout:
            main.put(6, self.rules._fields.index("seed"), "Q", int(seed))
        main.launch(self.grid, self.threads, stream)
        if self.tail:
            self._run_tail(q, k, v, o, lse, bad, seed, stream, poison)
        return o, (lse if with_lse else None)

    def _new_scratch(self, stream, fresh):
        """V's bad-column flags, and an lse for calls that want none, for
        calls on `stream`: kept for the stream's next call (its kernels
        run after this call's), made anew for each call a CUDA graph
        captures (the graph's pool owns them) or that poisons outputs."""
        import torch

        bad = self._flags()
        lse = torch.empty(self.lse_shape, dtype=torch.float32,
                          device=self.device)
        if not fresh and bad.nbytes + lse.nbytes <= SCRATCH_BYTES:
            _keep(self._scratch, stream, (bad, lse))
        return bad, lse


class _BackwardPlan:
    """The 16-bit backward of one (shapes, dtype, options), prepared as
    _ForwardPlan is: a call launches the one preparation (prepare16: D =
    rowsum(dO o O), the rows' statistics and the ordered kernel's counts
    zeroed, into buffers the plan keeps for each stream), allocates the
    gradients (16-bit, or float32 for kernels without `grads16`) and
    launches the dK/dV and the dQ kernels from their packed buffers; or,
    with a fused kernel (names[1] None), that kernel on a float32 dQ,
    which it adds tau dS K to (zeroed first unless each tile's first
    turn stores it, `zero_dq`), then dQ in q's dtype."""

    def __init__(self, q, k, v, o, lse, do, dtype, options, names):
        _refuse_simulator("q: the 16-bit backward (backward_v5)")
        q, k, v, o, lse, do = _dense(q, k, v, o, lse, do)
        call = _Call(q, k, v, options)
        d, d_v = q.shape[-1], v.shape[-1]
        self.call, self.d, self.d_v = call, d, d_v
        self.rules = call.args[0]
        # read once: each reading of q.device makes a new object
        self.device, self.stream_of = q.device, stream_reader(q)
        kind = "bf16" if dtype == "bfloat16" else "f16"
        bh, nq, nk = call.bh, call.nq, call.nk
        import torch

        self.fused = names[1] is None
        self.ordered = self.fused and _ordered(names[0])
        self._scratch = {}  # stream -> (D, the statistics, the counts)
        self._capturing = capture_reader()
        dkv_tr, dq_tr = (traits.traits(n or names[0], d, d_v)
                         for n in names)
        # 16-bit pairs with dK, dV per K/V head, or float32 per query head
        self.grads16 = registry.get(names[0]).grads16
        bh_k = call.bh_kv if self.grads16 else bh
        self.grad_dtype = q.dtype if self.grads16 else torch.float32
        self.grids = (launch_grid(dkv_tr, nq, nk, bh_k, call.args[0],
                                  keys=True),
                      launch_grid(dq_tr, nq, nk, bh, call.args[0]))
        self.threads = (dkv_tr.threads, dq_tr.threads)
        self.out_shapes = ((*call.heads, nq, d), (*k.shape[:-2], nk, d),
                           (*v.shape[:-2], nk, d_v))
        self.shapes = (self.out_shapes if self.grads16 else (
            self.out_shapes[0], (*call.heads, nk, d), (*call.heads, nk, d_v)))
        self.views = ((bh, nq, d), (bh_k, nk, d), (bh_k, nk, d_v))
        bits = [x.view(torch.int16) for x in (q, k, v, do)]
        self.rows = (bh, nq, d_v // 2)  # dO and O as 16-bit pairs
        # the ordered kernel's counts: one per query head and tile
        self.counts = _count_shape(dkv_tr, bh, nq) if self.ordered \
            else (0,)
        self.prepare = kernel(f"prepare_{kind}", 0, 0).pack(
            *(x.view(torch.int32).view(bh * nq, d_v // 2)
              for x in (do, o)), self._delta(q).view(bh * nq),
            bits[0].view(bh, nq, d), bits[1].view(call.bh_kv, nk, d),
            lse.view(bh * nq), self._stats(q).view(2, bh * nq),
            self._counts().view(-1), *call.args)
        self.dot_grid = warp.dot_grid(bh * nq, d_v, _multiprocessors(),
                                      warp.PREPARE_BLOCKS_PER_SM)
        inputs = [bits[0].view(bh, nq, d),
                  bits[1].view(call.bh_kv, nk, d),
                  bits[2].view(call.bh_kv, nk, d_v),
                  bits[3].view(bh, nq, d_v), self._stats(q),
                  self._delta(q)]
        # v9 stores each dQ tile at its first turn: zeros only where a
        # tile may have none (kv_lengths: any batch element may have 0)
        self.zero_dq = self.fused and not (
            self.ordered and options["kv_lengths"] is None
            and _stores_every_tile(dkv_tr, nq, nk, self.rules))
        grads = self._grads(q)
        dq, dk, dv = (self._kernel_view(g, shape) for g, shape in zip(
            grads, self.views))
        if self.fused:  # dQ float32, as it is (and the counts, ordered)
            counts = (self._counts(),) if self.ordered else ()
            self.dkv = kernel(names[0], d, d_v).pack(
                *inputs, dk, dv, grads[0].view(self.views[0]), *counts,
                *call.args)
            return
        self.dkv = kernel(names[0], d, d_v).pack(*inputs, dk, dv,
                                                 *call.args)
        self.dq = kernel(names[1], d, d_v).pack(*inputs, dq, *call.args)

    def _new_scratch(self, stream, q, fresh):
        """D, the rows' statistics and the counts for calls on `stream`,
        kept for its next call (whose kernels run after this call's, and
        whose preparation zeroes the counts again) unless a CUDA graph
        captures this one or outputs are poisoned."""

        scratch = self._delta(q), self._stats(q), self._counts()
        if not fresh and sum(x.nbytes for x in scratch) <= SCRATCH_BYTES:
            _keep(self._scratch, stream, scratch)
        return scratch

    def _kernel_view(self, grad, shape):
        """A gradient as its kernel writes it: (BH, N, d) float32, or 16-bit
        pairs (BH, N, d / 2)."""
        grad = grad.view(shape)
        return _pairs(grad) if self.grads16 else grad

    def _delta(self, q):
        """Room for D_i = rowsum(dO_i o O_i), float32 (BH, Nq)."""
        import torch

        return torch.empty(self.rows[:2], dtype=torch.float32,
                           device=self.device)

    def _stats(self, q):
        """Room for the rows' shifts and norms, float32 (2 BH, Nq)."""
        import torch

        return torch.empty((2 * self.rows[0], self.rows[1]),
                           dtype=torch.float32, device=self.device)

    def _counts(self):
        """Room for the ordered kernel's int32 counts (BH, tiles), which
        prepare16 zeroes; none where the kernel keeps none."""
        import torch

        return torch.empty(self.counts, dtype=torch.int32,
                           device=self.device)

    def _grads(self, q):
        """Fresh dq, dk, dv as the kernels write them (`grads16`); dq
        float32 for the fused kernel, which adds to it (zeros unless each
        tile's first turn stores it, `zero_dq`)."""
        import torch

        grads = []
        if self.fused:
            new = torch.zeros if self.zero_dq else torch.empty
            grads = [new(self.shapes[0], dtype=torch.float32,
                         device=self.device)]
            # an accumulator that starts as zeros is never poisoned
            if not self.zero_dq and _poisoned():
                grads[0].fill_(float("nan"))
        empty = [torch.empty(s, dtype=self.grad_dtype, device=self.device)
                 for s in self.shapes[len(grads):]]
        if _poisoned():
            for g in empty:
                g.fill_(float("nan"))
        return grads + empty

    def run(self, q, k, v, o, lse, do, seed):
        """(dq, dk, dv) of one call; None where one of the six is
        contiguous but not 16-byte aligned, which the general path
        takes (`_fast_key`)."""
        for x in (q, k, v, o, lse, do):
            if x.is_contiguous() and x.data_ptr() & 15:
                return None
        return self(q, k, v, o, lse, do, seed)

    def __call__(self, q, k, v, o, lse, do, seed):
        q, k, v, o, lse, do = _dense(q, k, v, o, lse, do)
        stream = self.stream_of()
        fresh = _poisoned() or self._capturing()  # as _ForwardPlan's
        scratch = None if fresh else self._scratch.get(stream)
        if scratch is None:
            scratch = self._new_scratch(stream, q, fresh)
        delta, stats, counts = scratch
        # the preparation first: the GPU works on it while the host
        # allocates the gradients
        for arg, x in enumerate((do, o, delta, q, k, lse, stats, counts)):
            self.prepare.point(arg, x.data_ptr())
        self.prepare.launch(self.dot_grid, warp.THREADS, stream)
        dq, dk, dv = self._grads(q)
        counts = (counts,) if self.ordered else ()
        inputs = (q, k, v, do, stats, delta)
        launches = (((self.dkv, (dk, dv, dq, *counts)),) if self.fused else
                    ((self.dkv, (dk, dv)), (self.dq, (dq,))))
        for packed, outs in launches:
            for arg, x in enumerate((*inputs, *outs)):
                packed.point(arg, x.data_ptr())
            if self.rules.use_dropout:
                _check_seed(seed)
                packed.put(len(inputs) + len(outs),
                           self.rules._fields.index("seed"), "Q", int(seed))
        self.dkv.launch(self.grids[0], self.threads[0], stream)
        if self.fused:  # the float32 sum, rounded once to q's dtype
            dq = dq.to(q.dtype)
        else:
            self.dq.launch(self.grids[1], self.threads[1], stream)
        if not self.grads16:  # per query head: sum each group's
            dk, dv = (self.call.group_sum(g.view(-1, *g.shape[-2:]))
                      for g in (dk, dv))
        return (dq, dk.view(self.out_shapes[1]),
                dv.view(self.out_shapes[2]))


SCRATCH_STREAMS = 8  # streams a plan keeps buffers for at once
# bytes of buffers a plan keeps a stream: an allocation is worth saving
# on a small call only, where the host's time is much of the call's (a
# row's lse is 4 bytes where its q is 128 to 256: small beside the call)
SCRATCH_BYTES = 1 << 20


def capture_reader():
    """A function of no arguments: whether a CUDA graph is capturing the
    current stream (torch's C accessor where it has one)."""
    import torch

    return getattr(torch._C, "_cuda_isCurrentStreamCapturing",
                   torch.cuda.is_current_stream_capturing)


def _keep(scratch, stream, buffers):
    """scratch[stream] = buffers, emptying a full `scratch` first. Letting
    a stream's buffers go is safe while its kernels still read them:
    torch's allocator gives a freed block only to later allocations on
    the stream it was made on (the call's own), which run after them."""
    if len(scratch) >= SCRATCH_STREAMS:
        scratch.clear()
    scratch[stream] = buffers


def _check_seed(seed):
    """A dropout seed as the packed rules hold it: 0 <= seed < 2**64."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) \
            or not 0 <= seed < 2**64:
        raise ValueError(f"seed: expected an integer in [0, 2**64) when "
                         f"dropout_p > 0, got {seed!r}")


def _dense(*tensors):
    """The tensors as the packed kernels read them: contiguous (a copy
    only of a strided view; torch's copies start 16-byte aligned)."""
    return tuple(x if x.is_contiguous() else x.contiguous()
                 for x in tensors)
