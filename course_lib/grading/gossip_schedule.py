"""Part of Assignment 4's checks (grading/gossip.py, which re-exports the check): mixing fast
with one peer per round.

    check_one_peer_schedule(peer, push_sum_step)
        peer(rank, world_size, round) -> int: the one rank that `rank` sends to in `round`.
        The student's own push-sum step of Part 1 runs on that schedule for
        `rounds_for(P) = ROUNDS_PER_DOUBLING * log2(P)` rounds on P ranks from random x; the
        consensus error max_i |x_i / w_i - mean| / max_i |x_i(0) - mean| (max over ranks and
        elements) must then be below `THRESHOLD`.

The rule of the part, judged from the calls each rank's process group reported to the
launcher, round by round (never from counters on the rank): in each round a rank sends to
exactly one peer, not itself, point-to-point only, at most `MESSAGES_PER_ROUND` messages (x
and w together, or apart) of at most one share of x and w in bytes, and receives only from the
ranks whose peer it is; the bytes the kernel saw on its sockets must all be accounted for by
those calls. Each round is also compared with push-sum on the same schedule computed here in
float64 (`mix`), from starting x drawn here from a secret seed new for each call (each rank
receives only its own), so the error measured is what the ranks really hold, and a rank cannot
compute it without the messages.

Measured with `simulate` (float64, 5 elements, no secret, tests/test_grading_gossip.py): the
ring (rank + 1 every round) ends at 0.036 on 4 ranks and 0.16 on 8 (seed 0; 0.036 to 0.054 and
0.16 to 0.25 over seeds 0 to 3: the check's secret draws spread the same way); the one-peer
exponential graph (rank + 2^(t mod log2 P)) is exact after log2 P rounds (about 1e-16); a
random derangement per round, seeded by the round, ends at about 0.005 on 8 ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from course_lib import PerRank
from course_lib.comm import POINT_TO_POINT
from course_lib.grading._harness import (
    Verdict,
    calls_by_case,
    fail,
    judge_unreported,
    measured,
    new_secret,
    run_on_ranks,
)
from course_lib.grading.gossip_ranks import SCHEDULE_SIZE as SIZE
from course_lib.grading.gossip_ranks import run_schedule, schedule_table, well_formed
from course_lib.grading.traffic import Sent

ROUNDS_PER_DOUBLING = 4  # rounds = 4 log2(P): 8 on 4 ranks, 12 on 8
THRESHOLD = 0.01  # the largest consensus error allowed after those rounds
MESSAGES_PER_ROUND = 2  # x and w in one message, or in two, to the one peer
DEFAULT_WORLD_SIZES = (8,)


def rounds_for(world_size: int) -> int:
    """How many rounds the check runs on world_size ranks (a power of two)."""
    return ROUNDS_PER_DOUBLING * (world_size.bit_length() - 1)


def start(world_size: int, seed: int, secret: int = 0) -> list[torch.Tensor]:
    """Every rank's starting x: random, float64, SIZE elements. The check draws them with a
    secret new for each call (`secrets.randbits`); `simulate` with none, to measure."""
    g = torch.Generator().manual_seed(secret ^ (7_919 * seed + world_size))
    return list(torch.randn(world_size, SIZE, generator=g, dtype=torch.float64) * 3)


def mix(
    xs: list[torch.Tensor], ws: list[torch.Tensor], peers: list[int]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One push-sum round, all ranks at once, float64: rank j keeps half of x_j and w_j and
    sends the other half to peers[j]."""
    new_x = [x.double() / 2 for x in xs]
    new_w = [w.double() / 2 for w in ws]
    for j, q in enumerate(peers):
        new_x[q] = new_x[q] + xs[j].double() / 2
        new_w[q] = new_w[q] + ws[j].double() / 2
    return new_x, new_w


def consensus_error(xs, ws, starts) -> float:
    """max_i |x_i / w_i - mean| / max_i |x_i(0) - mean|, over ranks and elements."""
    mean = sum(s.double() for s in starts) / len(starts)
    spread = max((s.double() - mean).abs().max().item() for s in starts)
    gap = max(
        (x.double() / w.double() - mean).abs().max().item() for x, w in zip(xs, ws, strict=True)
    )
    return gap / spread


def simulate(peer: Callable, world_size: int, seed: int = 0, rounds: int | None = None) -> float:
    """The consensus error of push-sum on `peer`'s schedule, in one process (float64)."""
    xs = start(world_size, seed)
    ws = [torch.ones((), dtype=torch.float64) for _ in xs]
    for t in range(rounds_for(world_size) if rounds is None else rounds):
        xs, ws = mix(xs, ws, [peer(r, world_size, t) for r in range(world_size)])
    return consensus_error(xs, ws, start(world_size, seed))


# --- judging in the calling process ---------------------------------------------------------


def _judge_table(check: str, tables: list[list[list]], p: int) -> None:
    __tracebackhide__ = True
    table = tables[0]
    for t, row in enumerate(table):
        for r, q in enumerate(row):
            if type(q) is not int or not 0 <= q < p or q == r:
                fail(
                    check,
                    f"peer({r}, {p}, {t}) returned {q!r}; expected one rank (an int) in "
                    f"0..{p - 1} other than {r}: one message per round goes to one peer",
                )
    if any(other != table for other in tables[1:]):
        fail(
            check,
            f"world size {p}: peer(rank, world_size, round) gave different answers on "
            "different ranks; it must depend on its arguments only (a random schedule needs "
            "its own seeded generator, e.g. random.Random(round))",
        )


def _judge_messages(
    check: str, at: str, r: int, peer: int, ins: list[int], calls: list[Sent]
) -> None:
    """Rank r's calls in one round, as its process group reported them to the launcher."""
    __tracebackhide__ = True
    where = f"{at}: rank {r} (peer {peer}, receiving from {ins})"
    others = sorted({call.op for call in calls if call.op not in POINT_TO_POINT})
    if others:
        fail(check, f"{where} called {', '.join(others)}; only point-to-point messages count")
    # isend and irecv reach the process group as its send and recv
    sends = [(call.peer, call.sent) for call in calls if call.op == "send"]
    heard = {call.peer for call in calls if call.op == "recv"}
    if {q for q, _ in sends} != {peer}:
        fail(check, f"{where} sent to {sorted({q for q, _ in sends})}: one peer per round")
    allowed = (SIZE + 1) * 8
    if len(sends) > MESSAGES_PER_ROUND or sum(n for _, n in sends) > allowed:
        fail(
            check,
            f"{where} sent {len(sends)} messages of {sum(n for _, n in sends)} bytes; at most "
            f"{MESSAGES_PER_ROUND} messages of {allowed} bytes in all (one share of x and w) "
            "per round",
        )
    if heard - set(ins):
        fail(check, f"{where} received from {sorted(heard - set(ins), key=str)}")


def _judge(
    check: str,
    p: int,
    seed: int,
    table: list[list[int]],
    starts: list[torch.Tensor],
    records: list[list[dict]],
    calls: list[list[list[Sent]]],
) -> float:
    """Every round on every rank (`records[r][t]`, `calls[r][t]`) against `mix` from the
    `starts` drawn here, its messages, and the final error."""
    __tracebackhide__ = True
    xs, ws = starts, [torch.ones((), dtype=torch.float64) for _ in range(p)]
    for t, peers in enumerate(table):
        at = f"world size {p}, seed {seed}, round {t}"
        for r in range(p):
            if not well_formed(records[r][t]["got"], SIZE, torch.float64):
                fail(
                    check,
                    f"{at}: rank {r}'s push_sum_step returned "
                    f"{records[r][t]['described'] or 'something else'}; expected "
                    f"(x_new, w_new), float64 x of shape ({SIZE},) and w with one element",
                )
            ins = [j for j, q in enumerate(peers) if q == r]
            _judge_messages(check, at, r, peers[r], ins, calls[r][t])
        xs, ws = mix(xs, ws, peers)
        for r in range(p):
            got_x = records[r][t]["got"][0].double()
            got_w = records[r][t]["got"][1].double().reshape(())
            if not (
                torch.allclose(got_x, xs[r], rtol=1e-12, atol=1e-12)
                and torch.allclose(got_w, ws[r], rtol=1e-12, atol=1e-12)
            ):
                fail(
                    check,
                    f"{at}: rank {r} holds x = {got_x.tolist()}, w = {got_w.item():.6g}; "
                    f"push-sum on this schedule gives x = {xs[r].tolist()}, w = "
                    f"{ws[r].item():.6g}: your push_sum_step of Part 1 must pass its test",
                )
    last = [records[r][-1]["got"] for r in range(p)]  # what the ranks hold
    error = consensus_error([x for x, _ in last], [w.reshape(()) for _, w in last], starts)
    if error > THRESHOLD:
        fail(
            check,
            f"world size {p}, seed {seed}: after {len(table)} rounds the consensus error "
            f"max |x_i / w_i - mean| / max |x_i(0) - mean| is {error:.3g}; at most "
            f"{THRESHOLD} allowed. The schedule mixes too slowly: how many rounds does a value "
            "need to reach every rank?",
        )
    return error


def _copied(check: str, results: list[dict]) -> None:
    """Fail if any rank saw the answer run the lecture's or the grader's code."""
    __tracebackhide__ = True
    for found in results:
        if found["copied"]:
            fail(check, found["copied"])


def check_one_peer_schedule(
    peer: Callable,
    push_sum_step: Callable,
    *,
    world_sizes: Iterable[int] = DEFAULT_WORLD_SIZES,
    seeds: Iterable[int] = (0,),
    timeout: float = 30.0,
) -> None:
    """Push-sum with `push_sum_step` on `peer`'s schedule, one peer per rank and round, for
    `rounds_for(P)` rounds: the consensus error must end below THRESHOLD."""
    __tracebackhide__ = True
    check = "check_one_peer_schedule"
    for fn, what in ((peer, "peer"), (push_sum_step, "push_sum_step")):
        if not callable(fn):
            fail(check, f"expected your {what} function, got {type(fn).__name__}")
    verdict, worst, sizes = Verdict(check), 0.0, sorted(set(world_sizes))
    secret = new_secret()
    for p in sizes:
        if p < 2 or p & (p - 1):
            raise ValueError(f"world sizes must be powers of two from 2, got {p}")
        tables = run_on_ranks(
            check,
            schedule_table,
            peer,
            p,
            rounds_for(p),
            world_size=p,
            timeout=timeout,
            what=f"your peer (world size {p})",
        )
        _copied(check, tables)
        _judge_table(check, [found["table"] for found in tables], p)
        table = tables[0]["table"]
        for seed in seeds:
            starts = start(p, seed, secret)
            results, traffic = run_on_ranks(
                check,
                run_schedule,
                table,
                push_sum_step,
                PerRank(starts),  # each rank its own x only
                world_size=p,
                timeout=timeout,
                what=f"your peer and push_sum_step (world size {p}, seed {seed})",
                traffic=True,
            )
            _copied(check, results)
            calls = calls_by_case(check, traffic.tallies, len(table))  # one mark per round
            judge_unreported(check, traffic)
            records = [found["records"] for found in results]
            with verdict.case():
                worst = max(worst, _judge(check, p, seed, table, starts, records, calls))
    verdict.conclude(
        f"world size(s) {', '.join(map(str, sizes))}: one peer per rank and round, push-sum "
        f"exact on every rank, and after {ROUNDS_PER_DOUBLING} log2(P) rounds a consensus "
        f"error of at most {worst:.2g} (allowed {THRESHOLD})"
    )
    what = "consensus error after 4 log2(P) rounds, worst case"
    measured(check, what, worst, "of the starting spread", combine="worst")


__all__ = ["THRESHOLD", "check_one_peer_schedule", "consensus_error", "mix", "rounds_for"]
