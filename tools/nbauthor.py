"""Write nbgrader notebooks from Python, with stable cell ids and nbgrader metadata.

    nb = Notebook()
    nb.markdown("intro", "# Assignment 2 ...")
    nb.readonly("setup", "import torch")
    nb.solution("ping", "def ping(conn):\\n    ### BEGIN SOLUTION\\n    ...\\n    ### END SOLUTION")
    nb.tests("test_ping", "check_ping(ping)", points=2)
    nb.write("solutions/a02_collectives/a02_collectives.ipynb")

Explicit cell ids keep `make release` byte-for-byte reproducible. After a notebook is
written, it is the source of truth: edit it in JupyterLab (View > Cell Toolbar > Create
Assignment), not by re-running a builder.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

KERNELSPEC = {
    "name": "distcourse",
    "display_name": "Python 3 (distributed training course)",
    "language": "python",
}
_ID = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


def _nbgrader(**fields) -> dict:
    meta = {"schema_version": 3, "grade": False, "solution": False, "locked": False}
    meta.update(fields)
    return {"nbgrader": meta}


class Notebook:
    """An nbgrader source notebook built cell by cell."""

    def __init__(self) -> None:
        self.nb = new_notebook()
        self.nb.metadata["kernelspec"] = dict(KERNELSPEC)
        self.nb.metadata["language_info"] = {"name": "python"}
        self._ids: set[str] = set()

    def _add(self, cell) -> None:
        if not _ID.match(cell.id) or cell.id in self._ids:
            raise ValueError(f"cell id {cell.id!r} is invalid or used twice")
        self._ids.add(cell.id)
        self.nb.cells.append(cell)

    def markdown(self, cell_id: str, text: str) -> None:
        """Explanations; students may edit them (they are not graded)."""
        self._add(new_markdown_cell(text.strip(), id=cell_id))

    def code(self, cell_id: str, source: str) -> None:
        """Ordinary code students may run and change (try-it cells)."""
        self._add(new_code_cell(source.strip(), id=cell_id))

    def readonly(self, cell_id: str, source: str) -> None:
        """Code students run but cannot change; autograde restores it if they do."""
        meta = _nbgrader(locked=True, grade_id=cell_id)
        self._add(new_code_cell(source.strip(), id=cell_id, metadata=meta))

    def solution(self, cell_id: str, source: str) -> None:
        """Student code: ### BEGIN SOLUTION ... ### END SOLUTION is removed on release."""
        if "### BEGIN SOLUTION" not in source:
            raise ValueError(f"solution cell {cell_id!r} has no ### BEGIN SOLUTION region")
        meta = _nbgrader(solution=True, grade_id=cell_id)
        self._add(new_code_cell(source.strip(), id=cell_id, metadata=meta))

    def tests(self, cell_id: str, source: str, points: float) -> None:
        """An autograded test cell worth `points`; ### BEGIN HIDDEN TESTS regions are
        removed on release and put back when grading."""
        meta = _nbgrader(grade=True, locked=True, points=points, grade_id=cell_id)
        self._add(new_code_cell(source.strip(), id=cell_id, metadata=meta))

    def write(self, path: str | Path) -> None:
        nbformat.validate(self.nb)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(self.nb, str(path))
