"""The self-checking exercises: solutions pass, typical mistakes are
caught with the hint that names them, messages say where and what."""

import numpy as np
import pytest

from flashlab import exercises, fragments

NAMES = sorted(exercises.EXERCISES)
MISTAKES = [(name, k) for name in NAMES
            for k in range(len(exercises.EXERCISES[name].mistakes))]


@pytest.mark.parametrize("name", NAMES)
def test_the_worked_solution_passes_fresh_cases(rng, name):
    # fresh cases each run, drawn from the rng fixture's printed seed so
    # that a failing draw can be replayed
    seed = int(rng.integers(2**63))
    report = exercises.check(name, exercises.solution(name), seed=seed)
    assert report.startswith(f"{name}: all ")


@pytest.mark.parametrize("name, k", MISTAKES)
def test_each_typical_mistake_is_caught_with_its_hint(name, k):
    hint, wrong = exercises.EXERCISES[name].mistakes[k]
    with pytest.raises(exercises.ExerciseError) as caught:
        exercises.check(name, wrong, seed=k)
    message = str(caught.value)
    assert message.startswith(f"{name}, case '")
    assert f"hint: {hint}" in message


def test_message_names_case_element_expected_and_got():
    def off_by_one_row(scores, values):
        out = exercises.solution("deferred_division")(scores, values)
        out[1] += 1.0
        return out

    with pytest.raises(exercises.ExerciseError) as caught:
        exercises.check("deferred_division", off_by_one_row, seed=0)
    message = str(caught.value)
    assert "case 'random, N=12 in chunks of 4'" in message
    assert "at index (1,)" in message and "expected " in message
    assert "got " in message and "hint: " in message


def test_wrong_shapes_and_exceptions_are_reported_not_raised_raw():
    with pytest.raises(exercises.ExerciseError, match="expected shape"):
        exercises.check("deferred_division", lambda s, v: np.zeros(7))
    with pytest.raises(exercises.ExerciseError, match="raised ZeroDivision"):
        exercises.check("log_sum_exp", lambda s: 1 / 0)
    with pytest.raises(ValueError, match="name: expected one of"):
        exercises.check("no_such_exercise", print)


def test_every_exercise_has_cases_with_the_hard_edges():
    rng = np.random.default_rng(0)
    for name in ("deferred_division", "online_output"):
        cases = {c.name for c in exercises.EXERCISES[name].cases(rng)}
        assert "a single key" in cases and "scores near 1000" in cases
        assert any("ragged" in c for c in cases)
    cases = {c.name for c in exercises.EXERCISES["online_output"].cases(rng)}
    assert "first chunk masked (-inf)" in cases


# Strictness: answers that are wrong in kind, not only in value.

def _right(name):
    return exercises.solution(name)


def test_a_complex_result_is_refused():
    def complex_output(scores, values):
        return _right("deferred_division")(scores, values) + 0j

    with pytest.raises(exercises.ExerciseError, match="complex result"):
        exercises.check("deferred_division", complex_output, seed=0)


@pytest.mark.parametrize("name, args_to_text", [
    ("log_sum_exp", lambda s: str(_right("log_sum_exp")(s))),
    ("intermediate_bytes",
     lambda *a: str(_right("intermediate_bytes")(*a))),
])
def test_a_numeric_string_is_refused(name, args_to_text):
    with pytest.raises(exercises.ExerciseError, match="got the text"):
        exercises.check(name, args_to_text, seed=0)


def test_integers_are_compared_exactly():
    biggest = 2 * 4 * 32 * 4096 * 4096 * 2  # the 8.6e9-byte case
    assert 8 / biggest < exercises.RTOL  # a relative check would pass it

    def eight_bytes_off(n, heads, batch, itemsize):
        return _right("intermediate_bytes")(n, heads, batch, itemsize) + 8

    with pytest.raises(exercises.ExerciseError, match="compared exactly"):
        exercises.check("intermediate_bytes", eight_bytes_off, seed=0)
    # the right count as a float is still the right count
    report = exercises.check(
        "intermediate_bytes",
        lambda *a: float(_right("intermediate_bytes")(*a)), seed=0)
    assert report.endswith("cases pass")


def test_a_function_that_changes_its_inputs_is_refused():
    def shifts_in_place(scores, values):
        scores -= scores.max()  # the caller's array, changed
        p = np.exp(scores)
        return (p @ values) / p.sum()

    with pytest.raises(exercises.ExerciseError,
                       match="changed argument 0 in place"):
        exercises.check("deferred_division", shifts_in_place, seed=0)


def test_the_hint_survives_a_function_that_changes_its_inputs():
    hint, forgot_rescale = exercises.EXERCISES["online_output"].mistakes[0]

    def forgot_rescale_and_scribbles(scores, values, chunk):
        out = forgot_rescale(scores, values, chunk)
        scores[:] = 0.0  # the mistakes must still see the true inputs
        return out

    with pytest.raises(exercises.ExerciseError) as caught:
        exercises.check("online_output", forgot_rescale_and_scribbles,
                        seed=0)
    assert f"hint: {hint}" in str(caught.value)


def test_a_function_that_never_returns_times_out():
    import threading

    before = threading.active_count()

    def never_returns(scores):
        while True:
            pass

    with pytest.raises(exercises.ExerciseError,
                       match=r"did not return within 0.5 s"):
        exercises.check("log_sum_exp", never_returns, seed=0, timeout=0.5)
    assert threading.active_count() == before  # the runaway was stopped


def test_masks_compare_exactly_and_take_zeros_and_ones():
    as_float = exercises.check(
        "causal_mask",
        lambda *a: _right("causal_mask")(*a).astype(float), seed=0)
    assert as_float.endswith("cases pass")
    with pytest.raises(exercises.ExerciseError, match="compared exactly"):
        exercises.check("causal_mask",
                        lambda *a: _right("causal_mask")(*a) * 0.999999,
                        seed=0)


def test_one_module_per_chapter_registered_in_chapter_order():
    chapters = [ex.chapter for ex in exercises.EXERCISES.values()]
    assert chapters == sorted(chapters)
    for ex in exercises.EXERCISES.values():
        module = ex.solution.__module__
        assert module == f"flashlab.exercises.chapter{ex.chapter:02d}"
        assert ex.cases.__module__ == module
        assert all(w.__module__ == module for _, w in ex.mistakes)


def test_chapter12_answers_match_the_kernel_and_the_model():
    # the worked answers against what v7 and the wgmma model do: thread
    # t of v7's copy puts chunk c of row r where swizzled_place says, and
    # accumulator register k of thread t is element (i, j) whose
    # accumulator_register is (t, k)
    from flashlab import fragments
    from flashlab.gpu import forward_v7

    place = exercises.solution("swizzled_place")
    for rows, per_row in ((128, 8), (128, 16)):
        for t in range(forward_v7.THREADS):
            offset, r, c, step = forward_v7.panel_copy_place(
                t, per_row, rows, forward_v7.THREADS)
            got = place(np.array([r, r + step]), np.array([c, c]), rows)
            assert got.tolist() == [offset, offset + step * 128]
    places = fragments.wgmma_c_places(64)  # (128, 32, 2)
    got = exercises.solution("accumulator_register")(
        places[..., 0].ravel(), places[..., 1].ravel())
    t, k = np.meshgrid(np.arange(128), np.arange(32), indexing="ij")
    assert np.array_equal(got, np.stack([t.ravel(), k.ravel()], -1))
    desc = exercises.solution("descriptor")(0x12340, 128, 2048)
    assert fragments.descriptor_fields(desc) == (0x12340, 128, 2048)
    # and the fused backward's dS^T places are the ones its kernel stores
    # at (fragments.a_pair_offset, compiled into backward_v7)
    t, kp, r = (x.ravel() for x in np.meshgrid(
        np.arange(256), np.arange(4), np.arange(4), indexing="ij"))
    got = exercises.solution("ds_tile_place")(t, kp, r)
    assert got.tolist() == [fragments.a_pair_offset(*map(int, x))
                            for x in zip(t, kp, r)]
    # and backward v8's staged dQ places the ones its kernel stores at:
    # warpgroup c's n-tile x (of 4) at fragments.c_pair_offset32 (compiled
    # into backward_v8) in box c, STREAMED x 128 bytes a box
    from flashlab.gpu import backward_v8

    t, n, h = (x.ravel() for x in np.meshgrid(
        np.arange(128), np.arange(8), np.arange(2), indexing="ij"))
    got = exercises.solution("dq_stage_place")(t, n, h)
    tiles = backward_v8.DQ_BOX // 8  # n-tiles of a warpgroup's columns
    box = backward_v8.STREAMED * 128
    assert got.tolist() == [
        box * (int(x) // tiles) + fragments.c_pair_offset32(
            int(y), int(x) % tiles, int(z)) for y, x, z in zip(t, n, h)]


def test_chapter12_full_tiles_is_the_run_forward_v8_finds(rng):
    # the worked answer, from the bounds at once, against masks.full_run,
    # the scan that forward_v8 compiles, on random rules and blocks
    from flashlab import masks

    full_tiles = exercises.solution("full_tiles")
    for _ in range(300):
        nq, nk = (int(x) for x in rng.integers(1, 700, 2))
        causal = [False, True, "bottom_right"][int(rng.integers(3))]
        window = None if rng.random() < 0.4 else tuple(
            None if rng.random() < 0.3 else int(rng.integers(0, 300))
            for _ in range(2))
        rules = masks.rules(causal, window, None, None, (), nq, nk).index()
        kv_len = int(rng.integers(0, nk + 1))
        bc = int(rng.choice([16, 64, 128]))
        i0 = int(rng.integers(0, nq))
        i1 = min(nq, i0 + int(rng.integers(1, 200)))
        lo, hi = masks.full_run(i0, i1, 0, -(-nk // bc) - 1, nk, bc,
                                rules, kv_len)
        got = full_tiles(i0, i1, nk, bc, bool(rules.causal),
                         int(rules.offset), int(rules.left),
                         int(rules.right), kv_len)
        assert got.tolist() == list(range(lo, hi + 1)), (
            nq, nk, causal, window, kv_len, bc, i0, i1)


def test_chapter12_exp2_cubic_is_the_kernels_model_in_float64(rng):
    # the worked answer (float64) against flashlab.exp2.model, the
    # float32 steps the kernel's PTX runs: apart by float32's rounding
    from flashlab import exp2

    t = np.concatenate([rng.uniform(-126, 0, 5000), [-np.inf, np.nan]])
    t32 = t.astype(np.float32)
    got = exercises.solution("exp2_cubic")(t32.astype(np.float64))
    want = exp2.model(t32).astype(np.float64)
    assert np.allclose(got, want, rtol=4 * 2.0**-23, atol=0,
                       equal_nan=True)
    assert got[-2] == 0 and np.isnan(got[-1])


def test_chapter12_dispatch_finish_is_flashlab_orders_model(rng):
    # the worked answer (the first free SM by argmin) against
    # order.finish (a heap), on random works, SM counts and orders
    from flashlab import order

    dispatch_finish = exercises.solution("dispatch_finish")
    for _ in range(200):
        works = rng.integers(1, 40, int(rng.integers(1, 300)))
        sms = int(rng.integers(1, 20))
        assert dispatch_finish(works, sms) == order.finish(works, sms)


def test_chapter12_parities_are_the_ones_forward_v8_waits_on():
    # the worked answer against the kernel's own waits, read from its
    # source: consumers on K full of tile n, the producer on K empty
    from flashlab import viz

    tiles = 7
    program = viz.v8_program(tiles)
    names = viz.v8_barrier_names()

    def waits(role, prefix):
        return [s.value for s in program[role] if s.what == "wait"
                and names[s.bar].startswith(prefix)]

    got = exercises.solution("wait_parity")(np.arange(tiles), 2)
    assert got[:, 0].tolist() == waits("warpgroup 0", "K full")
    assert got[:, 0].tolist() == waits("warpgroup 1", "K full")
    assert got[:, 1].tolist() == waits("producer", "K empty")


def test_chapter12_handed_back_is_what_the_v8_model_hands_back():
    # the worked answer against the kernel's own steps, read from its
    # source: after a warpgroup's last product (or from its start, where
    # it has none), one wait on K full for each tile it hands back
    from flashlab import viz

    handed = exercises.solution("handed_back")
    names = viz.v8_barrier_names()
    tiles = 6
    for empty, stops in ((False, {}), (False, {0: 1, 1: 3}),
                         (False, {0: -1, 1: 0, 2: 2}), (True, {})):
        program = viz.v8_program(tiles, stops=stops, empty=empty)
        first, last = (tiles, tiles - 1) if empty else (0, tiles - 1)
        for g in range(3):
            steps = program[f"warpgroup {g}"]
            own = stops.get(g, -1 if empty else tiles - 1)
            issued = [k for k, s in enumerate(steps)
                      if s.what.startswith("issue")]
            after = steps[issued[-1] + 1:] if issued else steps
            back = [s for s in after if s.what == "wait"
                    and names[s.bar].startswith("K full")]
            assert len(back) == len(handed(first, last, own)), (
                empty, stops, g)


def test_chapter12_a_near_miss_fails():
    # one register off, one slot off, one field off: each is refused
    def register_off(i, j):
        return _right("accumulator_register")(i, j) + np.array([0, 1])

    def slot_off(rows, chunks, n_rows):
        return _right("swizzled_place")(rows, chunks ^ 1, n_rows)

    def sbo_off(address, lbo, sbo):
        return _right("descriptor")(address, lbo, sbo + 16)

    for name, wrong in (("accumulator_register", register_off),
                        ("swizzled_place", slot_off),
                        ("descriptor", sbo_off)):
        with pytest.raises(exercises.ExerciseError, match="compared exactly"):
            exercises.check(name, wrong, seed=0)


# Chapters 9 and 10: the GPU exercises' CPU paths.

def test_v2_model_needs_both_barriers():
    from flashlab.exercises import chapter09

    races = _right("racing_addresses")
    assert races(chapter09.v2_accesses((True, True))) == set()
    everything = set(range(2 * 2 * 2))  # K_j and V_j: keys x d each
    for kept in ((False, True), (True, False)):
        assert races(chapter09.v2_accesses(kept)) == everything


def test_float_bits_shows_what_a_float_zero_does():
    bits = _right("float_bits")
    assert bits("F0 + x * y  (F0 = np.float32(0))") == 32
    assert bits("F0 + x * y  (F0 = 0.0)") == 64
    assert bits("math.exp(x - y)") == 32 and bits("x + 0.0") == 64


def test_importing_the_exercises_leaves_numba_unloaded():
    import subprocess
    import sys

    code = ("import sys, flashlab.exercises; "
            "sys.exit('numba' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_ldmatrix_passes_agree_with_the_primer_bank_model(rng):
    from flashlab import viz

    passes = _right("ldmatrix_passes")
    for _ in range(20):
        rows = 16 * rng.integers(0, 3072, 32)
        words = (rows[:, None] + 4 * np.arange(4)).reshape(4, 32)  # phases
        assert passes(rows) == sum(viz.bank_conflicts(w) for w in words)


def test_round_toward_zero_keeps_the_float32_at_or_inside_x(rng):
    from flashlab.exercises.chapter10 import to_float32_rz

    x = np.concatenate([rng.standard_normal(10000) * 10.0 ** rng.integers(
        -30, 30, 10000), rng.standard_normal(100).astype(np.float32)])
    y = to_float32_rz(x)
    assert y.dtype == np.float32
    assert np.all(np.abs(y.astype(np.float64)) <= np.abs(x))
    away = np.nextafter(y, np.copysign(np.float32(np.inf), y))
    assert np.all(np.abs(away.astype(np.float64)) > np.abs(x))
    exact = x[-100:]  # float32 values stay as they are
    assert np.array_equal(y[-100:], exact.astype(np.float32))
    special = to_float32_rz(np.array([np.inf, -np.inf, np.nan, 0.0]))
    assert np.isinf(special[:2]).all() and np.isnan(special[2])


def test_chapter12_o_staged_place_is_the_staged_epilogues_map():
    # every value of a warp's 16 rows, against the map built from the
    # functions forward v8's epilogue compiles (fragments.c_places,
    # swizzled_offset, staged_chunk); and the places are all distinct
    from flashlab.exercises import chapter12

    place = exercises.solution("o_staged_place")
    for d_v in (64, 128):
        want = chapter12._o_staged_places(d_v // 8)
        assert len(want) == 16 * d_v
        got = {(r, c): place(r, c, d_v) for r in range(16)
               for c in range(d_v)}
        assert got == want
        assert len({x[1] for x in got.values()}) == 16 * d_v  # bytes
        # each read-back (step, lane) holds one 16-byte chunk: 8 values
        reads = {}
        for _, offset, step, lane in got.values():
            reads.setdefault((step, lane), set()).add(offset // 16)
        assert all(len(x) == 1 for x in reads.values())
        assert len(reads) == 2 * d_v


def test_chapter12_o_stage_block_is_where_forward_v8_stages():
    # every warp of every consumer warpgroup, at each (d, d_v) whose
    # staging lies in Q_i's tile, against fragments.stage_place as the
    # kernel calls it (forward_v8: staged = 16 rows of 2 d_v bytes)
    from flashlab.gpu import forward_v8

    place = exercises.solution("o_stage_block")
    seen = 0
    for d in forward_v8.HEAD_DIMS:
        for d_v in forward_v8.HEAD_DIMS:
            if forward_v8.stage_bytes(d, d_v):
                continue  # staged past V's stages, not in Q_i
            rows = forward_v8.block_rows(d, d_v)
            for wg in range(forward_v8.groups(d, d_v)):
                for u in range(4):
                    assert place(u, wg, rows, d_v) == fragments.stage_place(
                        u, wg, rows, 16 * 2 * d_v)
                    seen += 1
    assert seen == 4 * (3 + 2 + 2)  # (64, 64), (128, 128), (128, 64)
