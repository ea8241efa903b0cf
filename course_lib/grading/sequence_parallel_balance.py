"""Part of Assignment 11's checks (grading/sequence_parallel.py): causal attention, balanced.

With a causal mask and contiguous shards, rank P-1's queries see the whole sequence and rank
0's only its own tokens: the last rank works about P times as long as the first. Part 5 lets
the student choose which tokens each rank holds (`layout(tokens, world_size)`) and how to
attend (`balanced_causal_attention(q, k, v)`); this part measures what each rank computed.

The measure (`WorkMeter`, a TorchDispatchMode on each rank around the student's call only):
- a matrix product costs its FLOPs, 2 m n k (torch.utils.flop_counter's formulas for mm, bmm,
  addmm, baddbmm; the same for mv, dot, and torch's fused attention as a whole rectangle);
- any other operation with a floating-point result costs the elements of its largest
  floating-point operand or result (views cost nothing);
so scores built by broadcasting and summing cost what the product would, and an elementwise
pass over scores costs one per score.

The minimum (`causal_attention_flops`): the two products of causal attention over the
visible pairs only, 2 h d N (N + 1) FLOPs for N tokens, h heads of size d. A balanced, exact
answer keeps every rank within BALANCE of the ranks' mean and the total within WORK times the
minimum (full scores then a mask cost about twice the minimum). Work done outside torch is
not seen: the total must reach the minimum, calls that turn floating-point tensors into numpy
arrays or Python numbers are refused, and so is code that switches the meter off.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils import _python_dispatch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from course_lib import comm, compare
from course_lib.comm import CommCounter
from course_lib.grading._harness import fail
from course_lib.grading.provenance import Provenance
from course_lib.grading.sequence_parallel_ranks import ATOL, LECTURE_SP, RTOL, Case, inputs
from course_lib.runtime import rank, world_size

BALANCE = 1.1  # the busiest rank's work / the ranks' mean, at most
WORK = 1.6  # the ranks' total work / the causal minimum, at most
HEADS, HEAD_DIM = 2, 16
TOKENS_PER_RANK = (16, 24)  # N = 16 P and 24 P: multiples of 2P
# Functions that take the meter off torch's dispatch stack: running them hides work.
METER_OFF = tuple(
    f"torch.utils._python_dispatch.{name}"
    for name in ("_disable_current_modes", "_pop_mode_temporarily")
    if hasattr(_python_dispatch, name)
)
# Tensor methods that hand a floating-point tensor's numbers to Python or numpy.
LEAVE_TORCH = ("numpy", "tolist", "item", "__array__", "__float__")

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


class WorkMeter(TorchDispatchMode):
    """The floating-point work of the torch operations run while it is on (see the module's
    docstring), and where it found itself switched off."""

    def __init__(self) -> None:
        super().__init__()
        self.work = 0
        self.missing: list[str] = []

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.work += self.cost(func, args, kwargs, out)
        return out

    @staticmethod
    def cost(func, args, kwargs, out) -> int:
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
            return 0  # positions, masks: bookkeeping, not attention's arithmetic
        return max(
            t.numel()
            for t in tree_leaves((args, kwargs, out))
            if isinstance(t, torch.Tensor) and t.is_floating_point()
        )

    def look(self, where: str) -> None:
        if self not in _python_dispatch._get_current_dispatch_mode_stack():
            self.missing.append(where)

    def _around(self, op, args, sent, received, call):
        self.look(f"torch.distributed.{op}")
        return call()

    def __enter__(self):
        meter = super().__enter__()
        comm.add_around_hook(self._around)
        return meter

    def __exit__(self, *exc):
        self.look("the end of your call")
        comm.remove_around_hook(self._around)
        return super().__exit__(*exc)


class _Watch(Provenance):
    """Provenance (the lecture's code, copies of it, the functions that switch the meter
    off), and the calls that take floating-point numbers out of torch."""

    def __init__(self) -> None:
        super().__init__((*LECTURE_SP, *METER_OFF))
        self.left: list[str] = []

    def _profile(self, frame, event, arg):
        if event == "c_call":
            self._c_call(arg)
        return super()._profile(frame, event, arg)

    def _c_call(self, fn) -> None:
        owner, name = getattr(fn, "__self__", None), getattr(fn, "__name__", "?")
        module = owner.__name__ if isinstance(owner, types.ModuleType) else None
        module = module or getattr(fn, "__module__", None) or ""
        if isinstance(owner, torch.Tensor) and name in LEAVE_TORCH:
            if owner.is_floating_point() and f"Tensor.{name}()" not in self.left:
                self.left.append(f"Tensor.{name}()")
        elif module.split(".")[0] == "numpy" and f"numpy.{name}" not in self.left:
            self.left.append(f"numpy.{name}")

    def problem(self) -> str | None:
        """What to tell the student, or None."""
        off = [hit for hit in self.hits if hit in METER_OFF]
        if off:
            return (
                f"your code ran {off[0]}, which takes the work meter off torch's dispatch "
                "stack; the measurement must see the whole call"
            )
        if self.left:
            return (
                f"your code called {', '.join(self.left[:3])}: it took floating-point numbers "
                "out of torch, where the work meter cannot see them; compute attention with "
                "torch operations on tensors"
            )
        return self.complaint()


def balance_cases(P: int, seeds) -> list[Case]:
    """Part 5's cases on P ranks: N = 16 P and 24 P tokens, causal."""
    return [Case(P, HEADS, n * P, HEAD_DIM, True, s) for s in seeds for n in TOKENS_PER_RANK]


def reference(case: Case) -> torch.Tensor:
    """Causal attention on one process by torch's own function, float64."""
    q, k, v = inputs(case)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def causal_attention_flops(tokens: int, heads: int, head_dim: int) -> int:
    """The causal minimum: FLOPs of causal attention's two products over the visible (query,
    key) pairs only. Row i sees i + 1 keys, 2 d FLOPs a pair for the scores and 2 d for the
    output: 2 h d N (N + 1) in all."""
    return 2 * heads * head_dim * tokens * (tokens + 1)


def run_layout(layout: Callable, tokens: list[int]) -> dict:
    """On each rank: the student's layout for each length, as plain lists (or what it was)."""
    with _Watch() as watch:
        answers = [layout(n, world_size()) for n in tokens]
    found = []
    for shards in answers:  # converted after the watch: the student's code is done
        try:
            found.append([torch.as_tensor(s).tolist() for s in shards])
        except (TypeError, ValueError, RuntimeError):
            found.append(repr(shards)[:80])
    return {"layouts": found, "copied": watch.problem()}


def _run_case(layout: Callable, attend: Callable, case: Case) -> dict:
    r, P = rank(), world_size()
    positions = torch.as_tensor(layout(case.tokens, P)[r], dtype=torch.long)
    q, k, v = (x[:, positions].contiguous() for x in inputs(case))
    with WorkMeter() as meter:
        out = attend(q, k, v)
    return {
        "out": out.detach().clone() if isinstance(out, torch.Tensor) else None,
        "returned": type(out).__name__,
        "positions": positions.tolist(),
        "work": meter.work,
        "missing": meter.missing[:3],
    }


def run_balanced(layout: Callable, attend: Callable, cases: list[Case]) -> dict:
    """On each rank: every case in turn, the student's attention under the work meter."""
    with CommCounter(), _Watch() as watch:
        results = [_run_case(layout, attend, case) for case in cases]
    return {"cases": results, "copied": watch.problem()}


def layout_problem(layouts: list, tokens: int, P: int) -> str | None:
    """What is wrong with the layouts the ranks computed for `tokens`, or None."""
    first = layouts[0]
    if any(other != first for other in layouts[1:]):
        return "the ranks computed different layouts; layout() must depend on its arguments only"
    if not isinstance(first, list) or len(first) != P:
        return f"layout({tokens}, {P}) must return a list of {P} 1-D integer tensors, got {first}"
    for r, shard in enumerate(first):
        if not isinstance(shard, list) or not all(isinstance(i, int) for i in shard):
            return f"layout({tokens}, {P})[{r}] is {shard!r:.60}, not a 1-D integer tensor"
        if len(shard) != tokens // P:
            return (
                f"layout({tokens}, {P})[{r}] holds {len(shard)} positions; every rank holds "
                f"tokens // world_size = {tokens // P}"
            )
    held = sorted(i for shard in first for i in shard)
    if held != list(range(tokens)):
        return (
            f"layout({tokens}, {P}) is not a partition of the positions 0..{tokens - 1}: "
            "every position must be held by exactly one rank"
        )
    return None


def judge_balanced_result(check: str, case: Case, records: list[dict]) -> None:
    """Every rank's rows equal torch's causal attention, with the meter on all along."""
    __tracebackhide__ = True
    want = reference(case)
    for r, record in enumerate(records):
        at = f"{case}: rank {r}"
        if record["missing"]:
            fail(
                check,
                f"{at}: the work meter was switched off (not on torch's dispatch stack at: "
                f"{', '.join(record['missing'])}); the measurement must see your whole call",
            )
        if record["out"] is None:
            fail(
                check,
                f"{at}: your balanced_causal_attention returned {record['returned']}; return "
                "this rank's (heads, n_local, head_dim) rows, in the order of its positions",
            )
        expected = want[:, record["positions"]]
        problem = compare.find_mismatch(
            {"output": record["out"]}, {"output": expected}, rtol=RTOL, atol=ATOL
        )
        if problem:
            fail(
                check,
                f"{at}: {problem}.\nRow j of rank r's output is the query at position "
                "layout(N, P)[r][j], and it sees the keys at positions <= its own, wherever "
                "they are held.",
            )


def work_ratios(case: Case, records: list[dict]) -> tuple[float, float]:
    """(the busiest rank's work / the ranks' mean, the total / the causal minimum)."""
    work = [record["work"] for record in records]
    least = causal_attention_flops(case.tokens, case.heads, case.head_dim)
    return max(work) * len(work) / max(sum(work), 1), sum(work) / least


def judge_work(check: str, case: Case, records: list[dict]) -> None:
    """The "work" property: the total is at least the causal minimum (else the meter missed
    some) and at most WORK times it."""
    __tracebackhide__ = True
    total = sum(record["work"] for record in records)
    least = causal_attention_flops(case.tokens, case.heads, case.head_dim)
    if total < least:
        fail(
            check,
            f"{case}: your ranks' torch operations add up to {total:,} FLOPs, less than the "
            f"{least:,} that causal attention's two products need: some of the work was done "
            "where the meter cannot see it. Compute attention with torch operations on tensors.",
            prop="work",
        )
    if total > WORK * least:
        fail(
            check,
            f"{case}: the ranks did {total:,} FLOPs in all, {total / least:.2f} x the causal "
            f"minimum {least:,}; at most {WORK:g} x. Scores the mask hides are work too: "
            "skip them rather than compute and mask them.",
            prop="work",
        )


def judge_balance(check: str, case: Case, records: list[dict]) -> None:
    """The "balance" property: the busiest rank within BALANCE of the ranks' mean."""
    __tracebackhide__ = True
    work = [record["work"] for record in records]
    busiest, share = max(range(len(work)), key=work.__getitem__), work_ratios(case, records)[0]
    if share > BALANCE:
        fail(
            check,
            f"{case}: rank {busiest} did {work[busiest]:,} FLOPs, {share:.2f} x the ranks' "
            f"mean; at most {BALANCE:g} x (per rank: {', '.join(f'{w:,}' for w in work)}). "
            "Which queries see the most keys, and which rank holds them?",
            prop="balance",
        )


__all__ = [
    "BALANCE",
    "WORK",
    "WorkMeter",
    "causal_attention_flops",
    "balance_cases",
    "judge_balance",
    "judge_balanced_result",
    "judge_work",
    "layout_problem",
    "reference",
    "run_balanced",
    "run_layout",
    "work_ratios",
]
