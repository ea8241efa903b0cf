"""Checks for Assignment 1, processes and pipes.

    check_ping_pong(ping, pong)             two processes over a multiprocessing Pipe
    check_chain(relay, run_chain)           a chain of processes passing a message along
    check_dist_ping_pong(dist_ping_pong)    the ping-pong with torch.distributed send/recv
    check_round_trip_time(round_trip_time)  timing a message against its size
    check_spread(spread)                    rank 0's tensor to every rank in few rounds
                                            (the open part, in processes_spread.py)

Each check plays the student's code against a reference written here (not the solution
notebook's), so one side's bug cannot be hidden by the other side's matching bug. The pipe
parts' partners run in child processes of their own, apart from the student's; the
torch.distributed parts count calls and bytes from what each rank's process group reported to
the launcher, and hold the kernel's count of the bytes on the wire to them (`_run_counted`),
never from counters on the ranks, which the student's code shares.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections import Counter
from collections.abc import Callable

from course_lib import counted_group
from course_lib.comm import POINT_TO_POINT
from course_lib.grading._harness import (
    calls_by_case,
    fail,
    judge_unreported,
    passed,
    run_on_ranks,
)
from course_lib.grading.processes_children import Child, describe
from course_lib.grading.processes_spread import check_spread

# --- ping-pong over a Pipe ----------------------------------------------------------------


def _reference_ping(conn, rounds: int) -> list[int] | tuple[str, list[int]]:
    """A correct ping; ("closed", replies) if the partner closed the pipe early."""
    replies = []
    try:
        for i in range(rounds):
            conn.send(i)
            replies.append(conn.recv())
    except (EOFError, OSError):
        return ("closed", replies)
    return replies


def _reference_pong(conn, rounds: int) -> list[int] | tuple[str, list[int]]:
    """A correct pong that returns the numbers it received ("closed", ... if cut short)."""
    received = []
    try:
        for _ in range(rounds):
            number = conn.recv()
            received.append(number)
            conn.send(number + 1)
    except (EOFError, OSError):
        return ("closed", received)
    return received


def _play(ping: Callable, pong: Callable, rounds: int, wait: float) -> tuple:
    """On a launched worker: ping and pong in two child processes joined by a Pipe."""
    here, there = multiprocessing.get_context("fork").Pipe()
    # Each child keeps only its own end, so a recv on a finished peer ends in EOFError
    # instead of waiting forever.
    ping_child = Child(ping, here, rounds, close=[there])
    pong_child = Child(pong, there, rounds, close=[here])
    here.close()
    there.close()
    deadline = time.monotonic() + wait
    return ping_child.outcome(wait), pong_child.outcome(max(0.0, deadline - time.monotonic()))


def _all_games(ping: Callable, pong: Callable, rounds: int, wait: float) -> dict:
    return {
        "ping": _play(ping, _reference_pong, rounds, wait),
        "pong": _play(_reference_ping, pong, rounds, wait),
        "both": _play(ping, pong, rounds, wait),
    }


def check_ping_pong(ping: Callable, pong: Callable, rounds: int = 5, wait: float = 5.0) -> None:
    """`ping(conn, rounds)` sends 0, 1, ..., rounds-1, receiving a reply after each, and
    returns the replies; `pong(conn, rounds)` replies to each number n with n + 1.
    Each is played against a reference partner, then against each other."""
    __tracebackhide__ = True
    check = "check_ping_pong"
    games = run_on_ranks(
        check,
        _all_games,
        ping,
        pong,
        rounds,
        wait,
        world_size=1,
        timeout=4 * wait + 10,
        what="the ping-pong game",
    )[0]
    expected_replies, expected_numbers = list(range(1, rounds + 1)), list(range(rounds))

    ping_out, reference_pong = games["ping"]
    _expect(check, ping_out, "your ping (against a correct pong)", wait)
    _expect(check, reference_pong, "a correct pong playing against your ping", wait)
    received = reference_pong[1]
    if isinstance(received, tuple):
        fail(
            check,
            f"your ping sent {received[1]} and then closed the connection; expected "
            f"it to send {expected_numbers}, receiving a reply after each",
        )
    if received != expected_numbers:
        fail(check, f"your ping sent {received}, expected {expected_numbers}")
    if ping_out[1] != expected_replies:
        fail(check, f"your ping returned {ping_out[1]}, expected the replies {expected_replies}")

    reference_ping, pong_out = games["pong"]
    _expect(check, pong_out, "your pong (against a correct ping)", wait)
    _expect(check, reference_ping, "a correct ping playing against your pong", wait)
    replies = reference_ping[1]
    if isinstance(replies, tuple):
        fail(
            check,
            f"your pong replied to only {len(replies[1])} of {rounds} numbers before "
            "closing the connection",
        )
    if replies != expected_replies:
        fail(
            check,
            f"your pong replied {replies} to {expected_numbers}; each reply should be "
            "the number received plus one",
        )

    ping_out, pong_out = games["both"]
    _expect(check, ping_out, "your ping (against your pong)", wait)
    _expect(check, pong_out, "your pong (against your ping)", wait)
    if ping_out[1] != expected_replies:
        fail(check, f"your ping and pong together gave {ping_out[1]}, expected {expected_replies}")
    passed(
        check,
        f"your ping and your pong, each against a correct partner and against each other, "
        f"{rounds} rounds: ping sent {expected_numbers} and got back {expected_replies}",
    )


def _expect(check: str, outcome: tuple, who: str, wait: float) -> None:
    __tracebackhide__ = True
    if outcome[0] == "ok":
        return
    message = describe(outcome, who, wait)
    if outcome[0] == "error" and ("EOFError" in outcome[1] or "ConnectionResetError" in outcome[1]):
        message += "\n(The other end had already finished: was a message sent or awaited too many?)"
    fail(check, message)


# --- a chain of processes -----------------------------------------------------------------


def _reference_chain(relay: Callable, n: int, wait: float) -> tuple:
    """On a launched worker: n relays in child processes, each joined to the next by a pipe."""
    ctx = multiprocessing.get_context("fork")
    pipes = [ctx.Pipe(duplex=False) for _ in range(n + 1)]  # (receive end, send end)
    children = [Child(relay, k, pipes[k][0], pipes[k + 1][1]) for k in range(n)]
    start, finish = pipes[0][1], pipes[n][0]
    for k, (receiver, sender) in enumerate(pipes):
        if k > 0:
            sender.close()
        if k < n:
            receiver.close()
    start.send((0, []))
    deadline = time.monotonic() + wait
    try:
        arrived = finish.recv() if finish.poll(wait) else None
    except EOFError:  # every relay has exited without sending
        arrived = None
    return arrived, [child.outcome(max(0.0, deadline - time.monotonic())) for child in children]


def _recording_relay(index: int, inbox, outbox) -> None:
    """A correct relay that also records which process it ran in."""
    total, path = inbox.recv()
    outbox.send((total + index, [*path, (index, os.getpid())]))


def _student_chain(run_chain: Callable, n: int) -> tuple:
    """On a launched worker: the student's orchestration with recording relays."""
    result = run_chain(n, _recording_relay)
    leftover = len(multiprocessing.active_children())
    return result, os.getpid(), leftover


def check_chain(relay: Callable, run_chain: Callable, n: int = 4, wait: float = 5.0) -> None:
    """`relay(index, inbox, outbox)` receives (total, path), sends (total + index,
    path + [index]); `run_chain(n, relay)` starts n processes running relay in a chain, sends
    (0, []) in, and returns what comes out of the last one, leaving no process running."""
    __tracebackhide__ = True
    check = "check_chain"
    arrived, outcomes = run_on_ranks(
        check,
        _reference_chain,
        relay,
        n,
        wait,
        world_size=1,
        timeout=3 * wait + 10,
        what="the chain",
    )[0]
    _judge_relays(check, arrived, outcomes, n, wait)

    result, own_pid, leftover = run_on_ranks(
        check,
        _student_chain,
        run_chain,
        n,
        world_size=1,
        timeout=3 * wait + 10,
        what="your run_chain",
    )[0]
    _judge_run_chain(check, result, own_pid, leftover, n)
    expected = (sum(range(n)), list(range(n)))
    passed(
        check,
        f"{n} of your relays turned (0, []) into {expected!r}; your run_chain ran {n} relays, "
        "each in a new process of its own, and returned with none left running",
    )


def _judge_relays(check: str, arrived, outcomes: list, n: int, wait: float) -> None:
    """The chain of the student's relays, run by the reference: each relay's outcome, then
    what came out of the last one."""
    for k, outcome in enumerate(outcomes):
        if outcome[0] in ("error", "died"):
            fail(check, describe(outcome, f"your relay in process {k} of {n}", wait))
    waiting = [k for k, outcome in enumerate(outcomes) if outcome[0] == "timeout"]
    if waiting:
        first = waiting[0]
        fail(
            check,
            f"relay {first} of {n} was still waiting for its message after {wait:g} s"
            + (
                f", although relay {first - 1} had finished: does each relay send what "
                "it received (updated) on to its outbox?"
                if first > 0
                else ""
            ),
        )
    expected = (sum(range(n)), list(range(n)))
    if arrived != expected:
        fail(check, f"{n} of your relays turned (0, []) into {arrived!r}, expected {expected!r}")


def _judge_run_chain(check: str, result, own_pid: int, leftover: int, n: int) -> None:
    """What the student's run_chain returned, the processes the relays ran in, and what it
    left running."""
    if not (isinstance(result, tuple) and len(result) == 2):
        fail(check, f"run_chain({n}, relay) returned {result!r}, expected the final (total, path)")
    total, path = result
    indices = [entry[0] for entry in path]
    if total != sum(range(n)) or indices != list(range(n)):
        fail(
            check,
            f"run_chain({n}, relay) returned total {total} after relays {indices}; "
            f"expected total {sum(range(n))} after relays {list(range(n))}",
        )
    pids = [entry[1] for entry in path]
    if own_pid in pids or len(set(pids)) != n:
        fail(
            check,
            f"run_chain({n}, relay) must run each relay in its own new process; the "
            f"relays ran in processes {pids} (run_chain itself ran in {own_pid})",
        )
    if leftover:
        fail(
            check,
            f"run_chain({n}, relay) returned with {leftover} child process(es) still "
            "running: join() every process you start",
        )


# --- ping-pong with torch.distributed -----------------------------------------------------


def _marked(fn: Callable, *args) -> object:
    """On each rank: fn between two marks, so that the launcher's tallies hold its calls and
    nothing else (`_harness.calls_by_case`)."""
    counted_group.mark(0)
    result = fn(*args)
    counted_group.mark(1)
    return result


def _run_counted(check: str, fn: Callable, *args, timeout: float, what: str) -> list[tuple]:
    """Per rank, (result, bytes sent, bytes received, calls by op), the bytes and calls as the
    rank's process group reported them to the launcher while fn ran: counted outside the
    ranks, where fn cannot change them. Bytes on the wire that no reported send or recv
    accounts for fail the part as tampering."""
    __tracebackhide__ = True
    results, traffic = run_on_ranks(
        check, _marked, fn, *args, world_size=2, timeout=timeout, what=what, traffic=True
    )
    calls = calls_by_case(check, traffic.tallies, 1)
    judge_unreported(check, traffic)
    return [
        (
            result,
            sum(call.sent for call in calls[r][0]),
            sum(call.received for call in calls[r][0]),
            dict(Counter(call.op for call in calls[r][0])),
        )
        for r, result in enumerate(results)
    ]


def check_dist_ping_pong(dist_ping_pong: Callable, rounds: int = 5, timeout: float = 20.0) -> None:
    """On 2 ranks, `dist_ping_pong(rounds)`: rank 0 sends torch.tensor([float(i)],
    dtype=torch.float64) for i in 0..rounds-1 and receives each reply; rank 1 replies with
    the value plus one. Rank 0 returns the replies, rank 1 the values it received, as floats.
    Only point-to-point calls are allowed: exactly one 8-byte tensor each way per round."""
    __tracebackhide__ = True
    check = "check_dist_ping_pong"
    results = _run_counted(
        check, dist_ping_pong, rounds, timeout=timeout, what="your dist_ping_pong"
    )
    expected = [[float(i + 1) for i in range(rounds)], [float(i) for i in range(rounds)]]
    for rank, (result, sent, received, calls) in enumerate(results):
        other_calls = set(calls) - set(POINT_TO_POINT)
        if other_calls:
            fail(
                check,
                f"rank {rank} used {sorted(other_calls)}; use only send/recv "
                "(or isend/irecv) for this exercise",
            )
        nbytes = 8 * rounds
        if (sent, received) != (nbytes, nbytes):
            fail(
                check,
                f"rank {rank} sent {sent} and received {received} bytes; {rounds} "
                f"rounds of one float64 each way is {nbytes} bytes each way",
            )
        values = [float(v) for v in result] if isinstance(result, list | tuple) else result
        if values != expected[rank]:
            fail(check, f"rank {rank} returned {result!r}, expected {expected[rank]}")
    passed(
        check,
        f"on 2 ranks, {rounds} rounds with send/recv only, {8 * rounds} bytes each way per "
        f"rank; rank 0 got the replies {expected[0]}",
    )


# --- the cost of a message ----------------------------------------------------------------


def check_round_trip_time(
    round_trip_time: Callable,
    small: int = 1_000,
    large: int = 16_000_000,
    repeats: int = 5,
    timeout: float = 60.0,
    attempts: int = 3,
) -> None:
    """On 2 ranks, `round_trip_time(nbytes, repeats)`: rank 0 sends a uint8 tensor of nbytes
    to rank 1, which sends it back, `repeats` times; rank 0 returns the median seconds per
    round trip. Checked: the bytes really travel, and a large message costs more.

    Timing on a shared machine is noisy (another process can stall a small round trip for
    milliseconds), so the size comparison gets `attempts` tries; a time that does not grow
    with the message size fails every one of them."""
    __tracebackhide__ = True
    check = "check_round_trip_time"
    for _ in range(attempts):
        small_s = _measured_round_trip(check, round_trip_time, small, repeats, timeout)
        large_s = _measured_round_trip(check, round_trip_time, large, repeats, timeout)
        if large_s > 3 * small_s:
            passed(
                check,
                f"on 2 ranks, send/recv only, every byte both ways: a {large:,}-byte round trip "
                f"took {large_s:.3g} s, a {small:,}-byte one {small_s:.3g} s",
            )
            return
    fail(
        check,
        f"a {large:,}-byte round trip took {large_s:.3g} s and a {small:,}-byte one "
        f"{small_s:.3g} s (last of {attempts} tries); the large message should cost far "
        "more. Is the time measured around the send and the receive of the reply?",
    )


def _measured_round_trip(
    check: str, round_trip_time: Callable, nbytes: int, repeats: int, timeout: float
) -> float:
    """Run the student's timer on 2 ranks; check that the bytes travel both ways with
    point-to-point calls only, and return rank 0's seconds per round trip."""
    __tracebackhide__ = True
    results = _run_counted(
        check, round_trip_time, nbytes, repeats, timeout=timeout, what="your round_trip_time"
    )
    for rank, (_, sent, received, calls) in enumerate(results):
        if set(calls) - set(POINT_TO_POINT):
            fail(
                check,
                f"rank {rank} used {sorted(set(calls) - set(POINT_TO_POINT))}; use send/recv only",
            )
        if (sent, received) != (nbytes * repeats, nbytes * repeats):
            fail(
                check,
                f"with nbytes={nbytes} and repeats={repeats}, rank {rank} sent "
                f"{sent} and received {received} bytes; each of the {repeats} round "
                f"trips should carry {nbytes} bytes each way",
            )
    value = results[0][0]
    if isinstance(value, bool) or not isinstance(value, float | int) or not value > 0:
        fail(
            check,
            f"rank 0 returned {value!r}; it should return the median seconds per "
            "round trip, a positive number",
        )
    return float(value)


__all__ = [
    "check_chain",
    "check_dist_ping_pong",
    "check_ping_pong",
    "check_round_trip_time",
    "check_spread",
]
