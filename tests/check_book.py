"""After `make book`: every page loads MathJax from the book itself.

    python tests/check_book.py _build/html

Fails (exit 1, naming the page) if a page asks a CDN for MathJax or the
local copy is missing, so that math renders with no network.
"""

import sys
from pathlib import Path


def main(root):
    root = Path(root)
    local = root / "mathjax" / "tex-chtml.js"
    problems = [] if local.is_file() else [f"missing {local}"]
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
