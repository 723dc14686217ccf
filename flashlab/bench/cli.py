"""`python -m flashlab.bench`: choose suites by flag, run, write, print."""

import argparse
import os

from flashlab.bench import (
    cpu,
    decode,
    extras,
    forward_kernels,
    forward_rounds,
    gpt,
    hopper,
    host,
    reads,
    report,
    ring,
    scalar,
    step_gaps,
    tensor,
    training,
    waves,
)
from flashlab.bench.runner import run


def measure(suite, out):
    """Run one suite, write its CSV under `out`, print its table."""
    rows = run(suite)
    report.write_csv(rows, os.path.join(out, suite.csv), suite.columns)
    print(report.table(rows, suite.shown))
    return rows


def main(argv=None):
    """Parse the flags, measure, write the files; returns the rows."""
    from flashlab import bench

    ap = argparse.ArgumentParser(prog="python -m flashlab.bench",
                                 description=bench.__doc__.split("\n")[0])
    ap.add_argument("--no-gpu", action="store_true", help="skip the GPU")
    ap.add_argument("--cpu", action="store_true", help="run the CPU bench")
    ap.add_argument("--cpu-masks", action="store_true",
                    help="the CPU suite with a boolean and an additive "
                         "float (N, N) mask (cpu_masks.csv)")
    ap.add_argument("--cpu-ladder", action="store_true",
                    help="the commits that built the CPU softmax, each in "
                         "a fresh process (a git checkout; cpu_ladder.json)")
    ap.add_argument("--quick", action="store_true",
                    help="N = 1024 and 4096 only, fewer repetitions")
    ap.add_argument("--versions", default="1,2,3,4",
                    help="flashlab.gpu forward versions to time")
    ap.add_argument("--ceilings", action="store_true",
                    help="only measure the float32 and bandwidth roofs")
    ap.add_argument("--decode", action="store_true",
                    help="split-KV on decoding shapes (Nq 1, 16; Nk to "
                         "128K) against torch")
    ap.add_argument("--tensor-cores", action="store_true",
                    help="bf16 and 3xTF32 forward (d = 64, 128) against "
                         "torch's flash, cuDNN and efficient kernels, "
                         "with accuracy and the tensor-core roofs")
    ap.add_argument("--backward-only", action="store_true",
                    help="with --tensor-cores: the bf16 backward rows only")
    ap.add_argument("--ring", action="store_true",
                    help="ring attention over NCCL on every GPU here "
                         "against one GPU (see flashlab.bench.ring)")
    ap.add_argument("--host", action="store_true",
                    help="host microseconds per call, forward and "
                         "forward+backward, against SDPA (host.csv), and "
                         "the pieces of each call (host_parts.csv)")
    ap.add_argument("--training", action="store_true",
                    help="bf16 training shapes against SDPA's flash and "
                         "cuDNN backends (training.csv)")
    ap.add_argument("--step-gaps", action="store_true",
                    help="where a bf16 training step leaves the GPU idle, "
                         "flashlab (deterministic and not) against cuDNN "
                         "(step_gaps.json)")
    ap.add_argument("--forward-rounds", action="store_true",
                    help="the bf16 forward at B2 H8, N 4096 and 16384, "
                         "against SDPA's cuDNN and flash in alternating "
                         "rounds (forward_rounds.json)")
    ap.add_argument("--forward-kernels", action="store_true",
                    help="the bf16 forward's kernel times at the training "
                         "shapes against SDPA's cuDNN, from the profiler "
                         "(forward_kernels.json)")
    ap.add_argument("--reads", action="store_true",
                    help="the kernels that only read (the backward's D, "
                         "V's flags) against torch's read of the same "
                         "data (reads.json)")
    ap.add_argument("--waves", action="store_true",
                    help="the bf16 forward at 16K, d = 64, against the "
                         "heads, with a block's cost by its warpgroups "
                         "and the modeled fill of its waves (waves.json)")
    ap.add_argument("--gpt", action="store_true",
                    help="one training step of a 4-block GPT, SDPA "
                         "against flashlab, losses compared (gpt.csv)")
    ap.add_argument("--hopper", action="store_true",
                    help="v5, v7 and v8 (wgmma) forwards, v8 on e4m3, "
                         "and backward_v5, v7 and v8 against flash and "
                         "cuDNN, with accuracy and the ladder that built "
                         "v8 (Hopper)")
    ap.add_argument("--fp8-only", action="store_true",
                    help="with --hopper: the e4m3 rows alone "
                         "(hopper_fp8.csv)")
    ap.add_argument("--out", default=".", help="folder for csv and png")
    args = ap.parse_args(argv)
    if args.fp8_only and not args.hopper:
        ap.error("--fp8-only: expected with --hopper")
    os.makedirs(args.out, exist_ok=True)
    print("machine:", report.machine())
    if args.cpu_ladder:
        rows = cpu.ladder()
        cpu.write_ladder(args.out, rows)
        return rows
    if args.cpu_masks:
        return measure(cpu.suite(reps=3 if args.quick else 5,
                                 masks=cpu.MASKS), args.out)
    if args.ceilings:
        roofs = extras.gpu_ceilings()
        print(f"ceilings: float32 matmul {roofs['fp32_tflops']:.1f} TFLOP/s,"
              f" device copy {roofs['copy_tbps']:.2f} TB/s")
        return roofs
    if args.hopper:
        _need_cuda(ap)
        return hopper.main(args.out, fp8_only=args.fp8_only)
    if args.tensor_cores and args.backward_only:
        return measure(tensor.suite(backward_only=True), args.out)
    if args.tensor_cores:
        return tensor_main(args)
    if args.ring:
        return ring.main(args.out, report.machine())
    if args.step_gaps:
        _need_cuda(ap)
        return step_gaps.main(args.out, report.machine())
    if args.forward_rounds:
        _need_cuda(ap)
        return forward_rounds.main(args.out, report.machine())
    if args.forward_kernels:
        _need_cuda(ap)
        return forward_kernels.main(args.out, report.machine())
    if args.reads:
        _need_cuda(ap)
        return reads.main(args.out, report.machine())
    if args.waves:
        _need_cuda(ap)
        return waves.main(args.out, report.machine())
    if args.decode:
        return measure(decode.suite(), args.out)
    if args.host or args.training or args.gpt:
        return model_main(args, ap)
    rows, memory = [], None
    if not args.no_gpu:
        _need_cuda(ap)
        sizes = (1024, 4096) if args.quick else scalar.SIZES
        versions = [int(x) for x in args.versions.split(",")]
        rows += run(scalar.suite(sizes, versions))
        if not args.quick:
            memory = extras.gpu_memory()
    settings = None
    if args.cpu:
        rows += run(cpu.suite(reps=3 if args.quick else 5))
        settings = extras.cpu_settings()
    report.write_csv(rows, os.path.join(args.out, "bench.csv"))
    if any(r["device"] == "gpu" for r in rows):
        import matplotlib

        matplotlib.use("Agg")  # a file, not a window
        report.plot(rows).savefig(os.path.join(args.out, "bench.png"),
                                  dpi=120)
    print(report.table(rows))
    if settings:
        print(settings)
    if memory:
        print(f"memory: forward at N={memory['n']}, B*H={memory['bh']}, "
              f"d={memory['d']}, causal: peak {memory['peak_gib']:.3f} GiB "
              f"for {memory['need_gib']:.3f} GiB of inputs, output and lse "
              f"({memory['ratio']:.4f}x, {memory['seconds']:.1f} s)")
    return rows


def _need_cuda(ap):
    import torch

    if not torch.cuda.is_available():
        ap.error("no CUDA device: use --no-gpu --cpu")


def model_main(args, ap):
    """--host, --training, --gpt: attention as a model calls it, against
    torch in the same process; each suite writes its own CSV."""
    _need_cuda(ap)
    reps = 5 if args.quick else 20
    rows = []
    if args.host:
        rows += measure(host.suite(), args.out)
        found = host.parts()
        report.write_csv(found, os.path.join(args.out, "host_parts.csv"),
                         host.PART_COLUMNS)
        for r in found:
            print(f"{r['part']:<42}{r['us']:>9.1f} us")
    if args.training:
        rows += measure(training.suite(reps=reps), args.out)
    if args.gpt:
        found = measure(gpt.suite(reps=reps), args.out)
        worst = max(r["loss_diff"] for r in found)
        print(f"max |loss difference| to the SDPA run over the first "
              f"{min(gpt.COMPARE, gpt.WARM + reps)} steps: {worst:.3e}")
        rows += found
    return rows


def tensor_main(args):
    """--tensor-cores: tables of speed, accuracy, roofs and memory."""
    import json

    sizes = (1024, 4096) if args.quick else tensor.SIZES
    suite = tensor.suite(sizes)
    rows = run(suite)
    errs = extras.accuracy()
    roofs = extras.tensor_ceilings()
    memory = [extras.gpu_memory(dtype=dt, version=ver)
              for dt, ver in (("bfloat16", 5), ("float32", 6))]
    report.write_csv(rows, os.path.join(args.out, suite.csv))
    with open(os.path.join(args.out, "tensor.json"), "w") as f:
        json.dump(dict(machine=report.machine(), accuracy=errs,
                       ceilings=roofs, memory=memory), f, indent=1)
    print(report.table(rows))
    print("accuracy, max |O - O_float64| (N=4096, B*H=4, d=64):")
    for name, e in errs.items():
        print(f"  {name:<18} {e:.3e}")
    print("roofs, TFLOP/s:", ", ".join(f"{k} {v:.0f}"
                                        for k, v in roofs.items()))
    for m in memory:
        print(f"memory: {m['dtype']} v{m['version']} forward N={m['n']}: "
              f"{m['ratio']:.4f}x inputs + output + lse")
    return rows
