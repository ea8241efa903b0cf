"""Part of Assignment 1's checks (grading/processes.py): reaching every process fast.

`spread(tensor)` runs on P ranks: rank 0's tensor holds a message, every other rank's tensor
has its shape and dtype, and on return every rank holds rank 0's values, with point-to-point
calls only. The check measures how many rounds it took, from its own log of every send and
receive each rank made (peer and order), in the telephone model: a rank sends one message
per round, so a rank that got the message in round d sends its k-th message in round d + k
(rank 0 holds it in round 0). The latest round in which a rank gets it must not exceed
ceil(log2 P), the fewest any schedule can do: the number of ranks holding the message at
most doubles per round.

    _spread_on_rank(spread, seed)   on each rank: its calls (op, peer) in order, its bytes,
                                    whether its tensor ends right
    rounds(calls)                   the round each rank got the message in, from those logs
    judge(verdict, records, seed)   one world size's verdict, and the rounds it took
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from course_lib import comm
from course_lib.comm import POINT_TO_POINT, CommCounter
from course_lib.grading._harness import Verdict, close_pool, fail, run_on_ranks
from course_lib.grading.provenance import Provenance
from course_lib.runtime import rank

# Lecture 2's collectives are built from send and recv (its binary tree sends the total
# back down from rank 0): an answer that runs them, or a copy, is not the student's.
LECTURE = ("course_lib.collectives",)
# (shape, dtype) of the messages every world size is tried with
MESSAGES = (((3, 5), torch.float64), ((7,), torch.int64))
SENDS, RECEIVES = ("send", "isend"), ("recv", "irecv")


class _Log:
    """While active: every point-to-point call of this rank, (op, peer) in call order. Seen
    through course_lib.comm's hook, which on grading ranks sees every route to the group."""

    def __enter__(self) -> _Log:
        self.calls: list[tuple[str, int | None]] = []
        comm.add_around_hook(self._seen)
        return self

    def _seen(self, op, args, sent, received, call):
        if op in POINT_TO_POINT:
            names = ("dst", "group_dst") if op in SENDS else ("src", "group_src")
            self.calls.append((op, next((args[n] for n in names if args.get(n) is not None), None)))
        return call()

    def __exit__(self, *exc: object) -> None:
        comm.remove_around_hook(self._seen)


def _message(shape: tuple[int, ...], dtype: torch.dtype, seed: int, who: int) -> torch.Tensor:
    """Rank 0's message (who=0), or the garbage another rank starts with (who=its rank)."""
    generator = torch.Generator().manual_seed(1_000_003 * seed + 101 * who + len(shape))
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator, dtype=dtype)
    return torch.randint(-(2**60), 2**60, shape, generator=generator, dtype=dtype)


def _spread_on_rank(spread: Callable, seed: int) -> list[dict]:
    """On each rank: every message in turn, with its calls logged and its bytes counted."""
    me, records = rank(), []
    for shape, dtype in MESSAGES:
        expected = _message(shape, dtype, seed, 0)
        tensor = _message(shape, dtype, seed, me)
        with CommCounter() as counter, _Log() as log, Provenance(LECTURE) as seen:
            spread(tensor)
        records.append(
            {
                "message": f"{str(dtype).replace('torch.', '')} {tuple(shape)}",
                "nbytes": expected.numel() * expected.element_size(),
                "right": torch.equal(tensor, expected),
                "calls": log.calls,
                "other": sorted(set(counter.calls) - set(POINT_TO_POINT)),
                "sent": counter.bytes_sent,
                "received": counter.bytes_received,
                "copied": seen.complaint(),
            }
        )
    return records


def rounds(calls: list[list[tuple[str, int | None]]]) -> tuple[list[int], list[str]]:
    """The round each rank got the message in (rank 0: 0), from each rank's calls in order;
    and the problems that make the log no broadcast tree (then the rounds are not given)."""
    ranks = len(calls)
    problems, sender_of = [], {}
    for r, mine in enumerate(calls):
        got = [peer for op, peer in mine if op in RECEIVES]
        want = 0 if r == 0 else 1
        if len(got) != want:
            problems.append(f"rank {r} received {len(got)} message(s); it must receive {want}")
        sends = [peer for op, peer in mine if op in SENDS]
        if r and got and mine[0][0] in SENDS:
            problems.append(f"rank {r} sent to rank {mine[0][1]} before it received the message")
        for k, peer in enumerate(sends, start=1):
            if not (isinstance(peer, int) and 0 <= peer < ranks) or peer in (0, r):
                problems.append(f"rank {r} sent a message to rank {peer}")
            elif peer in sender_of:
                problems.append(f"rank {peer} was sent the message twice")
            else:
                sender_of[peer] = (r, k)
    for r in range(1, ranks):
        got = [peer for op, peer in calls[r] if op in RECEIVES]
        if r not in sender_of:
            problems.append(f"no rank sent rank {r} the message")
        elif got and got[0] not in (None, sender_of[r][0]):
            problems.append(
                f"rank {r} received from rank {got[0]}, but rank "
                f"{sender_of[r][0]} sent it the message"
            )
    if problems:
        return [], problems
    depth = [0] + [-1] * (ranks - 1)

    def round_of(r: int, seen: frozenset = frozenset()) -> int:
        if depth[r] < 0:
            if r in seen:  # only sends posted before their data arrived make a cycle
                raise ValueError(f"ranks {sorted(seen)} wait for each other")
            q, k = sender_of[r]
            depth[r] = round_of(q, seen | {r}) + k
        return depth[r]

    try:
        return [round_of(r) for r in range(ranks)], []
    except ValueError as error:
        return [], [str(error)]


def path_to(r: int, calls: list, got_in: list[int]) -> str:
    """How the message reached rank r: the chain of sends from rank 0, with their rounds."""
    steps = []
    while r:
        q = next(q for q, mine in enumerate(calls) if ("send", r) in mine or ("isend", r) in mine)
        steps.append(f"{q}->{r} in round {got_in[r]}")
        r = q
    return ", ".join(reversed(steps))


def judge(verdict: Verdict, records: list[list[dict]], seed: int) -> int:
    """Judge one world size's records (per rank, per message); return the rounds taken."""
    __tracebackhide__ = True
    ranks, allowed, worst = len(records), math.ceil(math.log2(len(records))), 0
    for m in range(len(MESSAGES)):
        per_rank = [records[r][m] for r in range(ranks)]
        where = f"P = {ranks}, message {per_rank[0]['message']}, seed {seed}"
        with verdict.case():
            copied = next((x["copied"] for x in per_rank if x["copied"]), None)
            if copied:
                fail(verdict.check, f"{where}: {copied}")
            for r, x in enumerate(per_rank):
                if x["other"]:
                    fail(
                        verdict.check,
                        f"{where}: rank {r} used {x['other']}; use only send/recv (or isend/irecv)",
                    )
            got_in, problems = rounds([x["calls"] for x in per_rank])
            if problems:
                fail(verdict.check, f"{where}: " + "; ".join(problems[:3]))
            if not per_rank[0]["right"]:
                fail(
                    verdict.check,
                    f"{where}: rank 0's tensor changed; spread must leave it as it is",
                )
            wrong = [r for r, x in enumerate(per_rank) if not x["right"]]
            if wrong:
                fail(
                    verdict.check,
                    f"{where}: rank(s) {wrong} do not hold rank 0's message exactly after spread",
                )
            for r, x in enumerate(per_rank):
                n_sent = sum(op in SENDS for op, _ in x["calls"])
                n_got = sum(op in RECEIVES for op, _ in x["calls"])
                if (x["sent"], x["received"]) != (n_sent * x["nbytes"], n_got * x["nbytes"]):
                    fail(
                        verdict.check,
                        f"{where}: rank {r} sent {x['sent']} bytes in "
                        f"{n_sent} message(s) and received {x['received']} in {n_got}; "
                        f"each message must be the whole {x['nbytes']}-byte tensor",
                    )
            last = max(range(ranks), key=lambda r: got_in[r])
            if got_in[last] > allowed:
                calls = [x["calls"] for x in per_rank]
                fail(
                    verdict.check,
                    f"{where}: rank {last} got the message in round "
                    f"{got_in[last]} ({path_to(last, calls, got_in)}); at most "
                    f"ceil(log2 {ranks}) = {allowed} rounds allowed. A rank sends one "
                    "message per round: its k-th send goes out k rounds after it got "
                    "the message",
                )
            worst = max(worst, got_in[last])
    return worst


def check_spread(
    spread: Callable,
    world_sizes: tuple[int, ...] = (2, 3, 5, 8),
    seed: int = 0,
    timeout: float = 30.0,
) -> None:
    """On each world size P, `spread(tensor)`: every rank ends with rank 0's tensor, having
    received it once, within ceil(log2 P) rounds of one send per rank (see the module)."""
    __tracebackhide__ = True
    check = "check_spread"
    verdict = Verdict(check)
    taken = {}
    for p in world_sizes:
        try:
            records = run_on_ranks(
                check,
                _spread_on_rank,
                spread,
                seed,
                world_size=p,
                timeout=timeout,
                what=f"your spread on {p} ranks",
            )
        finally:
            # A warm pool per world size would keep up to 8 more ranks alive each: grading
            # allows the notebook 8 GiB, which P = 2..8 all alive together exceeded.
            close_pool()
        taken[p] = judge(verdict, records, seed)
    verdict.conclude(
        f"on P = {', '.join(map(str, world_sizes))} ranks, {len(MESSAGES)} messages each "
        "(float64 and int64), send/recv only: every rank got rank 0's tensor exactly, "
        "received once, in "
        + ", ".join(f"{t} round(s) for P = {p}" for p, t in taken.items())
        + " (at most ceil(log2 P))"
    )
