"""What a rank's torch operations cost while a meter is on: their floating-point work, and the
bytes of tensor storage they keep alive at once.

    with Meter(exempt=[q, k, v]) as meter:
        dq, dk, dv = attention_backward(q, k, v)
    meter.work          # FLOPs of the products, one per element for every other operation
    meter.peak_bytes    # the most bytes of storage the call's tensors held at once
    meter.missing       # where the meter found itself off torch's dispatch stack

Assignment 11's checks measure a student's code on a grading rank with it. It lives here, in
the machinery, because the student's operations pass through it: the grader's own code is
not the student's to run (`course_lib.grading.provenance`), and a meter is run by every torch
operation the student's code makes.

**Work.** A matrix product costs its FLOPs, 2 m n k (torch's flop counter's formulas for mm,
bmm, addmm, baddbmm; 2 per element of the larger operand for mv and dot; torch's fused
attention its whole rectangle, both products); any other operation with a floating-point
result costs one per element of its largest floating-point operand or result; views,
allocations without values and integer or boolean results cost nothing.

**Memory.** Every storage an operation creates counts from its creation until the last tensor
seen using it is freed, once however many views share it (`course_lib.memory.PeakMemory`
counts the same way). A storage made before the meter (a buffer made ahead, outside the call)
counts by the bytes the call writes into it (an in-place operation, an `out=`, a receive or a
collective's output; each byte once), from the first write to the end, unless it is `exempt`
(the call's own inputs). Memory outside torch (numpy arrays, Python lists) is not seen.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable

import torch
from torch.utils import _python_dispatch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from course_lib import comm

aten = torch.ops.aten
VECTOR_PRODUCTS = (aten.mv, aten.addmv, aten.dot, aten.vdot)
# Allocations without values, and views torch does not mark as views: no arithmetic.
FREE = (
    aten.empty,
    aten.empty_like,
    aten.empty_strided,
    aten.new_empty,
    aten.new_empty_strided,
    aten._unsafe_view,
)
# torch's fused attention kernels for the CPU that the flop counter does not list.
FUSED_ATTENTION = tuple(
    getattr(aten, name)
    for name in ("_scaled_dot_product_flash_attention_for_cpu",)
    if hasattr(aten, name)
)
# Messages that only read their tensors.
READ_ONLY = ("send", "isend")


def _products(args) -> int:
    """FLOPs of the products torch's flop counter has no formula for: a matrix times a vector
    (mv, addmv) or two vectors (dot, vdot), 2 per element of the larger operand."""
    a, b = args[-2:] if len(args) >= 2 else (None, None)
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return 0
    return 2 * max(a.numel(), b.numel())


def _attention_flops(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    """torch's fused attention, as a whole rectangle: both products."""
    rows = math.prod(q.shape[:-1])
    return 2 * rows * k.shape[-2] * (q.shape[-1] + v.shape[-1])


def work(func, args, kwargs, out) -> int:
    """The floating-point work of one operation (see the module's docstring)."""
    packet = func.overloadpacket
    if func.namespace != "aten" or func.is_view or packet in FREE:
        return 0  # messages, views, allocations: no arithmetic
    if packet in flop_registry:
        return int(flop_registry[packet](*args, **kwargs, out_val=out))
    if packet in VECTOR_PRODUCTS:
        return _products(args)
    if packet in FUSED_ATTENTION:
        return _attention_flops(*args[:3])
    results = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    if not any(t.is_floating_point() for t in results):
        return 0  # positions, masks: bookkeeping, not arithmetic
    return max(
        t.numel()
        for t in tree_leaves((args, kwargs, out))
        if isinstance(t, torch.Tensor) and t.is_floating_point()
    )


def _written(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors an operation writes into: in-place operations and `out=` arguments."""
    found = []
    for i, argument in enumerate(func._schema.arguments):
        alias = argument.alias_info
        if alias is None or not alias.is_write:
            continue
        value = kwargs.get(argument.name) if argument.kwarg_only or i >= len(args) else args[i]
        found += [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
    return found


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage a tensor spans: [first, last) (gaps of a strided view too)."""
    if not t.numel():
        return 0, 0
    span = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    first = t.storage_offset() * t.element_size()
    return first, first + span * t.element_size()


def _union(intervals: list[tuple[int, int]]) -> int:
    """Bytes covered by intervals that may overlap."""
    covered, end = 0, None
    for first, last in sorted(intervals):
        if end is None or first > end:
            covered, end = covered + last - first, last
        elif last > end:
            covered, end = covered + last - end, last
    return covered


class Meter(TorchDispatchMode):
    """The work and the live storage bytes of the torch operations run while it is on (see
    the module's docstring), and where it found itself switched off."""

    def __init__(self, exempt: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self.work = 0
        self.live_bytes = self.peak_bytes = 0
        self.missing: list[str] = []
        self._exempt = {_key(t) for t in exempt if isinstance(t, torch.Tensor)}
        self._holders: dict[int, int] = {}  # storage made here -> live tensors seen using it
        self._known: set[int] = set()  # ids of those tensors
        self._ahead: dict[int, list[tuple[int, int]]] = {}  # storage made before -> written

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.work += work(func, args, kwargs, out)
        given = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if func.namespace == "aten":
            for t in _written(func, args, kwargs):
                self._write(t)
        ids, keys = {id(t) for t in given}, {_key(t) for t in given if t.device.type != "meta"}
        for t in tree_leaves(out):  # an in-place operation returns its input: not new memory
            if isinstance(t, torch.Tensor) and id(t) not in ids and t.device.type != "meta":
                key = _key(t)
                if key in self._holders or not (key in keys or key in self._exempt):
                    self._hold(t)  # new storage, or a view of one made here
        return out

    def _hold(self, t: torch.Tensor) -> None:
        """Count `t`'s storage, made here, while `t` lives (views of it count once)."""
        if id(t) in self._known:
            return
        storage = t.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if not nbytes:
            return
        if not self._holders.get(key):
            self._grow(nbytes)
        self._holders[key] = self._holders.get(key, 0) + 1
        self._known.add(id(t))
        weakref.finalize(t, self._release, key, nbytes, id(t))

    def _write(self, t: torch.Tensor) -> None:
        """The call writes into `t`: if its storage was made before the meter (and is not
        exempt), the bytes written count from now on, each byte once."""
        if t.device.type == "meta" or not t.numel():
            return
        key = _key(t)
        if key in self._holders or key in self._exempt:
            return
        written = self._ahead.setdefault(key, [])
        before = _union(written)
        written.append(_extent(t))
        self._grow(_union(written) - before)

    def _grow(self, nbytes: int) -> None:
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _release(self, key: int, nbytes: int, tensor_id: int) -> None:
        self._known.discard(tensor_id)
        self._holders[key] -= 1
        if not self._holders[key]:
            del self._holders[key]
            self.live_bytes -= nbytes

    def look(self, where: str) -> None:
        if self not in _python_dispatch._get_current_dispatch_mode_stack():
            self.missing.append(where)

    def _around(self, op, args, sent, received, call):
        """At every torch.distributed call: is the meter still on, and which tensors made
        before the call does the message write into?"""
        self.look(f"torch.distributed.{op}")
        if op not in READ_ONLY:
            for t in tree_leaves(list(args.values())):
                if isinstance(t, torch.Tensor):
                    self._write(t)
        return call()

    def __enter__(self):
        meter = super().__enter__()
        comm.add_around_hook(self._around)
        return meter

    def __exit__(self, *exc):
        self.look("the end of the call")
        comm.remove_around_hook(self._around)
        return super().__exit__(*exc)


__all__ = ["Meter", "work"]
