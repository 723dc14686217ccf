"""flashlab as a reader meets it: the built wheel in a fresh environment.

A hosted GPU runtime has no repository beside the notebook, only the
installed package. These tests build the wheel, install it into a new
virtual environment outside the repository (its dependencies come from
the environment running the tests, its flashlab only from the wheel), and
run a computation and every chapter there from an empty directory.
"""

import json
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

import flashlab
from flashlab import measured

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
SETUP_MARK = "# Setup (the same in every chapter)"


@pytest.fixture(scope="session")
def wheel(tmp_path_factory):
    """The wheel of this checkout, built without network access."""
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps",
         "--no-build-isolation", "-q", "-w", str(out), str(ROOT)],
        check=True)
    (path,) = out.glob("flashlab_course-*.whl")
    return path


@pytest.fixture(scope="session")
def installed(wheel, tmp_path_factory):
    """Python of a fresh venv holding the wheel; deps from this env."""
    env = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)],
                   check=True)
    python = env / "bin" / "python"
    site = Path(subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()"
         "['purelib'])"], check=True, capture_output=True,
        text=True).stdout.strip())
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps",
         "--no-index", "--target", str(site), str(wheel)], check=True)
    # A plain path line: the outer site-packages is searched after the
    # venv's own. Its .pth hooks are copied (numba-cuda's redirects
    # numba.cuda), except the editable install of this checkout.
    outer = Path(sysconfig.get_paths()["purelib"])
    (site / "0_outer_deps.pth").write_text(f"{outer}\n")
    for pth in outer.glob("*.pth"):
        if not pth.name.startswith("__editable__"):
            (site / pth.name).write_text(pth.read_text())
    # NVRTC is looked up under the venv's own site-packages, as on a
    # runtime where numba-cuda[cu13] was installed beside flashlab.
    if (outer / "nvidia").is_dir():
        (site / "nvidia").symlink_to(outer / "nvidia")
    return python, site


def _run(python, cwd, code):
    env = {"PATH": str(Path(python).parent) + ":/usr/bin:/bin",
           "HOME": str(cwd), "NUMBA_CACHE_DIR": str(cwd / ".numba")}
    return subprocess.run([python, "-c", code], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def test_wheel_holds_the_package_and_its_data(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    for name in measured.FILES:
        assert f"flashlab/data/{name}" in names
    for module in ("flashlab/measured.py", "flashlab/merge.py",
                   "flashlab/tiled.py"):
        assert module in names
    meta = zipfile.ZipFile(wheel).read(
        next(n for n in names if n.endswith("METADATA"))).decode()
    assert "Name: flashlab-course" in meta
    assert f"Version: {flashlab.__version__}" in meta
    assert "Provides-Extra: gpu" in meta


def test_every_setup_cell_is_the_one_book_home_writes():
    # book/home.py writes the setup cell from the one home setting (its
    # contents are tested in test_workflows): no chapter may drift
    sys.path.insert(0, str(ROOT / "book"))
    import home

    assert home.stale() == []
    for path in NOTEBOOKS:
        setup = next(
            "".join(c["source"]) for c in json.loads(path.read_text())["cells"]
            if "".join(c["source"]).startswith(SETUP_MARK))
        assert f"flashlab_course-{flashlab.__version__}" in setup, path


def test_installed_wheel_computes_from_an_empty_directory(installed,
                                                         tmp_path):
    python, site = installed
    code = (
        "import numpy as np, flashlab\n"
        "from flashlab import measured, reference, tiled\n"
        "print(flashlab.__file__)\n"
        "rng = np.random.default_rng(1)\n"
        "q, k, v = (rng.standard_normal((2, 37, 16)) for _ in range(3))\n"
        "o = tiled.attention(q, k, v, block_q=8, block_k=16, causal=True)\n"
        "err = np.abs(o - reference.attention(q, k, v, causal=True)).max()\n"
        "assert err < 1e-12, err\n"
        "print(measured.text('bench_h200.txt').splitlines()[0])\n"
    )
    done = _run(python, tmp_path, code)
    assert done.returncode == 0, done.stderr
    first, machine = done.stdout.splitlines()[:2]
    assert first.startswith(str(site))  # the wheel, not the checkout
    assert machine.startswith("machine: NVIDIA H200")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_chapter_runs_alone_against_the_installed_wheel(installed, path,
                                                        tmp_path):
    """Every cell runs with the notebook alone in a fresh directory.

    Outputs are not compared here; nbval does that in place.
    """
    python, site = installed
    (tmp_path / path.name).write_bytes(path.read_bytes())
    code = (
        "import sys, nbformat\n"
        "from nbclient import NotebookClient\n"
        f"nb = nbformat.read({path.name!r}, as_version=4)\n"
        "nb.cells.append(nbformat.v4.new_code_cell(\n"
        "    'import flashlab; print(flashlab.__file__)'))\n"
        "NotebookClient(nb, timeout=600, kernel_name='python3',\n"
        "               resources={'metadata': {'path': '.'}}).execute()\n"
        "print(nb.cells[-1].outputs[0].text)\n"
    )
    done = _run(python, tmp_path, code)
    assert done.returncode == 0, done.stderr[-3000:]
    # the kernel imported the wheel, not the checkout
    assert done.stdout.strip().startswith(str(site)), done.stdout
