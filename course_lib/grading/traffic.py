"""What a run of the grading ranks communicated, as the launcher saw it from outside them:
the calls each rank's process group reported as they happened (`course_lib.counted_group`),
and the bytes the kernel counted on each rank's sockets (`course_lib.sockets`). A check judges
communication by these, never by counters kept on the ranks, which the student's code shares.

    Traffic(tallies, wire)          one run's record (`run_on_ranks(..., traffic=True)`)
    Sent                            one reported call
    Note                            an event the check reported among the calls
    CaseMarks                       on a rank: the check's marks, case 0, 1, 2, ... in order
    split_by_marks(entries, n)      one rank's calls, case by case
    split_with_notes(entries, n)    ... with the check's notes in their places among them
    unreported_bytes(traffic)       bytes on the wire that no reported call accounts for
"""

from __future__ import annotations

from dataclasses import dataclass

from course_lib import counted_group


@dataclass(frozen=True)
class Traffic:
    """What the launcher saw of a run's communication, outside the ranks: `tallies`, per rank,
    every call its process group reported as it happened (("call", op, peer, sent, received,
    group, dtypes), ("mark", label) and ("note", label) entries); `wire`, per rank, the bytes
    it wrote to each other rank's sockets, as the kernel counted them (None where they cannot
    be read)."""

    tallies: list[list[tuple]]
    wire: list[dict[int, int]] | None


@dataclass(frozen=True)
class Sent:
    """One call a rank's process group made, as the launcher received it (`run_on_ranks`
    with `traffic=True`): `peer` is a global rank for send and recv, else None; bytes by
    `course_lib.comm.volume`; `group` the global ranks of the group it ran on; `dtypes` the
    names of its tensors' dtypes ("float32", "int8"), sorted."""

    op: str
    peer: int | None
    sent: int
    received: int
    group: tuple[int, ...]
    dtypes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Note:
    """An event the check's code on a rank reported between the calls (`counted_group.note`),
    in its place among them: `label` is what it said."""

    label: object


def split_by_marks(entries: list[tuple], cases: int) -> list[list[Sent]] | None:
    """One rank's calls, per case, from a run whose rank function put `counted_group.mark(i)`
    before case i and `mark(cases)` after the last; None if the marks are not exactly those,
    in that order, or calls came outside the cases (before the first mark, after the last).
    Notes are left out (`split_with_notes` keeps them)."""
    per_case = split_with_notes([e for e in entries if e[0] != "note"], cases)
    return None if per_case is None else [list(case) for case in per_case]


def split_with_notes(entries: list[tuple], cases: int) -> list[list[Sent | Note]] | None:
    """As `split_by_marks`, with the notes kept among the calls, in the order they were
    reported; None also if a note came outside the cases."""
    marks = [e[1] for e in entries if e[0] == "mark"]
    if marks != list(range(cases + 1)) or not entries or entries[0][0] != "mark":
        return None
    if entries[-1][0] != "mark":
        return None
    per_case: list[list[Sent | Note]] = []
    for entry in entries:
        if entry[0] == "mark":
            per_case.append([])
        elif entry[0] == "note":
            per_case[-1].append(Note(entry[1]))
        else:
            per_case[-1].append(Sent(*entry[1:]))
    return per_case[:cases]


# What gloo puts on the wire for a send and a recv besides the tensor (held against real gloo
# by tests/test_grading_judge.py): the sender writes 96 bytes of message headers, the
# receiver 48 (its notice that it is ready to receive).
SEND_OVERHEAD, RECV_OVERHEAD = 96, 48


def unreported_bytes(traffic: Traffic) -> list[int | None]:
    """Per rank, the bytes it wrote to the other ranks beyond what its reported send and recv
    calls account for; None for a rank whose calls include collectives (whose wire bytes
    depend on gloo's algorithm) or where the wire cannot be read. More than 0 means code on
    the rank talked around the counted process group."""
    if traffic.wire is None:
        return [None] * len(traffic.tallies)
    out: list[int | None] = []
    for entries, wire in zip(traffic.tallies, traffic.wire, strict=True):
        calls = [Sent(*e[1:]) for e in entries if e[0] == "call"]
        if any(call.op not in ("send", "recv") for call in calls):
            out.append(None)
            continue
        explained = sum(
            call.sent + SEND_OVERHEAD if call.op == "send" else RECV_OVERHEAD for call in calls
        )
        out.append(sum(wire.values()) - explained)
    return out


class CaseMarks:
    """On a grading rank, the check's marks between a run's cases, 0, 1, 2, ... in order
    (`counted_group.mark`): the launcher books the calls reported after mark i to case i
    (`split_by_marks`)."""

    def __init__(self) -> None:
        self.count = 0

    def next(self) -> None:
        counted_group.mark(self.count)
        self.count += 1

    def finish(self, cases: int) -> None:
        """The marks of the cases not run (a model the check refused), and the last one."""
        while self.count <= cases:
            self.next()
