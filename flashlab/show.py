"""Notebook helpers: show package source and diffs, glue numbers."""

import difflib
import inspect


def source(obj):
    """Display the source of a flashlab function, class or module.

    Numba dispatchers are shown through their Python function (.py_func),
    so the book always shows the code that runs.
    """
    from IPython.display import Markdown, display

    target = getattr(obj, "py_func", obj)
    code = inspect.getsource(target).rstrip()
    display(Markdown(f"```python\n{code}\n```"))


def diff_text(old, new, context=3):
    """Unified diff of the sources of two objects (e.g. kernel versions)."""
    a, b = (inspect.getsource(getattr(x, "py_func", x)).splitlines()
            for x in (old, new))
    return "\n".join(difflib.unified_diff(
        a, b, fromfile=old.__name__, tofile=new.__name__, n=context,
        lineterm=""))


def diff(old, new, context=3, fold=False):
    """Display what changes from `old` to `new` as a diff code block.

    fold=True puts the diff in a closed <details> block whose summary says
    how many lines change, so a long diff does not bury the idea the text
    around it explains; the reader opens it to see the code.
    """
    import html

    from IPython.display import HTML, Markdown, display

    text = diff_text(old, new, context)
    if not fold:
        display(Markdown(f"```diff\n{text}\n```"))
        return
    lines = text.splitlines()[2:]  # without the ---/+++ header
    added = sum(line.startswith("+") for line in lines)
    removed = sum(line.startswith("-") for line in lines)
    display(HTML(
        f'<details class="flashlab-diff"><summary>{old.__name__} to '
        f"{new.__name__}: {added} lines added, {removed} removed (open to "
        f"see the diff)</summary><pre>{html.escape(text)}</pre></details>"))


def glue(name, value, display=False):
    """Glue a value for the book's {glue} roles (shown only where cited)."""
    try:
        from myst_nb import glue as _glue
    except ImportError:  # a plain Jupyter runtime without the book tools
        if display:
            print(value)
        return
    _glue(name, value, display=display)
