"""The student edition (`make student`) holds no answer: no solution code, no hidden test, no
test that carries a right implementation, and everything a student needs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import nbformat
import pytest

from tests.conftest import ROOT
from tools import student_edition

SOLUTIONS = sorted((ROOT / "solutions").glob("*/*.ipynb"))
WINDOW = 4  # consecutive lines of a solution region that count as a copy of it


@pytest.fixture(scope="module")
def edition(tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("edition") / "course"
    student_edition.build(dest)
    return dest


def _meaningful(line: str) -> str | None:
    text = line.strip()
    if not text or text.startswith("#") or len(text) < 4:
        return None
    return text


def regions(source: str, begin: str, end: str) -> list[list[str]]:
    """The meaningful lines of each begin..end region of a cell."""
    found, current = [], None
    for line in source.splitlines():
        if begin in line:
            current = []
        elif end in line and current is not None:
            found.append(current)
            current = None
        elif current is not None and (text := _meaningful(line)):
            current.append(text)
    return found


def edition_lines(edition: Path) -> dict[str, list[str]]:
    """Every text file of the edition as its meaningful lines (notebooks: cell by cell)."""
    texts = {}
    for path in edition.rglob("*"):
        if not path.is_file():
            continue
        if path.suffix == ".ipynb":
            cells = json.loads(path.read_text())["cells"]
            lines = [line for c in cells for line in "".join(c["source"]).splitlines()]
        else:
            try:
                lines = path.read_text().splitlines()
            except UnicodeDecodeError:
                continue
        texts[str(path.relative_to(edition))] = [t for x in lines if (t := _meaningful(x))]
    return texts


def contains(lines: list[str], block: list[str]) -> bool:
    n = len(block)
    return any(lines[i : i + n] == block for i in range(len(lines) - n + 1))


def test_edition_has_what_students_need(edition):
    for folder in ("lectures", "assignments", "course_lib", "course_lib/grading", "examples"):
        assert (edition / folder).is_dir(), folder
    lectures = sorted(p.name for p in (ROOT / "lectures").glob("*.ipynb"))
    assert sorted(p.name for p in (edition / "lectures").glob("*.ipynb")) == lectures
    for solution in SOLUTIONS:
        assert (edition / "assignments" / solution.parent.name / solution.name).is_file()
    for name in ("Makefile", "README.md", "pyproject.toml", "requirements.lock"):
        assert (edition / name).is_file(), name
    for name in ("nbgrader_config.py", "tools/build_site.py"):  # Validate; make test's site
        assert (edition / name).is_file(), name


def test_edition_leaves_out_solutions_answer_tests_and_instructor_tools(edition):
    files = [str(p.relative_to(edition)) for p in edition.rglob("*") if p.is_file()]
    assert not (edition / "solutions").exists()
    assert not [f for f in files if re.match(r"tests/(test_grading_|test_autograde|cheats/)", f)]
    assert not [f for f in files if f.startswith(("bench/", ".ci/", "docs/"))]
    assert [f for f in files if f.startswith("tools/")] == ["tools/build_site.py"]
    # The planted bugs quote lines of the solutions; adapters.py runs the solutions.
    assert not {"tests/grading_course.py", "tests/adapters.py", "CONTRIBUTING.md"} & set(files)
    makefile = (edition / "Makefile").read_text()
    assert "autograde" not in makefile and "release" not in makefile
    assert "lock:" not in makefile and "roster" not in makefile  # tools/lock.py stays here
    readme = (edition / "README.md").read_text()
    assert "For instructors" not in readme and "student edition" in readme
    assert "GradeInSandbox" not in (edition / "nbgrader_config.py").read_text()


def test_no_solution_region_or_hidden_test_is_in_the_edition(edition):
    texts = edition_lines(edition)
    leaks = []
    for solution in SOLUTIONS:
        for cell in nbformat.read(solution, 4).cells:
            hidden = regions(cell.source, "### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS")
            # The cases a hidden test tries are the secret: its check calls.
            for line in (x for region in hidden for x in region if "check_" in x):
                leaks += [
                    (solution.name, cell.id, line, f) for f, ls in texts.items() if line in ls
                ]
            for region in regions(cell.source, "### BEGIN SOLUTION", "### END SOLUTION"):
                windows = [region[i : i + WINDOW] for i in range(max(1, len(region) - WINDOW + 1))]
                for block in windows:
                    if sum(map(len, block)) < 100:  # too short to tell a copy from boilerplate
                        continue
                    leaks += [
                        (solution.name, cell.id, block[0], f)
                        for f, ls in texts.items()
                        if contains(ls, block)
                    ]
    assert not leaks, "\n".join(f"{s}:{c} '{line}' found in {f}" for s, c, line, f in leaks[:20])


def test_the_leak_detector_finds_a_planted_leak(edition, tmp_path):
    """The check above is only worth something if it fails on a leak."""
    solution = SOLUTIONS[1]
    cell = next(c for c in nbformat.read(solution, 4).cells if "### BEGIN SOLUTION" in c.source)
    region = regions(cell.source, "### BEGIN SOLUTION", "### END SOLUTION")[0]
    planted = edition / "course_lib" / "planted.py"
    planted.write_text("\n".join(region) + "\n")
    try:
        texts = edition_lines(edition)
        assert contains(texts["course_lib/planted.py"], region[:WINDOW])
    finally:
        planted.unlink()
