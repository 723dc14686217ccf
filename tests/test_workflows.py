"""The publishing workflows in .github/workflows, checked structurally.

actionlint is not installable here from a package registry (its PyPI
wrapper ships no wheel and downloads the binary while building), so these
tests read the YAML and check what a release depends on: the triggers,
the permissions, trusted publishing without stored secrets, pinned
actions, and that the book job runs the same entry point as CI.
"""

import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
FLOWS = ROOT / ".github" / "workflows"


def load(name):
    flow = yaml.safe_load((FLOWS / name).read_text())
    flow["on"] = flow.pop(True, flow.get("on"))  # YAML 1.1 reads on: as True
    return flow


def steps(flow):
    return [s for job in flow["jobs"].values() for s in job.get("steps", [])]


@pytest.mark.parametrize("name", ["book.yml", "release.yml"])
def test_actions_are_pinned_and_no_secret_is_read(name):
    text = (FLOWS / name).read_text()
    assert "secrets." not in text  # trusted publishing, Pages: no tokens
    flow = load(name)
    assert flow["permissions"] == {"contents": "read"}
    for step in steps(flow):
        assert "uses" in step or "run" in step, step
        if "uses" in step:
            assert re.fullmatch(r"[\w.-]+/[\w.-]+@(v\d+|release/v\d+)",
                                step["uses"]), step["uses"]


def test_book_builds_tests_and_deploys_from_main():
    flow = load("book.yml")
    assert flow["on"]["push"]["branches"] == ["main"]
    assert "pull_request" in flow["on"]
    test, deploy = flow["jobs"]["test"], flow["jobs"]["deploy"]
    assert any(s.get("run") == "bash .ci/run" for s in test["steps"])
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    upload = next(s for s in test["steps"]
                  if s.get("uses", "").startswith(
                      "actions/upload-pages-artifact@"))
    assert upload["with"]["path"] == "_build/html"
    assert deploy["needs"] == "test"
    assert deploy["permissions"] == {"pages": "write", "id-token": "write"}
    assert "refs/heads/main" in deploy["if"]
    assert [s["uses"].split("@")[0] for s in deploy["steps"]] == [
        "actions/deploy-pages"]


def test_release_publishes_the_course_distribution_on_a_version_tag():
    flow = load("release.yml")
    assert flow["on"] == {"push": {"tags": ["v*"]}}
    build, publish = flow["jobs"]["build"], flow["jobs"]["publish"]
    runs = "\n".join(s.get("run", "") for s in build["steps"])
    assert "python -m build" in runs and "twine check --strict" in runs
    assert 'test "$GITHUB_REF_NAME" = "v$version"' in runs
    assert publish["needs"] == "build"
    assert publish["permissions"] == {"id-token": "write"}
    assert publish["environment"]["name"] == "pypi"
    pypi = next(s for s in publish["steps"]
                if s.get("uses", "").startswith("pypa/gh-action-pypi-publish"))
    assert "password" not in pypi.get("with", {})  # trusted publishing
    project = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^name = "flashlab-course"$', project, re.M)
    assert "flashlab-course" in (FLOWS / "release.yml").read_text()


def test_buttons_follow_the_one_home_setting():
    import importlib.util
    from types import SimpleNamespace

    spec = importlib.util.spec_from_file_location(
        "home_buttons", ROOT / "book" / "_ext" / "home_buttons.py")
    ext = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ext)
    unset = SimpleNamespace(html_theme_options={
        "repository_url": "", "launch_buttons": {"colab_url": ""}})
    ext._follow_home(None, unset)
    assert unset.html_theme_options["use_repository_button"] is False
    assert unset.html_theme_options["launch_buttons"]["colab_url"] == ""
    home = "https://example.invalid/flashlab"  # a reserved, unreal name
    given = SimpleNamespace(html_theme_options={
        "repository_url": home, "launch_buttons": {"colab_url": ""}})
    ext._follow_home(None, given)
    assert given.html_theme_options["use_repository_button"] is True
    assert given.html_theme_options["launch_buttons"]["colab_url"] == (
        ext.COLAB)
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    assert config["repository"]["url"] == ""  # no address is guessed


def test_the_setup_cell_installs_from_the_home_or_says_what_to_do():
    import sys

    sys.path.insert(0, str(ROOT / "book"))
    import home

    version = home.version()
    unset = home.setup_cell("")
    assert "%pip install" not in unset.split("raise ImportError", 1)[0]
    assert f"dist/flashlab_course-{version}-py3-none-any.whl" in unset
    assert "repository.url" in unset and "make dist" in unset
    given = home.setup_cell("https://example.invalid/flashlab")
    assert 'home = "https://example.invalid/flashlab"' in given
    assert (f'%pip install -q "flashlab-course @ git+{{home}}'
            f'@v{version}"') in given  # IPython expands {home}
    for cell in (unset, given):
        assert cell.startswith(home.MARK)
        assert max(len(line) for line in cell.splitlines()) <= 79
    assert home.setup_cell() == unset  # _config.yml's home is unset
