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

Bytes are those of the tensor storages the step creates (`_Meter`, per storage, so a view
that keeps a whole tensor alive counts as the whole tensor). Memory outside torch (a copy kept
as a numpy array) is not seen: Python's tracemalloc would see it, but tracing allocations
under autograd crashed one rank in eight here (SIGSEGV), so the notebook forbids such copies
in words only.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import nn
from torch.nn.modules import module as modules
from torch.utils import _python_dispatch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from course_lib import comm, data
from course_lib.grading._harness import fail
from course_lib.grading.training import make_optimizer
from course_lib.grading.zero_memory import shard_bytes
from course_lib.grading.zero_ranks import ZeroRun, build_model, global_batches
from course_lib.runtime import rank, world_size

LAYERS_ALLOWED = 3


class _Meter(TorchDispatchMode):
    """The bytes of the tensor storages created while it is on, live and at their most (each
    storage once, however many views of it exist), and the operations it saw. The grader's
    own meter, independent of the lectures' (`memory.PeakMemory` measures the same way).

    Code that pops it off torch's dispatch stack hides what it allocates meanwhile; so the
    meter looks for itself on the stack at every module's forward (global module hooks, which
    run before a module's own), at every torch.distributed call and at the end; it also counts
    the operations it saw (a sharded step runs at least the unsharded step's)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = self.ops = 0
        self.holders: dict[int, int] = {}  # storage pointer -> live tensors seen using it
        self.seen: set[int] = set()  # ids of those tensors
        self.missing: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        out = func(*args, **(kwargs or {}))
        inputs = {id(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:  # an in-place op returns its input: not new memory
            if isinstance(t, torch.Tensor) and id(t) not in self.seen | inputs:
                self._hold(t)
        return out

    def _hold(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if not self.holders.get(key):
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        self.holders[key] = self.holders.get(key, 0) + 1
        self.seen.add(id(t))
        weakref.finalize(t, self._release, key, nbytes, id(t))

    def _release(self, key: int, nbytes: int, tensor_id: int) -> None:
        self.seen.discard(tensor_id)
        self.holders[key] -= 1
        if not self.holders[key]:
            del self.holders[key]
            self.live -= nbytes

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
    meter saw, and where it found itself switched off."""
    from course_lib.models import lm_loss

    with _Meter() as meter:
        lm_loss(model(x), y).backward()
    return {"torch": meter.peak, "ops": meter.ops, "missing": meter.missing[:3]}


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
                "peak": measured["torch"],
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
                    f"{step['peak']:,} bytes; "
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
