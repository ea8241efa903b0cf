"""Part of Assignment 1's checks (grading/processes.py): reaching every process fast.

`spread(tensor)` runs on P ranks: rank 0's tensor holds a message, every other rank's tensor
has its shape and dtype, and on return every rank holds rank 0's values, with point-to-point
calls only. The check measures how many rounds it took, from every send and receive each rank
made (peer and order), in the telephone model: a rank sends one message per round, so a rank
that got the message in round d sends its k-th message in round d + k (rank 0 holds it in
round 0). The latest round in which a rank gets it must not exceed ceil(log2 P), the fewest
any schedule can do: the number of ranks holding the message at most doubles per round.

Nothing the verdict trusts is on a rank beside the student's code: the messages are drawn here
from a secret seed, new for each call, and each rank receives only its own starting tensor
(rank 0 the message); the calls, their order, peers and bytes are those each rank's process
group reported to the launcher (`_harness.calls_by_case`), and the bytes on the wire must all
be accounted for by them (`_harness.judge_unreported`).

    draw(p, seed, secret)           every rank's starting tensor, per message
    _spread_on_rank(spread, given)  on each rank: spread on each of its tensors, between marks
    rounds(calls)                   the round each rank got the message in, from the calls
    judge(verdict, ...)             one world size's verdict, and the rounds it took
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from course_lib import PerRank, counted_group
from course_lib.comm import POINT_TO_POINT
from course_lib.grading._harness import (
    Verdict,
    calls_by_case,
    close_pool,
    fail,
    judge_unreported,
    measured,
    new_secret,
    run_on_ranks,
)
from course_lib.grading.provenance import Provenance
from course_lib.grading.traffic import Sent

# Lecture 2's collectives are built from send and recv (its binary tree sends the total
# back down from rank 0): an answer that runs them, or a copy, is not the student's.
LECTURE = ("course_lib.collectives",)
# (shape, dtype) of the messages every world size is tried with
MESSAGES = (((3, 5), torch.float64), ((7,), torch.int64))
SENDS, RECEIVES = ("send", "isend"), ("recv", "irecv")


def _message(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator):
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator, dtype=dtype)
    return torch.randint(-(2**60), 2**60, shape, generator=generator, dtype=dtype)


def draw(p: int, seed: int, secret: int) -> list[list[torch.Tensor]]:
    """[rank][message]: rank 0's messages, and the garbage every other rank starts with, drawn
    from `seed` mixed with a secret no rank knows."""
    generator = torch.Generator().manual_seed(secret ^ (1_000_003 * seed + p))
    return [[_message(shape, dtype, generator) for shape, dtype in MESSAGES] for _ in range(p)]


def _spread_on_rank(spread: Callable, given: list[torch.Tensor]) -> list[dict]:
    """On each rank: spread on each of its tensors in turn, a mark before each, so that the
    launcher's tallies tell the messages apart; returns what each tensor ended as."""
    records = []
    for m, tensor in enumerate(given):
        counted_group.mark(m)
        with Provenance(LECTURE) as seen:
            spread(tensor)
        records.append({"tensor": tensor.clone(), "copied": seen.complaint()})
    counted_group.mark(len(given))
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


def judge(
    verdict: Verdict,
    records: list[list[dict]],
    calls: list[list[list[Sent]]],
    given: list[list[torch.Tensor]],
    seed: int,
) -> int:
    """Judge one world size: what each rank's tensor ended as (`records[r][m]`), the calls it
    reported (`calls[r][m]`) and the tensors it was given (`given[r][m]`; rank 0's is the
    message). Returns the rounds taken."""
    __tracebackhide__ = True
    ranks, allowed, worst = len(records), math.ceil(math.log2(len(records))), 0
    for m, (shape, dtype) in enumerate(MESSAGES):
        message = given[0][m]
        nbytes = message.numel() * message.element_size()
        where = f"P = {ranks}, message {str(dtype).replace('torch.', '')} {shape}, seed {seed}"
        with verdict.case():
            copied = next((x[m]["copied"] for x in records if x[m]["copied"]), None)
            if copied:
                fail(verdict.check, f"{where}: {copied}")
            for r in range(ranks):
                other = sorted({c.op for c in calls[r][m]} - set(POINT_TO_POINT))
                if other:
                    fail(
                        verdict.check,
                        f"{where}: rank {r} used {other}; use only send/recv (or isend/irecv)",
                    )
            ops = [[(c.op, c.peer) for c in calls[r][m]] for r in range(ranks)]
            got_in, problems = rounds(ops)
            if problems:
                fail(verdict.check, f"{where}: " + "; ".join(problems[:3]))
            ended = [records[r][m]["tensor"] for r in range(ranks)]
            if not torch.equal(ended[0], message):
                fail(
                    verdict.check,
                    f"{where}: rank 0's tensor changed; spread must leave it as it is",
                )
            wrong = [r for r in range(ranks) if not torch.equal(ended[r], message)]
            if wrong:
                fail(
                    verdict.check,
                    f"{where}: rank(s) {wrong} do not hold rank 0's message exactly after spread",
                )
            for r in range(ranks):
                sent = sum(c.sent for c in calls[r][m])
                received = sum(c.received for c in calls[r][m])
                n_sent = sum(op in SENDS for op, _ in ops[r])
                n_got = sum(op in RECEIVES for op, _ in ops[r])
                if (sent, received) != (n_sent * nbytes, n_got * nbytes):
                    fail(
                        verdict.check,
                        f"{where}: rank {r} sent {sent} bytes in {n_sent} message(s) and "
                        f"received {received} in {n_got}; each message must be the whole "
                        f"{nbytes}-byte tensor",
                    )
            last = max(range(ranks), key=lambda r: got_in[r])
            if got_in[last] > allowed:
                fail(
                    verdict.check,
                    f"{where}: rank {last} got the message in round "
                    f"{got_in[last]} ({path_to(last, ops, got_in)}); at most "
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
    secret = new_secret()
    for p in world_sizes:
        given = draw(p, seed, secret)
        try:
            records, traffic = run_on_ranks(
                check,
                _spread_on_rank,
                spread,
                PerRank(given),
                world_size=p,
                timeout=timeout,
                what=f"your spread on {p} ranks",
                traffic=True,
            )
        finally:
            # A warm pool per world size would keep up to 8 more ranks alive each: grading
            # allows the notebook 8 GiB, which P = 2..8 all alive together exceeded.
            close_pool()
        calls = calls_by_case(check, traffic.tallies, len(MESSAGES))
        judge_unreported(check, traffic)
        taken[p] = judge(verdict, records, calls, given, seed)
    verdict.conclude(
        f"on P = {', '.join(map(str, world_sizes))} ranks, {len(MESSAGES)} messages each "
        "(float64 and int64), send/recv only: every rank got rank 0's tensor exactly, "
        "received once, in "
        + ", ".join(f"{t} round(s) for P = {p}" for p, t in taken.items())
        + " (at most ceil(log2 P))"
    )
    measured(check, "rounds, summed over the world sizes", sum(taken.values()), "rounds")
