"""Assignment 8's pipeline trainer, checked: the runs, the single-process reference, what
runs on each stage's rank, and the judging of each step.

A run trains a float64 model (an MLP, or TinyGPT cut by `pipeline_stages`) for a few steps.
Each rank draws its own stage's weights from a secret seed and keeps only that stage (no
rank holds the others' weights, so activations and gradients must travel as messages); it
runs `pipeline_step` with the stage wrapped by `watch`, each parameter's .grad handed over
holding a known value (`handed_grad`: backward must add to it), and sends back, as plain
data, its stage's first weights, and for every step its gradients, its parameters after an
SGD step, what it returned, its calls, its unwaited sends and the stage's log: which forward
(and the input it got) and which backward ran, in order.

In the checking process the judge assembles the model from the ranks' first weights and
trains it on whole batches (`reference_steps`); it tells each forward's micro-batch by its
input, holds every stage's order of ("F", i) and ("B", i) to the schedule's, and every step's
gradients, parameters and loss to the reference.
"""

from __future__ import annotations

import math
import secrets
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from course_lib import compare, data
from course_lib.comm import POINT_TO_POINT, CommCounter
from course_lib.grading._harness import fail
from course_lib.grading.pipeline_plumbing import (
    SendLog,
    in_flight_bound,
    peak_in_flight,
    schedule_order,
    watch,
)
from course_lib.grading.provenance import Provenance
from course_lib.grading.training import make_optimizer
from course_lib.models import MLP, GPTConfig, TinyGPT, lm_loss
from course_lib.runtime import rank, world_size

DTYPE = torch.float64
RTOL, ATOL = 1e-10, 1e-10  # float64; micro-batch sums differ from the whole batch by ~1e-16
# A stage's input is the micro-batch's activation within float64 rounding (~1e-15): far
# closer than to any other micro-batch's.
SAME_INPUT = {"rtol": 1e-8, "atol": 1e-10}

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


def build_model(run: PipelineRun, seed: int | None = None) -> nn.Module:
    """The run's model, its weights drawn from `seed` (the run's seed if None)."""
    seed = run.seed if seed is None else seed
    if run.model == "mlp":
        return MLP(MLP_SIZES, seed=seed, dtype=DTYPE)
    if run.model == "gpt":
        return TinyGPT(GPTConfig(n_layers=2), seed=seed, dtype=DTYPE)
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


def handed_grad(run: PipelineRun, step: int, name: str, shape: torch.Size) -> torch.Tensor:
    """What parameter `name`'s .grad holds when pipeline_step starts at `step`: backward
    adds to it, so a step that zeroes or replaces .grad shows."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{run.seed}/{step}/{name}".encode()))
    return 0.1 * torch.randn(shape, generator=g, dtype=DTYPE)


def reference_steps(run: PipelineRun, P: int, first: dict[str, torch.Tensor]) -> list[dict]:
    """Single-process training on whole batches of the model whose weights start as `first`:
    per step the loss, the gradients, the .grad handed over, the parameters after SGD (on the
    two added) and each stage's input, cut into micro-batches."""
    model = build_model(run)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(first[name])
    cut = stages(model, P)
    optimizer = make_optimizer("sgd", model.parameters())
    out = []
    for step, (x, y) in enumerate(global_batches(run)):
        inputs, h = [], x
        with torch.no_grad():
            for stage in cut:
                inputs.append(h.tensor_split(run.n_micro))
                h = stage(h)
        optimizer.zero_grad()
        loss = loss_function(run)(model(x), y)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        handed = {n: handed_grad(run, step, n, p.shape) for n, p in model.named_parameters()}
        for n, p in model.named_parameters():
            p.grad += handed[n]
        optimizer.step()
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        out.append(
            {
                "loss": loss.item(),
                "grads": grads,
                "handed": handed,
                "params": params,
                "inputs": inputs,
            }
        )
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
) -> dict:
    """This rank's part of a run: its stage's first weights and, step by step, what its
    stage did, as plain data."""
    stage, names = _own_stage(run)
    first = {names[id(p)]: p.detach().clone() for p in stage.parameters()}
    watched, events, inputs = watch(stage)
    optimizer = make_optimizer("sgd", stage.parameters())
    steps = []
    for step, (x, y) in enumerate(global_batches(run)):
        for p in stage.parameters():
            p.grad = handed_grad(run, step, names[id(p)], p.shape)
        with CommCounter() as counter, SendLog() as sends, seen:
            returned = pipeline_step(watched, x, y, loss_function(run), run.n_micro, schedule)
        grads = {names[id(p)]: _copy(p.grad) for p in stage.parameters()}
        optimizer.step()
        steps.append(
            {
                "returned": "float" if isinstance(returned, float) else type(returned).__name__,
                "loss": float(returned) if isinstance(returned, float) else None,
                "grads": grads,
                "params": {names[id(p)]: p.detach().clone() for p in stage.parameters()},
                "events": list(events),
                "inputs": list(inputs),
                "calls": dict(counter.calls),
                "unwaited": sends.unwaited(),
            }
        )
        events.clear()
        inputs.clear()
    return {"first": first, "steps": steps}


def _own_stage(run: PipelineRun) -> tuple[nn.Module, dict[int, str]]:
    """This rank's stage of a model drawn from a secret seed, and its parameters' names in
    the model; the other stages are dropped (and were drawn from another seed than the
    ranks that run them)."""
    model = build_model(run, seed=secrets.randbits(62))
    stage = stages(model, world_size())[rank()]
    mine = {id(p) for p in stage.parameters()}
    return stage, {id(p): n for n, p in model.named_parameters() if id(p) in mine}


def _copy(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().clone()


# --- judging, in the checking process -------------------------------------------------------


def judge_run(check: str, schedule: str, run: PipelineRun, per_rank: list[dict]) -> None:
    """Every step of a run, stage by stage, against single-process training of the model
    the ranks' first weights make together; stops at the first failing step."""
    __tracebackhide__ = True
    first = {name: t for found in per_rank for name, t in found["first"].items()}
    P = len(per_rank)
    for s, ref in enumerate(reference_steps(run, P, first)):
        compare_step(check, schedule, run, s, ref, [found["steps"] for found in per_rank])


def compare_step(
    check: str, schedule: str, run: PipelineRun, s: int, ref: dict, results: list[list]
) -> None:
    """Step s of a run on every stage (results[r] is rank r's list of steps): the calls,
    the schedule and what it returned, stage by stage; then the numbers, stage by stage;
    then the loss the last stage returned."""
    __tracebackhide__ = True
    P, m = len(results), run.n_micro
    where = run.describe(P)
    at = [f"stage {r}, step {s} ({where}, {schedule})" for r in range(P)]
    for r, per_rank in enumerate(results):  # what each stage did, then what it computed
        step = per_rank[s]
        _judge_calls(check, at[r], step)
        order = _micro_batches(check, at[r], step, ref["inputs"][r], r, m)
        _judge_schedule(check, at[r], order, schedule, P, m, r)
        _judge_returned(check, at[r], step["returned"], last=r == P - 1)
    for r, per_rank in enumerate(results):
        _judge_numbers(check, at[r], per_rank[s], ref, m)
    loss = results[-1][s]["loss"]
    if not math.isclose(loss, ref["loss"], rel_tol=1e-9):
        fail(
            check,
            f"step {s} ({where}, {schedule}): the last stage returned the loss {loss!r}, "
            f"expected the full-batch loss {ref['loss']:.10g} (the sum of the micro-batch "
            "losses, each divided by n_micro)",
        )


def _judge_calls(check: str, at: str, step: dict) -> None:
    """Point-to-point messages only, and every send of send_tensor waited for."""
    __tracebackhide__ = True
    calls = set(step["calls"]) - set(POINT_TO_POINT)
    if calls:
        fail(
            check,
            f"{at}: used {sorted(calls)}; a pipeline only passes activations and "
            "gradients between neighbouring stages with send/recv (or isend/irecv)",
        )
    if step["unwaited"]:
        fail(
            check,
            f"{at}: {step['unwaited']} send(s) that send_tensor started were never "
            ".wait()-ed before pipeline_step returned; call .wait() on every send it returns "
            "(until then the message may still be under way)",
        )


def _micro_batches(
    check: str, at: str, step: dict, micro: tuple, r: int, m: int
) -> list[tuple[str, int]]:
    """The stage's log as ("F", i) and ("B", i), i the micro-batch whose input its forward
    got (the rows of the batch on stage 0, their activation from the stage before after)."""
    __tracebackhide__ = True
    kinds = [kind for kind, _ in step["events"]]
    forwards, backwards = kinds.count("F"), kinds.count("B")
    if (forwards, backwards) != (m, m):
        fail(
            check,
            f"{at}: the stage ran {forwards} forwards and {backwards} backwards; expected "
            f"one of each per micro-batch ({m}). Call the stage once per micro-batch, and "
            "run backward through each output exactly once",
        )
    which = []
    for k, x in enumerate(step["inputs"]):
        same = [i for i, want in enumerate(micro) if _same(x, want)]
        if not same:
            what = "rows of the batch" if r == 0 else f"activation from stage {r - 1}"
            fail(
                check,
                f"{at}: forward number {k + 1} of the stage got an input that is no "
                f"micro-batch's {what}; hand the stage one micro-batch at a time "
                "(inputs.tensor_split(n_micro)[i] on stage 0, what the stage before sent "
                "on the others)",
            )
        which.append(same[0])
    return [(kind, which[k]) for kind, k in step["events"]]


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.shape == want.shape and torch.allclose(got.to(DTYPE), want.to(DTYPE), **SAME_INPUT)


def _said(order: list[tuple[str, int]]) -> str:
    return " ".join(f"{kind}{i}" for kind, i in order)


def _judge_schedule(
    check: str, at: str, order: list[tuple[str, int]], schedule: str, P: int, m: int, r: int
) -> None:
    """Stage r's forwards and backwards, micro-batch by micro-batch, in the schedule's order
    (and so no more micro-batches in flight than it keeps)."""
    __tracebackhide__ = True
    peak, bound = peak_in_flight(kind for kind, _ in order), in_flight_bound(schedule, P, m, r)
    if peak > bound:
        fail(
            check,
            f"{at}: the stage held the activations of {peak} micro-batches at "
            f"once (forward done, backward not yet); 1F1B keeps at most min(m, P - r) = "
            f"{bound}: after {min(P - r - 1, m)} warm-up forwards, run each next forward "
            "right before a backward",
        )
    expected = schedule_order(schedule, P, m, r)
    if order != expected:
        fail(
            check,
            f"{at}: the stage ran {_said(order)}; the {schedule} schedule runs "
            f"{_said(expected)} on stage {r} of {P} (Fi, Bi: the forward, the backward of "
            "micro-batch i; each in micro-batch order)",
        )


def _judge_returned(check: str, at: str, returned: str, last: bool) -> None:
    """The whole-batch loss as a float from the last stage, None from the others."""
    __tracebackhide__ = True
    said = "None" if returned == "NoneType" else f"a {returned}"
    if last and returned != "float":
        fail(
            check,
            f"{at}: the last stage returned {said}; return the whole-batch loss as a float "
            "(a tensor's .item() is one)",
        )
    if not last and returned != "NoneType":
        fail(
            check,
            f"{at}: the stage returned {said}; only the last stage returns the loss, the "
            "others return None",
        )


def _grad_hint(got: torch.Tensor, want: torch.Tensor, handed: torch.Tensor, m: int) -> str:
    """Why a gradient differs, when the mistake is a common one: `want` is the full-batch
    gradient, `handed` what .grad held before the step."""
    scale = max(1e-12, want.abs().max().item())

    def close(a: torch.Tensor, b: torch.Tensor) -> bool:
        return torch.allclose(a, b, rtol=1e-6, atol=1e-9 * scale)

    added = got - handed
    if close(got, want):
        return (
            "it is the full-batch gradient alone: what .grad held when pipeline_step "
            "started is gone. Let backward add into .grad; do not zero it (zero_grad()) or "
            "assign it"
        )
    if m > 1 and close(added, m * want):
        return (
            f"it is n_micro = {m} times the full-batch gradient: divide each micro-batch's "
            "loss by n_micro before its backward, so that the sum over micro-batches is the "
            "mean over the whole batch"
        )
    if m > 1 and close(added, want / m):
        return f"it is 1/{m} of the full-batch gradient: is the loss divided by n_micro twice?"
    return (
        "every micro-batch's backward must add into .grad (do not zero gradients between "
        "micro-batches), with the gradient of each activation sent back to the stage that "
        "produced it"
    )


def _judge_numbers(check: str, at: str, step: dict, ref: dict, m: int) -> None:
    """A stage's .grad (what it held before the step plus the full-batch gradient) and its
    parameters after SGD: single-process training's."""
    __tracebackhide__ = True
    for name, got in step["grads"].items():
        want, handed = ref["grads"][name], ref["handed"][name]
        if got is None:
            fail(
                check,
                f"{at}: {name!r} has no .grad after the step. The check hands .grad over "
                "holding a value and backward adds to it: do not set it to None "
                "(zero_grad()), and let backward reach this stage",
            )
        problem = compare.find_mismatch({name: got}, {name: handed + want}, rtol=RTOL, atol=ATOL)
        if problem:
            fail(
                check,
                f"{at}: .grad is not what it held before the step plus the gradient of "
                f"single-process training on the whole batch: {problem}.\n"
                f"Hint: {_grad_hint(got, want, handed, m)}",
            )
    problem = compare.find_mismatch(
        step["params"], {n: ref["params"][n] for n in step["params"]}, rtol=RTOL, atol=ATOL
    )
    if problem:
        fail(check, f"{at}: after an SGD step, {problem}; do you change the weights?")
