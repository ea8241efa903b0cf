"""Assignment 8's open part: a schedule with a smaller bubble than 1F1B in 1F1B's memory.

`split_schedule(P, m)` returns, for each stage s = 0..P-1, the list of the operations stage s
runs, in order: ("F", i) the forward of micro-batch i, ("B", i) its input gradient (which
stage s - 1 waits for) and ("W", i) its weight gradient (which nobody waits for). The check
does not trust any simulator but its own:

- it validates the lists: P of them, each running F, B and W of every micro-batch 0..m-1
  exactly once, with B i after F i and W i after B i on the stage;
- it simulates them (`simulate_split`): each stage runs its list in order, each operation as
  soon as the stage is free and what it needs has ended (F i on stage s - 1 before F i on s,
  B i on stage s + 1 before B i on s); every operation lasts one unit (`OP_TIME`); a stage
  that waits for an operation that can never run is a deadlock, refused;
- it measures the bubble, 1 - (busy time) / (P x makespan), and each stage's peak of
  micro-batches in flight: forward done, weight gradient not yet (W needs the activations).

It scores when, on every (P, m) case, no stage holds more than P micro-batches (1F1B's first
stage) and the step is shorter than 1F1B's: at most 3m + 2(P - 1) - 1 units
(`makespan_allowed`). 1F1B written with split backwards (each W right after its B) takes
3m + 2(P - 1) here (B, not W, is on the critical path; a fused backward takes 3m + 3(P - 1)),
and GPipe's order the same; letting every stage hold P micro-batches and filling waits with
W's reaches 3m + P - 1 when m <= P (measured in tests/test_grading_pipeline.py).
"""

from __future__ import annotations

from course_lib.grading._harness import fail

KINDS = ("F", "B", "W")
OP_TIME = 1.0  # every F, B and W lasts one unit


def makespan_allowed(P: int, m: int) -> float:
    """The longest step that scores: one unit shorter than 1F1B's 3m + 2(P - 1) (3m units of
    work per stage, the rest idle)."""
    return OP_TIME * (3 * m + 2 * (P - 1) - 1)


def bubble_allowed(P: int, m: int) -> float:
    """The bubble fraction of a step of makespan_allowed(P, m)."""
    return 1 - 3 * m * OP_TIME / makespan_allowed(P, m)


def validate_split(check: str, at: str, P: int, m: int, orders: object) -> list[list[tuple]]:
    """The schedule as P lists of (kind, micro-batch), once each list runs F, B and W of
    every micro-batch exactly once, B i after F i and W i after B i."""
    __tracebackhide__ = True
    if not isinstance(orders, list | tuple) or len(orders) != P:
        fail(check, f"{at} returned {orders!r:.200}; expected a list of {P} lists, one per stage")
    clean = []
    for s, ops in enumerate(orders):
        try:
            ops = [(str(kind), int(i)) for kind, i in ops]
        except (TypeError, ValueError):
            fail(check, f"{at}: stage {s}'s entries must be (kind, micro_batch) pairs")
        expected = sorted((k, i) for k in KINDS for i in range(m))
        if sorted(ops) != expected:
            wrong = sorted(set(ops) ^ set(expected)) or "some twice"
            fail(
                check,
                f"{at}: stage {s} must run F, B and W of each micro-batch 0..{m - 1} exactly "
                f"once; wrong: {wrong!r:.160}",
            )
        position = {op: n for n, op in enumerate(ops)}
        for i in range(m):
            for before, after in (("F", "B"), ("B", "W")):
                if position[after, i] < position[before, i]:
                    fail(
                        check,
                        f"{at}: stage {s} runs {after}{i} before {before}{i}; "
                        f"{after} of a micro-batch needs its {before}",
                    )
        clean.append(ops)
    return clean


def _needs(kind: str, i: int, s: int, P: int) -> tuple | None:
    """What must have ended on another stage before (kind, i) runs on stage s."""
    if kind == "F":
        return ("F", i, s - 1) if s > 0 else None
    if kind == "B":
        return ("B", i, s + 1) if s < P - 1 else None
    return None  # W i waits only for B i on its own stage, before it in the list


def simulate_split(P: int, orders: list[list[tuple]]) -> dict:
    """Each stage's list run in order, each op as early as it can. Returns the timeline
    (per stage, (kind, i, start, end)), the makespan, the bubble fraction, each stage's peak
    in flight, and `stuck` ({stage: the op it waits at}) if the lists deadlock."""
    end: dict[tuple, float] = {}
    free, done = [0.0] * P, [0] * P
    timeline: list[list[tuple]] = [[] for _ in range(P)]
    moved = True
    while moved:
        moved = False
        for s in range(P):
            while done[s] < len(orders[s]):
                kind, i = orders[s][done[s]]
                need = _needs(kind, i, s, P)
                if need is not None and need not in end:
                    break
                start = max(free[s], end[need] if need else 0.0)
                end[kind, i, s] = free[s] = start + OP_TIME
                timeline[s].append((kind, i, start, free[s]))
                done[s] += 1
                moved = True
    stuck = {s: orders[s][done[s]] for s in range(P) if done[s] < len(orders[s])}
    makespan = max(free)
    busy = sum(len(ops) for ops in orders) * OP_TIME
    return {
        "timeline": timeline,
        "makespan": makespan,
        "bubble_fraction": 1 - busy / (P * makespan) if makespan else 0.0,
        "peaks": [_peak(ops) for ops in orders],
        "stuck": stuck,
    }


def _peak(ops: list[tuple]) -> int:
    """Most micro-batches whose F has run and whose W has not, along a stage's list."""
    live = peak = 0
    for kind, _ in ops:
        live += {"F": 1, "W": -1}.get(kind, 0)
        peak = max(peak, live)
    return peak


def judge_split(check: str, P: int, m: int, orders: object) -> dict:
    """The schedule validated, simulated and measured; fails unless it runs without deadlock
    in 1F1B's memory within makespan_allowed(P, m). Returns the simulation."""
    __tracebackhide__ = True
    at = f"split_schedule({P}, {m})"
    found = simulate_split(P, validate_split(check, at, P, m, orders))
    if found["stuck"]:
        waits = ", ".join(
            f"stage {s} at {k}{i}, which needs {_needs(k, i, s, P)[0]}{i} of stage "
            f"{_needs(k, i, s, P)[2]}"
            for s, (k, i) in found["stuck"].items()
        )
        fail(check, f"{at} deadlocks: no stage can go on ({waits})")
    worst = max(range(P), key=lambda s: found["peaks"][s])
    if found["peaks"][worst] > P:
        fail(
            check,
            f"{at}: stage {worst} holds {found['peaks'][worst]} micro-batches at once "
            f"(forward done, W not yet); 1F1B's memory is at most P = {P}",
        )
    if found["makespan"] > makespan_allowed(P, m) + 1e-9:
        fail(
            check,
            f"{at}: the step takes {found['makespan']:g} units, bubble "
            f"{found['bubble_fraction']:.3f}; at most {makespan_allowed(P, m):g} "
            f"(bubble {bubble_allowed(P, m):.3f}) scores; 1F1B takes {3 * m + 2 * (P - 1)}",
        )
    return found
