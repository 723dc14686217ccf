"""Chapter 12's suite: forward v7 on Hopper, and the ladder that built it.

`main` measures the bf16 forward of v5, v7 and v8 against torch's flash
and cuDNN kernels (tensor.suite's forward cases, hopper.csv), the bf16
backward of backward_v5, v7 and v8 against theirs (hopper_backward.csv), the
e4m3 forward against v8 and theirs on bf16 (hopper_fp8.csv), the
forwards' error against float64 SDPA on the same inputs, e4m3's too
(hopper.json), and the ladder
(hopper_ladder.json): v7 built three ways, then v8, each in a fresh
process with a kernel cache of its own, since the switches are read when
a kernel is built.

1. assembled by nvJitLink, as numba's own kernels are: relocatable code,
   in which ptxas waits for every wgmma at once (its warning C7509);
2. assembled whole by ptxas: the products stay asynchronous and the
   softmax runs under P V, tiles still unswizzled core matrices;
3. tiles 128-byte swizzled: v7 as flashlab runs it;
4. v8: the copies moved to a producer warpgroup (TMA), the tiles handed
   over on mbarriers instead of a block barrier, registers moved to the
   consumers by setmaxnreg.
"""

import dataclasses
import json
import os
import subprocess
import sys
import tempfile

from flashlab.bench import report, runner, tensor, timing

SIZES = (1024, 4096, 16384)
LADDER = (("nvJitLink: every wgmma waited at once", 7, False, False),
          ("ptxas, whole: asynchronous wgmma", 7, True, False),
          ("128-byte swizzled tiles", 7, True, True),
          ("v8: TMA producer, mbarriers, setmaxnreg", 8, True, True))
LADDER_SHAPE = (2, 8, 16384)  # B, H, N of every ladder step

_STEP = """
import json, sys, torch
from flashlab import gpu
from flashlab.bench import timing
from flashlab.gpu import forward_v7, launch
version, whole, swizzle, (b, h, n), cases = json.loads(sys.argv[1])
launch.WHOLE_PROGRAM, forward_v7.SWIZZLE = whole, swizzle
out = []
for d, causal in cases:
    g = torch.Generator(device="cuda").manual_seed(n + d)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", generator=g)
               .bfloat16() for _ in range(3))
    ms = timing.gpu_time(lambda: gpu.attention(q, k, v, causal=causal,
                                               version=version), 10)
    out.append(ms)
print(json.dumps(out))
"""


def forward_rows(sizes=SIZES):
    """tensor.suite's bf16 forward rows: v5, v7, flash, cuDNN."""
    suite = tensor.suite(sizes=sizes)
    cases = tuple(c for c in suite.cases
                  if c.pass_ == "forward" and c.dtype == "bfloat16")
    return runner.run(dataclasses.replace(suite, cases=cases, csv=None))


BACKWARD = ("flashlab v5 bf16", "flashlab v7 bf16",
            "flashlab v7 fused bf16", "flashlab v8 bf16",
            "flashlab v8 fused bf16", "flashlab v9 bf16", "torch flash bf16",
            "torch cudnn bf16")


def backward_rows(sizes=(4096, 16384), dims=(64, 128), b=2, h=8):
    """The bf16 backward alone, from a saved forward: backward_v5, v7
    (gpu.attention_backward; v7 deterministic, and fused with dQ by
    atomics), v8 (and fused, dQ by TMA's reductions) and v9 (those
    reductions in turn) against
    torch's flash and cuDNN backwards (autograd), per (d, N, causal)."""
    cases = tuple(runner.Case("backward", b, h, n, d, c, BACKWARD,
                              "torch flash bf16", 5 if n > 8192 else 20,
                              dtype="bfloat16")
                  for d in dims for n in sizes for c in (False, True))
    impls = {("backward", "flashlab v5 bf16"): _saved_backward(5),
             ("backward", "flashlab v7 bf16"):
             tensor._hopper(_saved_backward(7)),
             ("backward", "flashlab v7 fused bf16"):
             tensor._hopper(_saved_backward(7, deterministic=False)),
             ("backward", "flashlab v8 bf16"):
             tensor._hopper(_saved_backward(8)),
             ("backward", "flashlab v8 fused bf16"):
             tensor._hopper(_saved_backward(8, deterministic=False)),
             ("backward", "flashlab v9 bf16"):
             tensor._hopper(_saved_backward(9)),
             ("backward", "torch flash bf16"):
             tensor._backward("FLASH_ATTENTION"),
             ("backward", "torch cudnn bf16"):
             tensor._backward("CUDNN_ATTENTION")}
    suite = runner.Suite("hopper backward", cases, tensor._inputs, impls,
                         timing.events, columns=report.FIELDS,
                         shown=report.SHOWN, csv=None,
                         optional=("torch cudnn bf16", "flashlab v7 bf16",
                                   "flashlab v7 fused bf16",
                                   "flashlab v8 bf16",
                                   "flashlab v8 fused bf16",
                                   "flashlab v9 bf16"))
    return runner.run(suite)


def _saved_backward(version, deterministic=True):
    """gpu.attention_backward of backward `version` from a saved forward
    (v8's, or v5's where there is no Hopper)."""
    def make(case, x):
        from flashlab import gpu
        from flashlab.gpu import registry

        part = "dkv" if deterministic and version < 9 else "fused"
        if not registry.get(f"backward_v{version}_{part}_bf16").takes(
                case.d, case.d):
            def absent():
                raise RuntimeError(f"backward v{version} ({part}) is not "
                                   f"built for d = {case.d}")
            return absent
        o, lse = gpu.attention(*x[:3], causal=case.causal, return_lse=True)
        return lambda: gpu.attention_backward(
            *x[:3], o, lse, x[3], causal=case.causal, version=version,
            deterministic=deterministic)
    return make


FP8 = ("flashlab v8 e4m3", "flashlab v7 bf16", "flashlab v8 bf16",
       "torch flash bf16", "torch cudnn bf16")


def fp8_rows(sizes=(4096, 16384), b=2, h=8, d=128):
    """fp8_suite's rows, measured."""
    return runner.run(fp8_suite(sizes, b, h, d))


def fp8_suite(sizes=(4096, 16384), b=2, h=8, d=128):
    """The e4m3 forward (gpu.attention_fp8, inputs quantized before the
    clock starts) against v7, v8 and torch's flash and cuDNN on the bf16
    inputs, per (N, causal), in one suite (one clock for every ratio);
    ratios over torch flash."""
    cases = tuple(runner.Case("forward", b, h, n, d, c, FP8,
                              "torch flash bf16", 5 if n > 8192 else 20,
                              dtype="bfloat16")
                  for n in sizes for c in (False, True))
    impls = {("forward", "flashlab v8 e4m3"): tensor._hopper(_fp8),
             ("forward", "flashlab v7 bf16"):
             tensor._hopper(tensor._flashlab(version=7)),
             ("forward", "flashlab v8 bf16"):
             tensor._hopper(tensor._flashlab(version=8)),
             ("forward", "torch flash bf16"):
             tensor._sdpa("FLASH_ATTENTION"),
             ("forward", "torch cudnn bf16"):
             tensor._sdpa("CUDNN_ATTENTION")}
    return runner.Suite("hopper fp8", cases, tensor._inputs, impls,
                        timing.events, columns=report.FIELDS,
                        shown=report.SHOWN, csv=None,
                        optional=("torch cudnn bf16", "flashlab v8 e4m3",
                                  "flashlab v7 bf16", "flashlab v8 bf16"))


def _fp8(case, x):
    """attention_fp8 on x's q, k, v quantized per tensor (untimed)."""
    from flashlab import gpu

    (q, dq), (k, dk), (v, dv) = (gpu.quantize(t) for t in x[:3])
    return lambda: gpu.attention_fp8(q, k, v, descale_q=dq, descale_k=dk,
                                     descale_v=dv, causal=case.causal)


def fp8_accuracy(n=4096, seed=11, spreads=(1.0, 4.0)):
    """{"e4m3 spread 1 full": {"max", "rms"}, ...}: the e4m3 forward's
    and v8 bf16's error against float64 attention of the same float32
    inputs (B1 H4 d128; q and k times `spread`: sharper rows), and e4m3's
    against float64 attention of its own dequantized inputs (what the
    rounding of P and O alone costs)."""
    import torch
    import torch.nn.functional as F

    from flashlab import gpu

    gen = torch.Generator(device="cuda").manual_seed(seed)
    out = {}
    for spread in spreads:
        for causal in (False, True):
            q, k, v = (torch.randn(1, 4, n, 128, device="cuda",
                                   generator=gen) for _ in range(3))
            q, k = q * spread, k * spread
            (q8, dq), (k8, dk), (v8, dv) = (gpu.quantize(t)
                                            for t in (q, k, v))
            got = {"e4m3": gpu.attention_fp8(
                q8, k8, v8, descale_q=dq, descale_k=dk, descale_v=dv,
                causal=causal),
                "bf16": gpu.attention(q.bfloat16(), k.bfloat16(),
                                      v.bfloat16(), causal=causal,
                                      version=8)}
            want = F.scaled_dot_product_attention(
                q.double(), k.double(), v.double(), is_causal=causal)
            own = F.scaled_dot_product_attention(
                q8.double() * dq, k8.double() * dk, v8.double() * dv,
                is_causal=causal)
            label = f"spread {spread:g} {'causal' if causal else 'full'}"
            for name, o, ref in (("e4m3", got["e4m3"], want),
                                 ("bf16", got["bf16"], want),
                                 ("e4m3 own inputs", got["e4m3"], own)):
                err = o.double() - ref
                out[f"{name} {label}"] = {
                    "max": err.abs().max().item(),
                    "rms": err.square().mean().sqrt().item()}
    return out


def accuracy(n=2048, seed=7):
    """{"v5 d64 full": max |o - float64 SDPA|, ...} on the same bf16
    inputs (B1 H4) for v5, v7, v8 and torch's flash kernel."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashlab import gpu

    gen = torch.Generator(device="cuda").manual_seed(seed)
    out = {}
    for d in (64, 128):
        for causal in (False, True):
            q, k, v = (torch.randn(1, 4, n, d, device="cuda", generator=gen)
                       .bfloat16() for _ in range(3))
            want = F.scaled_dot_product_attention(
                q.double(), k.double(), v.double(), is_causal=causal)
            got = {f"v{version}": gpu.attention(q, k, v, causal=causal,
                                                version=version)
                   for version in (5, 7, 8)}
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                got["flash"] = F.scaled_dot_product_attention(
                    q, k, v, is_causal=causal)
            for name, o in got.items():
                key = f"{name} d{d} {'causal' if causal else 'full'}"
                out[key] = (o.double() - want).abs().max().item()
    return out


def ladder(cases=((128, False), (64, False))):
    """[{step, d, causal, ms, tflops}]: each step of LADDER (a version,
    built whole or not, its tiles swizzled or not)."""
    b, h, n = LADDER_SHAPE
    rows = []
    for step, version, whole, swizzle in LADDER:
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, FLASHLAB_CACHE_DIR=cache)
            done = subprocess.run(
                [sys.executable, "-c", _STEP,
                 json.dumps([version, whole, swizzle, LADDER_SHAPE,
                             cases])],
                env=env, capture_output=True, text=True, check=True)
        for (d, causal), ms in zip(cases, json.loads(done.stdout)):
            case = runner.Case("forward", b, h, n, d, causal, (), "", 1)
            rows.append(dict(step=step, d=d, causal=causal, ms=ms,
                             tflops=runner.attention_flops(case) / ms
                             / 1e9))
    return rows


def main(out, fp8_only=False):
    """Measure everything above; write hopper.csv, hopper.json and
    hopper_ladder.json under `out` and print the tables (fp8_only: the
    e4m3 rows alone, hopper_fp8.csv)."""
    if fp8_only:
        fp8 = fp8_rows()
        report.write_csv(fp8, os.path.join(out, "hopper_fp8.csv"))
        print(report.table(fp8))
        return fp8
    rows = forward_rows()
    report.write_csv(rows, os.path.join(out, "hopper.csv"))
    print(report.table(rows))
    backward = backward_rows()
    report.write_csv(backward, os.path.join(out, "hopper_backward.csv"))
    print(report.table(backward))
    fp8 = fp8_rows()
    report.write_csv(fp8, os.path.join(out, "hopper_fp8.csv"))
    print(report.table(fp8))
    record = {"machine": report.machine(), "accuracy": accuracy(),
              "fp8_accuracy": fp8_accuracy()}
    with open(os.path.join(out, "hopper.json"), "w") as f:
        json.dump(record, f, indent=1)
    print(json.dumps(record["accuracy"], indent=1))
    steps = ladder()
    b, h, n = LADDER_SHAPE
    with open(os.path.join(out, "hopper_ladder.json"), "w") as f:
        json.dump({"machine": record["machine"],
                   "command": "python -m flashlab.bench --hopper",
                   "shape": f"B{b} H{h} N{n} bf16", "steps": steps}, f,
                  indent=1)
    for s in steps:
        print(f"{s['step']:40s} d{s['d']:<4d} {s['ms']:8.3f} ms "
              f"{s['tflops']:7.1f} TFLOP/s")
    return rows
