"""Benchmarks: flashlab against torch on the same inputs, in one run.

    python -m flashlab.bench [--cpu] [--no-gpu] [--quick] [--out DIR]
    python -m flashlab.bench --tensor-cores [--backward-only] | --decode
    python -m flashlab.bench --ring | --ceilings
    python -m flashlab.bench [--host] [--training] [--gpt] [--quick]
    python -m flashlab.bench --step-gaps | --forward-rounds
    python -m flashlab.bench --forward-kernels | --reads | --waves

Each benchmark is a suite, one module each, written as data: its cases
(shape, pass, the implementations timed and the torch baseline every
ratio divides by), how each implementation is called, its timer, its
FLOP count (flashlab.costs.flops) and the columns it reports. One runner
(`run`) measures any suite and one writer (`report`) makes its CSV and
table. Suites: `scalar` (chapter 9's float32 versions, bench.csv, with
the float32 roof and peak memory), `cpu` (flashlab.cpu, --cpu),
`tensor` (chapter 10, tensor.csv and tensor.json with accuracy, roofs
and memory), `decode` (split-KV, decode.csv), `ring` (ring attention
over NCCL, ring.json), `host` (host microseconds per call, host.csv),
`training` (bf16 training shapes against flash and cuDNN, training.csv)
and `gpt` (a small GPT's training step, gpt.csv); `step_gaps` profiles
a training step's kernels for the GPU's idle time (step_gaps.json), and
`forward_rounds` times the bf16 forward against cuDNN and flash in
alternating rounds (forward_rounds.json), and `forward_kernels` sums
its kernels' device time at the training shapes against cuDNN's
(forward_kernels.json); `reads` times the kernels that only read (the
backward's D, V's flags) against torch's own read of the same data
(reads.json); `waves` times the forward at 16K against the number of
heads, with a model of how full its waves are (waves.json).
Times are medians after warm-up; FLOPs are 4 B H N^2 d for the forward
and 10 B H N^2 d for the backward, halved when causal. Every run prints
its table with the ratios to torch. Timings are never asserted anywhere:
this is a measurement, not a test.
"""

import functools

from flashlab.bench import cpu, decode, gpt, host, scalar, tensor, training
from flashlab.bench.cli import main
from flashlab.bench.extras import (
                                   accuracy,
                                   cpu_settings,
                                   gpu_ceilings,
                                   gpu_memory,
                                   tensor_ceilings,
)
from flashlab.bench.report import FIELDS, machine, plot, table, write_csv
from flashlab.bench.runner import Case, Suite, attention_flops, run

SUITES = {  # name: the function that builds the suite (defaults: H200)
    "gpu": scalar.suite, "cpu": cpu.suite, "tensor": tensor.suite,
    "tensor backward": functools.partial(tensor.suite, backward_only=True),
    "decode": decode.suite, "host": host.suite,
    "training": training.suite, "gpt": gpt.suite,
}

__all__ = ["Case", "FIELDS", "SUITES", "Suite", "accuracy",
           "attention_flops", "cpu_settings", "gpu_ceilings", "gpu_memory",
           "machine", "main", "plot", "run", "table", "tensor_ceilings",
           "write_csv"]
