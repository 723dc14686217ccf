"""The checker: run a reader's function on an exercise's cases, strictly.

A reader's answer passes only if, on every case, it returns real numbers
(no complex values, no strings) in the expected shape, equal to flashlab's
answer: floats within RTOL, integers and booleans exactly. The function
gets copies of the inputs and must leave them unchanged, and it must
return within `timeout` seconds. A failure names the case, the first
element that differs, the expected and the received value, and a hint:
when the wrong answer is the one a typical mistake produces, the hint
names that mistake.
"""

import copy
import ctypes
import threading
from typing import Callable, NamedTuple

import numpy as np

RTOL = 1e-9  # float64 throughout: any correct order of operations is closer
TIMEOUT = 20.0  # seconds per case; every solution needs far less than 1


class ExerciseError(AssertionError):
    """A reader's answer differs from flashlab's; the message says where."""


class Case(NamedTuple):
    """One input of an exercise and flashlab's answer to it."""

    name: str
    args: tuple
    want: object  # float arrays, ints, bools, tuples of them, or a set


class Exercise(NamedTuple):
    """A checked exercise: its task, its cases, a solution, typical errors."""

    chapter: int
    task: str
    cases: Callable  # rng -> list of Case
    solution: Callable
    mistakes: tuple  # (hint, wrong function) pairs


EXERCISES = {}  # name -> Exercise, in chapter order


def register(name, exercise):
    """Add an exercise under `name` (each chapter module calls this)."""
    if name in EXERCISES:
        raise ValueError(f"name: exercise {name!r} is already registered")
    EXERCISES[name] = exercise
    return exercise


def check(name, fn, seed=None, timeout=TIMEOUT):
    """Run fn on every case of exercise `name`; raise ExerciseError if wrong.

    Returns a one-line report when every case passes. seed fixes the
    random cases (by default they are fresh on every call); timeout is
    the most seconds one case may take.
    """
    ex = _get(name)
    cases = ex.cases(np.random.default_rng(seed))
    for case in cases:
        args = copy.deepcopy(case.args)  # the reader's copy to work on
        got = _run(name, case, fn, args, timeout)
        problem = _compare(case.want, got)
        if problem is not None:
            raise ExerciseError(
                f"{name}, case '{case.name}': {problem}\n"
                f"hint: {_diagnose(ex, case, got)}")
        changed = [k for k, (a, b) in enumerate(zip(args, case.args))
                   if not _same(a, b)]
        if changed:
            raise ExerciseError(
                f"{name}, case '{case.name}': the answer is right, but "
                f"your function changed argument {changed[0]} in place\n"
                "hint: a caller's arrays are not yours to change: work on "
                "a copy (x = x.copy()) or build new arrays (x = x - m "
                "instead of x -= m)")
    return f"{name}: all {len(cases)} cases pass"


def task(name):
    """The exercise's statement, with the signature to implement."""
    ex = _get(name)
    return f"{name} (chapter {ex.chapter}): {ex.task}"


def solution(name):
    """The worked solution of exercise `name` (a function)."""
    return _get(name).solution


def _get(name):
    if name not in EXERCISES:
        raise ValueError(
            f"name: expected one of {sorted(EXERCISES)}, got {name!r}")
    return EXERCISES[name]


def _run(name, case, fn, args, timeout):
    """fn(*args) in a worker thread, stopped if it outlives timeout."""
    out = {}

    def work():
        try:
            with np.errstate(all="ignore"):  # errstate is per thread
                out["got"] = fn(*args)
        except _Stopped:
            pass
        except Exception as err:  # reported as a wrong answer, with why
            out["error"] = err

    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    try:
        worker.join(timeout)
    except KeyboardInterrupt:  # the reader stopped the cell: stop it too
        _stop(worker)
        raise
    if worker.is_alive():
        _stop(worker)
        raise ExerciseError(
            f"{name}, case '{case.name}': your function did not return "
            f"within {timeout:g} s\nhint: look for a loop whose index or "
            "condition never changes (a while loop, or a step of 0)")
    if "error" in out:
        err = out["error"]
        raise ExerciseError(
            f"{name}, case '{case.name}': your function raised "
            f"{type(err).__name__}: {err}") from err
    return out.get("got")


class _Stopped(BaseException):
    """Raised inside a worker that ran past its timeout."""


def _stop(worker):
    """Ask a runaway worker thread to stop at its next Python instruction.

    A thread cannot be killed; this raises _Stopped inside it, which a
    pure-Python loop sees at once and a long numpy call when it returns.
    """
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(worker.ident), ctypes.py_object(_Stopped))
    worker.join(1.0)


def _same(a, b):
    """True if argument a is still equal to the original b (NaN == NaN)."""
    if isinstance(b, tuple):
        return (isinstance(a, tuple) and len(a) == len(b)
                and all(_same(x, y) for x, y in zip(a, b)))
    if isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and a.shape == b.shape
                and np.array_equal(a, b, equal_nan=b.dtype.kind in "fc"))
    return a == b or (a != a and b != b)


def _real(got):
    """(array, None) for an answer of real numbers, else (None, why)."""
    if isinstance(got, (str, bytes)):
        return None, f"expected numbers, got the text {got!r}"
    try:
        arr = np.asarray(got)
    except (TypeError, ValueError):
        return None, f"expected numbers, got {got!r}"
    if arr.dtype.kind == "c":
        return None, ("expected real numbers, got a complex result "
                      f"({got!r}); look for a square root or log of a "
                      "negative number")
    if arr.dtype.kind not in "biuf":
        return None, f"expected numbers, got {got!r}"
    return arr, None


def _compare(want, got):
    """None if got matches want, else a sentence saying where it does not."""
    if isinstance(want, (set, frozenset)):
        if not isinstance(got, (set, frozenset, list, tuple)):
            return f"expected a set of {len(want)} items, got {got!r}"
        got_set = set(got)
        if got_set == want:
            return None
        extra, missing = sorted(got_set - want), sorted(want - got_set)
        return (f"expected {len(want)} items, got {len(got_set)}; "
                f"missing {missing[:4]}, not expected {extra[:4]}")
    if isinstance(want, tuple):
        if not isinstance(got, (tuple, list)) or len(got) != len(want):
            return f"expected a tuple of {len(want)} values, got {got!r}"
        for k, (w, g) in enumerate(zip(want, got)):
            problem = _compare(w, g)
            if problem is not None:
                return f"item {k} of the tuple: {problem}"
        return None
    want = np.asarray(want)
    got, problem = _real(got)
    if problem is not None:
        return problem
    if got.shape != want.shape:
        return f"expected shape {want.shape}, got shape {got.shape}"
    if want.dtype.kind in "biu":  # counts and masks: exactly, no tolerance
        same = got == want
        exactly = " (compared exactly)"
    else:
        if got.dtype.kind == "b":
            return "expected numbers, got booleans"
        got = got.astype(np.float64)
        same = (np.isclose(got, want, rtol=RTOL, atol=RTOL)
                | (np.isnan(got) & np.isnan(want)))
        exactly = ""
    if np.all(same):
        return None
    idx = tuple(int(i) for i in np.argwhere(~np.asarray(same))[0])
    where = f" at index {idx}" if idx else ""
    return (f"expected {_show(want[idx])}{where}, got {_show(got[idx])}"
            f"{exactly}")


def _show(x):
    """A number as the message prints it: integers in full."""
    x = x.item() if isinstance(x, np.generic) else x
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, int) or (isinstance(x, float) and x.is_integer()
                              and abs(x) < 1e17):
        return str(int(x))
    return f"{x:.10g}"


def _diagnose(ex, case, got):
    """The hint of the typical mistake that gives exactly `got`, if any."""
    for hint, wrong in ex.mistakes:
        try:
            with np.errstate(all="ignore"):
                mistaken = wrong(*copy.deepcopy(case.args))
        except Exception:  # a mistake that cannot even run this case
            continue
        if _compare(mistaken, got) is None:
            return hint
    arr, _ = _real(got)
    try:
        want_finite = np.all(np.isfinite(np.asarray(case.want, float)))
    except (TypeError, ValueError):  # a tuple or set: no such hint
        want_finite = False
    if arr is not None and want_finite and not np.all(np.isfinite(arr)):
        return ("your answer is not finite where the true one is: look for "
                "exp of a large score, or (-inf) - (-inf) in an empty block")
    return ("compare with the chapter's derivation one step at a time, on "
            "this case's inputs")
