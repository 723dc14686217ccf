"""After `make book`: every page loads MathJax from the book itself.

    python tests/check_book.py _build/html

Fails (exit 1, naming the page) if a page asks a CDN for MathJax or the
local copy is missing, so that math renders with no network. The book is
built from the chapters' committed outputs (nbval compares them with a
fresh run in `make test`), so it also fails on a chapter with a cell that
was never run or that stored an error.
"""

import json
import sys
from pathlib import Path

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def notebook_problems():
    """Chapters whose stored outputs cannot stand for a run."""
    problems = []
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        for i, cell in enumerate(cells):
            if cell["cell_type"] != "code":
                continue
            if cell["execution_count"] is None:
                problems.append(f"{path.name} cell {i}: never executed")
            if any(o["output_type"] == "error" for o in cell["outputs"]):
                problems.append(f"{path.name} cell {i}: stored an error")
    return problems


def main(root):
    root = Path(root)
    local = root / "mathjax" / "tex-chtml.js"
    problems = [] if local.is_file() else [f"missing {local}"]
    problems += notebook_problems()
    pages = sorted(root.rglob("*.html"))
    for page in pages:
        text = page.read_text(encoding="utf-8")
        if "cdn.jsdelivr.net" in text or "mathjax@3/es5" in text:
            problems.append(f"{page}: loads MathJax from a CDN")
        elif "\\(" in text and "mathjax/tex-chtml.js" not in text:
            problems.append(f"{page}: has math but no local MathJax")
    for line in problems:
        print(line)
    print(f"{len(pages)} pages checked, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
