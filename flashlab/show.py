"""Notebook helpers: show package source, glue numbers into the prose."""

import inspect


def source(obj):
    """Display the source of a flashlab function or class as a code block.

    Numba dispatchers are shown through their Python function (.py_func),
    so the book always shows the code that runs.
    """
    from IPython.display import Markdown, display

    target = getattr(obj, "py_func", obj)
    code = inspect.getsource(target).rstrip()
    display(Markdown(f"```python\n{code}\n```"))


def glue(name, value, display=False):
    """Glue a value for the book's {glue} roles (shown only where cited)."""
    try:
        from myst_nb import glue as _glue
    except ImportError:  # a plain Jupyter runtime without the book tools
        if display:
            print(value)
        return
    _glue(name, value, display=display)
