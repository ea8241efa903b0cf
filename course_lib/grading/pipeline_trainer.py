"""Assignment 8's pipeline trainer, checked: the runs, the single-process reference, what
runs on each stage's rank, and the judging of each step.

A run trains a seeded float64 model (an MLP, or TinyGPT cut by `pipeline_stages`) for a few
steps; each rank runs `pipeline_step` with its stage wrapped in an `InFlightProbe`, and
every step's gradients, parameters, loss, order of forwards and backwards and micro-batches
in flight are held against single-process training on the whole batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from course_lib import compare, data
from course_lib.comm import POINT_TO_POINT, CommCounter
from course_lib.grading._harness import fail
from course_lib.grading.pipeline_plumbing import InFlightProbe, in_flight_bound, schedule_order
from course_lib.grading.provenance import Provenance
from course_lib.grading.training import make_optimizer
from course_lib.models import MLP, GPTConfig, TinyGPT, lm_loss
from course_lib.runtime import rank, world_size

DTYPE = torch.float64
RTOL, ATOL = 1e-10, 1e-10  # float64; micro-batch sums differ from the whole batch by ~1e-16

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


def reference_steps(run: PipelineRun) -> list[dict]:
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


def pipeline_runs(
    models: tuple[str, ...], n_micro: tuple[int, ...], seed: int, steps: int
) -> list[PipelineRun]:
    """One run per model and number of micro-batches (a batch of 8 sequences for "gpt",
    16 rows for "mlp"); ValueError if a number of micro-batches does not divide it."""
    runs = []
    for model in models:
        batch = 8 if model == "gpt" else 16
        for m in n_micro:
            if batch % m:
                raise ValueError(f"n_micro={m} does not divide the batch of {batch}")
            runs.append(PipelineRun(model, seed=seed, n_micro=m, batch_size=batch, steps=steps))
    return runs


# --- what runs on each rank ---------------------------------------------------------------


def run_pipeline(
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


def compare_step(
    check: str, schedule: str, run: PipelineRun, s: int, ref: dict, results: list[list]
) -> None:
    """Step s of a run on every stage (results[r] is rank r's list of steps): the schedule,
    then the numbers, stage by stage; then the loss the last stage returned."""
    __tracebackhide__ = True
    P, m = len(results), run.n_micro
    where = run.describe(P)
    for r, per_rank in enumerate(results):
        step = per_rank[s]
        at = f"stage {r}, step {s} ({where}, {schedule})"
        _judge_schedule(check, at, step, schedule, P, m, r)
        _judge_numbers(check, at, step, ref, m)
    loss = results[-1][s]["loss"]
    if not isinstance(loss, float) or not math.isclose(loss, ref["loss"], rel_tol=1e-9):
        fail(
            check,
            f"step {s} ({where}, {schedule}): the last stage returned the loss {loss!r}, "
            f"expected the full-batch loss {ref['loss']:.10g} (the sum of the micro-batch "
            "losses, each divided by n_micro)",
        )


def _judge_schedule(check: str, at: str, step: dict, schedule: str, P: int, m: int, r: int) -> None:
    """Stage r's communication, its forwards and backwards, how many micro-batches it kept
    in flight and their order: the schedule's."""
    __tracebackhide__ = True
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


def _judge_numbers(check: str, at: str, step: dict, ref: dict, m: int) -> None:
    """A stage's gradients and its parameters after SGD: single-process training's."""
    __tracebackhide__ = True
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
