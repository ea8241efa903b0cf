"""Checks for Assignment 8, pipeline parallelism.

    check_pipeline_trainer(pipeline_step, schedule)   GPipe or 1F1B on P processes
    check_simulate_schedule(simulate_schedule)        timelines and the bubble (P-1)/(m+P-1)
    check_optimal_partition(optimal_partition)        the A(j, m) dynamic program
    check_split_schedule(split_schedule)              F, B, W orders: a smaller bubble than
                                                      1F1B in its memory (open part)

The assignment's plumbing is imported from here too: `send_tensor` / `recv_tensor` (a tensor
of any shape between two ranks) and `InFlightProbe` (a stage that counts its micro-batches in
flight, for trying a schedule out).

`pipeline_step(stage, inputs, targets, loss_fn, n_micro, schedule)` runs on every rank with
that rank's stage of a float64 model (an MLP, or TinyGPT cut by `pipeline_stages`). The
check draws the weights and the data from a secret new for every call, in the checking
process, and gives each rank only its stage, the inputs on stage 0 and the targets on the
last stage (zeros of their shape elsewhere); it trains the reference there too. The check
wraps the stage (`watch`) so that each forward and backward of the stage is reported to the
launcher as it runs, with a fingerprint of the forward's input that tells its micro-batch,
and hands each .grad over holding a value that backward must add to. After each step the
gradients (and the parameters after an SGD step) must equal single-process training on the
whole batch, and the order of forwards and backwards on each stage, micro-batch by
micro-batch, read from what the launcher received, must be the schedule's, and fit the
stage's messages (no activation sent before its forward, no gradient before its backward).
The calls each rank made are the ones the launcher received (`run_on_ranks(...,
traffic=True)`), and the kernel's count of the bytes on the ranks' sockets must be theirs
(`judge_unreported`).

The schedules, for P stages, m micro-batches, stage r (0 = first), each kind of operation
in micro-batch order:
- "gpipe": the m forwards, then the m backwards;
- "1f1b": w = min(P - r - 1, m) forwards (warm-up), then m - w times one forward and one
  backward, then the last w backwards; so at most min(m, P - r) micro-batches are in flight.

The checks stand on their parts:
    pipeline_plumbing.py   the schedules' order, send_tensor / recv_tensor, the stage's notes
    pipeline_cases.py      the trainer's runs drawn, each rank's share, the reference
    pipeline_ranks.py      what runs on each rank for the trainer check
    pipeline_trainer.py    each step judged, its calls from the launcher's tallies
    pipeline_notes.py      the order of forwards and backwards, from the launcher's notes
    pipeline_timeline.py   a simulated schedule's timeline judged
    pipeline_partition.py  partition problems, brute force, a returned partition judged
    pipeline_schedule.py   split-backward schedules validated, simulated and measured
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from course_lib.calls import PerRank
from course_lib.grading._harness import (
    CheckFailed,
    Verdict,
    events_by_case,
    fail,
    judge_unreported,
    measured,
    run_on_ranks,
)
from course_lib.grading.pipeline_cases import PipelineRun, pipeline_runs, share, stages
from course_lib.grading.pipeline_partition import (
    PartitionProblem,
    brute_force_partition,
    judge_partition,
    large_best_time,
    large_partition_problems,
    partition_problems,
    partition_time,
    stage_time,
)
from course_lib.grading.pipeline_plumbing import (
    SCHEDULES,
    InFlightProbe,
    PendingSend,
    in_flight_bound,
    recv_tensor,
    schedule_order,
    send_tensor,
)
from course_lib.grading.pipeline_ranks import run_runs
from course_lib.grading.pipeline_schedule import (
    bubble_allowed,
    judge_split,
    makespan_allowed,
    simulate_split,
)
from course_lib.grading.pipeline_timeline import check_timeline
from course_lib.grading.pipeline_trainer import ATOL, RTOL, judge_run
from course_lib.grading.provenance import Provenance

# Lecture 8's modules hold what would answer parts under other names (the simulator, Part
# 2's algorithm; ZB-H1's order, a right answer to the open Part 4; the zero-bubble runtime and
# the run of torch's schedules, trainers close to Part 1's), and the checks' schedule order,
# brute force and split-schedule simulator would help (defined in parts, named here, where the
# notebook sees them): an answer that runs any of them, or a copy, is not the student's own.
FORBIDDEN = (
    "course_lib.pipeline",
    "course_lib.measure.pipeline",
    "course_lib.grading.pipeline.schedule_order",
    "course_lib.grading.pipeline.in_flight_bound",
    "course_lib.grading.pipeline.brute_force_partition",
    "course_lib.grading.pipeline.simulate_split",
)


def _watched(fn: Callable, *args) -> dict:
    """fn(*args) on a rank, watched for the course's own implementations."""
    with Provenance(FORBIDDEN) as seen:
        result = fn(*args)
    return {"result": result, "copied": seen.complaint()}


def _unwatched(check: str, found: dict):
    __tracebackhide__ = True
    if found["copied"]:
        fail(check, found["copied"])
    return found["result"]


# --- what runs on each rank ---------------------------------------------------------------


def _simulate_cases(simulate_schedule: Callable, cases: list[tuple]) -> dict:
    return _watched(
        lambda: [
            simulate_schedule(P, m, schedule, t_forward=f, t_backward=b)
            for P, m, schedule, f, b in cases
        ]
    )


def _split_cases(split_schedule: Callable, cases: tuple[tuple[int, int], ...]) -> dict:
    return _watched(lambda: [split_schedule(P, m) for P, m in cases])


def _solve_all(optimal_partition: Callable, problems: list[PartitionProblem]) -> dict:
    return _watched(lambda: [optimal_partition(*p.args(), **p.kwargs()) for p in problems])


# --- the checks ---------------------------------------------------------------------------


def check_pipeline_trainer(
    pipeline_step: Callable,
    schedule: str,
    *,
    world_sizes: tuple[int, ...] = (2, 4),
    models: tuple[str, ...] = ("mlp",),
    n_micro: tuple[int, ...] = (1, 4, 8),
    seed: int = 0,
    steps: int = 2,
    timeout: float = 30.0,
) -> None:
    """`pipeline_step(stage, inputs, targets, loss_fn, n_micro, schedule)` on every rank: the
    batch in n_micro micro-batches through the stages with the given schedule; gradients
    added to each stage's .grad; the last stage returns the full-batch loss as a float, the
    others None. Checked against single-process training, and for the schedule's order of
    forwards and backwards, micro-batch by micro-batch."""
    __tracebackhide__ = True
    check = "check_pipeline_trainer"
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}: use 'gpipe' or '1f1b'")
    for P in world_sizes:
        if not 1 <= P <= 4:
            raise ValueError(f"world sizes must be 1..4 (the models have 4 stages at most): {P}")
    runs = pipeline_runs(models, n_micro, steps)  # `seed` is kept for the notebooks' calls
    verdict = Verdict(check)
    for P in world_sizes:
        # Each rank gets its own stage and data only; the runs it sees carry no secret.
        shares = PerRank([[share(run, P, r) for run in runs] for r in range(P)])
        (results, traffic) = run_on_ranks(
            check,
            run_runs,
            pipeline_step,
            schedule,
            [replace(run, secret=0) for run in runs],
            shares,
            FORBIDDEN,
            world_size=P,
            timeout=timeout,
            what=f"your pipeline_step ({schedule}, {P} stages)",
            traffic=True,
        )
        results = [_unwatched(check, found) for found in results]
        # Per rank, per step: its calls, and the notes of its stage's forwards and backwards.
        per_step = events_by_case(check, traffic.tallies, len(runs) * steps)
        judge_unreported(check, traffic)  # send/recv only: every byte on the wire accounted
        for i, run in enumerate(runs):
            events = [per_rank[i * steps : (i + 1) * steps] for per_rank in per_step]
            with verdict.case():  # a run's first failing step
                judge_run(check, schedule, run, [found[i] for found in results], events)
    verdict.conclude(
        f"{len(runs) * len(world_sizes)} run(s) of {steps} steps ({', '.join(models)}; "
        f"{', '.join(str(m) for m in n_micro)} micro-batches; "
        f"{', '.join(str(P) for P in world_sizes)} stages), {schedule}: every stage's "
        f"gradients and the loss equal single-process training (rtol {RTOL:g}, atol "
        f"{ATOL:g}), .grad added to, with the schedule's order of forwards and backwards, "
        "micro-batch by micro-batch, only point-to-point messages, every send waited for, "
        "the loss as a float on the last stage and None on the others"
    )


def check_simulate_schedule(
    simulate_schedule: Callable,
    *,
    cases: tuple[tuple[int, int], ...] = ((1, 1), (2, 1), (4, 1), (4, 4), (4, 8), (3, 5)),
    times: tuple[tuple[float, float], ...] = ((1.0, 1.0), (1.0, 2.0)),
    timeout: float = 30.0,
) -> None:
    """`simulate_schedule(P, m, schedule, t_forward=1.0, t_backward=1.0)` returns
    {"timeline": per stage a list of (kind, micro_batch, start, end), "makespan": ...,
    "bubble_fraction": idle share}; checked for both schedules against the dependencies and
    the formula (P-1)/(m+P-1)."""
    __tracebackhide__ = True
    check = "check_simulate_schedule"
    all_cases = [(P, m, s, f, b) for P, m in cases for s in SCHEDULES for f, b in times]
    results = run_on_ranks(
        check,
        _simulate_cases,
        simulate_schedule,
        all_cases,
        world_size=1,
        timeout=timeout,
        what="your simulate_schedule",
    )[0]
    results = _unwatched(check, results)
    verdict = Verdict(check)
    for case, result in zip(all_cases, results, strict=True):
        with verdict.case():
            check_timeline(check, case, result)
    verdict.conclude(
        f"{len(all_cases)} case(s) (P, m, both schedules, two sets of times): every "
        "timeline runs each op once, for its duration, one at a time per stage, after what "
        "it depends on and in the schedule's order, and its makespan and bubble fraction "
        "agree with it and with (P-1)/(m+P-1)"
    )


def check_optimal_partition(
    optimal_partition: Callable,
    *,
    seeds: tuple[int, ...] = (0,),
    large: tuple[int, ...] = (),
    timeout: float = 30.0,
    large_timeout: float = 20.0,
) -> None:
    """`optimal_partition(layer_times, activation_sizes, n_machines, bandwidth=1.0,
    weight_sizes=None)` returns (slowest stage time, [(start, stop, machines), ...]) for a split
    of the layers into contiguous stages using all n_machines. Small problems are checked
    against brute force; `large` ones (64 layers, 8 machines; seeds 0 to 9) against their
    stored optimum, and all of them together must be solved within `large_timeout` seconds."""
    __tracebackhide__ = True
    check = "check_optimal_partition"
    verdict, solved = Verdict(check), []
    for problems, limit, best in (
        (partition_problems(seeds), timeout, brute_force_partition),
        (large_partition_problems(large), large_timeout, large_best_time),
    ):
        if not problems:
            continue
        found = _solve_on_a_rank(check, optimal_partition, problems, limit)
        for problem, result in zip(problems, found, strict=True):
            with verdict.case():
                judge_partition(check, problem, result, best(problem))
        solved.append(f"{len(problems)} {'large' if problems[0].label else 'small'}")
    verdict.conclude(
        f"{' and '.join(solved)} problem(s): every returned split covers the layers in order "
        "with all the machines, its time is what it returns, and no split is faster"
        + (f"; the large ones (64 layers, 8 machines) within {large_timeout:g} s" if large else "")
    )


def check_split_schedule(
    split_schedule: Callable,
    *,
    cases: tuple[tuple[int, int], ...] = ((4, 4), (4, 8)),
    timeout: float = 30.0,
) -> None:
    """`split_schedule(P, m)` returns, per stage, its ("F" | "B" | "W", micro_batch) ops in
    order. Validated, simulated by the check (every op one unit) and measured: it scores when
    it runs without deadlock, no stage holds more than P micro-batches (F done, W not yet)
    and every step takes at most 3m + 2(P - 1) - 1 units, shorter than 1F1B's."""
    __tracebackhide__ = True
    check = "check_split_schedule"
    found = run_on_ranks(
        check,
        _split_cases,
        split_schedule,
        cases,
        world_size=1,
        timeout=timeout,
        what="your split_schedule",
    )[0]
    results = _unwatched(check, found)
    verdict, seen, units = Verdict(check), [], 0.0
    for (P, m), orders in zip(cases, results, strict=True):
        with verdict.case():
            run = judge_split(check, P, m, orders)
            units += run["makespan"]
            seen.append(
                f"P={P} m={m}: {run['makespan']:g} <= {makespan_allowed(P, m):g} units, "
                f"bubble {run['bubble_fraction']:.3f} <= {bubble_allowed(P, m):.3f}, "
                f"peak {max(run['peaks'])} <= {P}"
            )
    verdict.conclude(
        f"{len(cases)} case(s), simulated by the check: every stage runs F, B, W of each "
        "micro-batch once, in an order that can run, holding at most P micro-batches, in "
        "fewer units than 1F1B (" + "; ".join(seen) + ")"
    )
    measured(check, "units of time a step takes, summed over the cases", units, "units")


def _solve_on_a_rank(
    check: str, optimal_partition: Callable, problems: list[PartitionProblem], limit: float
) -> list:
    """What optimal_partition returns for each problem, solved on one grading rank within
    `limit` seconds; the large problems, not solved in time, call for the dynamic program."""
    __tracebackhide__ = True
    try:
        found = run_on_ranks(
            check,
            _solve_all,
            optimal_partition,
            problems,
            world_size=1,
            timeout=limit,
            what="your optimal_partition",
        )[0]
    except CheckFailed as error:
        if problems[0].label and "did not finish within" in str(error):
            fail(
                check,
                f"your optimal_partition did not solve {len(problems)} problem(s) of 64 "
                f"layers on 8 machines within {limit:g} s. Trying every cut and every "
                "split of the machines takes exponential time; the dynamic program A(j, m) "
                "takes O(N^2 M^2) steps, well under a second here",
            )
        raise
    return _unwatched(check, found)


__all__ = [
    "InFlightProbe",
    "PendingSend",
    "PartitionProblem",
    "PipelineRun",
    "brute_force_partition",
    "check_optimal_partition",
    "check_pipeline_trainer",
    "check_simulate_schedule",
    "check_split_schedule",
    "in_flight_bound",
    "partition_time",
    "recv_tensor",
    "schedule_order",
    "send_tensor",
    "simulate_split",
    "stage_time",
    "stages",
]
