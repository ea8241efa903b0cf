"""The student's answer as source code, so that only the ranks ever run it.

When grading (`course_lib.grading.judge`), the process that calls the checks and decides
the score never executes student code: each name an answer cell defines is bound to an
`Answer`, which carries the source of the notebook's set-up cell and answer cells. The
checks hand it to `launch` like a function; on each rank, `resolve` runs those cells in a
fresh namespace and passes the real function or class on. Whatever the student's code
does, it does on a rank, whose results the grading process only reads as data.
"""

from __future__ import annotations

import ast
import linecache
from dataclasses import dataclass
from typing import Any

from course_lib import _worker


@dataclass(frozen=True)
class Answer:
    """Stands for `name` as the cells define it; runs only on a rank (see `resolve`)."""

    name: str
    cells: tuple[tuple[str, str], ...]  # (cell id, source), in notebook order

    def __getattr__(self, attr: str) -> Any:
        if attr in ("__name__", "__qualname__"):  # checks name the student's function
            return self.name
        raise AttributeError(attr)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"{self.name} is the student's code: grading runs it on a rank, never here"
        )

    def __repr__(self) -> str:
        return f"<your {self.name}>"


def defined_names(source: str) -> list[str]:
    """Names a cell binds at its top level (def, class, import, assignment)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names += [(a.asname or a.name).split(".")[0] for a in node.names if a.name != "*"]
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names += [n.id for n in ast.walk(target) if isinstance(n, ast.Name)]
    return names


class AnswerCellError(Exception):
    """An answer cell raised while it was being run on a rank."""


def _namespace(cells: tuple[tuple[str, str], ...]) -> dict:
    namespace: dict = {"__name__": "__main__", "__builtins__": __builtins__}
    for cell_id, source in cells:
        filename = f"<cell {cell_id}>"
        # So that tracebacks quote the student's lines.
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        try:
            exec(compile(source, filename, "exec"), namespace)  # noqa: S102 (on a rank, by design)
        except Exception as error:
            raise AnswerCellError(
                f"cell {cell_id!r} raised {type(error).__name__} when run on its own after the "
                f"set-up cell: {error}. Answer cells are graded alone (in notebook order), so "
                "they must not use names defined in other cells."
            ) from error
    return namespace


def resolve(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """On a rank: replace every `Answer` in the arguments (also inside lists, tuples and
    dicts) by what its cells define. Cells shared by several answers run once."""
    namespaces: dict[tuple, dict] = {}

    def real(value: Any, depth: int = 0) -> Any:
        if isinstance(value, Answer):
            if value.cells not in namespaces:
                namespaces[value.cells] = _namespace(value.cells)
            namespace = namespaces[value.cells]
            if value.name not in namespace:
                raise NameError(f"your answer cells do not define {value.name!r}")
            return namespace[value.name]
        if depth < 3 and isinstance(value, (list, tuple)):
            return type(value)(real(v, depth + 1) for v in value)
        if depth < 3 and isinstance(value, dict):
            return {k: real(v, depth + 1) for k, v in value.items()}
        return value

    return tuple(real(a) for a in args), {k: real(v) for k, v in kwargs.items()}


def contains_answer(values: Any, depth: int = 0) -> bool:
    if isinstance(values, Answer):
        return True
    if depth < 3 and isinstance(values, (list, tuple)):
        return any(contains_answer(v, depth + 1) for v in values)
    if depth < 3 and isinstance(values, dict):
        return any(contains_answer(v, depth + 1) for v in values.values())
    return False


def _resolve_answers(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return resolve(args, kwargs) if contains_answer((args, kwargs)) else (args, kwargs)


# Imported on a rank (grading ranks preload it; elsewhere, unpickling an Answer imports it),
# this module tells the worker to resolve answers before each call.
_worker.ARGUMENT_HOOKS = (*_worker.ARGUMENT_HOOKS, _resolve_answers)
