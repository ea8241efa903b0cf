"""Every file about a topic carries the topic's name, and the README's course table is the
topic table (`course_lib.topics`): a renamed, missing or stray file fails here."""

from __future__ import annotations

import ast
import json
import re

import nbformat
import pytest

from course_lib.topics import GRADING_LIBRARY, LIBRARY, LIBRARY_TESTS, TOPICS, Topic, topic
from tests.conftest import ROOT


def stems(folder: str, pattern: str) -> set[str]:
    return {p.stem for p in (ROOT / folder).glob(pattern)}


def packages(folder: str) -> set[str]:
    """The packages in a folder: a module too long for one file is a folder of files named by
    what a reader looks for, with an __init__.py that gathers their names."""
    return {p.parent.name for p in (ROOT / folder).glob("*/__init__.py")}


def heading(notebook: str) -> str:
    """The first line of a notebook's first cell."""
    cells = json.loads((ROOT / notebook).read_text())["cells"]
    return "".join(cells[0]["source"]).splitlines()[0]


def test_numbers_and_names_are_unique_and_in_course_order():
    assert [t.number for t in TOPICS] == list(range(len(TOPICS)))
    assert len({t.name for t in TOPICS}) == len(TOPICS)
    assert all(re.fullmatch(r"[a-z][a-z0-9_]*", t.name) for t in TOPICS)
    assert topic("zero").lecture == "lectures/07_zero.ipynb"
    with pytest.raises(KeyError, match="no topic 'sharding'"):
        topic("sharding")


@pytest.mark.parametrize("t", TOPICS, ids=lambda t: t.name)
def test_every_file_of_a_topic_exists(t: Topic):
    # course_lib/<topic>.py may be a package, course_lib/<topic>/, when one file is too long
    package = {t.module_path: f"course_lib/{t.name}/__init__.py"} if t.module else {}
    missing = [
        path
        for path in t.paths()
        if not (ROOT / path).is_file() and not (ROOT / package.get(path, path)).is_file()
    ]
    assert not missing, f"topic {t.name!r} has no {', '.join(missing)}"


@pytest.mark.parametrize("t", TOPICS, ids=lambda t: t.name)
def test_lecture_and_assignment_headings_are_the_topics(t: Topic):
    assert heading(t.lecture) == f"# {t.number}. {t.title}"
    for notebook in (t.solution, t.release):
        if notebook:
            assert heading(notebook) == f"# Assignment {t.number}: {t.assignment}"


def test_no_file_is_named_after_something_that_is_not_a_topic():
    """Each lecture, assignment, topic module, check module and test file belongs to a topic
    (or to the machinery the topics table names): a file renamed on its own fails here."""
    names = {t.name for t in TOPICS}
    lectures = {t.lecture.split("/")[1][:-6] for t in TOPICS}
    assignments = {t.assignment_name for t in TOPICS if t.assignment}
    assert stems("lectures", "*.ipynb") == lectures
    assert {p.name for p in (ROOT / "solutions").iterdir() if p.is_dir()} == assignments
    assert {p.name for p in (ROOT / "assignments").iterdir() if p.is_dir()} == assignments
    modules = {t.name for t in TOPICS if t.module}
    layers = {"grading", "measure"}
    assert stems("course_lib", "*.py") | packages("course_lib") - layers == modules | LIBRARY
    # What a lecture measures and draws lives apart from the topic's code, under its name.
    assert (
        stems("course_lib/measure", "*.py") - {"__init__"} | packages("course_lib/measure")
        <= modules
    )
    checks = {t.name for t in TOPICS if t.assignment}
    # A check module too long to read in one sitting has parts: grading/<topic>_<part>.py.
    parts = {s for s in stems("course_lib/grading", "*.py") if part_of(s)}
    assert stems("course_lib/grading", "*.py") == checks | parts | GRADING_LIBRARY
    # An assignment's cheats are listed in tests/cheats/<assignment>.py; sources too long for
    # one file sit beside it, as tests/cheats/<assignment>_<part>.py.
    cheats = stems("tests/cheats", "a*.py")
    assert assignments <= cheats
    assert all(any(c.startswith(f"{a}_") for a in assignments) for c in cheats - assignments)
    tested = {s.removeprefix("test_") for s in stems("tests", "test_*.py")}
    expected = modules | {f"grading_{name}" for name in checks} | LIBRARY_TESTS
    # A check's part may have its own tests, named after the part: test_grading_<part>.py;
    # so may a module of a topic's package (course_lib/<topic>/ or course_lib/measure/<topic>/):
    # test_<topic>_<module>.py.
    package_parts = {
        f"{topic}_{stem}"
        for topic in modules
        for folder in (f"course_lib/{topic}", f"course_lib/measure/{topic}")
        if (ROOT / folder).is_dir()
        for stem in stems(folder, "*.py") - {"__init__"}
    }
    allowed = expected | {f"grading_{part}" for part in parts} | package_parts
    assert expected <= tested <= allowed, (
        f"not a topic's test: {sorted(tested - allowed)}; missing: {sorted(expected - tested)}"
    )
    assert not LIBRARY & names and not GRADING_LIBRARY & checks


def part_of(stem: str) -> str | None:
    """The topic whose checks grading/<stem>.py is a part of, if it is one."""
    owners = [t.name for t in TOPICS if t.assignment and stem.startswith(f"{t.name}_")]
    return max(owners, key=len, default=None)


def imported(path) -> set[str]:
    """The modules a Python file imports (also inside functions), by their dotted names."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
    return names


def test_check_parts_stand_below_their_topic_and_out_of_notebooks():
    """A part of a topic's checks never imports the topic's check module (which imports it),
    and notebooks import only the check module: the parts can move without a release."""
    for path in sorted((ROOT / "course_lib/grading").glob("*.py")):
        owner = part_of(path.stem)
        if owner:
            assert f"course_lib.grading.{owner}" not in imported(path), (
                f"{path.name} imports course_lib.grading.{owner}, its topic's module"
            )
    for folder in ("lectures", "solutions", "assignments"):
        for notebook in sorted((ROOT / folder).rglob("*.ipynb")):
            for module in re.findall(r"course_lib\.grading\.(\w+)", notebook.read_text()):
                assert not part_of(module), f"{notebook.name} imports grading.{module}, a part"


def test_the_tools_given_to_students_are_what_the_set_up_cells_import():
    """course_lib.grading.GIVEN (what answers may call of the grader's) is exactly what the
    solutions' set-up cells import from course_lib.grading besides the checks."""
    from course_lib.grading import GIVEN

    imported: dict[str, set[str]] = {}
    for notebook in sorted((ROOT / "solutions").rglob("*.ipynb")):
        setup = next((c for c in nbformat.read(notebook, 4).cells if c.id == "setup"), None)
        for statement in ast.parse(setup.source if setup else "").body:
            if isinstance(statement, ast.ImportFrom) and (statement.module or "").startswith(
                "course_lib.grading"
            ):
                names = {a.name for a in statement.names}
                tools = {n for n in names if not n.startswith("check_") and n != "CheckFailed"}
                if tools:
                    imported.setdefault(statement.module, set()).update(tools)
    assert {module: set(names) for module, names in GIVEN.items()} == imported


# Imports that break the layers on purpose (docs/architecture.md says why): (importer, imported).
LAYER_EXCEPTIONS = {
    # the bytes a tensor's storage takes, as lecture 6 counts them
    ("grading.parallel_3d_configurations", "memory"),
}


def course_lib_imports() -> dict[str, set[str]]:
    """module -> the course_lib modules it imports, both without the "course_lib." prefix."""
    graph = {}
    for path in sorted((ROOT / "course_lib").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT / "course_lib").with_suffix("").parts)
        names = set()
        for name in imported(path):
            if name.startswith("course_lib."):
                name = name.removeprefix("course_lib.")
                # "from course_lib.grading import x": x may be a function; keep the module
                names.add(name if module_exists(name) else name.rsplit(".", 1)[0])
        graph[module.removesuffix(".__init__")] = names - {""}
    return graph


def module_exists(name: str) -> bool:
    path = ROOT / "course_lib" / name.replace(".", "/")
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def top_of(module: str) -> str:
    return module.split(".")[0]


def test_imports_follow_the_layers():
    """The import table of docs/architecture.md: the machinery knows no topic, a topic module
    builds only on earlier topics, a lecture's measurements on their own topic, and a check
    on no topic module (its reference is independent of code a student can copy) and on no
    other topic's checks."""
    number = {t.name: t.number for t in TOPICS}
    checks_of = {
        m: part_of(m.split(".")[1]) or m.split(".")[1]
        for m in course_lib_imports()
        if m.startswith("grading.") and m.split(".")[1] not in GRADING_LIBRARY
    }
    broken = []
    for module, names in course_lib_imports().items():
        for name in names:
            top = name.split(".")[0]
            if (module, top) in LAYER_EXCEPTIONS or (module, name) in LAYER_EXCEPTIONS:
                continue
            if name.startswith("measure."):
                topic_of_name = name.split(".")[1]
            else:
                topic_of_name = top if top in number else None
            # a lecture's code: course_lib/<topic>, course_lib/measure/<topic>, or a file of
            # either where it is a package
            if top_of(module) in number or module.startswith("measure."):
                own = module.split(".")[1] if module.startswith("measure.") else top_of(module)
                later = topic_of_name and number[topic_of_name] > number[own]
                lecture_reads_measure = name.startswith("measure.") and top_of(module) in number
                if top == "grading" or later or lecture_reads_measure:
                    broken.append(f"{module} -> {name}")
            elif module in checks_of:  # a check module or one of its parts
                other = checks_of.get(name)
                if topic_of_name or (other and other != checks_of[module]):
                    broken.append(f"{module} -> {name}")
            elif module.split(".")[0] in LIBRARY:  # the machinery
                if topic_of_name or top in ("grading", "measure"):
                    broken.append(f"{module} -> {name}")
    assert not broken, "imports across the layers (docs/architecture.md):\n" + "\n".join(broken)


def test_course_lib_imports_form_no_circle():
    """No module imports, even through others, one that imports it back: the launcher, at the
    bottom, is told by grading what its ranks preload (`WorkerPool(preload=...)`) and how to
    resolve an answer (`_worker.ARGUMENT_HOOKS`), and imports none of it."""
    # _worker run as a script imports itself (the module, not __main__'s copy): no circle
    graph = {module: names - {module} for module, names in course_lib_imports().items()}
    assert "pool" in graph["launch"] and "_worker" in graph["grading.answers"]  # read right

    def reachable(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for name in graph.get(todo.pop(), set()) - seen:
                seen.add(name)
                todo.append(name)
        return seen

    circles = sorted(module for module in graph if module in reachable(module))
    assert not circles, f"modules on an import circle: {circles}"


def readme_course_table() -> list[list[str]]:
    lines = (ROOT / "README.md").read_text().split("## The course\n", 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    table = []
    for line in lines[start + 2 :]:  # after the header and the |---| row
        if not line.startswith("|"):
            break
        table.append([cell.strip() for cell in line.strip("|").split(" | ")])
    return table


def test_readme_course_table_is_the_topic_table():
    rows = readme_course_table()
    assert len(rows) == len(TOPICS)
    for t, (lecture, measures, assignment) in zip(TOPICS, rows, strict=True):
        assert lecture == f"[{t.number:02d} {t.title.split(':')[0]}]({t.lecture})"
        assert measures, f"README: say what lecture {t.number} measures"
        if t.assignment:
            assert assignment == f"[{t.assignment_name}]({t.release}): {t.assignment}"
        else:
            assert assignment == ""


def _graded_names(solution: str) -> list[str]:
    """The functions and classes of a solution's answer cells that its graded test cells use,
    in the order the tests first name them."""
    cells = json.loads((ROOT / solution).read_text())["cells"]

    def code(cell: dict) -> str:  # IPython magics are not Python
        return "\n".join(
            "" if re.match(r"\s*[%!]", x) else x for x in "".join(cell["source"]).splitlines()
        )

    meta = lambda cell: cell.get("metadata", {}).get("nbgrader", {})  # noqa: E731
    answers = [c for c in cells if c["cell_type"] == "code" and meta(c).get("solution")]
    defined = {
        node.name
        for cell in answers
        for node in ast.parse(code(cell)).body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
    }
    used: list[str] = []
    for cell in (c for c in cells if c["cell_type"] == "code" and meta(c).get("grade")):
        for node in ast.walk(ast.parse(code(cell))):
            if isinstance(node, ast.Name) and node.id in defined and node.id not in used:
                used.append(node.id)
    return used


@pytest.mark.parametrize("t", [t for t in TOPICS if t.assignment], ids=lambda t: t.name)
def test_deliverables_are_what_the_graded_cells_check(t: Topic):
    """A topic's `deliverables` are the names its graded test cells hand to the checks (the
    student edition's library must define none of them), neither more nor fewer."""
    assert t.deliverables == tuple(_graded_names(t.solution)), (
        f"{t.name}: deliverables {t.deliverables} are not the answers its graded test cells "
        f"check, {tuple(_graded_names(t.solution))}; update course_lib/topics.py"
    )


def test_a_topic_without_an_assignment_has_no_deliverables():
    assert not [t.name for t in TOPICS if t.deliverables and not t.assignment]
