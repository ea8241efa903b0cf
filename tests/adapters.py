"""The right answers, as the solution notebooks define them: one copy of each answer.

    a07 = solution("zero")                        # solutions/a07_zero's answers, by name
    a07.ShardedOptimizer                          # as the notebook's cells define it
    buggy = mutant("zero", "zero2", ("param.grad = None", "pass"))   # a named mutation
    cheat = planted("zero", "zero2", CHEAT_SOURCE)   # one answer cell replaced, as a cheat is

The grading tests hold the checks against these, against small named mutations of them and
against right answers written in other styles; bench/ring.py times the solution's ring. The
cells run (the set-up cell, then every answer cell, in notebook order, as the judge runs
them) in a namespace that is not an importable module, so the ranks receive what it defines
by value.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import nbformat

from course_lib.topics import topic
from tests.conftest import ROOT


def answer_cells(topic_name: str) -> dict[str, str]:
    """cell id -> source of the set-up cell and every code answer cell of the topic's solution
    (written answers, markdown, are graded by hand)."""
    t = topic(topic_name)
    if t.solution is None:
        raise ValueError(f"topic {topic_name!r} has no assignment")
    cells = nbformat.read(ROOT / t.solution, as_version=4).cells
    return {
        c.id: c.source
        for c in cells
        if c.id == "setup"
        or (c.cell_type == "code" and c.metadata.get("nbgrader", {}).get("solution", False))
    }


def _run(topic_name: str, cells: dict[str, str]) -> SimpleNamespace:
    name = topic(topic_name).assignment_name
    namespace = {"__name__": f"{name}_solution"}  # not importable: ranks get it by value
    for cell_id, source in cells.items():
        exec(compile(source, f"<{name}:{cell_id}>", "exec"), namespace)  # noqa: S102
    return SimpleNamespace(**{k: v for k, v in namespace.items() if not k.startswith("__")})


@functools.cache
def solution(topic_name: str) -> SimpleNamespace:
    """Everything the solution's set-up and answer cells define (run once per session)."""
    return _run(topic_name, answer_cells(topic_name))


def mutant(topic_name: str, cell_id: str, *edits: tuple[str, str]) -> SimpleNamespace:
    """The solution with a few edits in one answer cell: each (old, new) replaces a piece of
    its source that occurs there exactly once."""
    cells = answer_cells(topic_name)
    source = cells[cell_id]
    for old, new in edits:
        if source.count(old) != 1:
            raise ValueError(f"{old!r} occurs {source.count(old)} times in cell {cell_id!r}")
        source = source.replace(old, new)
    return _run(topic_name, {**cells, cell_id: source})


def planted(topic_name: str, cell_id: str, source: str) -> SimpleNamespace:
    """The solution with one answer cell's whole source replaced, as tests/cheats plants a
    cheat or an alternative in a graded notebook: the grading tests hold the checks against
    the same text."""
    cells = answer_cells(topic_name)
    if cell_id not in cells:
        raise ValueError(f"no answer cell {cell_id!r} in {topic_name}'s solution")
    return _run(topic_name, {**cells, cell_id: source})
