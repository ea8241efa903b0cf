"""Cheats and right-but-different answers, one module per assignment (`a1_collectives.py`, ...).

`tests/test_cheats.py` plants each in a copy of the assignment's solution notebook, grades
the copies through `make autograde` (sandbox, judge and all) and asserts that every cheat
scores 0 on the parts it targets, while the untouched parts, the solution and every
alternative keep full marks.

A module defines

    CHEATS = [Cheat(...), ...]          # must score 0 on `fails`
    ALTERNATIVES = [Alternative(...)]   # right answers the notebook allows: full marks

Cheats that change only their own answer cell are graded together in one notebook (they
target different parts); a cheat with `alone=True` (one that changes shared state, such as
rebinding a check or patching a module) gets a notebook of its own.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Cheat:
    """A submission that wants points without the work."""

    name: str  # what the student tries, in a few words
    cell: str  # id of the answer cell it rewrites
    source: str  # the cell's new source (the whole cell)
    fails: frozenset[str]  # grade ids of the test cells that must score 0
    alone: bool = False  # changes shared state: graded in a notebook of its own


@dataclass(frozen=True)
class Alternative:
    """A right answer written differently from the solution: must keep full marks."""

    name: str
    cell: str
    source: str
