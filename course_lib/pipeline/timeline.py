"""Timelines: when each op ran on each stage, simulated on an idealised machine (`simulate`)
or measured on ranks (`Timeline.from_logs` of every rank's `StageLog`), and their bubble
(lecture 8)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from course_lib.pipeline.schedules import BACKWARD, FORWARD, Op, schedule_order

# --- timelines: when each op ran, simulated or measured --------------------------------------


@dataclass(frozen=True)
class Task:
    """An op that ran on `stage` from `start` to `end` (seconds)."""

    stage: int
    kind: str
    micro: int
    chunk: int
    start: float
    end: float


# What a timed pipeline step returns on each rank (course_lib.measure.pipeline). It lives
# here, by the timeline `Timeline.from_logs` builds from it.
@dataclass
class StageLog:
    """What one rank measured during one pipeline step."""

    stage: int
    schedule: str
    tasks: list[Task] = field(default_factory=list)  # each op's start and end (perf_counter)
    peak_in_flight: int = 0  # most micro-batches holding activations at once
    peak_activation_bytes: int = 0  # most bytes autograd held for backward at once
    activation_bytes: list[int] = field(default_factory=list)  # saved per micro-batch forward
    loss: float | None = None  # mean loss over micro-batches (last stage only)
    grads: list[torch.Tensor] = field(default_factory=list)  # this stage's, in parameter order


@dataclass
class Timeline:
    """Every stage's tasks; the bubble is the idle share of P stages x the makespan."""

    n_stages: int
    tasks: list[Task]
    schedule: str = ""
    measured: bool = False  # True: times are seconds on a real clock; else simulated units

    @property
    def makespan(self) -> float:
        return max(t.end for t in self.tasks) - min(t.start for t in self.tasks)

    def busy(self, stage: int) -> float:
        return sum(t.end - t.start for t in self.tasks if t.stage == stage)

    @property
    def bubble(self) -> float:
        """Share of the P x makespan stage-seconds in which stages were idle."""
        return bubble_fraction(self)

    def peak_in_flight(self, stage: int) -> int:
        """Most micro-batches whose forward ran on `stage` and whose backward had not yet
        (each holds its activations); an interleaved stage counts each chunk's separately."""
        live = peak = 0
        for t in sorted((t for t in self.tasks if t.stage == stage), key=lambda t: t.start):
            live += 1 if t.kind == FORWARD else -1
            peak = max(peak, live)
        return peak

    @classmethod
    def from_logs(cls, logs: Sequence[StageLog], schedule: str = "") -> Timeline:
        """The measured timeline of one step, from every rank's `StageLog`."""
        tasks = [t for log in logs for t in log.tasks]
        origin = min(t.start for t in tasks)
        shifted = [
            Task(t.stage, t.kind, t.micro, t.chunk, t.start - origin, t.end - origin) for t in tasks
        ]
        return cls(len(logs), shifted, schedule or logs[0].schedule, measured=True)


def bubble_fraction(timeline: Timeline) -> float:
    """1 - (time stages were busy) / (P x makespan), from the tasks' start and end times."""
    busy = sum(timeline.busy(s) for s in range(timeline.n_stages))
    return 1.0 - busy / (timeline.n_stages * timeline.makespan)


def _per_stage(value: float | Sequence[float], n_stages: int, name: str) -> list[float]:
    values = [float(value)] * n_stages if isinstance(value, int | float) else list(value)
    if len(values) != n_stages or any(v < 0 for v in values):
        raise ValueError(f"{name} must be one time >= 0 or one per stage ({n_stages}): {value}")
    return values


def simulate(
    n_stages: int,
    m: int,
    schedule: str = "1f1b",
    forward_s: float | Sequence[float] = 1.0,
    backward_s: float | Sequence[float] = 2.0,
    chunks: int = 2,
    comm_s: float = 0.0,
) -> Timeline:
    """Run `schedule_order` on an idealised machine: each stage starts its next op as soon as
    the op it depends on has finished on the neighbouring stage (plus `comm_s`).

    A forward of micro-batch i through virtual stage v needs its forward through v - 1; a
    backward needs the backward through v + 1 (the last virtual stage: its own forward).
    `forward_s` / `backward_s`: one time or one per stage; with interleaving each chunk takes
    1/chunks of it, so a stage does the same work under every schedule.
    """
    orders = schedule_order(schedule, n_stages, m, chunks)
    n_chunks = chunks if schedule == "interleaved" else 1
    fwd = [t / n_chunks for t in _per_stage(forward_s, n_stages, "forward_s")]
    bwd = [t / n_chunks for t in _per_stage(backward_s, n_stages, "backward_s")]
    last_virtual = n_chunks * n_stages - 1

    def needs(s: int, op: Op) -> tuple[tuple, list[tuple[tuple, float]]]:
        v = op.chunk * n_stages + s  # chunk c of stage s is virtual stage c*P + s
        if op.kind == FORWARD:
            after = [(FORWARD, op.micro, v - 1)] if v > 0 else []
        elif v < last_virtual:
            after = [(BACKWARD, op.micro, v + 1)]
        else:
            after = [(FORWARD, op.micro, v)]
        return (op.kind, op.micro, v), [(k, comm_s if k[2] != v else 0) for k in after]

    def seconds(s: int, op: Op) -> float:
        return fwd[s] if op.kind == FORWARD else bwd[s]

    return play(orders, needs, seconds, schedule)


def play(
    orders: Sequence[Sequence[Op]],
    needs: Callable[[int, Op], tuple[tuple, list[tuple[tuple, float]]]],
    seconds: Callable[[int, Op], float],
    name: str,
) -> Timeline:
    """Play each stage's ops, in their order, on the idealised machine: an op starts once its
    stage is free and every op it waits for has ended, plus a delay. `needs(s, op)` gives the
    op's own key and the (key, delay) of each op it waits for; `seconds(s, op)` how long it
    takes. Used by `simulate` and by the zero-bubble schedules, whose backward is split."""
    n_stages = len(orders)
    done: dict[tuple, float] = {}  # an op's key -> its end time
    free = [0.0] * n_stages
    position = [0] * n_stages
    tasks: list[Task] = []
    progress = True
    while progress:
        progress = False
        for s in range(n_stages):
            while position[s] < len(orders[s]):
                op = orders[s][position[s]]
                key, after = needs(s, op)
                if any(k not in done for k, _ in after):
                    break  # waits for a neighbour; another stage moves first
                start = max([free[s]] + [done[k] + delay for k, delay in after])
                done[key] = free[s] = start + seconds(s, op)
                tasks.append(Task(s, op.kind, op.micro, op.chunk, start, free[s]))
                position[s] += 1
                progress = True
    stuck = {
        s: str(orders[s][position[s]]) for s in range(n_stages) if position[s] < len(orders[s])
    }
    if stuck:
        raise RuntimeError(f"schedule {name!r} deadlocks: stages wait forever at {stuck}")
    return Timeline(n_stages, tasks, name)
