"""Pipeline schedules: the ops each stage runs, in which order, under the naive schedule,
GPipe, 1F1B and interleaved 1F1B (lecture 8). The simulator (timeline.py) plays
`schedule_order`; the lecture checks that torch's ScheduleGPipe / Schedule1F1B ran the same
order on the ranks, and lecture 10's 3-D step runs it."""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("naive", "gpipe", "1f1b", "interleaved")
FORWARD, BACKWARD = "F", "B"


# --- schedules: what each stage runs, in which order -----------------------------------------


@dataclass(frozen=True)
class Op:
    """One unit of a stage's work: the forward or backward of micro-batch `micro` through
    model chunk `chunk` of the stage (chunks > 0 only in the interleaved schedule)."""

    kind: str  # FORWARD or BACKWARD
    micro: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.micro}" + (f".{self.chunk}" if self.chunk else "")


def _check(n_stages: int, m: int, chunks: int) -> None:
    for name, value in (("P (stages)", n_stages), ("m (micro-batches)", m), ("chunks", chunks)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")


def _one_f_one_b(forwards: list[Op], backwards: list[Op], warmup: int) -> list[Op]:
    """`warmup` forwards, then alternate one forward and one backward, then the backwards
    left over: the order of 1F1B and of its interleaved variant."""
    warmup = min(warmup, len(forwards))
    order = forwards[:warmup]
    for f, b in zip(forwards[warmup:], backwards, strict=False):
        order += [f, b]
    return order + backwards[len(forwards) - warmup :]


def schedule_order(schedule: str, n_stages: int, m: int, chunks: int = 2) -> list[list[Op]]:
    """For each stage, the ops it runs in order under `schedule`.

    naive: one micro-batch at a time through the whole model (forward then backward);
    gpipe: every forward, then every backward; 1f1b: P - s - 1 warm-up forwards on stage s,
    then one forward / one backward; interleaved: 1F1B over `chunks` model chunks per stage
    (Megatron-LM's order; needs m divisible by P).
    """
    _check(n_stages, m, chunks)
    P = n_stages
    if schedule == "naive":
        return [[Op(k, i) for i in range(m) for k in (FORWARD, BACKWARD)] for _ in range(P)]
    if schedule == "gpipe":
        return [
            [Op(FORWARD, i) for i in range(m)] + [Op(BACKWARD, i) for i in range(m)]
            for _ in range(P)
        ]
    if schedule == "1f1b":
        return [
            _one_f_one_b(
                [Op(FORWARD, i) for i in range(m)], [Op(BACKWARD, i) for i in range(m)], P - s - 1
            )
            for s in range(P)
        ]
    if schedule == "interleaved":
        if m % P:
            raise ValueError(f"the interleaved schedule needs m divisible by P: m={m}, P={P}")

        # Groups of P micro-batches go through chunk 0, then the same group through chunk 1...
        def op(kind: str, k: int) -> Op:
            group, chunk = divmod(k // P, chunks)
            chunk = chunk if kind == FORWARD else chunks - 1 - chunk
            return Op(kind, group * P + k % P, chunk)

        total = m * chunks
        orders = []
        for s in range(P):
            warmup = (P - s - 1) * 2 + (chunks - 1) * P
            forwards = [op(FORWARD, k) for k in range(total)]
            backwards = [op(BACKWARD, k) for k in range(total)]
            orders.append(_one_f_one_b(forwards, backwards, warmup))
        return orders
    raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
