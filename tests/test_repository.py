"""The repository itself: clean notebooks, one place for versions, idempotent set-up."""

from __future__ import annotations

import json
import re

import nbformat
import pytest

from tests.conftest import ROOT

NOTEBOOKS = sorted(
    p
    for folder in ("lectures", "solutions", "assignments")
    for p in (ROOT / folder).rglob("*.ipynb")
    if ".ipynb_checkpoints" not in p.parts
)


def test_there_are_notebooks():
    assert NOTEBOOKS, "no notebooks found under lectures/, solutions/ or assignments/"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: str(p.relative_to(ROOT)))
def test_notebooks_are_committed_without_outputs(path):
    # Cell ids as written in the file: nbformat.read would add missing ones (with a warning
    # that says it will become an error), so look at the raw JSON.
    ids = [cell.get("id") for cell in json.loads(path.read_text())["cells"]]
    assert None not in ids, f"{path.name}: cell {ids.index(None)} has no id"
    assert len(set(ids)) == len(ids), f"{path.name}: cell ids repeat"
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"cell {i} of {path.name} has outputs"
            assert cell.execution_count is None, f"cell {i} of {path.name} has an execution count"


def test_versions_are_pinned_once_in_pyproject():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + project["optional-dependencies"]["test"]
    assert all("==" in r for r in requirements), "every dependency is pinned exactly"
    env = (ROOT / "environment.yml").read_text()
    assert "-e .[test]" in env and "torch" not in env.replace("pytorch.org", "")


# A file a person can read in one sitting: split a longer one by what a reader looks for (a
# topic's measurements into course_lib/measure/, a check's machinery into its parts).
MAX_LINES = 500


def test_every_course_lib_file_reads_in_one_sitting():
    long = {
        str(path.relative_to(ROOT)): n
        for path in sorted((ROOT / "course_lib").rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"over {MAX_LINES} lines: {long}"


def test_the_lock_holds_every_pin_of_pyproject_at_its_version_with_hashes():
    """`make install` installs requirements.lock: a pin changed in pyproject.toml without
    `make lock` would be installed at the lock's old version (or not at all)."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = dict(
        r.lower().replace("_", "-").split("==")
        for r in project["dependencies"] + project["optional-dependencies"]["test"]
    )
    lock = (ROOT / "requirements.lock").read_text()
    entries = re.findall(r"^([\w.-]+)==(\S+)(.*?)(?=^\S|\Z)", lock, re.MULTILINE | re.DOTALL)
    locked = {name.lower().replace("_", "-"): version for name, version, _ in entries}
    assert "torch" not in locked, "torch is installed from its pin, CPU or CUDA build"
    stale = {n: (v, locked.get(n)) for n, v in pins.items() if n != "torch" and locked.get(n) != v}
    assert not stale, f"pyproject.toml pin vs requirements.lock: {stale}; run `make lock`"
    unhashed = [name for name, _, rest in entries if "--hash=sha256:" not in rest]
    assert not unhashed, f"no hash for {unhashed}"
    cuda = [n for n in locked if n.startswith(("nvidia-", "cuda-")) or n == "triton"]
    assert not cuda, f"the CPU build must install without {cuda}"
