"""Checks for Assignment 8, pipeline parallelism.

    check_pipeline_trainer(pipeline_step, schedule)   GPipe or 1F1B on P processes
    check_simulate_schedule(simulate_schedule)        timelines and the bubble (P-1)/(m+P-1)
    check_optimal_partition(optimal_partition)        the A(j, m) dynamic program

The assignment's plumbing lives here too: `send_tensor` / `recv_tensor` (a tensor of any
shape between two ranks) and `InFlightProbe` (what the check wraps around a stage).

`pipeline_step(stage, inputs, targets, loss_fn, n_micro, schedule)` runs on every rank with
that rank's stage of a seeded float64 model (an MLP, or TinyGPT cut by `pipeline_stages`).
The check wraps the stage in an `InFlightProbe`, which counts the micro-batches whose forward
has run on the stage and whose backward has not yet: the activations the stage must keep.
After each step the gradients (and the parameters after an SGD step) must equal
single-process training on the whole batch, and the order of forwards and backwards on each
stage must be the schedule's.

The schedules, for P stages, m micro-batches, stage r (0 = first):
- "gpipe": the m forwards, then the m backwards;
- "1f1b": w = min(P - r - 1, m) forwards (warm-up), then m - w times one forward and one
  backward, then the last w backwards; so at most min(m, P - r) micro-batches are in flight.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course_lib import compare, data
from course_lib.comm import POINT_TO_POINT, CommCounter
from course_lib.costs import bubble_formula
from course_lib.grading._harness import CheckFailed, Verdict, fail, run_on_ranks
from course_lib.grading.provenance import Provenance
from course_lib.grading.training import make_optimizer
from course_lib.models import MLP, GPTConfig, TinyGPT, lm_loss
from course_lib.runtime import rank, world_size

DTYPE = torch.float64
RTOL, ATOL = 1e-10, 1e-10  # float64; micro-batch sums differ from the whole batch by ~1e-16
SCHEDULES = ("gpipe", "1f1b")
# The lecture's pipeline module answers parts 5-7 as it stands (its trainer, simulator and
# partition), and this module's schedule order and brute force would help: an answer that
# runs any of them, or a copy, is not the student's own.
FORBIDDEN = (
    "course_lib.pipeline",
    "course_lib.measure.pipeline",
    "course_lib.grading.pipeline.schedule_order",
    "course_lib.grading.pipeline.in_flight_bound",
    "course_lib.grading.pipeline.brute_force_partition",
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


# --- the schedules ------------------------------------------------------------------------


def schedule_order(schedule: str, P: int, m: int, r: int) -> list[str]:
    """The order of forwards ("F") and backwards ("B") on stage r."""
    if schedule == "gpipe":
        return ["F"] * m + ["B"] * m
    if schedule == "1f1b":
        warmup = min(P - r - 1, m)
        return ["F"] * warmup + ["F", "B"] * (m - warmup) + ["B"] * warmup
    raise ValueError(f"unknown schedule {schedule!r}: use 'gpipe' or '1f1b'")


def in_flight_bound(schedule: str, P: int, m: int, r: int) -> int:
    """Most micro-batches stage r keeps activations for: m (GPipe), min(m, P - r) (1F1B)."""
    return m if schedule == "gpipe" else min(m, P - r)


# --- sending tensors of any shape between stages ----------------------------------------

_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32]
_HEADER = 8  # dtype code, number of dimensions, up to 6 sizes


class PendingSend:
    """The sends of one tensor, under way; `wait()` returns when they are done."""

    def __init__(self, works: list, tensors: list[torch.Tensor]) -> None:
        self.works, self._tensors = works, tensors  # the tensors must live until then

    def wait(self) -> None:
        for work in self.works:
            work.wait()


def send_tensor(tensor: torch.Tensor, dst: int) -> PendingSend:
    """Start sending `tensor` (any shape and dtype) to rank dst: a small header with its
    dtype and shape, then the data. Returns at once, so two neighbours that send to each
    other cannot deadlock; call `.wait()` on the result before the step ends."""
    if tensor.dim() > _HEADER - 2:
        raise ValueError(f"send_tensor sends up to {_HEADER - 2} dimensions, got {tensor.dim()}")
    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[0], header[1] = _DTYPES.index(tensor.dtype), tensor.dim()
    header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    payload = tensor.detach().contiguous()
    works = [dist.isend(header, dst), dist.isend(payload, dst)]
    return PendingSend(works, [header, payload])


def recv_tensor(src: int) -> torch.Tensor:
    """Receive a tensor sent by `send_tensor` from rank src (waits until it arrives)."""
    header = torch.empty(_HEADER, dtype=torch.int64)
    dist.recv(header, src)
    shape = header[2 : 2 + int(header[1])].tolist()
    tensor = torch.empty(shape, dtype=_DTYPES[int(header[0])])
    dist.recv(tensor, src)
    return tensor


# --- measuring a stage --------------------------------------------------------------------


class _Track(torch.autograd.Function):
    @staticmethod
    def forward(ctx, output, probe):
        ctx.probe = probe
        probe.live += 1
        probe.peak = max(probe.peak, probe.live)
        probe.events.append("F")
        return output.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.probe.live -= 1
        ctx.probe.events.append("B")
        return grad, None


class InFlightProbe(nn.Module):
    """A stage that counts its micro-batches in flight (forward done, backward not yet).

    `events` lists "F" and "B" in the order they ran; `peak` is the most in flight at once."""

    def __init__(self, stage: nn.Module) -> None:
        super().__init__()
        self.stage = stage
        self.reset()

    def reset(self) -> None:
        self.live, self.peak, self.events = 0, 0, []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Track.apply(self.stage(x), self)


# --- models, data and the reference -------------------------------------------------------


@dataclass(frozen=True)
class PipelineRun:
    """One pipelined training run: model, seed, micro-batches, batch size and steps."""

    model: str = "mlp"  # "mlp" or "gpt"
    seed: int = 0
    n_micro: int = 4
    batch_size: int = 16
    steps: int = 2

    def describe(self, P: int) -> str:
        return (
            f"{self.model} model, seed {self.seed}, batch of {self.batch_size} in "
            f"{self.n_micro} micro-batches, {P} stage{'s' if P > 1 else ''}"
        )


MLP_SIZES = (8, 16, 16, 16, 16, 4)  # 9 layers (5 linear): every stage of 1-4 has weights


def build_model(run: PipelineRun) -> nn.Module:
    if run.model == "mlp":
        return MLP(MLP_SIZES, seed=run.seed, dtype=DTYPE)
    if run.model == "gpt":
        return TinyGPT(GPTConfig(n_layers=2), seed=run.seed, dtype=DTYPE)
    raise ValueError(f"unknown model {run.model!r}: use 'mlp' or 'gpt'")


def stages(model: nn.Module, P: int) -> list[nn.Module]:
    """The model's layers cut into P contiguous stages of near-equal layer counts."""
    if isinstance(model, TinyGPT):
        return model.pipeline_stages(P)
    layers = list(model.layers)
    bounds = [round(i * len(layers) / P) for i in range(P + 1)]
    return [nn.Sequential(*layers[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def loss_function(run: PipelineRun) -> Callable:
    return lm_loss if run.model == "gpt" else F.mse_loss


def global_batches(run: PipelineRun) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if run.model == "gpt":
        x, y = data.tokens(4 * run.batch_size, seed=run.seed + 1)
    else:
        x, y = data.regression(4 * run.batch_size, in_dim=8, seed=run.seed + 1, dtype=DTYPE)
    return data.batches(x, y, run.batch_size, run.steps, seed=run.seed)


def _reference(run: PipelineRun) -> list[dict]:
    """Single-process training on whole batches: loss, gradients, parameters after SGD."""
    model = build_model(run)
    optimizer = make_optimizer("sgd", model.parameters())
    out = []
    for x, y in global_batches(run):
        optimizer.zero_grad()
        loss = loss_function(run)(model(x), y)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        out.append({"loss": loss.item(), "grads": grads, "params": params})
    return out


# --- what runs on each rank ---------------------------------------------------------------


def _pipeline_on_rank(pipeline_step: Callable, schedule: str, runs: list[PipelineRun]) -> dict:
    seen = Provenance(FORBIDDEN)  # watches the student's calls only, not the check's code
    results = [_pipeline_run(pipeline_step, schedule, run, seen) for run in runs]
    return {"result": results, "copied": seen.complaint()}


def _pipeline_run(
    pipeline_step: Callable, schedule: str, run: PipelineRun, seen: Provenance
) -> list[dict]:
    model = build_model(run)
    names = {id(p): n for n, p in model.named_parameters()}
    stage = stages(model, world_size())[rank()]
    probe = InFlightProbe(stage)
    optimizer = make_optimizer("sgd", stage.parameters())
    steps = []
    for x, y in global_batches(run):
        optimizer.zero_grad()
        probe.reset()
        with CommCounter() as counter, seen:
            loss = pipeline_step(probe, x, y, loss_function(run), run.n_micro, schedule)
        grads = {names[id(p)]: _copy(p.grad) for p in stage.parameters()}
        optimizer.step()
        steps.append(
            {
                "loss": float(loss) if isinstance(loss, torch.Tensor | float | int) else repr(loss),
                "grads": grads,
                "params": {names[id(p)]: p.detach().clone() for p in stage.parameters()},
                "events": list(probe.events),
                "peak": probe.peak,
                "calls": dict(counter.calls),
            }
        )
    return steps


def _copy(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().clone()


# --- comparing ----------------------------------------------------------------------------


def _grad_hint(got: torch.Tensor, want: torch.Tensor, m: int) -> str:
    scale = max(1e-12, want.abs().max().item())
    if m > 1 and torch.allclose(got, m * want, rtol=1e-6, atol=1e-9 * scale):
        return (
            f"it is n_micro = {m} times the full-batch gradient: divide each micro-batch's "
            "loss by n_micro before its backward, so that the sum over micro-batches is the "
            "mean over the whole batch"
        )
    if m > 1 and torch.allclose(got, want / m, rtol=1e-6, atol=1e-9 * scale):
        return f"it is 1/{m} of the full-batch gradient: is the loss divided by n_micro twice?"
    return (
        "every micro-batch's backward must add into .grad (do not zero gradients between "
        "micro-batches), with the gradient of each activation sent back to the stage that "
        "produced it"
    )


def _compare_step(
    check: str, schedule: str, run: PipelineRun, s: int, ref: dict, results: list[list]
) -> None:
    __tracebackhide__ = True
    P, m = len(results), run.n_micro
    where = run.describe(P)
    for r, per_rank in enumerate(results):
        step = per_rank[s]
        at = f"stage {r}, step {s} ({where}, {schedule})"
        calls = set(step["calls"]) - set(POINT_TO_POINT)
        if calls:
            fail(
                check,
                f"{at}: used {sorted(calls)}; a pipeline only passes activations and "
                "gradients between neighbouring stages with send/recv (or isend/irecv)",
            )
        forwards, backwards = step["events"].count("F"), step["events"].count("B")
        if (forwards, backwards) != (m, m):
            fail(
                check,
                f"{at}: the stage ran {forwards} forwards and {backwards} backwards; expected "
                f"one of each per micro-batch ({m}). Call the stage once per micro-batch, and "
                "run backward through each output exactly once",
            )
        bound = in_flight_bound(schedule, P, m, r)
        if step["peak"] > bound:
            fail(
                check,
                f"{at}: the stage held the activations of {step['peak']} micro-batches at "
                f"once (forward done, backward not yet); 1F1B keeps at most min(m, P - r) = "
                f"{bound}: after {min(P - r - 1, m)} warm-up forwards, run each next forward "
                "right before a backward",
            )
        expected = schedule_order(schedule, P, m, r)
        if step["events"] != expected:
            fail(
                check,
                f"{at}: the stage ran {' '.join(step['events'])}; the {schedule} schedule "
                f"runs {' '.join(expected)} on stage {r} of {P}",
            )
        for name, got in step["grads"].items():
            want = ref["grads"][name]
            if got is None:
                fail(check, f"{at}: {name!r} got no gradient: did backward reach this stage?")
            problem = compare.find_mismatch({name: got}, {name: want}, rtol=RTOL, atol=ATOL)
            if problem:
                fail(
                    check,
                    f"{at}: the gradient differs from single-process training on the whole "
                    f"batch: {problem}.\nHint: {_grad_hint(got, want, m)}",
                )
        problem = compare.find_mismatch(
            step["params"], {n: ref["params"][n] for n in step["params"]}, rtol=RTOL, atol=ATOL
        )
        if problem:
            fail(check, f"{at}: after an SGD step, {problem}; do you change the weights?")
    loss = results[-1][s]["loss"]
    if not isinstance(loss, float) or not math.isclose(loss, ref["loss"], rel_tol=1e-9):
        fail(
            check,
            f"step {s} ({where}, {schedule}): the last stage returned the loss {loss!r}, "
            f"expected the full-batch loss {ref['loss']:.10g} (the sum of the micro-batch "
            "losses, each divided by n_micro)",
        )


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
    accumulated in each stage's .grad; the last stage returns the full-batch loss.
    Checked against single-process training, and for the order and memory of the schedule."""
    __tracebackhide__ = True
    check = "check_pipeline_trainer"
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}: use 'gpipe' or '1f1b'")
    runs = []
    for model in models:
        batch = 8 if model == "gpt" else 16
        for m in n_micro:
            if batch % m:
                raise ValueError(f"n_micro={m} does not divide the batch of {batch}")
            runs.append(PipelineRun(model, seed=seed, n_micro=m, batch_size=batch, steps=steps))
    for P in world_sizes:
        if not 1 <= P <= 4:
            raise ValueError(f"world sizes must be 1..4 (the models have 4 stages at most): {P}")
    verdict = Verdict(check)
    for P in world_sizes:
        results = run_on_ranks(
            check,
            _pipeline_on_rank,
            pipeline_step,
            schedule,
            runs,
            world_size=P,
            timeout=timeout,
            what=f"your pipeline_step ({schedule}, {P} stages)",
        )
        results = [_unwatched(check, found) for found in results]
        for i, run in enumerate(runs):
            with verdict.case():  # a run's first failing step
                for s, ref in enumerate(_reference(run)):
                    per_rank = [found[i] for found in results]
                    _compare_step(check, schedule, run, s, ref, per_rank)
    verdict.conclude(
        f"{len(runs) * len(world_sizes)} run(s) of {steps} steps ({', '.join(models)}; "
        f"{', '.join(str(m) for m in n_micro)} micro-batches; "
        f"{', '.join(str(P) for P in world_sizes)} stages), {schedule}: every stage's "
        f"gradients and the loss equal single-process training (rtol {RTOL:g}, atol "
        f"{ATOL:g}), with the schedule's order of forwards and backwards and at most its "
        "micro-batches in flight"
    )


# --- simulated schedules ------------------------------------------------------------------


def _simulate_cases(simulate_schedule: Callable, cases: list[tuple]) -> dict:
    return _watched(
        lambda: [
            simulate_schedule(P, m, schedule, t_forward=f, t_backward=b)
            for P, m, schedule, f, b in cases
        ]
    )


def _check_timeline(check: str, case: tuple, result: object) -> None:
    """The timeline runs every op once, for its duration, one at a time per stage, after
    what it depends on, in the schedule's order; makespan and bubble agree with it."""
    __tracebackhide__ = True
    P, m, schedule, tf, tb = case
    at = f"simulate_schedule({P}, {m}, {schedule!r}, t_forward={tf:g}, t_backward={tb:g})"
    if not isinstance(result, dict) or not {"timeline", "makespan", "bubble_fraction"} <= set(
        result
    ):
        fail(
            check,
            f"{at} returned {result!r:.200}; expected a dict with keys 'timeline', "
            "'makespan' and 'bubble_fraction'",
        )
    timeline = result["timeline"]
    if not isinstance(timeline, list | tuple) or len(timeline) != P:
        fail(check, f"{at}: 'timeline' must be a list of {P} lists, one per stage")
    end: dict[tuple[str, int, int], float] = {}
    start: dict[tuple[str, int, int], float] = {}
    for s, ops in enumerate(timeline):
        try:
            ops = sorted((float(a), float(b), str(k), int(i)) for k, i, a, b in ops)
        except (TypeError, ValueError):
            fail(check, f"{at}: stage {s}'s entries must be (kind, micro_batch, start, end)")
        keys = sorted((k, i) for _, _, k, i in ops)
        expected = sorted((k, i) for k in "FB" for i in range(m))
        if keys != expected:
            fail(
                check,
                f"{at}: stage {s} runs {keys}; expected F and B of each micro-batch "
                f"0..{m - 1} exactly once",
            )
        previous_end = 0.0
        for a, b, k, i in ops:
            duration = tf if k == "F" else tb
            if not math.isclose(b - a, duration, rel_tol=1e-9, abs_tol=1e-9):
                fail(check, f"{at}: stage {s}'s {k}{i} lasts {b - a:g}, expected {duration:g}")
            if a < previous_end - 1e-9:
                fail(
                    check,
                    f"{at}: stage {s} starts {k}{i} at {a:g}, before its previous "
                    f"operation ends at {previous_end:g}: a stage runs one at a time",
                )
            previous_end = b
            start[k, i, s], end[k, i, s] = a, b
        order = [k for _, _, k, _ in ops]
        live, peak = 0, 0
        for k in order:
            live += 1 if k == "F" else -1
            peak = max(peak, live)
        bound = in_flight_bound(schedule, P, m, s)
        if schedule == "gpipe" and order != schedule_order("gpipe", P, m, s):
            fail(
                check,
                f"{at}: stage {s} runs {' '.join(order)}; GPipe runs every forward "
                "before any backward",
            )
        if peak > bound:
            fail(
                check,
                f"{at}: stage {s} has {peak} micro-batches in flight at once; "
                f"1F1B keeps at most min(m, P - s) = {bound}",
            )
    for (k, i, s), a in start.items():
        after = [("F", i, s - 1)] if k == "F" and s > 0 else []
        if k == "B":
            after = [("B", i, s + 1)] if s < P - 1 else [("F", i, s)]
        for dep in after:
            if a < end[dep] - 1e-9:
                fail(
                    check,
                    f"{at}: stage {s} starts {k}{i} at {a:g}, but it needs "
                    f"{dep[0]}{i} of stage {dep[2]}, which ends at {end[dep]:g}",
                )
    makespan = max(end.values())
    busy = m * (tf + tb)
    bubble = 1 - busy / makespan
    for key, want in (("makespan", makespan), ("bubble_fraction", bubble)):
        got = result[key]
        if not isinstance(got, float | int) or not math.isclose(
            got, want, rel_tol=1e-9, abs_tol=1e-12
        ):
            fail(
                check,
                f"{at}: {key} is {got!r}, but the timeline gives {want:.10g}"
                + (" (the idle share of P x makespan)" if key == "bubble_fraction" else ""),
            )
    formula = bubble_formula(P, m)
    if not math.isclose(bubble, formula, rel_tol=1e-9, abs_tol=1e-12):
        fail(
            check,
            f"{at}: the bubble is {bubble:.6g}, but with equal stages it is "
            f"(P-1)/(m+P-1) = {formula:.6g}; does every operation start as soon as the "
            "stage is free and what it needs is done?",
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
            _check_timeline(check, case, result)
    verdict.conclude(
        f"{len(all_cases)} case(s) (P, m, both schedules, two sets of times): every "
        "timeline runs each op once, for its duration, one at a time per stage, after what "
        "it depends on and in the schedule's order, and its makespan and bubble fraction "
        "agree with it and with (P-1)/(m+P-1)"
    )


# --- the optimal partition ----------------------------------------------------------------


@dataclass(frozen=True)
class PartitionProblem:
    layer_times: tuple[float, ...]
    activation_sizes: tuple[float, ...]
    n_machines: int
    weight_sizes: tuple[float, ...] | None = None
    bandwidth: float = 1.0
    label: str = ""  # how to name a problem too long to print

    def args(self) -> tuple:
        return (list(self.layer_times), list(self.activation_sizes), self.n_machines)

    def kwargs(self) -> dict:
        return {
            "bandwidth": self.bandwidth,
            "weight_sizes": None if self.weight_sizes is None else list(self.weight_sizes),
        }

    def describe(self) -> str:
        if self.label:
            return self.label
        return (
            f"optimal_partition({list(self.layer_times)}, {list(self.activation_sizes)}, "
            f"{self.n_machines}, bandwidth={self.bandwidth:g}, "
            f"weight_sizes={self.kwargs()['weight_sizes']})"
        )


def stage_time(problem: PartitionProblem, start: int, stop: int, machines: int) -> float:
    """T(start -> stop, m'): (1/m') max(sum of layer times, sum of weight-sync times), where
    replicas (m' > 1) all-reduce layer l's weights in about 2 w_l / bandwidth."""
    compute = sum(problem.layer_times[start:stop])
    weights = problem.weight_sizes or [0.0] * len(problem.layer_times)
    sync = sum(2 * w / problem.bandwidth for w in weights[start:stop]) if machines > 1 else 0.0
    return max(compute, sync) / machines


def partition_time(problem: PartitionProblem, partition: list[tuple[int, int, int]]) -> float:
    """The slowest stage or boundary: max of the stage times and of 2 a_l / bandwidth for
    each layer l that ends a stage (its activation goes forward, its gradient back)."""
    times = [stage_time(problem, a, b, k) for a, b, k in partition]
    times += [2 * problem.activation_sizes[b - 1] / problem.bandwidth for _, b, _ in partition[:-1]]
    return max(times)


def brute_force_partition(problem: PartitionProblem) -> float:
    """The best slowest-stage time over every contiguous split and machine assignment."""
    n, machines = len(problem.layer_times), problem.n_machines
    best = math.inf
    for k in range(1, min(n, machines) + 1):
        for cuts in itertools.combinations(range(1, n), k - 1):
            bounds = (0, *cuts, n)
            for split in itertools.combinations(range(1, machines), k - 1):
                counts = [b - a for a, b in zip((0, *split), (*split, machines), strict=True)]
                partition = [(bounds[i], bounds[i + 1], counts[i]) for i in range(k)]
                best = min(best, partition_time(problem, partition))
    return best


def partition_problems(seeds: tuple[int, ...]) -> list[PartitionProblem]:
    """Hand-made problems where greedy splits go wrong, and random ones per seed."""
    problems = [
        PartitionProblem((1.0,), (1.0,), 1),
        PartitionProblem((4.0, 1.0, 1.0, 1.0, 1.0), (0.1,) * 5, 2),  # split after layer 0
        # the balanced cut sends a large activation; replicas pay for weight sync
        PartitionProblem((1.0, 1.0, 1.0, 1.0), (0.2, 5.0, 0.2, 1.0), 2, (1.0,) * 4),
        PartitionProblem((6.0, 1.0, 1.0), (0.1, 0.1, 0.1), 3),  # 2 machines on the slow layer
        PartitionProblem((2.0, 2.0, 2.0), (0.1, 0.1, 0.1), 4, (4.0, 0.0, 0.0)),  # sync costs
        PartitionProblem((1.0, 6.0), (0.1, 0.1), 3, (10.0, 0.0)),  # 2 machines on the last
    ]
    for seed in seeds:
        rng = random.Random(seed)
        for _ in range(4):
            n, machines = rng.randint(1, 6), rng.randint(1, 4)
            times = tuple(round(rng.uniform(0.5, 4.0), 2) for _ in range(n))
            sizes = tuple(round(rng.uniform(0.1, 3.0), 2) for _ in range(n))
            weights = rng.choice([None, tuple(round(rng.uniform(0, 2), 2) for _ in range(n))])
            bandwidth = rng.choice([1.0, 2.0, 0.5])
            problems.append(PartitionProblem(times, sizes, machines, weights, bandwidth))
    return problems


def large_partition_problems(seeds: tuple[int, ...]) -> list[PartitionProblem]:
    """64 layers on 8 machines: the dynamic program takes well under a second, trying every
    cut and split of the machines (about 10^9 of them) would take days."""
    problems = []
    for seed in seeds:
        rng = random.Random(1000 + seed)
        heavy = seed % 2 == 0  # weights slow to synchronize: a deep pipeline wins
        n = 64
        times = tuple(round(rng.uniform(0.5, 4.0), 2) for _ in range(n))
        sizes = tuple(round(rng.uniform(0.5, 8.0), 2) for _ in range(n))
        weights = tuple(
            round(rng.uniform(0.5, 4.0) if heavy else rng.uniform(0, 0.3), 2) for _ in range(n)
        )
        label = f"optimal_partition on large problem {seed} ({n} layers, 8 machines)"
        problems.append(PartitionProblem(times, sizes, 8, weights, 1.0, label))
    return problems


def _best_time(problem: PartitionProblem) -> float:
    """The optimum of a large problem, from the lecture's dynamic program (which the tests
    compare with `brute_force_partition` on small problems)."""
    from course_lib.pipeline import optimal_partition

    weights = None if problem.weight_sizes is None else list(problem.weight_sizes)
    return optimal_partition(
        list(problem.layer_times),
        list(problem.activation_sizes),
        problem.n_machines,
        problem.bandwidth,
        weights,
    ).time


def _solve_all(optimal_partition: Callable, problems: list[PartitionProblem]) -> dict:
    return _watched(lambda: [optimal_partition(*p.args(), **p.kwargs()) for p in problems])


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
    against brute force; `large` ones (64 layers, 8 machines) against the lecture's dynamic
    program, and all of them together must be solved within `large_timeout` seconds."""
    __tracebackhide__ = True
    check = "check_optimal_partition"
    verdict, solved = Verdict(check), []
    for problems, limit, best in (
        (partition_problems(seeds), timeout, brute_force_partition),
        (large_partition_problems(large), large_timeout, _best_time),
    ):
        if not problems:
            continue
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
        for problem, result in zip(problems, _unwatched(check, found), strict=True):
            with verdict.case():
                _judge_partition(check, problem, result, best(problem))
        solved.append(f"{len(problems)} {'large' if problems[0].label else 'small'}")
    verdict.conclude(
        f"{' and '.join(solved)} problem(s): every returned split covers the layers in order "
        "with all the machines, its time is what it returns, and no split is faster"
        + (f"; the large ones (64 layers, 8 machines) within {large_timeout:g} s" if large else "")
    )


def _judge_partition(check: str, problem: PartitionProblem, result, best: float) -> None:
    __tracebackhide__ = True
    at = problem.describe()
    try:
        value, partition = result
        value = float(value)
        partition = [(int(a), int(b), int(k)) for a, b, k in partition]
    except (TypeError, ValueError):
        fail(check, f"{at} returned {result!r}; expected (time, [(start, stop, machines), ...])")
    n = len(problem.layer_times)
    starts = [a for a, _, _ in partition]
    stops = [b for _, b, _ in partition]
    if (
        not partition
        or starts != [0, *stops[:-1]]
        or stops[-1] != n
        or any(b <= a for a, b in zip(starts, stops, strict=True))
    ):
        fail(
            check,
            f"{at} returned stages {partition}; they must cover layers 0..{n - 1} "
            "in order, each (start, stop) non-empty, stop of one = start of the next",
        )
    if any(k < 1 for _, _, k in partition) or sum(k for _, _, k in partition) != problem.n_machines:
        fail(
            check,
            f"{at} returned stages {partition}; every stage needs at least one "
            f"machine and together they use all {problem.n_machines}",
        )
    achieved = partition_time(problem, partition)
    if not math.isclose(value, achieved, rel_tol=1e-9):
        fail(
            check,
            f"{at} returned time {value:g}, but its stages {partition} give "
            f"{achieved:g} (the slowest of the stage times and 2 a_l / bandwidth at each "
            "boundary)",
        )
    if not math.isclose(achieved, best, rel_tol=1e-9):
        fail(
            check,
            f"{at} returned stages {partition} with time {achieved:g}; the best "
            f"split takes {best:g}. The recurrence A(j, m) must try every last stage "
            "(i+1..j) and every number of machines m' for it",
        )


__all__ = [
    "InFlightProbe",
    "PendingSend",
    "PartitionProblem",
    "PipelineRun",
    "brute_force_partition",
    "check_optimal_partition",
    "check_pipeline_trainer",
    "check_simulate_schedule",
    "in_flight_bound",
    "partition_time",
    "recv_tensor",
    "schedule_order",
    "send_tensor",
    "stage_time",
    "stages",
]
