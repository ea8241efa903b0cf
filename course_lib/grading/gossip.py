"""Checks for Assignment 4, decentralized communication: push-sum gossip (SGP).

    check_push_sum(push_sum_step)
        push_sum_step(x, w, out_neighbors, in_neighbors) -> (x_new, w_new): one round of
        Stochastic Gradient Push's gossip. Each rank keeps the share 1 / (d + 1) of its x and
        w (d = len(out_neighbors)), sends one share of each to every out-neighbour, and adds
        what its in-neighbours sent. The totals of x and w over the ranks never change, and
        z = x / w converges to the average of the starting x on every rank.

Each round is compared with `push_sum_reference` (float64, from all ranks' inputs) on three
graphs: the directed exponential graph (rank i sends to i + 1, i + 2, i + 4, ...), its
one-peer version that changes every round (as SGP runs it), and an irregular graph where rank
0 sends to everyone, on which the weights w stop being 1 and really matter.

Part 2's check, `check_one_peer_schedule(peer, push_sum_step)` (a schedule of one peer per
rank and round, graded by push-sum's consensus error), is in grading/gossip_schedule.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from course_lib import comm
from course_lib.comm import POINT_TO_POINT, CommCounter
from course_lib.grading._harness import Verdict, fail, run_on_ranks
from course_lib.grading.gossip_schedule import check_one_peer_schedule
from course_lib.grading.provenance import Provenance
from course_lib.runtime import rank

GRAPHS = ("exponential", "one-peer exponential", "irregular")
DEFAULT_WORLD_SIZES = (1, 2, 3, 4)
# (rtol, atol) per round and for the totals; float32 shares of x differ from float64 ones
# by a few units in the last place.
TOLERANCE = {torch.float32: (1e-5, 1e-6), torch.float64: (1e-12, 1e-12)}
CONSENSUS = {torch.float32: 1e-5, torch.float64: 1e-10}  # beyond the reference's own gap


# --- graphs --------------------------------------------------------------------------------


def out_neighbors(graph: str, r: int, world_size: int, round_: int = 0) -> list[int]:
    """The ranks that rank r sends to in round `round_` of `graph`, on world_size ranks."""
    offsets = [
        2**k for k in range(world_size.bit_length()) if 2**k < world_size
    ]  # 1, 2, 4, ... below P
    if graph == "exponential":
        return [(r + d) % world_size for d in offsets]
    if graph == "one-peer exponential":
        return [(r + offsets[round_ % len(offsets)]) % world_size] if offsets else []
    if graph == "irregular":
        if world_size == 1:
            return []
        return [j for j in range(world_size) if j != 0] if r == 0 else [(r + 1) % world_size]
    raise ValueError(f"unknown graph {graph!r}: use one of {GRAPHS}")


def in_neighbors(graph: str, r: int, world_size: int, round_: int = 0) -> list[int]:
    """The ranks that send to rank r in that round (in increasing order)."""
    return [j for j in range(world_size) if r in out_neighbors(graph, j, world_size, round_)]


def push_sum_reference(
    xs: list[torch.Tensor], ws: list[torch.Tensor], graph: str, round_: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One push-sum round for all ranks at once, in float64: rank j's x and w are split into
    d_j + 1 equal shares, one kept and one sent to each out-neighbour; shares are added up."""
    p = len(xs)
    new_x = [torch.zeros_like(xs[0], dtype=torch.float64) for _ in range(p)]
    new_w = [torch.zeros((), dtype=torch.float64) for _ in range(p)]
    for j in range(p):
        targets = out_neighbors(graph, j, p, round_)
        share = 1.0 / (len(targets) + 1)
        for i in [j, *targets]:
            new_x[i] += share * xs[j].double()
            new_w[i] += share * ws[j].double()
    return new_x, new_w


# --- what runs on each rank ----------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """Gossip on one graph: world size, graph, rounds, seed, dtype, vector size."""

    world_size: int
    graph: str
    rounds: int
    seed: int
    dtype: torch.dtype = torch.float64
    size: int = 5

    def __str__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return (
            f"world size {self.world_size}, {self.graph} graph, seed {self.seed}, {dtype} x "
            f"of {self.size} elements"
        )


def _start(case: Case, r: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1_009 * case.seed + 31 * r + 3)
    return (torch.randn(case.size, generator=g) * 3 + r).to(case.dtype)


# Lecture 4's module has a working push-sum step, and this module's reference computes a
# round for every rank: an answer that runs them, or a copy, is not the student's own.
FORBIDDEN = ("course_lib.gossip", "course_lib.grading.gossip.push_sum_reference")


class _Messages:
    """While active: every torch.distributed call this rank makes, with its peer for point-
    to-point ones, on every route (course_lib.comm's hook; on grading ranks it sees calls
    made through names bound earlier and through the group object too)."""

    def __enter__(self) -> _Messages:
        self.calls: list[tuple[str, int | None]] = []
        comm.add_around_hook(self._hook)
        return self

    def __exit__(self, *exc_info: object) -> None:
        comm.remove_around_hook(self._hook)

    def _hook(self, op, args, sent, received, call):
        names = ("dst", "group_dst") if op in ("send", "isend") else ("src", "group_src")
        peer = next((args[n] for n in names if args.get(n) is not None), None)
        self.calls.append((op, peer if op in POINT_TO_POINT else None))
        return call()


def _gossip(push_sum_step: Callable, cases: list[Case]) -> dict:
    with Provenance(FORBIDDEN) as seen:
        records = _gossip_records(push_sum_step, cases)
    return {"records": records, "copied": seen.complaint()}


def _gossip_records(push_sum_step: Callable, cases: list[Case]) -> list[list[dict]]:
    """On each rank: every case, `rounds` rounds each, feeding each round's output back."""
    out = []
    with CommCounter():
        for case in cases:
            p, me = case.world_size, rank()
            x, w = _start(case, me), torch.ones((), dtype=case.dtype)
            rounds = []
            for t in range(case.rounds):
                outs, ins = out_neighbors(case.graph, me, p, t), in_neighbors(case.graph, me, p, t)
                with _Messages() as messages:
                    try:
                        got = push_sum_step(x.clone(), w.clone(), list(outs), list(ins))
                    except BaseException as exc:
                        if hasattr(exc, "add_note"):
                            exc.add_note(f"(while checking: {case}, round {t})")
                        raise
                rounds.append({"x": x, "w": w, "got": got, "calls": messages.calls})
                if _well_formed(got, case):  # else judged in the calling process; every
                    # rank still runs every round, so the messages keep matching
                    x, w = got[0].detach().clone(), got[1].detach().clone().reshape(())
            out.append(rounds)
    return out


def _well_formed(got, case: Case) -> bool:
    if not (isinstance(got, (tuple, list)) and len(got) == 2):
        return False
    x, w = got
    return (
        isinstance(x, torch.Tensor)
        and x.shape == (case.size,)
        and x.dtype == case.dtype
        and isinstance(w, torch.Tensor)
        and w.numel() == 1
    )


# --- judging in the calling process ---------------------------------------------------------


def _judge(check: str, name: str, case: Case, records: list[list[dict]]) -> None:
    __tracebackhide__ = True
    p = case.world_size
    average = sum(_start(case, r).double() for r in range(p)) / p
    for t in range(case.rounds):
        got_x, got_w = _judge_round(check, name, case, t, records)
    z = [got_x[r] / got_w[r] for r in range(p)]
    worst = max((zr - average).abs().max().item() for zr in z)
    # As close as push-sum itself gets in that many rounds (some graphs mix slowly), twice.
    allowed = 2 * _reference_gap(case, average) + CONSENSUS[case.dtype] * max(
        average.abs().max().item(), 1.0
    )
    if worst > allowed:
        fail(
            check,
            f"{case}: after {case.rounds} rounds z = x / w is still up to {worst:.3g} away "
            f"from the average of the starting x (allowed {allowed:.3g}).",
        )


def _judge_round(check: str, name: str, case: Case, t: int, records: list[list[dict]]):
    """Round t on every rank: well-formed results, the totals push-sum conserves, each rank's
    (x, w) against the reference, and its messages. Returns the new x and w, in float64."""
    __tracebackhide__ = True
    p = case.world_size
    rtol, atol = TOLERANCE[case.dtype]
    at = f"{case}, round {t}"
    for r in range(p):
        got = records[r][t]["got"]
        if not _well_formed(got, case):
            fail(
                check,
                f"{at}: rank {r}'s {name} returned {_describe(got)}; expected a pair "
                f"(x_new, w_new): x_new a {case.dtype} tensor of shape ({case.size},) and "
                "w_new a tensor with one element",
            )
    xs = [records[r][t]["x"] for r in range(p)]
    ws = [records[r][t]["w"] for r in range(p)]
    got_x = [records[r][t]["got"][0].double() for r in range(p)]
    got_w = [records[r][t]["got"][1].double().reshape(()) for r in range(p)]
    want_x, want_w = push_sum_reference(xs, ws, case.graph, t)
    total_w, before_w = sum(got_w).item(), sum(w.double() for w in ws).item()
    if abs(total_w - before_w) > atol + rtol * abs(before_w):
        fail(
            check,
            f"{at}: the weights w summed over the ranks were {before_w:.10g} before the "
            f"round and {total_w:.10g} after; push-sum conserves them. Keep the share "
            "w / (d + 1) and send one share to each of the d out-neighbours, then add "
            "the shares received from the in-neighbours.",
        )
    total_x, before_x = sum(got_x), sum(x.double() for x in xs)
    if not torch.allclose(total_x, before_x, rtol=rtol, atol=atol * before_x.abs().max()):
        fail(
            check,
            f"{at}: x summed over the ranks changed by up to "
            f"{(total_x - before_x).abs().max().item():.3g}; push-sum conserves the total "
            "(every share of x kept or sent exactly once). " + _hint(case, t, xs, ws, got_x, got_w),
        )
    for r in range(p):
        scale = max(want_x[r].abs().max().item(), 1.0)
        bad_x = not torch.allclose(got_x[r], want_x[r], rtol=rtol, atol=atol * scale)
        bad_w = not torch.allclose(got_w[r], want_w[r], rtol=rtol, atol=atol)
        if bad_x or bad_w:
            what = "x" if bad_x else "w"
            fail(
                check,
                f"{at}: rank {r} (out-neighbours {out_neighbors(case.graph, r, p, t)}, "
                f"in-neighbours {in_neighbors(case.graph, r, p, t)}) got {what} = "
                f"{_show(got_x[r] if bad_x else got_w[r])}, expected "
                f"{_show(want_x[r] if bad_x else want_w[r])}. "
                + _hint(case, t, xs, ws, got_x, got_w),
            )
    for r in range(p):
        _judge_messages(check, at, case, t, r, records[r][t]["calls"])
    return got_x, got_w


def _judge_messages(check: str, at: str, case: Case, t: int, r: int, calls: list) -> None:
    """Push-sum talks to its neighbours only: point-to-point messages, sent to every
    out-neighbour and to no one else, received from in-neighbours only."""
    __tracebackhide__ = True
    outs = out_neighbors(case.graph, r, case.world_size, t)
    ins = in_neighbors(case.graph, r, case.world_size, t)
    where = f"{at}: rank {r} (out-neighbours {outs}, in-neighbours {ins})"
    others = sorted({op for op, _ in calls if op not in POINT_TO_POINT})
    if others:
        fail(
            check,
            f"{where} called {', '.join(others)}; push-sum uses point-to-point messages only "
            "(dist.isend / dist.irecv, or send / recv), whatever way a collective is reached",
        )
    sent_to = {peer for op, peer in calls if op in ("send", "isend")}
    heard_from = {peer for op, peer in calls if op in ("recv", "irecv")}
    if sent_to - set(outs):
        fail(check, f"{where} sent to rank(s) {sorted(sent_to - set(outs))}: not out-neighbours")
    if heard_from - set(ins):
        shown = ["any (no src)" if p is None else p for p in heard_from - set(ins)]
        fail(check, f"{where} received from {shown}: not in-neighbours")
    if set(outs) - sent_to:
        fail(
            check,
            f"{where} sent nothing to rank(s) {sorted(set(outs) - sent_to)}: every "
            "out-neighbour gets its share of x and w",
        )


def _reference_gap(case: Case, average: torch.Tensor) -> float:
    """max |z - average| of the float64 reference after all the rounds."""
    p = case.world_size
    xs = [_start(case, r).double() for r in range(p)]
    ws = [torch.ones((), dtype=torch.float64) for _ in range(p)]
    for t in range(case.rounds):
        xs, ws = push_sum_reference(xs, ws, case.graph, t)
    return max((x / w - average).abs().max().item() for x, w in zip(xs, ws, strict=True))


def _hint(case: Case, t: int, xs, ws, got_x, got_w) -> str:
    p = case.world_size
    reverse_graph = [
        sum(
            (xs[j].double() / (len(in_neighbors(case.graph, j, p, t)) + 1))
            for j in [i, *out_neighbors(case.graph, i, p, t)]
        )
        for i in range(p)
    ]
    if p > 2 and all(
        torch.allclose(a, b, rtol=1e-5, atol=1e-6)
        for a, b in zip(got_x, reverse_graph, strict=True)
    ):
        return (
            "The shares went the wrong way: send to out_neighbors and receive from "
            "in_neighbors, not the other way round."
        )
    if all(torch.allclose(w, torch.ones((), dtype=torch.float64)) for w in got_w) and not all(
        torch.allclose(w, torch.ones((), dtype=torch.float64))
        for w in push_sum_reference(xs, ws, case.graph, t)[1]
    ):
        return "Every w is still 1: w must be split, sent and summed exactly like x."
    return (
        "Share: x / (d + 1) with d = len(out_neighbors); keep one share, send one to each "
        "out-neighbour, receive one message from each in-neighbour (dist.isend/irecv, then "
        "wait), and add them all."
    )


def _show(t: torch.Tensor) -> str:
    values = t.reshape(-1)[:4].tolist()
    return "[" + ", ".join(f"{v:.6g}" for v in values) + (", ...]" if t.numel() > 4 else "]")


def _describe(got) -> str:
    if isinstance(got, (tuple, list)):
        inner = ", ".join(
            f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
            for x in got
        )
        return f"{type(got).__name__} of ({inner})"
    return type(got).__name__


def check_push_sum(
    push_sum_step: Callable,
    *,
    world_sizes: Iterable[int] = DEFAULT_WORLD_SIZES,
    graphs: Iterable[str] = GRAPHS,
    rounds: int = 20,
    seeds: Iterable[int] = (0,),
    dtype: torch.dtype = torch.float64,
    timeout: float = 30.0,
) -> None:
    """`push_sum_step(x, w, out_neighbors, in_neighbors) -> (x_new, w_new)`, run for
    `rounds` rounds on each graph: each round equal to `push_sum_reference`, totals of x and
    w conserved, and every rank's z = x / w at the average of the starting x at the end."""
    __tracebackhide__ = True
    check = "check_push_sum"
    if not callable(push_sum_step):
        fail(check, f"expected your function, got {type(push_sum_step).__name__}")
    if dtype not in TOLERANCE:
        raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    graphs = list(graphs)
    for graph in graphs:
        if graph not in GRAPHS:
            raise ValueError(f"unknown graph {graph!r}: use one of {GRAPHS}")
    name = getattr(push_sum_step, "__name__", "push_sum_step")
    verdict, count = Verdict(check), 0
    for p in sorted(set(world_sizes)):
        cases = [Case(p, graph, rounds, seed, dtype) for seed in seeds for graph in graphs]
        results = run_on_ranks(
            check,
            _gossip,
            push_sum_step,
            cases,
            world_size=p,
            timeout=timeout,
            what=f"your {name} (world size {p}, {len(cases)} cases)",
        )
        if results[0]["copied"]:
            fail(check, results[0]["copied"])
        results = [found["records"] for found in results]
        for i, case in enumerate(cases):
            with verdict.case():
                _judge(check, name, case, [results[r][i] for r in range(p)])
        count += len(cases)
    sizes = ", ".join(str(p) for p in sorted(set(world_sizes)))
    verdict.conclude(
        f"{count} case(s) on {sizes} rank(s) (graphs {', '.join(graphs)}; {rounds} rounds, "
        f"{str(dtype).removeprefix('torch.')}): every round equals push-sum on every rank, "
        "sends only to the round's out-neighbours and receives only from its in-neighbours, "
        "conserves the totals of x and w, and z = x / w ends at the average"
    )


__all__ = [
    "GRAPHS",
    "check_one_peer_schedule",
    "check_push_sum",
    "in_neighbors",
    "out_neighbors",
    "push_sum_reference",
]
