"""Chapter 9's CPU suite: flashlab.cpu against torch's CPU attention.

float32, 4-D inputs (1, 4, N, 64), N = 1024 and 4096, 2 threads for
both, forward and backward, full and causal, the calls of a case
interleaved rep by rep in one process (medians); plus flashlab.cpu with
64 x 64 tiles, its tile products alone, and the drop-in
flashlab.torch.attention on the same tensors. Its rows join bench.csv
(--cpu). With masks (--cpu-masks, cpu_masks.csv) the same calls take an
(N, N) mask instead of the causal rule: a boolean one, and a float one
that adds to the scores ("bias", as ALiBi's or a -1e9 fill's), refusing
the same pairs. `ladder` (--cpu-ladder) measures the commits that built
the softmax, each in a fresh process, into cpu_ladder.json.
"""

import json
import os
import subprocess
import sys
import tempfile

from flashlab.bench import report, timing
from flashlab.bench.runner import Case, Suite

FORWARD = ("torch sdpa", "flashlab cpu", "flashlab.torch",
           "cpu 64x64 tiles", "cpu products only")
BACKWARD = ("torch sdpa", "flashlab cpu", "flashlab.torch")
MASKS = ("bool", "bias")  # --cpu-masks: a boolean mask, a float one
REFUSED = 0.1  # the masks' share of refused pairs


def suite(reps=5, sizes=(1024, 4096), b=1, h=4, d=64, threads=2,
          masks=(None,)):
    """Forward and backward cases per size and causal setting; with
    masks (of MASKS), per size and mask, without the causal rule (SDPA
    takes one or the other)."""
    cases = tuple(Case(pass_, b, h, n, d, causal,
                       impls[:3] if mask else impls, "torch sdpa", reps,
                       params={"threads": threads, "mask": mask})
                  for n in sizes
                  for mask in masks
                  for causal in ((False,) if mask else (False, True))
                  for pass_, impls in (("forward", FORWARD),
                                       ("backward", BACKWARD)))
    impls = {
        ("forward", "torch sdpa"): _sdpa,
        ("forward", "flashlab cpu"): _cpu(),
        ("forward", "flashlab.torch"): _drop_in,
        ("forward", "cpu 64x64 tiles"): _cpu(block_q=64, block_k=64),
        ("forward", "cpu products only"): _products,
        ("backward", "torch sdpa"): _sdpa_backward,
        ("backward", "flashlab cpu"): _cpu_backward,
        ("backward", "flashlab.torch"): _drop_in_backward,
    }
    return Suite("cpu", cases, _inputs, impls, timing.interleaved,
                 columns=report.FIELDS, shown=report.SHOWN,
                 device=f"cpu x{threads}",
                 csv="bench.csv" if masks == (None,) else "cpu_masks.csv",
                 label=_label)


def _label(case, impl):
    """The row's impl: with a mask, its kind after the impl's name."""
    mask = case.params.get("mask")
    return f"{impl} {mask}" if mask else impl


def _inputs(case):
    """q, k, v, dO: (B, H, N, d) float32 numpy arrays, seeded, and the
    case's (N, N) mask or None; torch and numba set to its threads."""
    import numba
    import numpy as np
    import torch

    torch.set_num_threads(case.params["threads"])
    numba.set_num_threads(case.params["threads"])
    rng = np.random.default_rng(0)
    x = [rng.standard_normal((case.B, case.H, case.N, case.d),
                             dtype=np.float32) for _ in range(4)]
    mask = case.params.get("mask")
    if mask is not None:  # the same pairs refused by both kinds
        keep = rng.random((case.N, case.N)) >= REFUSED
        bias = rng.standard_normal((case.N, case.N), dtype=np.float32)
        mask = keep if mask == "bool" else np.where(keep, bias, -np.inf)
    return [*x, mask]


def _rules(case, x, tensors=False):
    """The keywords of a case's call: its causal rule, or its mask (as
    SDPA's attn_mask, a tensor, when `tensors`)."""
    if x[4] is None:
        return {"is_causal" if tensors else "causal": case.causal}
    if tensors:
        import torch

        return {"attn_mask": torch.from_numpy(x[4])}
    return {"mask": x[4]}


def _sdpa(case, x):
    import torch
    import torch.nn.functional as F

    q, k, v = (torch.from_numpy(t) for t in x[:3])
    rules = _rules(case, x, tensors=True)
    return lambda: F.scaled_dot_product_attention(q, k, v, **rules)


def _cpu(**blocks):
    def make(case, x):
        from flashlab import cpu

        rules = _rules(case, x)
        return lambda: cpu.attention(*x[:3], **rules, **blocks)
    return make


def _products(case, x):
    from flashlab import cpu

    return lambda: cpu.products_only(*x[:3], causal=case.causal)


def _sdpa_backward(case, x):
    """torch's CPU backward, autograd from a saved forward."""
    import torch
    import torch.nn.functional as F

    leaves = [torch.from_numpy(t).requires_grad_() for t in x[:3]]
    out = F.scaled_dot_product_attention(*leaves,
                                         **_rules(case, x, tensors=True))
    do = torch.from_numpy(x[3])
    return lambda: torch.autograd.grad(out, leaves, do, retain_graph=True)


def _cpu_backward(case, x):
    from flashlab import cpu

    q, k, v, do = x[:4]
    rules = _rules(case, x)
    o, lse = cpu.attention(q, k, v, return_lse=True, **rules)
    return lambda: cpu.attention_backward(q, k, v, o, lse, do, **rules)


def _drop_in(case, x):
    """flashlab.torch.attention on CPU tensors: numpy views, no copies."""
    import torch

    from flashlab import torch as fl_torch

    q, k, v = (torch.from_numpy(t) for t in x[:3])
    rules = _rules(case, x, tensors=True)
    return lambda: fl_torch.attention(q, k, v, **rules)


def _drop_in_backward(case, x):
    """The drop-in's backward, autograd from a saved forward as SDPA's."""
    import torch

    from flashlab import torch as fl_torch

    leaves = [torch.from_numpy(t).requires_grad_() for t in x[:3]]
    out = fl_torch.attention(*leaves, **_rules(case, x, tensors=True))
    do = torch.from_numpy(x[3])
    return lambda: torch.autograd.grad(out, leaves, do, retain_graph=True)


def machine():
    """The CPU and the BLAS kernels, as threadpoolctl reports them."""
    import platform

    import numpy as np  # noqa: F401 (loads the OpenBLAS it reports)
    import threadpoolctl

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f
                         if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    blas = [dict(api=p["internal_api"], kernels=p.get("architecture"),
                 version=p.get("version"))
            for p in threadpoolctl.threadpool_info()
            if p["user_api"] == "blas"]
    return dict(cpu=model, cores=os.cpu_count(), blas=blas,
                OPENBLAS_CORETYPE=os.environ.get("OPENBLAS_CORETYPE", ""),
                versions=report.machine())


# (commit, what it changed): the steps that built the softmax between
# the two products, in order; None is the tree being measured
LADDER = (
    ("149fb0d", "BLAS tiles: max from column 1, a masking pass, exp2 of "
                "degree 7"),
    ("e4626cc", "exp2 of degree 5 (1.4 ulps)"),
    ("b761ac5", "rows from column 0, causal spans instead of a masking "
                "pass"),
    (None, "this tree"),
)

# One ladder step in a fresh process: flashlab from the step's tree,
# torch's SDPA and flashlab.cpu interleaved rep by rep, medians in ms.
_STEP = """
import json, statistics, sys, time
import numpy as np, numba, torch
import torch.nn.functional as F
from flashlab import cpu
n, reps, threads = json.loads(sys.argv[1])
torch.set_num_threads(threads)
numba.set_num_threads(threads)
rng = np.random.default_rng(0)
x = [rng.standard_normal((1, 4, n, 64), dtype=np.float32)
     for _ in range(4)]
t = [torch.from_numpy(a) for a in x]
out = []
for causal in (False, True):
    o, lse = cpu.attention(*x[:3], causal=causal, return_lse=True)
    leaves = [a.clone().requires_grad_() for a in t[:3]]
    o_t = F.scaled_dot_product_attention(*leaves, is_causal=causal)
    calls = {
        "torch": lambda: F.scaled_dot_product_attention(
            *t[:3], is_causal=causal),
        "forward": lambda: cpu.attention(*x[:3], causal=causal),
        "products": lambda: cpu.products_only(*x[:3], causal=causal),
        "torch backward": lambda: torch.autograd.grad(
            o_t, leaves, t[3], retain_graph=True),
        "backward": lambda: cpu.attention_backward(
            *x[:3], o, lse, x[3], causal=causal),
    }
    times = {name: [] for name in calls}
    for fn in calls.values():
        fn()
    for _ in range(reps):
        for name, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
    out.append(dict(causal=causal, **{
        name: statistics.median(ts) for name, ts in times.items()}))
print(json.dumps(out))
"""


def ladder(repo=".", steps=LADDER, n=4096, reps=7, threads=2):
    """[{step, commit, causal, forward_ms, torch_ms, ratio, products_ms,
    outside, backward_ms, torch_backward_ms, backward_ratio}]: each
    commit's flashlab (git archive of `repo`) in a fresh process."""
    rows = []
    for commit, label in steps:
        with tempfile.TemporaryDirectory() as tree:
            env = dict(os.environ)
            if commit is not None:  # that commit's package, nothing else
                archive = subprocess.run(
                    ["git", "-C", repo, "archive", commit, "flashlab"],
                    capture_output=True, check=True).stdout
                subprocess.run(["tar", "-x", "-C", tree], input=archive,
                               check=True)
                env["PYTHONPATH"] = tree
            done = subprocess.run(
                [sys.executable, "-c", _STEP, json.dumps([n, reps,
                                                          threads])],
                env=env, cwd=tree, capture_output=True, text=True,
                check=True)
        for r in json.loads(done.stdout):
            rows.append(dict(
                step=label, commit=commit or "HEAD", causal=r["causal"],
                forward_ms=r["forward"], torch_ms=r["torch"],
                ratio=r["torch"] / r["forward"],
                products_ms=r["products"],
                outside=(r["forward"] - r["products"]) / r["forward"],
                backward_ms=r["backward"],
                torch_backward_ms=r["torch backward"],
                backward_ratio=r["torch backward"] / r["backward"]))
    return rows


def write_ladder(out, rows, n=4096, threads=2):
    """cpu_ladder.json under `out` (the machine, the shape, the steps);
    prints one line per step."""
    with open(os.path.join(out, "cpu_ladder.json"), "w") as f:
        json.dump(dict(
            machine=machine(), command="python -m flashlab.bench "
            "--cpu-ladder", shape=f"B1 H4 N{n} d64 float32",
            threads=threads, timing="wall clock, flashlab and torch "
            "interleaved rep by rep in one process per step, medians",
            steps=rows), f, indent=1)
    for r in rows:
        print(f"{r['step'][:44]:44s} {'causal' if r['causal'] else 'full':6s}"
              f" fwd {r['forward_ms']:7.1f} ms {r['ratio']:.2f}x, outside "
              f"products {100 * r['outside']:4.1f}%; bwd "
              f"{r['backward_ms']:7.1f} ms {r['backward_ratio']:.2f}x")
