"""Exercises that check themselves: `check(name, fn)` runs a reader's fn.

Each exercise runs the reader's function on fresh random inputs and on the
edge cases that break careless code (a single key, ragged chunks, scores
near 1000, blocks with no allowed key) and compares with flashlab's own
answer, strictly (see `checker`). A failure names the case, the first
element that differs, the expected and the received value, and a hint:
when the wrong answer is the one a typical mistake produces (a forgotten
rescale, a division before the end, a maximum not subtracted), the hint
names that mistake.

One module per chapter (`chapter01` ... `chapter12`); in it, each
exercise is one block: its cases, its worked solution (`solution(name)`,
shown in the book), its typical mistakes, and the `register` call that
ties them together. Adding an exercise touches that one block.
"""

from flashlab.exercises import (  # noqa: F401  (each registers its own)
    chapter01,
    chapter02,
    chapter03,
    chapter04,
    chapter05,
    chapter06,
    chapter07,
    chapter08,
    chapter09,
    chapter10,
    chapter11,
    chapter12,
)
from flashlab.exercises.checker import (
    EXERCISES,
    RTOL,
    TIMEOUT,
    Case,
    Exercise,
    ExerciseError,
    check,
    register,
    solution,
    task,
)

__all__ = ["EXERCISES", "RTOL", "TIMEOUT", "Case", "Exercise",
           "ExerciseError", "check", "register", "solution", "task"]
