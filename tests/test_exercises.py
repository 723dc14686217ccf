"""The self-checking exercises: solutions pass, typical mistakes are
caught with the hint that names them, messages say where and what."""

import numpy as np
import pytest

from flashlab import exercises

NAMES = sorted(exercises.EXERCISES)
MISTAKES = [(name, k) for name in NAMES
            for k in range(len(exercises.EXERCISES[name].mistakes))]


@pytest.mark.parametrize("name", NAMES)
def test_the_worked_solution_passes_fresh_cases(name):
    report = exercises.check(name, exercises.solution(name))
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
