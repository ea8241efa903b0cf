"""Assignment 4 Part 1's judging, in the checking process: what every rank returned, round after
round, against push-sum computed here from the starting x drawn here; the totals push-sum
conserves; the messages, from the launcher's tallies; and how close z = x / w ends to the
average.

    judge_case(check, name, case, starts, records, calls)   one case, every rank and round

Round t is judged from what round t - 1 returned on every rank (the drawn x and w = 1 for
round 0), which is what the ranks were given: a mistake is reported in the round it is made.
"""

from __future__ import annotations

import torch

from course_lib.comm import POINT_TO_POINT
from course_lib.grading._harness import fail
from course_lib.grading.gossip_cases import push_sum_reference, reference_gap
from course_lib.grading.gossip_graphs import in_neighbors, out_neighbors
from course_lib.grading.gossip_ranks import Case, well_formed
from course_lib.grading.traffic import Sent

# (rtol, atol) per round and for the totals; float32 shares of x differ from float64 ones
# by a few units in the last place.
TOLERANCE = {torch.float32: (1e-5, 1e-6), torch.float64: (1e-12, 1e-12)}
CONSENSUS = {torch.float32: 1e-5, torch.float64: 1e-10}  # beyond the reference's own gap


def judge_case(
    check: str,
    name: str,
    case: Case,
    starts: list[torch.Tensor],
    records: list[list[dict]],
    calls: list[list[list[Sent]]],
) -> None:
    """Every round of one case on every rank (`records[r][t]`, `calls[r][t]`), then the end:
    every z = x / w within twice push-sum's own gap of the average of `starts`."""
    __tracebackhide__ = True
    p = case.world_size
    average = sum(x.double() for x in starts) / p
    xs, ws = list(starts), [torch.ones((), dtype=case.dtype) for _ in range(p)]
    for t in range(case.rounds):
        xs, ws = _judge_round(check, name, case, t, xs, ws, [rounds[t] for rounds in records])
        for r in range(p):
            _judge_messages(check, case, t, r, calls[r][t])
    z = [x.double() / w.double() for x, w in zip(xs, ws, strict=True)]
    worst = max((zr - average).abs().max().item() for zr in z)
    # As close as push-sum itself gets in that many rounds (some graphs mix slowly), twice.
    allowed = 2 * reference_gap(case, starts) + CONSENSUS[case.dtype] * max(
        average.abs().max().item(), 1.0
    )
    if worst > allowed:
        fail(
            check,
            f"{case}: after {case.rounds} rounds z = x / w is still up to {worst:.3g} away "
            f"from the average of the starting x (allowed {allowed:.3g}).",
        )


def _judge_round(check: str, name: str, case: Case, t: int, xs, ws, found: list[dict]):
    """Round t on every rank, given (xs, ws): well-formed results, the totals push-sum
    conserves, each rank's (x, w) against the reference. Returns what the ranks returned,
    the next round's inputs."""
    __tracebackhide__ = True
    p = case.world_size
    rtol, atol = TOLERANCE[case.dtype]
    at = f"{case}, round {t}"
    for r in range(p):
        got = found[r]["got"]
        if not well_formed(got, case.size, case.dtype):
            fail(
                check,
                f"{at}: rank {r}'s {name} returned {found[r]['described'] or 'something else'}; "
                f"expected a pair (x_new, w_new): x_new a {case.dtype} tensor of shape "
                f"({case.size},) and w_new a tensor with one element",
            )
    got_x = [found[r]["got"][0].double() for r in range(p)]
    got_w = [found[r]["got"][1].double().reshape(()) for r in range(p)]
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
    return [found[r]["got"][0] for r in range(p)], [found[r]["got"][1] for r in range(p)]


def _judge_messages(check: str, case: Case, t: int, r: int, calls: list[Sent]) -> None:
    """Push-sum talks to its neighbours only: point-to-point messages, sent to every
    out-neighbour and to no one else, received from in-neighbours only. The calls are those
    rank r's process group reported to the launcher during round t."""
    __tracebackhide__ = True
    outs = out_neighbors(case.graph, r, case.world_size, t)
    ins = in_neighbors(case.graph, r, case.world_size, t)
    where = f"{case}, round {t}: rank {r} (out-neighbours {outs}, in-neighbours {ins})"
    others = sorted({call.op for call in calls if call.op not in POINT_TO_POINT})
    if others:
        fail(
            check,
            f"{where} called {', '.join(others)}; push-sum uses point-to-point messages only "
            "(dist.isend / dist.irecv, or send / recv), whatever way a collective is reached",
        )
    # isend and irecv reach the process group as its send and recv
    sent_to = {call.peer for call in calls if call.op == "send"}
    heard_from = {call.peer for call in calls if call.op == "recv"}
    if sent_to - set(outs):
        fail(check, f"{where} sent to rank(s) {sorted(sent_to - set(outs))}: not out-neighbours")
    if heard_from - set(ins):
        shown = ["any (no src)" if q is None else q for q in heard_from - set(ins)]
        fail(check, f"{where} received from {shown}: not in-neighbours")
    if set(outs) - sent_to:
        fail(
            check,
            f"{where} sent nothing to rank(s) {sorted(set(outs) - sent_to)}: every "
            "out-neighbour gets its share of x and w",
        )


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
