"""Run every CUDA kernel once at a small, ragged size: a target for
compute-sanitizer on a GPU machine, e.g.

    compute-sanitizer --tool memcheck python tests/sanitize_kernels.py
    compute-sanitizer --tool racecheck python tests/sanitize_kernels.py
    compute-sanitizer --tool synccheck python tests/sanitize_kernels.py tensor
    compute-sanitizer --tool racecheck python tests/sanitize_kernels.py \
        forward16
    compute-sanitizer --tool memcheck python tests/sanitize_kernels.py placed
    compute-sanitizer --tool memcheck --report-api-errors no \
        python tests/sanitize_kernels.py plans16

(plans16 runs torch's CUDA, whose start asks the driver for entry points
it lacks: memcheck lists those API errors unless told not to.)

It checks the results too, so a clean sanitizer run is also a right one.
"""

import numpy as np

from flashlab import gpu, reference


def forward_calls(d):
    """(label, dtype, keywords, tolerance) of every forward kernel at d
    that this GPU runs (16-bit ones in float16)."""
    from flashlab.gpu import launch, registry

    cc = launch.device_cc()
    calls = []
    for version in gpu.VERSIONS:
        for spec in registry.forwards(version):
            # float16 for the 16-bit kernels; e4m3's (flashlab.gpu.fp8,
            # scaled inputs) runs in test_gpu_fp8
            if not {"float16", "float32"} & set(spec.dtypes) \
                    or not spec.takes(d, d) or not spec.runs_on(cc):
                continue
            half = "float16" in spec.dtypes
            extra = ({"precision": spec.name[11:]} if version == 6
                     else {})
            # float16 output rounding: 2**-11 relative; tf32: 2**-11 on
            # each operand; float32 elsewhere
            tol = 1e-2 if half or spec.name.endswith("_tf32") else 1e-4
            calls.append((spec.name, np.float16 if half else np.float32,
                          dict(version=version, **extra), tol))
    return calls


def backward16(rng):
    """The tensor-core backward (float16 numpy inputs), ragged and
    grouped, masked and not, with deterministic=False as well (on Hopper
    v8's fused kernel, dQ added by TMA's reductions) and by v9, which
    must agree with the default. At 256 queries and keys every tile is
    whole and needs no mask: the consumers' path for such tiles."""
    for d in (64, 128):
        for kv_heads, opts, nq, nk in (
                (2, dict(), 77, 90),
                (1, dict(causal=True, window=(20, 3)), 77, 90),
                (2, dict(), 256, 256)):
            q = rng.standard_normal((1, 2, nq, d)).astype(np.float16)
            k, v = (rng.standard_normal((1, kv_heads, nk, d)).astype(
                np.float16) for _ in range(2))
            do = rng.standard_normal(q.shape).astype(np.float16)
            both_ways(q, k, v, do, opts)
    print("the 16-bit backward ran, both ways")


def both_ways(q, k, v, do, opts):
    """The backward of gpu.attention's own forward (float16 numpy), with
    deterministic=True and False, and by backward v9 where the GPU runs
    it (at d = d_v; at these lengths None runs v8): finite, and within
    float16's rounding of each other (each rounds float32 sums once)."""
    from flashlab.gpu import launch, registry

    o, lse = gpu.attention(q, k, v, return_lse=True, **opts)
    calls = [dict(deterministic=True), dict(deterministic=False)]
    if registry.get("backward_v9_fused_f16").runs_on(launch.device_cc()):
        calls.append(dict(version=9))
    runs = [gpu.attention_backward(q, k, v, o, lse, do, **kw, **opts)
            for kw in calls]
    for g, *others in zip(*runs):
        for g2 in others:
            assert np.isfinite(g).all() and np.isfinite(g2).all()
            scale = float(np.abs(g.astype(np.float32)).max())
            assert np.abs(g.astype(np.float32) - g2).max() <= 2.0**-9 * scale


def tensor_cores(rng):
    """The tensor-core kernels alone: backward16, then forward16."""
    backward16(rng)
    forward16(rng)


def forward16(rng):
    """Every tensor-core forward at both head dims, causal and not; at
    400 rows a causal block's first warpgroups stop before its last
    tiles (forward v8)."""
    for d, n in ((64, 77), (128, 77), (64, 400)):
        q, k, v = (rng.standard_normal((2, n, d)).astype(np.float32)
                   for _ in range(3))
        for causal in (False, True):
            for name, dtype, kw, tol in forward_calls(d):
                if kw["version"] not in gpu.TENSOR_CORE_VERSIONS:
                    continue
                x = [a.astype(dtype) for a in (q, k, v)]
                want = reference.attention(*(a.astype(np.float64) for a in x),
                                           causal=causal)
                got = gpu.attention(*x, causal=causal, **kw)
                assert np.max(np.abs(got - want)) < tol, (d, name)
    # blocks that visit no tile: bottom-right with 1000 queries and 600
    # keys leaves the first 400 rows without keys, and kv_lengths 0 an
    # element (v8 had waited there for copies that never came)
    for d in (64, 128):
        q = rng.standard_normal((2, 1000, d)).astype(np.float16)
        k, v = (rng.standard_normal((2, 600, d)).astype(np.float16)
                for _ in range(2))
        opts = dict(causal="bottom_right", kv_lengths=np.array([600, 0]))
        for name, dtype, kw, tol in forward_calls(d):
            if kw["version"] not in gpu.TENSOR_CORE_VERSIONS \
                    or dtype != np.float16:
                continue
            want = reference.attention(*(a.astype(np.float64)
                                         for a in (q, k, v)), **opts)
            got = gpu.attention(q, k, v, **opts, **kw)
            assert np.max(np.abs(got - want)) < tol, (d, name)
    print("tensor-core kernels ran")


def plans16(rng):
    """The prepared plans' own helper kernels (find_bad_parts and
    prepare16: D, the statistics, v9's counts) and kernels, through
    flashlab.torch on bf16 CUDA tensors: query lengths that leave a
    prepare16 block's later passes, or part of its last pass, without
    rows; then a NaN in V; then backward v9's plan (`ordered_plans`)."""
    import torch

    from flashlab import tiled
    from flashlab import torch as fl_torch

    for d, n in ((64, 77), (128, 77), (64, 300)):
        q, k, v, do = (torch.tensor(rng.standard_normal((2, 2, n, d)),
                                    dtype=torch.bfloat16, device="cuda")
                       for _ in range(4))
        wide = [x.double().cpu().numpy() for x in (q, k, v, do)]
        o, lse = tiled.attention(*wide[:3], causal=True, return_lse=True)
        want = tiled.attention_backward(*wide[:3], o, lse, wide[3],
                                        causal=True)
        leaves = [x.requires_grad_(True) for x in (q, k, v)]
        for _ in range(2):  # the first call makes the plans, then them
            grads = torch.autograd.grad(
                fl_torch.attention(*leaves, is_causal=True), leaves, do)
            for g, w in zip(grads, want):
                g = g.double().cpu().numpy()
                assert np.max(np.abs(g - w)) < 0.05 * np.abs(w).max(), d
        with torch.no_grad():
            v[1, 0, 5, 3] = float("nan")
            o = fl_torch.attention(q, k, v, is_causal=True)
        bad = torch.isnan(o).cpu().numpy()
        assert bad[1, 0, :, 3].all() and bad.sum() == n, d
    ordered_plans(rng)
    print("the plans' kernels ran")


def ordered_plans(rng):
    """Backward v9 through its plan, dQ poisoned where the host does not
    zero it: stored at each tile's first turn (causal, every query tile
    reached), and zeroed where a bottom-right mask leaves the first query
    tiles without keys (`host._stores_every_tile`)."""
    import torch

    from flashlab import tiled
    from flashlab.gpu import launch, registry

    if not registry.get("backward_v9_fused_bf16").runs_on(
            launch.device_cc()):
        return
    gpu.POISON_OUTPUTS = True
    for nq, nk, causal in ((300, 300, True), (200, 70, "bottom_right")):
        q, do = (torch.tensor(rng.standard_normal((2, 2, nq, 64)),
                              dtype=torch.bfloat16, device="cuda")
                 for _ in range(2))
        k, v = (torch.tensor(rng.standard_normal((2, 2, nk, 64)),
                             dtype=torch.bfloat16, device="cuda")
                for _ in range(2))
        o, lse = gpu.attention(q, k, v, causal=causal, return_lse=True)
        wide = [x.double().cpu().numpy() for x in (q, k, v, o, lse, do)]
        want = tiled.attention_backward(*wide, causal=causal)
        for _ in range(2):  # the first call makes the plan, then it
            got = gpu.attention_backward(q, k, v, o, lse, do,
                                         causal=causal, version=9)
            for g, w in zip(got, want):
                g = g.double().cpu().numpy()
                assert np.max(np.abs(g - w)) < 0.05 * np.abs(w).max(), (
                    nq, nk)
    gpu.POISON_OUTPUTS = False


def placed(rng, together=4):
    """The placed kernels (forward v7, v8; backward v7, v8 and the fused
    ones) with `together` of 6 heads started at once: the last group's
    two idle places leave at once, and every result matches float64."""
    from flashlab import order
    from flashlab.gpu import host

    order.for_launch = lambda *shape: together
    host._plans.clear()
    for d in (64, 128):
        q, k, v, do = (rng.standard_normal((2, 3, 150, d)).astype(
            np.float16) for _ in range(4))
        want = reference.attention(*(a.astype(np.float64) for a in (q, k, v)),
                                   causal=True)
        for version in (7, 8):
            got = gpu.attention(q, k, v, causal=True, version=version)
            assert np.max(np.abs(got - want)) < 1e-2, (d, version)
        both_ways(q, k, v, do, dict(causal=True))
    print(f"the placed kernels ran, {together} heads of 6 together")


def main():
    rng = np.random.default_rng(0)
    backward16(rng)
    for d in (16, 64, 128):
        q, k, v = (rng.standard_normal((2, 77, d)).astype(np.float32)
                   for _ in range(3))
        do = rng.standard_normal((2, 77, d)).astype(np.float32)
        for causal in (False, True):
            for name, dtype, kw, tol in forward_calls(d):
                x = [a.astype(dtype) for a in (q, k, v)]
                want = reference.attention(*(a.astype(np.float64) for a in x),
                                           causal=causal)
                got = gpu.attention(*x, causal=causal, **kw)
                assert np.max(np.abs(got - want)) < tol, (d, name)
            o, lse = gpu.attention(q, k, v, causal=causal, return_lse=True)
            grads = gpu.attention_backward(q, k, v, o, lse, do,
                                           causal=causal)
            assert all(np.isfinite(g).all() for g in grads)
        print(f"d={d}: forward {[c[0] for c in forward_calls(d)]} and "
              f"backward ran")
    # masks, padding to no key at all, and non-finite input: the finishing
    # kernels of flashlab.nonfinite run with empty rows and bad columns
    q, k, v = (rng.standard_normal((2, 77, 64)).astype(np.float32)
               for _ in range(3))
    v[1, 3, 5] = np.nan
    opts = dict(kv_lengths=np.array([0, 60]), window=(9, 2), causal=True)
    for name, dtype, kw, tol in forward_calls(64):
        x = [a.astype(dtype) for a in (q, k, v)]
        want = reference.attention(*(a.astype(np.float64) for a in x),
                                   **opts)
        o = gpu.attention(*x, **kw, **opts)
        assert np.array_equal(np.isnan(o), np.isnan(want)), name
        ok = ~np.isnan(want)
        assert np.max(np.abs(o[ok] - want[ok])) < tol, name
    print("masked, padded and non-finite cases ran")
    # split-KV: v3 on blockIdx.z, then the combine kernel, ragged splits
    want = reference.attention(*(a.astype(np.float64) for a in (q, k, v)),
                               **opts)
    o = gpu.attention(q, k, v, version=3, num_splits=3, **opts)
    assert np.array_equal(np.isnan(o), np.isnan(want))
    ok = ~np.isnan(want)
    assert np.max(np.abs(o[ok] - want[ok])) < 1e-4
    print("split-KV and its combine ran")
    # grouped heads: 4 query heads read 2 K/V heads, every kernel
    q4 = rng.standard_normal((1, 4, 77, 64)).astype(np.float32)
    k2, v2 = (rng.standard_normal((1, 2, 77, 64)).astype(np.float32)
              for _ in range(2))
    want = reference.attention(q4, *(np.repeat(x, 2, 1) for x in (k2, v2)),
                               causal=True)
    for name, dtype, kw, tol in forward_calls(64):
        x = [a.astype(dtype) for a in (q4, k2, v2)]
        o = gpu.attention(*x, causal=True, **kw)
        assert np.max(np.abs(o - want)) < tol * 10, name
    o, lse = gpu.attention(q4, k2, v2, causal=True, return_lse=True)
    grads = gpu.attention_backward(q4, k2, v2, o, lse, np.ones_like(q4),
                                   causal=True)
    assert [g.shape for g in grads] == [q4.shape, k2.shape, v2.shape]
    print("grouped heads ran")


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["backward16"]:
        backward16(np.random.default_rng(0))
    elif sys.argv[1:] == ["forward16"]:
        forward16(np.random.default_rng(0))
    elif sys.argv[1:] == ["tensor"]:
        tensor_cores(np.random.default_rng(0))
    elif sys.argv[1:] == ["plans16"]:
        plans16(np.random.default_rng(0))
    elif sys.argv[1:] == ["placed"]:
        placed(np.random.default_rng(0))
    else:
        main()
