"""The repository itself: clean notebooks, one place for versions, idempotent set-up."""

from __future__ import annotations

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
