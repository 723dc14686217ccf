"""A benchmark suite as data, and the one runner that measures it.

A suite lists its cases (shape, pass, the implementations timed there
and the baseline every ratio divides by), how to make each
implementation's call from a case's inputs, how to time the calls,
the FLOPs of one call, and the columns it reports. `run` turns a suite
into rows, one per (case, implementation); `report` writes them.
"""

import sys
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

from flashlab import costs


@dataclass(frozen=True)
class Case:
    """One measured point: a shape, a pass, the impls timed on it and the
    impl whose time every ratio divides (the baseline, torch's)."""

    pass_: str  # "forward", "backward", "fwd+bwd", "decode", "step"
    B: int
    H: int
    N: int  # keys (and queries, unless nq is given)
    d: int
    causal: bool = False
    impls: tuple = ()  # names in Suite.impls for this pass, in row order
    baseline: str = ""
    reps: int = 20  # timed repetitions (calls per loop for host time)
    nq: Optional[int] = None  # query rows where they differ from N
    dtype: str = "float32"
    params: Mapping = field(default_factory=dict, compare=False)

    def describe(self):
        """A short label for progress lines."""
        shape = f"B{self.B} H{self.H} N{self.N} d{self.d}"
        if self.nq is not None:
            shape = f"Nq{self.nq} Nk{self.N} d{self.d}"
        return f"{self.pass_} {shape} causal={self.causal}"


def attention_flops(case):
    """FLOPs of one call: B H times costs.flops of the case's pass."""
    nq = case.N if case.nq is None else case.nq

    def one(backward):
        return case.B * case.H * costs.flops(nq, case.N, case.d,
                                             causal=case.causal,
                                             backward=backward)

    if case.pass_ == "fwd+bwd":
        return one(False) + one(True)
    return one(case.pass_ == "backward")


@dataclass(frozen=True)
class Suite:
    """Cases, implementations, timer, FLOP count and reported columns.

    inputs(case) builds what every impl of a case shares; impls[pass,
    name](case, inputs) returns the call to time; time(calls, case) returns
    {name: ms per call}. Impls named in `optional` may be missing from a
    build (cuDNN): a RuntimeError on their first call drops their row.
    extra(case, inputs), if given, adds columns per impl after timing.
    """

    name: str
    cases: tuple
    inputs: Callable
    impls: Mapping
    time: Callable
    columns: tuple
    shown: tuple  # the columns of the printed table
    flops: Optional[Callable] = attention_flops
    device: str = "gpu"  # the rows' device column
    csv: Optional[str] = None  # file name under --out
    optional: tuple = ()
    label: Optional[Callable] = None  # label(case, impl) -> row's impl
    extra: Optional[Callable] = None


def run(suite, progress=True):
    """Measure every case of `suite`: one row per (case, impl), with the
    columns of suite.columns, the ratio vs_torch = baseline ms / ms."""
    rows = []
    for step, case in enumerate(suite.cases, 1):
        if progress:
            _progress(step, len(suite.cases),
                      f"{suite.name} {case.describe()}")
        x = suite.inputs(case)
        calls = {name: suite.impls[case.pass_, name](case, x)
                 for name in case.impls}
        for name in suite.optional:
            if name in calls and not _works(calls[name]):
                print(f"\n{suite.name}: {name} is not available here, "
                      f"no row", file=sys.stderr)
                del calls[name]
        ms = suite.time(calls, case)
        extra = suite.extra(case, x) if suite.extra else {}
        base = ms[case.baseline]
        flops = suite.flops(case) if suite.flops else None
        for name, t in ms.items():
            label = suite.label(case, name) if suite.label else name
            row = _row(suite, case, label, t, base / t, flops)
            row.update(extra.get(name, {}))
            rows.append({key: row.get(key) for key in suite.columns})
        del x, calls
        if suite.device == "gpu":
            import torch

            torch.cuda.empty_cache()  # the next case's inputs fit alone
    if progress:
        print(file=sys.stderr)
    return rows


def _works(call):
    """Whether call() runs: False when this build lacks the backend."""
    try:
        call()
    except RuntimeError:
        return False
    return True


def _row(suite, case, label, ms, ratio, flops):
    """Every column a suite may report, for one measured impl."""
    row = dict(device=suite.device, impl=label, causal=case.causal,
               B=case.B, H=case.H, N=case.N, d=case.d, dtype=case.dtype,
               calls=case.reps, ms=round(ms, 4), us=round(ms * 1e3, 1),
               vs_torch=round(ratio, 3), **case.params)
    row["pass"] = case.pass_
    if flops is not None:
        row["tflops"] = round(flops / ms / 1e9, 3)
    return row


def _progress(step, total, label):
    width = 24
    done = int(width * step / total)
    print(f"\r[{'#' * done}{'.' * (width - done)}] {step}/{total} "
          f"{label:<48}", end="", file=sys.stderr, flush=True)
