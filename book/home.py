"""The project's home, one setting: `repository.url` in _config.yml.

    python book/home.py            # exit 1 if a chapter's setup cell is stale
    python book/home.py --write    # rewrite every chapter's setup cell

The setup cell that opens every chapter is written from that setting: with
a home, a runtime without flashlab (a hosted GPU notebook) installs the
release tagged v<version> from it; without one, the cell says exactly what
to do instead. The book's repository and launch buttons follow the same
setting (book/_ext/home_buttons.py). No address is ever guessed.
"""

import json
import re
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
MARK = "# Setup (the same in every chapter)"


def home():
    """The repository.url of _config.yml, or "" while it is unset."""
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    return ((config.get("repository") or {}).get("url") or "").strip()


def version():
    """flashlab.__version__, read without importing the package."""
    text = (ROOT / "flashlab" / "__init__.py").read_text()
    return re.search(r'^__version__ = "([^"]+)"', text, re.M)[1]


def setup_cell(url=None):
    """The source of every chapter's first code cell for home `url`."""
    url = home() if url is None else url
    wheel = f"flashlab_course-{version()}-py3-none-any.whl"
    if url:
        install = [
            "except ImportError:  # a fresh runtime: install this release",
            f'    home = "{url}"  # repository.url in _config.yml',
            f'    %pip install -q "flashlab-course @ git+{{home}}'
            f'@v{version()}"',
            "    import flashlab",
        ]
    else:
        install = [
            "except ImportError:  # a runtime without flashlab",
            "    raise ImportError(",
            '        "flashlab is not installed here, and the book\'s home '
            '(repository.url "',
            '        "in _config.yml) is not set, so there is nothing to '
            'install from. "',
            '        "In a copy of the book\'s repository run `make dist`, '
            'upload "',
            f'        "dist/{wheel} to this runtime, run "',
            f'        "`%pip install {wheel}`, then run this "',
            '        "cell again."',
            "    ) from None",
        ]
    return "\n".join([
        MARK, "import numpy as np", "", "try:", "    import flashlab",
        *install,
        "from flashlab.show import glue, source", "",
        "rng = np.random.default_rng(0)",
        'np.set_printoptions(precision=3, suppress=True, floatmode="fixed")',
    ])


def stale(write=False, names=None):
    """Chapters whose setup cell differs from setup_cell(); fix if write.

    names, if given, limits both to those notebook file names.
    """
    want = setup_cell()
    out = []
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        if names is not None and path.name not in names:
            continue
        nb = json.loads(path.read_text())
        cell = next(c for c in nb["cells"] if c["cell_type"] == "code")
        if "".join(cell["source"]) == want:
            continue
        out.append(path.name)
        if write:
            cell["source"] = want.splitlines(keepends=True)
            path.write_text(json.dumps(nb, indent=1, ensure_ascii=False)
                            + "\n")
    return out


if __name__ == "__main__":
    write = "--write" in sys.argv
    changed = stale(write)
    for name in changed:
        print(f"{name}: setup cell "
              + ("rewritten" if write else "differs from book/home.py"))
    sys.exit(1 if changed and not write else 0)
