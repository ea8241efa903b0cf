"""Checks for Assignment 2, collectives built from point-to-point messages.

    check_broadcast(broadcast)                 broadcast(tensor, src), in place
    check_reduce(reduce)                       reduce(tensor, dst): the sum lands on dst
    check_all_gather(all_gather)               all_gather(tensor_list, tensor)
    check_reduce_scatter(reduce_scatter)       reduce_scatter(output, input_list)
    check_all_reduce(all_reduce)               all_reduce(tensor): the sum on every rank
    check_bidirectional_ring_all_reduce(bidirectional_ring_all_reduce)
                                               ... and each rank talks only to its two
                                               neighbours and sends each way at most
                                               (P-1)/P * N: half the tensor on each ring
    check_all_reduce_fast(all_reduce_fast)     all_reduce(tensor) on 2 to 8 ranks, each rank
                                               sending at most 2 floor(log2 P) messages
                                               (+2 when P is no power of two) and about
                                               2(Q-1)/Q * N bytes (+N), Q = 2^floor(log2 P)

Every case runs the student's function on inputs drawn here, in the checking process, from a
secret seed; each rank receives only its own (`collectives_cases`). The reference is what
torch.distributed's collective gives, computed here from all the inputs. Sums are compared
exactly for int64 and within `TOLERANCE` for floats (the order of the additions differs).
The calls come from the launcher's tallies, which each rank's process group reports as the
calls happen: only send/recv/isend/irecv are allowed, and every isend/irecv must be waited
for.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable

import torch

from course_lib import PerRank
from course_lib.comm import POINT_TO_POINT
from course_lib.grading._harness import (
    RESULT,
    Verdict,
    calls_by_case,
    fail,
    judge_unreported,
    measured,
    new_secret,
    run_on_ranks,
)
from course_lib.grading.collectives_cases import draw, reference
from course_lib.grading.collectives_judge import (
    Spec,
    Tally,
    judge_bytes,
    judge_case,
    judge_directions,
    judge_messages,
    judge_neighbours,
)
from course_lib.grading.collectives_ranks import Case, run_cases
from course_lib.grading.traffic import Sent

# (rtol, atol) for sums: |got - expected| <= atol + rtol * |expected|. A sum of P float32
# values in another order differs by a few units in the last place (~1e-7 relative).
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float64: (1e-12, 1e-12), torch.int64: (0, 0)}

# The ring part's points: half for talking only to the neighbours, half for the bytes each
# way, and neither unless the sum is right on every rank (a right sum alone is part 5's
# naive answer).
RING_WEIGHTS = {RESULT: 0.0, "neighbours": 0.5, "bytes": 0.5}

DTYPES = (torch.float32, torch.float64, torch.int64)
DEFAULT_SHAPES = ((5,), (2, 3))
DEFAULT_WORLD_SIZES = (1, 2, 3, 4)
# Part 6 on 5 ranks too: 3 and 4 have few far ranks to send to by mistake.
RING_WORLD_SIZES = (1, 2, 3, 4, 5)
# Part 7: 2 and 4, powers of two; 3, 5 and 6, which a halving-doubling must fold to 2 or 4;
# and 8, where the ring's 14 messages are over 6.
FAST_WORLD_SIZES = (2, 3, 4, 5, 6, 8)


def _check(
    spec: Spec,
    fn: Callable,
    world_sizes: Iterable[int],
    shapes: Iterable,
    dtypes: Iterable[torch.dtype],
    seeds: Iterable[int],
    timeout: float,
    point_to_point_only: bool,
) -> None:
    """Every case of `spec`'s collective on each world size (one run of the ranks per world
    size), each case judged apart, then the verdict with what was verified."""
    __tracebackhide__ = True
    if not callable(fn):
        fail(spec.check, f"expected your function, got {type(fn).__name__} {fn!r:.60}")
    shapes = [tuple(s) if isinstance(s, Iterable) else (int(s),) for s in shapes]
    name = getattr(fn, "__name__", "function")
    verdict = Verdict(spec.check, RING_WEIGHTS if spec.bidirectional else None)
    tally = Tally()
    busiest = 0  # Part 7's measure: the busiest rank's bytes, summed over the cases
    secret = new_secret()
    for p in sorted(set(world_sizes)):
        roots = range(p) if spec.root else [None]
        cases = [
            Case(p, shape, dtype, seed, root)
            for shape in shapes
            for dtype in dtypes
            for seed in seeds
            for root in roots
        ]
        inputs = [draw(spec.kind, case, secret) for case in cases]  # [case][rank]
        results, traffic = run_on_ranks(
            spec.check,
            run_cases,
            spec.kind,
            fn,
            cases,
            PerRank([[given[r] for given in inputs] for r in range(p)]),
            world_size=p,
            timeout=timeout,
            what=f"your {name} (world size {p}, {len(cases)} cases)",
            traffic=True,
        )
        if results[0]["copied"]:
            fail(spec.check, results[0]["copied"])
        sent = calls_by_case(spec.check, traffic.tallies, len(cases))
        judge_unreported(spec.check, traffic)
        for i, case in enumerate(cases):
            records = _records(spec, case, inputs[i], [results[r]["cases"][i] for r in range(p)])
            for r, record in enumerate(records):
                record.update(_communication(sent[r][i]))
            with verdict.case():
                judge_case(spec, name, case, records, point_to_point_only)
            if spec.bidirectional:
                with verdict.case():
                    judge_neighbours(spec, case, records)
                with verdict.case():
                    judge_directions(spec, case, records)
            if spec.fewest_messages:
                busiest += max(record["sent"] for record in records)
                with verdict.case():
                    judge_messages(spec, case, records)
                with verdict.case():
                    judge_bytes(spec, case, records)
            tally.add(spec, case, records)
    verdict.conclude(tally.summary(spec, point_to_point_only))
    if spec.fewest_messages:
        measured(spec.check, "bytes sent by the busiest rank, summed over the cases", busiest, "B")


def _records(spec: Spec, case: Case, inputs: list[dict], found: list[dict]) -> list[dict]:
    """Each rank's record for judging: what it reported, its inputs (drawn here), what
    torch's collective gives it (computed here) and the garbage its outputs held before."""
    expected = reference(spec.kind, case, inputs)
    records = []
    for r, record in enumerate(found):
        given = inputs[r]
        record = dict(record, expected=expected[r])
        if spec.kind == "all_gather":
            record["inputs"] = {"tensor": given["tensor"]}
            record["initial"] = {f"tensor_list[{i}]": t for i, t in enumerate(given["tensor_list"])}
        elif spec.kind == "reduce_scatter":
            record["inputs"] = {f"input_list[{i}]": t for i, t in enumerate(given["input_list"])}
            record["initial"] = {"output": given["output"]}
        else:
            record["inputs"] = {"tensor": given["tensor"]}
        records.append(record)
    return records


def _communication(calls: list[Sent]) -> dict:
    """What one rank's calls in one case add up to, from the launcher's tallies: `sent_to`,
    the bytes of its sends by destination rank."""
    sent_to = Counter()
    for call in calls:
        if call.op in ("send", "isend"):
            sent_to[call.peer] += call.sent
    return {
        "calls": Counter(call.op for call in calls),
        "sent": sum(call.sent for call in calls),
        "received": sum(call.received for call in calls),
        "peers": [(call.op, call.peer) for call in calls if call.op in POINT_TO_POINT],
        "sent_to": sent_to,
    }


# --- the checks ---------------------------------------------------------------------------


def check_broadcast(
    broadcast: Callable,
    *,
    world_sizes: Iterable[int] = DEFAULT_WORLD_SIZES,
    shapes: Iterable = DEFAULT_SHAPES,
    dtypes: Iterable[torch.dtype] = DTYPES,
    seeds: Iterable[int] = (0,),
    timeout: float = 20.0,
    point_to_point_only: bool = True,
) -> None:
    """`broadcast(tensor, src)`: afterwards every rank's `tensor` holds src's, bit for bit.
    Tried from every src, for each world size, shape, dtype and seed."""
    __tracebackhide__ = True
    spec = Spec("broadcast", "check_broadcast", tolerance=None, root="src")
    _check(spec, broadcast, world_sizes, shapes, dtypes, seeds, timeout, point_to_point_only)


def check_reduce(
    reduce: Callable,
    *,
    world_sizes: Iterable[int] = DEFAULT_WORLD_SIZES,
    shapes: Iterable = DEFAULT_SHAPES,
    dtypes: Iterable[torch.dtype] = DTYPES,
    seeds: Iterable[int] = (0,),
    timeout: float = 20.0,
    point_to_point_only: bool = True,
) -> None:
    """`reduce(tensor, dst)`: afterwards dst's `tensor` holds the sum over all ranks (the
    other ranks' tensors are not checked, as in torch). Tried with every dst."""
    __tracebackhide__ = True
    spec = Spec("reduce", "check_reduce", tolerance=TOLERANCE, root="dst")
    _check(spec, reduce, world_sizes, shapes, dtypes, seeds, timeout, point_to_point_only)


def check_all_gather(
    all_gather: Callable,
    *,
    world_sizes: Iterable[int] = DEFAULT_WORLD_SIZES,
    shapes: Iterable = DEFAULT_SHAPES,
    dtypes: Iterable[torch.dtype] = DTYPES,
    seeds: Iterable[int] = (0,),
    timeout: float = 20.0,
    point_to_point_only: bool = True,
) -> None:
    """`all_gather(tensor_list, tensor)`: on every rank, tensor_list[i] is filled (in place)
    with rank i's `tensor`; `tensor` itself is unchanged."""
    __tracebackhide__ = True
    spec = Spec("all_gather", "check_all_gather", tolerance=None)
    _check(spec, all_gather, world_sizes, shapes, dtypes, seeds, timeout, point_to_point_only)


def check_reduce_scatter(
    reduce_scatter: Callable,
    *,
    world_sizes: Iterable[int] = DEFAULT_WORLD_SIZES,
    shapes: Iterable = DEFAULT_SHAPES,
    dtypes: Iterable[torch.dtype] = DTYPES,
    seeds: Iterable[int] = (0,),
    timeout: float = 20.0,
    point_to_point_only: bool = True,
) -> None:
    """`reduce_scatter(output, input_list)`: rank r's `output` becomes the sum over all ranks
    of their input_list[r]; `input_list` is unchanged."""
    __tracebackhide__ = True
    spec = Spec("reduce_scatter", "check_reduce_scatter", tolerance=TOLERANCE)
    _check(spec, reduce_scatter, world_sizes, shapes, dtypes, seeds, timeout, point_to_point_only)


def check_all_reduce(
    all_reduce: Callable,
    *,
    world_sizes: Iterable[int] = DEFAULT_WORLD_SIZES,
    shapes: Iterable = ((1,), (7,), (3, 4)),
    dtypes: Iterable[torch.dtype] = DTYPES,
    seeds: Iterable[int] = (0,),
    timeout: float = 20.0,
    point_to_point_only: bool = True,
) -> None:
    """`all_reduce(tensor)`: every rank's `tensor` becomes the sum over all ranks, in place."""
    __tracebackhide__ = True
    spec = Spec("all_reduce", "check_all_reduce", tolerance=TOLERANCE)
    _check(spec, all_reduce, world_sizes, shapes, dtypes, seeds, timeout, point_to_point_only)


def check_bidirectional_ring_all_reduce(
    bidirectional_ring_all_reduce: Callable,
    *,
    world_sizes: Iterable[int] = RING_WORLD_SIZES,
    shapes: Iterable = ((1,), (7,), (3, 4)),
    dtypes: Iterable[torch.dtype] = DTYPES,
    seeds: Iterable[int] = (0,),
    timeout: float = 20.0,
    point_to_point_only: bool = True,
) -> None:
    """`bidirectional_ring_all_reduce(tensor)`: every rank's `tensor` becomes the sum over all
    ranks, in place (the gate); each rank sends to and receives from rank +- 1 only (half
    the points); and sends each way, to rank + 1 and to rank - 1, at most 2(P-1) chunks of
    ceil(N/(2P)) elements, one ring all-reduce of half the tensor (the other half; on 2
    ranks, where both rings share the one neighbour, at most twice that in all). Whether the
    two rings run at the same time is not judged."""
    __tracebackhide__ = True
    spec = Spec(
        "all_reduce", "check_bidirectional_ring_all_reduce", tolerance=TOLERANCE, bidirectional=True
    )
    fn = bidirectional_ring_all_reduce
    _check(spec, fn, world_sizes, shapes, dtypes, seeds, timeout, point_to_point_only)


def check_all_reduce_fast(
    all_reduce_fast: Callable,
    *,
    world_sizes: Iterable[int] = FAST_WORLD_SIZES,
    shapes: Iterable = ((1,), (7,), (3, 4), (2, 17)),
    dtypes: Iterable[torch.dtype] = DTYPES,
    seeds: Iterable[int] = (0,),
    timeout: float = 30.0,
    point_to_point_only: bool = True,
) -> None:
    """`all_reduce_fast(tensor)`: every rank's `tensor` becomes the sum over all ranks, in
    place, on any number of ranks P; with Q the largest power of two <= P, each rank sends at
    most 2 log2 Q messages and 2(Q-1) chunks of ceil(N/Q) elements (halving-doubling on Q
    ranks, `fast_messages`, `fast_budget`), and when P > Q 2 messages and N elements more (a
    fold of the P - Q other ranks in and out). All or nothing: a right sum that breaks
    either bound scores 0."""
    __tracebackhide__ = True
    world_sizes = sorted(set(world_sizes))
    if any(p < 1 for p in world_sizes):
        raise ValueError(f"check_all_reduce_fast needs world sizes >= 1, got {world_sizes}")
    spec = Spec("all_reduce", "check_all_reduce_fast", tolerance=TOLERANCE, fewest_messages=True)
    _check(spec, all_reduce_fast, world_sizes, shapes, dtypes, seeds, timeout, point_to_point_only)


__all__ = [
    "TOLERANCE",
    "check_all_gather",
    "check_all_reduce",
    "check_all_reduce_fast",
    "check_bidirectional_ring_all_reduce",
    "check_broadcast",
    "check_reduce",
    "check_reduce_scatter",
]
