"""Stored measurements that the chapters read, shipped inside the package.

The benchmark tables and ceilings in `flashlab/data/` were measured with
`python -m flashlab.bench` (tensor_h200: `--tensor-cores`, decode_h200:
`--decode`, ring_h200x2 and ring_h200: `--ring` on two GPUs and on
one; launch_h200 with
`python -m flashlab.launch_cost`, gpt_h200 with `--gpt`; hopper_h200,
hopper_backward_h200, hopper_fp8_h200 and hopper_ladder_h200:
`--hopper`; hopper_fused_order_h200 with `bench.hopper.backward_rows`
run twice for each of two builds; hopper_full_run_h200 with the forwards
run twice for each of two builds; hopper_whole_tiles_h200 with the
backwards of v8, v8's fused kernel and v9 the same way, by
`bench.timing.gpu_time`; hopper_stalls with ncu's source
counters, reduced by `python -m flashlab.stalls`; hopper_trials_h200
the one-off runs of builds that were not kept, as its notes say;
hopper_order_h200 the causal kernels with the heads started together
forced, as its command says; hopper_turns_h200 backward v9's kernel
time under torch.profiler in builds that order its turns differently;
hopper_v9_default_h200 a training step's kernels with version None
running backward v9 or v8, as its command says; hopper_prepare_h200 the
backward's preparation kernels alone and in a step, and
hopper_block_times_h200 forward v8's per-block clock stamps from a build
that writes them, as their notes say; training_h200 with `--training`;
reads_h200 with `--reads`;
cpu_masks with
`--cpu-masks`), the registers
and local memory per kernel with `python -m flashlab.ptx --resources`, the
profile with Nsight Compute (ncu), on the machine their first line or
"machine" field names. They are read through importlib.resources, so a
chapter finds them wherever flashlab is installed, whatever its working
directory. See chapters 9 and 10.
"""

import csv
import io
import json
from importlib import resources

FILES = ("bench_cpu.csv", "bench_cpu.txt", "bench_h200.csv",
         "bench_h200.txt", "ceilings_h200.txt", "resources_h200.txt",
         "tensor_h200.csv", "tensor_h200.json", "profile_h200.txt",
         "decode_h200.csv", "ring_h200x2.json", "ring_h200.json",
         "launch_h200.json",
         "gpt_h200.csv", "hopper_h200.csv", "hopper_h200.json",
         "hopper_backward_h200.csv", "hopper_fp8_h200.csv",
         "hopper_fused_order_h200.csv",
         "hopper_profile_h200.txt", "hopper_stalls_h200.csv",
         "hopper_full_run_h200.csv", "hopper_whole_tiles_h200.csv",
         "hopper_warpgroups_h200.csv", "hopper_step_h200.json",
         "hopper_dq_h200.json", "hopper_helpers_h200.json",
         "hopper_forward_rounds_h200.json",
         "hopper_trials_h200.json",
         "hopper_ladder_h200.json", "hopper_order_h200.json",
         "hopper_epilogue_h200.json", "hopper_staged_o_h200.json",
         "hopper_forward_kernels_h200.json", "hopper_turns_h200.json",
         "hopper_v9_default_h200.json", "hopper_prepare_h200.json",
         "hopper_block_times_h200.json", "training_h200.csv",
         "reads_h200.json", "hopper_waves_h200.json",
         "cpu_ladder.json",
         "cpu_ladder_avx2.json", "bench_cpu_dropin.csv",
         "bench_cpu_dropin.txt", "bench_cpu_dropin_avx2.csv",
         "cpu_masks.csv", "cpu_masks.txt")


def text(name):
    """The stored file `name` (one of FILES) as a string."""
    if name not in FILES:
        raise ValueError(f"name: expected one of {FILES}, got {name!r}")
    return resources.files("flashlab.data").joinpath(name).read_text(
        encoding="utf-8")


def record(name):
    """The stored JSON file `name` (a .json of FILES) as a dict."""
    if not name.endswith(".json"):
        raise ValueError(f"name: expected a .json file, got {name!r}")
    return json.loads(text(name))


def rows(name):
    """The stored benchmark table `name` (a .csv of FILES) as typed dicts."""
    if not name.endswith(".csv"):
        raise ValueError(f"name: expected a .csv file, got {name!r}")
    out = []
    for r in csv.DictReader(io.StringIO(text(name))):
        r["N"], r["ms"] = int(r["N"]), float(r["ms"])
        for key in ("tflops", "vs_torch"):  # where the table has them
            if key in r:
                r[key] = float(r[key])
        r["causal"] = r["causal"] == "True"
        out.append(r)
    return out
