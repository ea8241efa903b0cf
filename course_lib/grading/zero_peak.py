"""Part of Assignment 7's checks (grading/zero.py): memory at its peak, ZeRO-2's backward and
ZeRO-3's forward and backward.

`check_zero2` and `check_zero3` look at what a rank holds at moments of rest. This part
measures memory while the work runs, which decides whether a model fits: a ZeRO-2 that keeps
every full gradient until the end of backward, or a ZeRO-3 that keeps full parameters alive
from forward to backward (autograd saves a Linear's weight), peaks as high as plain data
parallelism.

The ranks meter their own work (`zero_meter`: the bytes of the tensor storages it creates or
writes into, per storage) and return the numbers; what the unsharded model needs for the
same work is measured here, in the checking process, on the plain model and the same rank's
share of the same batch:
- ZeRO-2, each backward, each time autograd has finished a parameter's gradient: the bytes
  alive beyond what the plain backward holds at the same moment, when it drops every full
  gradient as soon as it is ready (`_plain_backward_samples`), may be at most this rank's
  gradient shards, one parameter's full size and 1,024 bytes (`zero_judge`'s bound on what
  backward leaves alive). Sampled at these moments, the bytes of activations' gradients,
  which backward makes whatever the sharding, cancel out; a peak over the whole backward
  would let full gradients hide where activations' gradients were.
- ZeRO-3, forward and backward: the plain step's peak minus the full gradients it creates
  (`_plain_step_need`); the rank's may exceed it by at most its gradient shards plus
  `LAYERS_ALLOWED` times the largest layer's full parameters (a layer's gathered
  parameters, its full gradient before the reduce-scatter, and one more layer fetched early).

Memory outside torch (a copy kept as a numpy array) is not seen: Python's tracemalloc would
see it, but tracing allocations under autograd crashed one rank in eight here (SIGSEGV), so
the notebook forbids such copies in words only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from course_lib import data
from course_lib.grading._harness import fail, measured
from course_lib.grading.training import make_optimizer
from course_lib.grading.zero_memory import largest_parameter_bytes, shard_bytes
from course_lib.grading.zero_meter import GradientMeter, _Meter
from course_lib.grading.zero_ranks import (
    ZeroRun,
    _weighted_loss,
    build_model,
    global_batches,
)
from course_lib.models import lm_loss

LAYERS_ALLOWED = 3


def _share(run: ZeroRun, s: int, r: int, ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank r's share of step s's global batch, as the ranks cut it."""
    x, y = global_batches(run)[s]
    return data.shard(x, r, ranks), data.shard(y, r, ranks)


def _switched_off(measured: dict, plain_ops: int) -> str | None:
    """Where the meter found itself off the dispatch stack, or that it saw fewer operations
    than the plain model's same work (a sharded step runs at least those); None if neither."""
    if measured["missing"]:
        return ", ".join(measured["missing"][:3])
    if measured["ops"] < plain_ops:
        return f"{measured['ops']} operations seen, fewer than the plain model's {plain_ops}"
    return None


# --- ZeRO-2: each backward, each time a gradient is ready -------------------------------


def _drop_grad(param: torch.Tensor) -> None:
    param.grad = None


def _plain_backward_samples(run: ZeroRun, s: int, r: int, ranks: int) -> tuple[dict, ...]:
    """In the checking process: each backward of step s on rank r's share, by the plain model
    with every full gradient dropped as soon as it is ready, metered as the ranks meter
    theirs (`GradientMeter.record`)."""
    rows = len(_share(run, s, r, ranks)[0])
    return _plain_backward_samples_of(rows, run.accumulates(s))


@functools.lru_cache(maxsize=32)
def _plain_backward_samples_of(rows: int, twice: bool) -> tuple[dict, ...]:
    """`_plain_backward_samples` of a share of `rows` sequences, in one backward or (`twice`)
    two. Bytes and operations depend on the shapes alone, not on the values (the tests hold
    this against the ranks' own measurements), so each shape is measured once."""
    run = ZeroRun(steps=2, batch_size=rows, accumulate=twice)
    x, y = global_batches(run)[1]
    model = build_model(run)
    sampler = GradientMeter(model)
    for p in model.parameters():  # after the sampler's hooks, as a student's are
        p.register_post_accumulate_grad_hook(_drop_grad)
    out = []
    for xs, ys, weight in run.backwards(1, x, y):
        loss = _weighted_loss(model, xs, ys, weight)
        with sampler.backward():
            loss.backward()
        out.append(sampler.record())
    return tuple(out)


def _judge_backward_samples(
    check: str, results: list[dict], run: ZeroRun, model: nn.Module, allowed: int, where: str
) -> int:
    """Fail if, when a gradient was ready, a rank held more than `allowed` bytes beyond what
    the plain backward holds at the same moment, or hid work from the meter; else the most
    bytes beyond it any rank held."""
    __tracebackhide__ = True
    ranks, names, most = len(results), [n for n, _ in model.named_parameters()], 0
    shards, largest = shard_bytes(model, ranks), largest_parameter_bytes(model)
    for r, result in enumerate(results):
        for s, step in enumerate(result["steps"]):
            plain = _plain_backward_samples(run, s, r, ranks)
            for k, (got, want) in enumerate(zip(step["backwards"], plain, strict=True)):
                at = f"rank {r}, step {s}, backward {k + 1} of {len(plain)} ({where})"
                off = _switched_off(got, want["ops"])
                unseen = [names[i] for i in want["ready"] if i not in got["ready"]]
                if off or unseen:
                    fail(
                        check,
                        f"{at}: the memory meter was switched off during backward (not on "
                        f"torch's dispatch stack at: {off})"
                        if off
                        else f"{at}: the check's hook never saw the gradient of {unseen[0]!r} "
                        "ready: autograd must finish each parameter's gradient in its .grad "
                        "(your hook then takes it), and the check's hooks must stay",
                    )
                beyond = {i: got["ready"][i] - live for i, live in want["ready"].items()}
                worst = max(beyond, key=beyond.get)
                most = max(most, beyond[worst])
                if beyond[worst] > allowed:
                    fail(
                        check,
                        f"{at}: when the gradient of {names[worst]!r} was ready, "
                        f"{beyond[worst]:,} bytes were alive beyond what the unsharded model's "
                        "backward holds at that moment (each full gradient dropped as soon as "
                        f"it is ready); at most {allowed:,} allowed: the "
                        f"{shards:,} of this rank's gradient shards, one parameter's full "
                        f"size ({largest:,}) and {allowed - shards - largest:,} bytes."
                        "\nHint: reduce-scatter each gradient in its own "
                        "post-accumulate-grad hook and free it there (param.grad = None): "
                        "full gradients kept until the end of backward, or copied into "
                        "buffers made beforehand, are what ZeRO-2 removes",
                    )
    return most


# --- ZeRO-3: forward and backward -------------------------------------------------------


def _step_peak(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict:
    """Forward and backward: the peak bytes of the tensors they create or write into, the
    operations the meter saw, and where it found itself switched off."""
    with _Meter() as meter:
        lm_loss(model(x), y).backward()
    return {"peak": meter.peak, "ops": meter.ops, "missing": meter.missing[:3]}


def largest_layer_bytes(model: nn.Module) -> int:
    """The most bytes of full parameters one module owns itself (a Linear's weight and bias)."""
    return max(
        sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
        for m in model.modules()
    )


def _peak_stage3(shard_module: Callable, run: ZeroRun, mine: dict) -> list[dict]:
    """On each rank, per step: the peak of the student's sharded model's forward and
    backward on this rank's shares (`mine`, `zero_cases.given`), as metered here (the plain
    model's is measured in the checking process)."""
    model = build_model(run, mine["weights"])
    model = shard_module(model) or model
    optimizer = make_optimizer("adamw", model.parameters())
    steps = []
    for x, y in mine["shares"]:
        optimizer.zero_grad()
        steps.append(_step_peak(model, x, y))
        optimizer.step()
    return steps


def _plain_step_need(run: ZeroRun, s: int, r: int, ranks: int) -> tuple[int, int]:
    """In the checking process: what the plain model's forward and backward of step s on rank
    r's share need, without the full gradients they create (bytes), and their operations."""
    return _plain_step_need_of(len(_share(run, s, r, ranks)[0]))


@functools.lru_cache(maxsize=32)
def _plain_step_need_of(rows: int) -> tuple[int, int]:
    """`_plain_step_need` of a share of `rows` sequences, measured once per shape (bytes and
    operations depend on the shapes alone)."""
    run = ZeroRun(steps=1, batch_size=rows)
    plain = build_model(run)
    full_grads = sum(p.numel() * p.element_size() for p in plain.parameters())
    measured = _step_peak(plain, *global_batches(run)[0])
    return measured["peak"] - full_grads, measured["ops"]


def budget(needed: int, model: nn.Module, ranks: int) -> int:
    """The most a sharded step may peak at: what any step needs, this rank's gradient
    shards, and LAYERS_ALLOWED layers' full parameters."""
    return needed + shard_bytes(model, ranks) + LAYERS_ALLOWED * largest_layer_bytes(model)


def _judge_peak(
    check: str, results: list[list[dict]], run: ZeroRun, model: nn.Module, where: str
) -> str:
    """Fail if a rank's step peaked above its budget or hid work from the meter; else say
    what was measured."""
    __tracebackhide__ = True
    ranks, worst = len(results), 0.0
    for r, steps in enumerate(results):
        for s, step in enumerate(steps):
            needed, plain_ops = _plain_step_need(run, s, r, ranks)
            off = _switched_off(step, plain_ops)
            if off:
                fail(
                    check,
                    f"rank {r}, step {s}, {where}: the memory meter was switched off during "
                    f"the step (not on torch's dispatch stack at: {off}); the measurement "
                    "must see the whole step",
                )
            allowed = budget(needed, model, ranks)
            worst = max(worst, step["peak"] / allowed)
            if step["peak"] > allowed:
                fail(
                    check,
                    f"rank {r}, step {s}, {where}: forward and backward peaked at "
                    f"{step['peak']:,} bytes; "
                    f"at most {allowed:,} allowed: the {needed:,} the unsharded step "
                    f"needs without its full gradients, {shard_bytes(model, ranks):,} of "
                    f"gradient shards and {LAYERS_ALLOWED} x {largest_layer_bytes(model):,} "
                    "for the largest layer's full parameters.\nHint: what keeps every "
                    "layer's full parameters alive until backward? Autograd keeps what "
                    "forward saved (a Linear saves its weight), and a buffer made once and "
                    "gathered into counts from the moment it is written",
                )
    what = "the highest step's peak, share of its budget (worst rank and step)"
    measured(check, what, 100 * worst, "%", combine="worst")
    return (
        f"{len(results[0])} steps ({where}): every rank's forward and backward peaked at "
        f"most at {worst:.0%} of its budget (the unsharded step's needs + gradient shards + "
        f"{LAYERS_ALLOWED} layers' full parameters)"
    )
