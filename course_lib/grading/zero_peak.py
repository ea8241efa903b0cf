"""Part of Assignment 7's checks (grading/zero.py): ZeRO-3's memory at its peak.

`check_zero3` looks at what the model holds at rest. This part measures the high-water mark
of one training step's forward and backward on each rank, which is what decides whether a
model fits: with full parameters kept alive from forward to backward (autograd saves a
Linear's weight), ZeRO-3 peaks as high as plain data parallelism.

On each rank, for the same share of the same batch:
- the plain, unsharded model's peak, minus the full gradients it creates, is what the step
  needs whatever the sharding (activations, saved tensors, temporaries);
- the student's sharded model's peak may exceed it by at most this rank's gradient shards
  (`shard_bytes`) plus `LAYERS_ALLOWED` times the largest layer's full parameters (a
  layer's gathered parameters, its full gradient before the reduce-scatter, and one more
  layer fetched early).

Bytes are those of the tensors the step creates (`memory.PeakMemory`, per storage), plus
what Python holds between forward and backward beyond the unsharded step's (`tracemalloc`:
numpy arrays, big blocks), so a copy kept outside torch for backward counts too. The meter
notices being switched off (`_Meter`).
"""

from __future__ import annotations

import tracemalloc
import weakref
from collections.abc import Callable

import torch
from torch import nn
from torch.nn.modules import module as modules
from torch.utils import _python_dispatch

from course_lib import comm, data, memory
from course_lib.grading._harness import fail
from course_lib.grading.training import make_optimizer
from course_lib.grading.zero_memory import shard_bytes
from course_lib.grading.zero_ranks import ZeroRun, build_model, global_batches
from course_lib.runtime import rank, world_size

LAYERS_ALLOWED = 3
NUMPY_DOMAIN = 389047  # numpy reports its arrays' memory to tracemalloc in this domain
BIG_BLOCK = 4096


class _Meter(memory.PeakMemory):
    """PeakMemory that notices being switched off. Code that pops it off torch's dispatch
    stack hides what it allocates meanwhile; so the meter looks for itself on the stack at
    every module's forward (global module hooks, which run before a module's own), at every
    torch.distributed call and at the end; it also counts the operations it saw (a sharded
    step runs at least the unsharded step's)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.missing: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return super().__torch_dispatch__(func, types, args, kwargs)

    def look(self, where: str) -> None:
        if self not in _python_dispatch._get_current_dispatch_mode_stack():
            self.missing.append(where)

    def _around(self, op, args, sent, received, call):
        self.look(f"torch.distributed.{op}")
        return call()

    def __enter__(self):
        meter = super().__enter__()
        look = self.look
        self._hooks = [
            modules.register_module_forward_pre_hook(lambda m, a: look(f"{type(m).__name__}")),
            modules.register_module_forward_hook(lambda m, a, o: look(f"{type(m).__name__}")),
        ]
        comm.add_around_hook(self._around)
        return meter

    def __exit__(self, *exc):
        self.look("the end of the step")
        comm.remove_around_hook(self._around)
        for hook in self._hooks:
            hook.remove()
        return super().__exit__(*exc)


def _step_peak(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict:
    """Forward and backward: the peak bytes of the tensors they create, the operations the
    meter saw and where it was missing, and the bytes Python (numpy, big blocks) holds
    between forward and backward, where a copy kept for backward outside torch would be."""
    from course_lib.models import lm_loss

    tracemalloc.start()
    try:
        with _Meter() as meter:
            loss = lm_loss(model(x), y)
            python = _python_bytes(tracemalloc.take_snapshot())
            loss.backward()
    finally:
        tracemalloc.stop()
    return {
        "torch": meter.peak_bytes,
        "python": python,
        "ops": meter.ops,
        "missing": meter.missing[:3],
    }


def _python_bytes(snapshot: tracemalloc.Snapshot) -> int:
    """Memory outside torch a snapshot holds: numpy's arrays, and any other single block of
    BIG_BLOCK bytes or more (a tensor kept as bytes, say). The small objects of hooks and
    autograd's bookkeeping, and the meter's own, are left out: they are noise, not copies."""
    ours = [memory.__file__, weakref.__file__, __file__, tracemalloc.__file__]
    kept = snapshot.filter_traces([tracemalloc.Filter(False, f) for f in ours])
    return sum(
        trace.size
        for trace in kept.traces
        if trace.domain == NUMPY_DOMAIN or trace.size >= BIG_BLOCK
    )


def largest_layer_bytes(model: nn.Module) -> int:
    """The most bytes of full parameters one module owns itself (a Linear's weight and bias)."""
    return max(
        sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
        for m in model.modules()
    )


def _peak_stage3(shard_module: Callable, run: ZeroRun) -> list[dict]:
    """On each rank, per step: the plain model's peak and the student's sharded model's."""
    ranks, me = world_size(), rank()
    plain = build_model(run)
    full_grads = sum(p.numel() * p.element_size() for p in plain.parameters())
    model = build_model(run)
    model = shard_module(model) or model
    optimizer = make_optimizer("adamw", model.parameters())
    steps = []
    for x, y in global_batches(run):
        x, y = data.shard(x, me, ranks), data.shard(y, me, ranks)
        reference = _step_peak(plain, x, y)
        plain.zero_grad(set_to_none=True)
        optimizer.zero_grad()
        measured = _step_peak(model, x, y)
        optimizer.step()
        steps.append(
            {
                "needed": reference["torch"] - full_grads,
                "plain_ops": reference["ops"],
                "peak": measured["torch"] + max(0, measured["python"] - reference["python"]),
                "python": max(0, measured["python"] - reference["python"]),
                "ops": measured["ops"],
                "missing": measured["missing"],
            }
        )
    return steps


def budget(needed: int, model: nn.Module, ranks: int) -> int:
    """The most a sharded step may peak at: what any step needs, this rank's gradient
    shards, and LAYERS_ALLOWED layers' full parameters."""
    return needed + shard_bytes(model, ranks) + LAYERS_ALLOWED * largest_layer_bytes(model)


def _judge_peak(check: str, results: list[list[dict]], model: nn.Module, where: str) -> str:
    """Fail if a rank's step peaked above its budget or hid work from the meter; else say
    what was measured."""
    __tracebackhide__ = True
    ranks, worst = len(results), 0.0
    for r, steps in enumerate(results):
        for s, step in enumerate(steps):
            if step["missing"] or step["ops"] < step["plain_ops"]:
                at = ", ".join(step["missing"]) or f"{step['ops']} operations seen"
                fail(
                    check,
                    f"rank {r}, step {s}, {where}: the memory meter was switched off during "
                    f"the step (not on torch's dispatch stack at: {at}); the measurement "
                    "must see the whole step",
                )
            allowed = budget(step["needed"], model, ranks)
            worst = max(worst, step["peak"] / allowed)
            if step["peak"] > allowed:
                fail(
                    check,
                    f"rank {r}, step {s}, {where}: forward and backward peaked at "
                    f"{step['peak']:,} bytes ({step['python']:,} of them outside torch); "
                    f"at most {allowed:,} allowed: the {step['needed']:,} the unsharded step "
                    f"needs without its full gradients, {shard_bytes(model, ranks):,} of "
                    f"gradient shards and {LAYERS_ALLOWED} x {largest_layer_bytes(model):,} "
                    "for the largest layer's full parameters.\nHint: what keeps every "
                    "layer's full parameters alive until backward? Autograd keeps what "
                    "forward saved (a Linear saves its weight)",
                )
    return (
        f"{len(results[0])} steps ({where}): every rank's forward and backward peaked at "
        f"most at {worst:.0%} of its budget (the unsharded step's needs + gradient shards + "
        f"{LAYERS_ALLOWED} layers' full parameters)"
    )
