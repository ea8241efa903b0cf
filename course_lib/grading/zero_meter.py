"""Part of Assignment 7's checks (grading/zero.py): the meter of memory while work runs.

    with _Meter() as meter:
        loss.backward()
    meter.peak, meter.ops, meter.missing

    sampler = GradientMeter(model)     # the bytes alive each time a gradient is ready
    with sampler.backward():
        loss.backward()

`_Meter` counts the bytes of the tensor storages an operation creates, and of every storage
made before it that an operation writes into (a buffer allocated in advance and filled with
`copy_`, an in-place collective, a gradient accumulated in place): both are memory the
metered code uses. Each storage counts once however many views of it exist, from the moment
it is created or first written until the last tensor seen using it is freed; `peak` is the
most at once. `GradientMeter` reads the same count each time autograd has finished a
parameter's gradient. Used on the ranks (ZeRO-2's backward, ZeRO-3's forward and backward)
and, on the plain model, in the checking process (`zero_peak`'s references).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterator

import torch
from torch.nn.modules import module as modules
from torch.utils import _python_dispatch
from torch.utils._python_dispatch import TorchDispatchMode

from course_lib import comm


def _tensors(value: object) -> list[torch.Tensor]:
    """The tensors in an operation's arguments or results: a tensor, or tensors in (nested)
    tuples and lists (what aten operations take and return; cheaper than torch's pytree)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    return []


class _Meter(TorchDispatchMode):
    """The bytes of the tensor storages created or written into while it is on, live and at
    their most (each storage once, however many views of it exist), and the operations it
    saw. The grader's own meter, independent of the lectures' (`memory.PeakMemory` counts the
    storages created the same way, and not those written into).

    Code that pops it off torch's dispatch stack hides what it allocates meanwhile; so the
    meter looks for itself on the stack at every module's forward (global module hooks, which
    run before a module's own), at every torch.distributed call, at every gradient
    `GradientMeter` samples and at the end; it also counts the operations it saw (a sharded
    step runs at least the unsharded step's). Code that takes it off and puts it back between
    these moments, calling no collective meanwhile, is not seen."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = self.ops = 0
        self.holders: dict[int, int] = {}  # storage pointer -> live tensors seen using it
        self.seen: set[int] = set()  # ids of those tensors
        self.missing: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {id(t) for t in _tensors((*args, *kwargs.values()))}
        for t in _tensors(out):
            if id(t) in self.seen:
                continue
            # An in-place op returns its input: new memory only if its storage was made
            # before the meter started and is counted from now on.
            if id(t) not in inputs or not self.holders.get(t.untyped_storage().data_ptr()):
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


class GradientMeter:
    """Meters the backwards of a model: the bytes `_Meter` counts alive at each moment
    autograd has finished a parameter's gradient (sampled by a post-accumulate-grad hook on
    every parameter, made before any other so that it runs first), the operations it saw and
    where it found itself switched off.

        sampler = GradientMeter(model)          # before the optimizer registers its hooks
        with sampler.backward():
            loss.backward()
        sampler.record()    # {"ready": {parameter index: bytes}, "ops": n, "missing": [...]}
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.meter: _Meter | None = None
        self.ready: dict[int, int] = {}
        for i, p in enumerate(model.parameters()):
            p.register_post_accumulate_grad_hook(functools.partial(self._ready, i))

    def _ready(self, i: int, param: torch.Tensor) -> None:
        if self.meter is not None:
            self.meter.look(f"the gradient of parameter {i}")
            self.ready[i] = self.meter.live

    @contextlib.contextmanager
    def backward(self) -> Iterator[None]:
        self.ready = {}
        with _Meter() as self.meter:
            yield

    def record(self) -> dict:
        assert self.meter is not None, "record() after a backward()"
        meter, self.meter = self.meter, None
        return {"ready": dict(self.ready), "ops": meter.ops, "missing": meter.missing[:3]}
