"""The benchmark suites and their runner, on the CPU at tiny sizes.

No timing is asserted: the checks are the suites' data (cases,
baselines, FLOP counts by costs.flops, the shapes the launch-path issue
names), the rows the runner makes from any times (columns, ratios,
TFLOP/s), that every implementation a suite times computes the same
attention, and the files and tables the writer makes.
"""

import csv

import numpy as np
import pytest
import torch

from flashlab import bench, costs, measured, reference
from flashlab.bench import (
    cli,
    cpu,
    forward_kernels,
    forward_rounds,
    gpt,
    host,
    reads,
    report,
    step_gaps,
    timing,
    training,
    waves,
)
from flashlab.bench.runner import Case, Suite, run

TINY = (("fwd+bwd", 2, 2, 64, 64, True), ("forward", 1, 3, 48, 64, False),
        ("fwd+bwd", 1, 4, 40, 32, True, 2))  # grouped: 4 query heads, 2 K/V
# d = 64: the tensor-core kernels take it on a GPU


def _costs_flops(case):
    """FLOPs of one call of `case`, from costs.flops by its pass."""
    nq = case.N if case.nq is None else case.nq
    fwd = case.B * case.H * costs.flops(nq, case.N, case.d,
                                        causal=case.causal)
    bwd = case.B * case.H * costs.flops(nq, case.N, case.d,
                                        causal=case.causal, backward=True)
    return {"forward": fwd, "decode": fwd, "backward": bwd,
            "fwd+bwd": fwd + bwd}[case.pass_]


@pytest.mark.parametrize("name", sorted(bench.SUITES))
def test_every_suite_is_consistent_data(name):
    suite = bench.SUITES[name]()
    assert suite.cases
    for case in suite.cases:
        assert case.baseline in case.impls
        for impl in case.impls:
            assert (case.pass_, impl) in suite.impls
        if "tflops" in suite.columns:
            assert suite.flops(case) == _costs_flops(case)
        else:
            assert suite.flops is None
    assert set(suite.shown) <= set(report.COLUMNS)
    assert {"impl", "vs_torch"} <= set(suite.columns)
    assert suite.csv.endswith(".csv")


def test_flops_of_a_training_step_are_fourteen_n_squared_d():
    # 4 B H N^2 d forward + 10 B H N^2 d backward, halved by causality
    case = training.suite().cases[0]
    assert (case.pass_, case.B, case.H, case.N, case.d, case.causal) == (
        "fwd+bwd", 16, 12, 1024, 64, True)
    assert bench.attention_flops(case) == 14 * 16 * 12 * 1024**2 * 64 / 2


def test_suites_measure_the_shapes_the_issue_names():
    fwd, step = host.suite().cases
    for case in (fwd, step):
        assert (case.B, case.H, case.N, case.d, case.causal, case.dtype,
                case.reps) == (1, 4, 128, 64, True, "bfloat16", 200)
    assert (fwd.pass_, step.pass_) == ("forward", "fwd+bwd")
    forward = training.suite().cases[1]
    assert (forward.pass_, forward.B, forward.H, forward.N, forward.d,
            forward.dtype) == ("forward", 2, 8, 1024, 64, "bfloat16")
    assert training.suite().optional == ("torch cudnn",)
    (model,) = gpt.suite().cases
    assert (model.B, model.N, model.params["C"], model.params["layers"],
            model.dtype) == (8, 1024, 512, 4, "bfloat16")


def _fixed_clock(ms):
    """A timer that reports the times in `ms` instead of measuring."""
    def timer(calls, case):
        for fn in calls.values():
            fn()
        return {name: ms[name] for name in calls}
    return timer


def test_runner_rows_ratios_and_flops_from_given_times(rng):
    ms = {"ours": float(rng.uniform(1, 5)), "theirs": float(rng.uniform(1, 5)),
          "missing": 1.0}

    def missing(case, x):
        def call():
            raise RuntimeError("no such backend in this build")
        return call

    case = Case("forward", 2, 3, 256, 32, True, ("ours", "theirs",
                                                "missing"), "theirs")
    suite = Suite("fixed", (case,), lambda case: None,
                  {("forward", "ours"): lambda c, x: lambda: None,
                   ("forward", "theirs"): lambda c, x: lambda: None,
                   ("forward", "missing"): missing},
                  _fixed_clock(ms), columns=report.FIELDS,
                  shown=report.SHOWN, optional=("missing",))
    rows = run(suite, progress=False)
    assert [r["impl"] for r in rows] == ["ours", "theirs"]  # missing: no row
    flops = 2 * 3 * costs.flops(256, 256, 32, causal=True)
    for r in rows:
        assert list(r) == list(report.FIELDS)
        assert r["ms"] == round(ms[r["impl"]], 4)
        assert r["vs_torch"] == round(ms["theirs"] / ms[r["impl"]], 3)
        assert r["tflops"] == round(flops / ms[r["impl"]] / 1e9, 3)
    assert rows[1]["vs_torch"] == 1.0


def test_a_missing_required_impl_is_an_error():
    def missing(case, x):
        def call():
            raise RuntimeError("no such backend in this build")
        return call

    case = Case("forward", 1, 1, 8, 8, False, ("gone",), "gone")
    suite = Suite("fixed", (case,), lambda case: None,
                  {("forward", "gone"): missing}, _fixed_clock({}),
                  columns=report.FIELDS, shown=report.SHOWN)
    with pytest.raises(RuntimeError, match="no such backend"):
        run(suite, progress=False)


def _check_csv(path, rows, columns):
    with open(path, newline="") as f:
        found = list(csv.DictReader(f))
    assert list(found[0]) == list(columns)
    assert len(found) == len(rows)
    return found


def _check_ratios(rows, key="ms", half_unit=5e-5, baseline="torch sdpa"):
    """Every case's baseline row has ratio 1, the others its time over
    theirs, up to the rounding of the times (to 2 half_units) and of the
    ratio (3 decimals)."""
    for r in rows:
        base = next(b for b in rows if b["pass"] == r["pass"]
                    and b["causal"] == r["causal"] and b["N"] == r["N"]
                    and b["impl"] == baseline)
        assert base["vs_torch"] == 1.0
        ratio = base[key] / r[key]
        bound = 5e-4 + ratio * (half_unit / base[key] + half_unit / r[key])
        assert r["vs_torch"] > 0
        assert abs(r["vs_torch"] - ratio) <= bound * (1 + 1e-9)


def test_cpu_suite_writes_its_columns_and_ratios(tmp_path):
    suite = cpu.suite(reps=1, sizes=(64,), b=1, h=2, d=16, threads=1)
    rows = cli.measure(suite, str(tmp_path))
    _check_csv(tmp_path / "bench.csv", rows, report.FIELDS)
    assert len(rows) == 16  # 2 x (5 forward + 3 backward)
    assert {r["device"] for r in rows} == {"cpu x1"}
    assert [r["vs_torch"] for r in rows if r["impl"] == "torch sdpa"] == [
        1.0] * 4
    _check_ratios(rows)
    for r in rows:
        assert r["tflops"] == pytest.approx(
            r["B"] * r["H"] * costs.flops(r["N"], r["N"], r["d"],
                                          causal=r["causal"],
                                          backward=r["pass"] == "backward")
            / r["ms"] / 1e9, rel=1e-3, abs=1e-3)


def test_cpu_mask_suite_labels_its_rows(tmp_path):
    # --cpu-masks: each mask kind's rows carry its name, and their ratios
    # divide by SDPA's time with the same mask
    suite = cpu.suite(reps=1, sizes=(64,), b=1, h=2, d=16, threads=1,
                      masks=cpu.MASKS)
    rows = cli.measure(suite, str(tmp_path))
    _check_csv(tmp_path / "cpu_masks.csv", rows, report.FIELDS)
    assert [r["impl"] for r in rows] == [
        f"{impl} {mask}" for mask in cpu.MASKS for _ in range(2)
        for impl in cpu.BACKWARD]
    for mask in cpu.MASKS:
        _check_ratios([r for r in rows if r["impl"].endswith(mask)],
                      baseline=f"torch sdpa {mask}")


def test_host_suite_on_the_cpu(tmp_path):
    suite = host.suite(shape=(1, 2, 32, 16), calls=3, device="cpu",
                       dtype="float32")
    rows = cli.measure(suite, str(tmp_path))
    found = _check_csv(tmp_path / "host.csv", rows, host.COLUMNS)
    assert [(r["pass"], r["impl"]) for r in found] == [
        ("forward", "flashlab"), ("forward", "torch sdpa"),
        ("fwd+bwd", "flashlab"), ("fwd+bwd", "torch sdpa")]
    assert all(r["calls"] == 3 and r["us"] > 0 for r in rows)
    _check_ratios(rows, key="us", half_unit=0.05)


def test_host_loop_alternates_the_calls_loop_by_loop():
    # warm-up calls of each first, then the loops of a and b in turn, so
    # a drift of the host's speed falls on both
    order = []
    calls = {"a": lambda: order.append("a"), "b": lambda: order.append("b")}
    case = Case("host", 1, 1, 4, 4, False, ("a", "b"), "a", 3)
    ms = timing.host_loop("cpu", loops=2, warm=1)(calls, case)
    assert "".join(order) == "ab" + "aaabbb" * 2
    assert set(ms) == {"a", "b"} and all(t >= 0 for t in ms.values())


def test_host_parts_on_the_cpu():
    # every piece timed, in order, none of the GPU's plans off a GPU
    rows = host.parts(shape=(1, 2, 32, 16), calls=2, device="cpu",
                      dtype="float32")
    assert [r["part"] for r in rows] == [
        "torch.empty of o's shape", "autograd.grad of one C++ op",
        "autograd.grad of one Python Function",
        "flashlab forward, no grad", "flashlab forward+backward",
        "sdpa forward, no grad", "sdpa forward+backward"]
    assert all(set(r) == set(host.PART_COLUMNS) and r["device"] == "cpu"
               and r["calls"] == 2 and r["us"] > 0 for r in rows)


def test_training_suite_on_the_cpu_drops_the_missing_backend(tmp_path):
    # cuDNN has no CPU kernel: its rows are left out, the rest measured
    suite = training.suite(shapes=TINY, reps=2, device="cpu",
                           dtype="float32")
    rows = cli.measure(suite, str(tmp_path))
    _check_csv(tmp_path / "training.csv", rows, training.COLUMNS)
    assert [r["impl"] for r in rows] == [
        "flashlab", "flashlab atomic dq", "torch flash"] * 3
    assert [r["vs_torch"] for r in rows][2::3] == [1.0] * 3
    assert [r["H_kv"] for r in rows] == [2] * 3 + [3] * 3 + [2] * 3
    # TFLOP/s from the row's own (rounded) ms, both rounded to 3 places:
    # they may differ by one unit of the last place, no more
    assert [r["tflops"] for r in rows] == pytest.approx([
        _costs_flops(c) / r["ms"] / 1e9
        for c, r in zip([c for c in suite.cases for _ in "abc"], rows)],
        abs=1.001e-3, rel=0)


SAME = [("cpu", "float32", 1e-4),
        pytest.param("cuda", "bfloat16", 2e-2, marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device, dtype, budget", SAME)
@pytest.mark.parametrize("name", ["host", "training"])
def test_every_impl_computes_the_same_attention(name, device, dtype,
                                                budget, rng):
    # against float64 on the same (rounded) inputs, relative to the
    # largest entry: float32 rounds O and the gradients near 1e-6 of it,
    # bf16 (8 bits, P rounded before P V) near 4e-3; the budgets leave
    # room and still catch a wrong mask, scale or shape (errors of order
    # 1). Fresh inputs of the suite's shapes, not the suite's seeded ones
    make = {"host": lambda: host.suite(shape=(1, 3, 48, 64), calls=1,
                                       device=device, dtype=dtype),
            "training": lambda: training.suite(shapes=TINY, device=device,
                                               dtype=dtype)}[name]
    suite = make()
    for case in suite.cases:
        heads = case.params.get("H_kv", case.H)  # grouped: k, v fewer
        x = [torch.from_numpy(rng.standard_normal(
                 (case.B, h, case.N, case.d))).to(
                 device=device, dtype=getattr(torch, dtype))
             for h in (case.H, heads, heads, case.H)]
        for t in x[:3]:
            t.requires_grad_(case.pass_ == "fwd+bwd")
        q, k, v, do = (t.detach().cpu().double().numpy() for t in x)
        group = case.H // heads  # query head h reads K/V head h // group
        o = reference.attention(q, np.repeat(k, group, axis=1),
                                np.repeat(v, group, axis=1),
                                causal=case.causal)
        for impl in case.impls:
            try:
                got = suite.impls[case.pass_, impl](case, x)()
            except RuntimeError:
                assert impl in suite.optional  # cuDNN: none on a CPU
                continue
            if case.pass_ == "forward":
                err = np.abs(got.cpu().double().numpy() - o).max()
                err /= np.abs(o).max()
            else:
                err = _gradient_error(q, k, v, do, case.causal, got)
            assert err < budget, (case.pass_, impl, err)


def _gradient_error(q, k, v, do, causal, got):
    """max |dX - dX_float64| / max |dX_float64| over dQ, dK, dV, the
    float64 gradients by torch's autograd of the materialized math (K and
    V repeated to the query heads, so grouped heads sum their gradients)."""
    leaves = [torch.from_numpy(t).requires_grad_() for t in (q, k, v)]
    group = q.shape[1] // k.shape[1]
    kx, vx = (t.repeat_interleave(group, dim=1) for t in leaves[1:])
    s = leaves[0] @ kx.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        s = s.masked_fill(~keep, float("-inf"))
    o = torch.softmax(s, -1) @ vx
    want = torch.autograd.grad(o, leaves, torch.from_numpy(do))
    return max(float((g.cpu().double() - w).abs().max() / w.abs().max())
               for g, w in zip(got, want))


def test_gpt_suite_trains_identically_in_float64(tmp_path):
    # float64 on the CPU: the two runs give the same losses to rounding
    # (test_transformer holds 1e-10 over 30 steps); a wrong attention
    # call would differ by far more from the first step on
    suite = gpt.suite(batch=2, n=16, width=32, heads=2, layers=1,
                      vocab=16, reps=3, device="cpu", dtype="float64")
    rows = cli.measure(suite, str(tmp_path))
    _check_csv(tmp_path / "gpt.csv", rows, gpt.COLUMNS)
    ours, theirs = rows
    assert (ours["impl"], theirs["impl"]) == ("flashlab", "torch sdpa")
    assert theirs["loss_diff"] == 0.0 and theirs["vs_torch"] == 1.0
    assert 0 <= ours["loss_diff"] < 1e-10
    assert (ours["C"], ours["layers"], ours["N"]) == (32, 1, 16)


@pytest.mark.gpu
def test_new_suites_run_on_the_gpu(tmp_path):
    # the runner over the host, training and GPT suites at small sizes
    # on CUDA in bf16; the losses of a bf16 model trained both ways
    # stay within bf16's rounding of a loss near 4 (2^-8 of it is 0.016,
    # 0.05 allows the few steps to drift), a wrong attention would not
    rows = cli.measure(host.suite(calls=5), str(tmp_path))
    assert len(rows) == 4
    rows = cli.measure(training.suite(shapes=TINY, reps=3), str(tmp_path))
    assert {"flashlab", "torch flash"} <= {r["impl"] for r in rows}
    suite = gpt.suite(batch=2, n=128, width=128, heads=2, layers=2,
                      vocab=64, reps=10)
    ours, theirs = cli.measure(suite, str(tmp_path))
    assert theirs["loss_diff"] == 0.0
    assert ours["loss_diff"] < 0.05


def test_table_reproduces_the_stored_cpu_run():
    # bench_cpu.txt is what `python -m flashlab.bench --cpu` printed
    rows = measured.rows("bench_cpu.csv")
    assert bench.table(rows) in measured.text("bench_cpu.txt")


def test_command_line_without_a_gpu(tmp_path, monkeypatch, capsys):
    rows = bench.main(["--no-gpu", "--out", str(tmp_path)])
    assert rows == []
    with open(tmp_path / "bench.csv") as f:
        assert f.read().strip() == ",".join(report.FIELDS)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for flag in ("--host", "--training", "--gpt", "--step-gaps",
                 "--forward-rounds", "--forward-kernels", "--reads"):
        with pytest.raises(SystemExit):
            bench.main([flag, "--out", str(tmp_path)])
        assert "no CUDA device" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--help"])
    out = capsys.readouterr().out
    for flag in ("--cpu", "--no-gpu", "--quick", "--out", "--tensor-cores",
                 "--backward-only", "--decode", "--ring", "--ceilings",
                 "--versions", "--host", "--training", "--gpt", "--hopper",
                 "--fp8-only", "--step-gaps", "--forward-rounds",
                 "--forward-kernels", "--reads"):
        assert flag in out
    with pytest.raises(SystemExit):
        bench.main(["--fp8-only", "--out", str(tmp_path)])
    assert "--fp8-only: expected with --hopper" in capsys.readouterr().err


def test_fp8_suite_times_v7_and_v8_beside_e4m3():
    # chapter 12's e4m3 ratios over v7 and v8 are of rows of one suite
    from flashlab.bench import hopper

    suite = hopper.fp8_suite()
    assert {(c.N, c.causal) for c in suite.cases} == {
        (n, c) for n in (4096, 16384) for c in (False, True)}
    for case in suite.cases:
        assert {"flashlab v8 e4m3", "flashlab v7 bf16",
                "flashlab v8 bf16"} <= set(case.impls)
        assert case.baseline == "torch flash bf16" and case.d == 128
        assert all(("forward", impl) in suite.impls for impl in case.impls)
        assert suite.flops(case) == _costs_flops(case)


def test_hopper_ladder_changes_one_thing_per_step():
    # each step of the ladder switches one build setting on, in order,
    # and ends at the kernel flashlab runs; the child's code compiles
    from flashlab.bench import hopper
    from flashlab.gpu import forward_v7, launch

    switches = [(version, whole, swizzle)
                for _, version, whole, swizzle in hopper.LADDER]
    assert switches == [(7, False, False), (7, True, False),
                        (7, True, True), (8, True, True)]
    assert switches[-1][1:] == (launch.WHOLE_PROGRAM, forward_v7.SWIZZLE)
    compile(hopper._STEP, "ladder step", "exec")


def test_cpu_machine_names_the_blas_kernels():
    m = cpu.machine()
    assert m["cores"] >= 1 and m["cpu"]
    assert all(b["kernels"] for b in m["blas"])  # e.g. SkylakeX, Haswell


def test_step_gaps_summarize_medians_of_each_steps_gaps(rng):
    # three kernels a step at random starts and lengths: each step's own
    # gaps, idle time and span, then the medians over the steps
    steps, kernels, want = 5, [], []
    t = 0.0
    for _ in range(steps):
        t += float(rng.uniform(100, 200))  # the host's time between steps
        start, durs, gaps = t, rng.uniform(5, 50, 3), rng.uniform(0, 30, 2)
        for i, dur in enumerate(durs):
            kernels.append((t, float(dur)))
            t += float(dur) + (float(gaps[i]) if i < 2 else 0.0)
        want.append((durs.sum(), t - start, gaps))
    got = step_gaps.summarize(kernels, steps, forward_at=1)
    med = np.median
    assert got["kernel_us"] == round(med([w[0] for w in want]), 1)
    assert got["first_to_last_us"] == round(med([w[1] for w in want]), 1)
    assert got["idle_us"] == round(med([w[1] - w[0] for w in want]), 1)
    assert got["wait_us"] == round(med([w[2][1] for w in want]), 1)
    assert got["gaps_us"] == [round(med([w[2][i] for w in want]), 1)
                              for i in range(2)]
    with pytest.raises(ValueError, match="kernels: expected"):
        step_gaps.summarize(kernels[:-1], steps, 1)
    with pytest.raises(ValueError, match="forward_at"):
        step_gaps.summarize(kernels, steps, 2)


def test_step_gaps_by_name_sums_each_kernel_a_step():
    # flashlab's mangled names shortened to the function's, others cut;
    # the same name's events summed and divided by the steps, longest
    # first
    fused = ("flashlab::gpu::backward_v8::_make::_3clocals_3e::"
             "backward_v9_fused[abi:v1,cw51cXTLSUwv1sCUt9Uw1VEAA](Array)")
    dot = "flashlab::gpu::warp::_row_dot16::_3clocals_3e::row_dot16[abi:v2]"
    fill = "void at::native::vectorized_elementwise_kernel<4, " + "x" * 80
    events = [(fused, 900.0), (dot, 80.0), (fill, 29.0), ("Memset", 1.5),
              (fused, 916.0), (dot, 79.0), ("Memset", 2.5)]
    got = step_gaps.by_name(events, steps=2)
    assert got == {"backward_v9_fused": 908.0, "row_dot16": 79.5,
                   fill[:step_gaps.NAME_CHARS]: 14.5, "Memset": 2.0}
    assert list(got) == ["backward_v9_fused", "row_dot16",
                         fill[:step_gaps.NAME_CHARS], "Memset"]
    with pytest.raises(ValueError, match="steps"):
        step_gaps.by_name(events, 0)


def test_step_gaps_median_rounds_is_the_median_round_a_step():
    # ms per round of 10 steps: the median round's µs a step of each, and
    # cuDNN's over flashlab's (an odd count of rounds, then an even one)
    got = step_gaps.median_rounds(
        {"flashlab": [6.0, 5.0, 9.0], "cudnn": [4.5, 4.0, 4.2]}, 10)
    assert got == {"us": 600.0, "cudnn_us": 420.0, "x_cudnn": 0.7}
    got = step_gaps.median_rounds(
        {"flashlab": [6.0, 5.0, 9.0, 7.0], "cudnn": [4.5, 4.0, 4.2, 4.0]},
        10)
    assert got == {"us": 650.0, "cudnn_us": 410.0,
                   "x_cudnn": round(410 / 650, 3)}
    # and deterministic=False's rounds, where there are any
    got = step_gaps.median_rounds(
        {"flashlab": [6.0, 5.0, 9.0], "flashlab atomic": [5.0, 5.2, 6.0],
         "cudnn": [4.5, 4.0, 4.2]}, 10)
    assert got == {"us": 600.0, "cudnn_us": 420.0, "x_cudnn": 0.7,
                   "atomic_us": 520.0, "x_cudnn_atomic": round(420 / 520, 3)}
    with pytest.raises(ValueError, match="rounds_ms"):
        step_gaps.median_rounds({"flashlab": [1.0]}, 10)
    with pytest.raises(ValueError, match="rounds_ms"):
        step_gaps.median_rounds({"flashlab atomic": [1.0], "cudnn": [1.0]},
                                10)
    with pytest.raises(ValueError, match="per_round"):
        step_gaps.median_rounds({"flashlab": [1.0], "cudnn": [1.0]}, 0)


def test_forward_rounds_takes_each_median_round_a_call():
    # ms per round of 10 calls: each impl's median round, a tenth of it
    got = forward_rounds.per_call_ms(
        {"flashlab": [6.0, 5.0, 9.0], "cudnn": [4.5, 4.0, 4.2, 4.0],
         "flash": [8.0]}, 10)
    assert got == {"flashlab": 0.6, "cudnn": 0.41, "flash": 0.8}
    with pytest.raises(ValueError, match="rounds_ms"):
        forward_rounds.per_call_ms({"flashlab": [1.0], "cudnn": []}, 10)
    with pytest.raises(ValueError, match="per_round"):
        forward_rounds.per_call_ms({"flashlab": [1.0]}, 0)


def test_forward_rounds_rows_count_the_forwards_flops():
    # B2 H8 N16K d128: 4 B H N^2 d FLOPs, half of them under a causal
    # mask; the ratios are cuDNN's and flash's time over flashlab's
    shape = (2, 8, 16384, 128, True)
    ms = {"flashlab": 2.0, "cudnn": 2.2, "flash": 3.0}
    got = forward_rounds.row(shape, ms)
    flop = 4 * 2 * 8 * 16384**2 * 128 / 2
    assert got == dict(B=2, H=8, N=16384, d=128, causal=True,
                       flashlab_tflops=round(flop / 2e-3 / 1e12, 1),
                       cudnn_tflops=round(flop / 2.2e-3 / 1e12, 1),
                       flash_tflops=round(flop / 3e-3 / 1e12, 1),
                       x_cudnn=1.1, x_flash=1.5)
    assert {s[:4] for s in forward_rounds.SHAPES} == {
        (2, 8, 16384, 64), (2, 8, 16384, 128), (2, 8, 4096, 64),
        (2, 8, 4096, 128)}


def test_forward_kernels_rows_sum_each_impls_kernels():
    # flashlab's forward is two kernels (V's flags, then the forward);
    # cuDNN's one: the ratio is cuDNN's sum over flashlab's
    kernels = {"flashlab": {"forward_v8": 300.0, "find_bad_parts": 20.0},
               "cudnn": {"fprop": 256.0}}
    got = forward_kernels.row((8, 16, 2048, 128, True), kernels)
    assert got == dict(B=8, H=16, N=2048, d=128, causal=True,
                       kernels=kernels,
                       total_us={"flashlab": 320.0, "cudnn": 256.0},
                       x_cudnn=0.8)
    with pytest.raises(ValueError, match="kernels"):
        forward_kernels.row((8, 16, 2048, 128, True),
                            {"flashlab": kernels["flashlab"]})
    with pytest.raises(ValueError, match="kernels"):
        forward_kernels.row((8, 16, 2048, 128, True),
                            {"flashlab": {}, "cudnn": {"fprop": 1.0}})
    # the step's training shapes, both masks at 2048, and 4096 causal
    assert set(forward_kernels.SHAPES) >= {
        (16, 12, 1024, 64, True), (8, 16, 2048, 128, True),
        (8, 16, 2048, 128, False)}


def test_reads_rates_against_torchs_read_in_the_same_state():
    # 134 MB of dO and O at B8 H16 N2048 d128 (bf16), 67 MB of V
    assert reads.reads_mb("prepare16", 8, 16, 2048, 128) == \
        pytest.approx(134.217728)
    assert reads.reads_mb("find_bad_parts", 8, 16, 2048, 128) == \
        pytest.approx(67.108864)
    times = {("torch sum of V", True): 26.0, ("row_dot16", True): 52.0,
             ("torch sum of V", False): 20.0, ("find_bad_parts", False): 40.0}
    got = {(r["kernel"], r["cold"]): r for r in
           reads.rows((8, 16, 2048, 128), times)}
    torch_cold = got[("torch sum of V", True)]
    assert torch_cold["x_torch_read"] == 1.0
    assert torch_cold["tb_s"] == pytest.approx(67.108864 / 26, abs=0.01)
    # twice the bytes in twice the time: torch's rate
    assert got[("row_dot16", True)]["x_torch_read"] == 1.0
    # the same bytes in twice the time: half of it
    assert got[("find_bad_parts", False)]["x_torch_read"] == 0.5
    with pytest.raises(ValueError, match="kernel: expected one of"):
        reads.reads_mb("row_dot", 1, 1, 1, 8)
    with pytest.raises(ValueError, match="positive"):
        reads.rows((1, 1, 8, 8), {("torch sum of V", True): 0.0})


def test_waves_costs_and_modeled_fill():
    # a block's cost over a whole block's; B2 H8 at 16K, d = 64: 1376
    # blocks, 10.4 waves of work ending at 11
    assert waves.costs({1: 150.0, 2: 210.0, 3: 240.0}) == {
        1: 0.625, 2: 0.875, 3: 1.0}
    for bad in ({1: 1.0}, {1: 0.0, 3: 2.0}):
        with pytest.raises(ValueError, match="us"):
            waves.costs(bad)
    row = dict(B=1, H=16, N=16384, d=64, causal=False, x_cudnn=0.96)
    got = waves.modeled(row, {1: 0.625, 3: 1.0}, 132)
    assert got["blocks"] == 1376 and got["modeled_end"] == 11.0
    assert got["waves"] == round(16 * 85.625 / 132, 2)
    assert got["modeled_fill"] == round(16 * 85.625 / 132 / 11, 3)
    assert got["x_cudnn"] == 0.96
