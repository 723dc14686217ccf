"""The chapters are committed executed, listed in the book, and complete.

nbval passes a notebook with no stored outputs, so these checks make sure
there is something for it to compare.
"""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def cells(path, kind):
    return [c for c in json.loads(path.read_text())["cells"]
            if c["cell_type"] == kind]


def test_there_are_chapters():
    assert len(NOTEBOOKS) >= 5


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_code_cell_was_executed_in_order(path):
    code = cells(path, "code")
    counts = [c["execution_count"] for c in code]
    assert None not in counts, "a code cell was never executed"
    assert counts == sorted(counts), "cells were executed out of order"
    assert sum(bool(c["outputs"]) for c in code) >= len(code) // 2


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_name_and_book_entry(path):
    assert re.fullmatch(r"\d\d_[a-z_]+\.ipynb", path.name)
    toc = (ROOT / "_toc.yml").read_text()
    assert f"notebooks/{path.stem}" in toc


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_ends_with_summary_and_exercises(path):
    text = "\n".join("".join(c["source"]) for c in cells(path, "markdown"))
    assert "## Summary" in text
    exercises = text.split("## Exercises", 1)
    assert len(exercises) == 2, "no Exercises section"
    assert len(re.findall(r"^\d+\. ", exercises[1], re.M)) >= 2


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_path_leaves_the_notebook_directory(path):
    """A chapter runs alone: it reads data through the installed package."""
    code = "\n".join("".join(c["source"]) for c in cells(path, "code"))
    assert "../" not in code and "..\\" not in code


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_setup_cell_follows_the_home(path):
    """The first code cell is book/home.py's for _config.yml's home,
    folded in the book (hide-input) and still run by nbval."""
    import sys

    sys.path.insert(0, str(ROOT / "book"))
    import home

    first = cells(path, "code")[0]
    assert "".join(first["source"]) == home.setup_cell(), (
        "run `python book/home.py --write`")
    assert "hide-input" in first["metadata"].get("tags", [])
