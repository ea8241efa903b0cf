"""What runs on each rank for Assignment 12's checks: the rank's tokens and experts cut from a
seeded mixture of experts, the student's layer run on them (forward, and backward with the
router's gradients synchronised), and what its messages did, recorded for
`expert_parallel.py` to judge against a single-process reference.

    Case                         one run: world size, tokens, sizes, experts, k, capacity factor
    layer(case)                  the whole layer: router and every expert (every rank builds it)
    inputs(case)                 the whole batch x and the output gradient g
    mine(case, r)                rank r's tokens (torch.tensor_split) and experts (E/P in order)
    run_cases(fn, sync, cases)   what every rank runs: one record per case
    judge_calls(check, case, records, prop)   the message rules: which calls carry what
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from course_lib import comm, models
from course_lib.comm import POINT_TO_POINT, CommCounter
from course_lib.grading._harness import fail
from course_lib.grading.provenance import Provenance
from course_lib.runtime import rank, world_size

# Lecture 12's module answers every part as it stands (`ExpertParallelMoE`, its routing and its
# all-to-all), and its all-to-all is lecture 11's: an answer that runs any of it, or a copy,
# is not the student's own.
LECTURE_EP = (
    "course_lib.expert_parallel",
    "course_lib.measure.expert_parallel",
    "course_lib.sequence_parallel._all_to_all",
)
TOKEN_CALLS = (*POINT_TO_POINT, "all_to_all", "all_to_all_single")  # what may carry tokens
SMALL_CALLS = ("all_gather", "all_gather_into_tensor", "all_reduce", "broadcast")
PAIR_SPREAD = 0.03  # how far a paired expert's router row is from its twin's (see `layer`)


@dataclass(frozen=True)
class Case:
    """One run of the layer: P ranks, `tokens` in the whole batch, E experts, top-k routing;
    `paired`: experts 2i and 2i + 1 have nearly the same router row (see `layer`)."""

    world_size: int
    tokens: int
    n_experts: int
    k: int
    capacity_factor: float
    seed: int
    d_model: int = 8
    d_ff: int = 12
    paired: bool = False

    def __str__(self) -> str:
        return (
            f"world size {self.world_size}, {self.tokens} tokens, {self.n_experts} experts, "
            f"k={self.k}, capacity_factor {self.capacity_factor:g}, seed {self.seed}"
            + (f", d_model {self.d_model}, paired router" if self.paired else "")
        )


def layer(case: Case) -> tuple[nn.Linear, list[nn.Module]]:
    """The router (d_model -> E, no bias) and the E experts (`models.MLPBlock`), float64, the
    same on every rank and in the checking process. Router logits of a few units, so that the
    routing is far from ties and the gate weights differ. A paired router gives expert 2i + 1
    the row of expert 2i plus 3% of its own: a token's two most probable experts are then
    mostly such a pair, which lives on one rank when P divides E / 2."""
    config = models.GPTConfig(d_model=case.d_model, d_ff=case.d_ff)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1_000 + 7 * case.seed + case.n_experts)
        router = nn.Linear(case.d_model, case.n_experts, bias=False, dtype=torch.float64)
        with torch.no_grad():
            if case.paired:
                router.weight[1::2] = router.weight[0::2] + PAIR_SPREAD * router.weight[1::2]
            router.weight.mul_(3.0)
        experts = [models.MLPBlock(config, torch.float64) for _ in range(case.n_experts)]
    return router, experts


def inputs(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch x [tokens, d_model] and the gradient g of the output, float64."""
    g = torch.Generator().manual_seed(10_007 * case.seed + 101 * case.tokens + case.k)
    x = torch.randn(case.tokens, case.d_model, generator=g, dtype=torch.float64)
    return x, torch.randn(case.tokens, case.d_model, generator=g, dtype=torch.float64)


def lengths(case: Case) -> list[int]:
    """Tokens on each rank: torch.tensor_split's chunks."""
    return [len(c) for c in torch.arange(case.tokens).tensor_split(case.world_size)]


def expert_ids(case: Case, r: int) -> list[int]:
    """Rank r's experts: r E/P .. (r+1) E/P - 1 (torch.tensor_split's chunk when P does not
    divide E, for the case that must raise)."""
    ids = torch.arange(case.n_experts).tensor_split(case.world_size)[r]
    return ids.tolist()


def _grads(module: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in module.parameters()]


class _Messages:
    """While active: every torch.distributed call of this rank, whatever route it took, as
    (op, peer, bytes sent, elements of this rank's tensor)."""

    def __enter__(self) -> _Messages:
        self.log: list[tuple[str, int | None, int, int]] = []
        comm.add_around_hook(self._seen)
        return self

    def _seen(self, op, args, sent, received, call):
        peer = None
        if op in POINT_TO_POINT:
            names = ("dst", "group_dst") if op in ("send", "isend") else ("src", "group_src")
            peer = next((args[n] for n in names if args.get(n) is not None), None)
        mine = args.get("tensor", args.get("input_tensor", args.get("input")))
        size = mine.numel() if isinstance(mine, torch.Tensor) else 0
        self.log.append((op, peer, int(sent), size))
        return call()

    def __exit__(self, *exc_info: object) -> None:
        comm.remove_around_hook(self._seen)


def _run_case(fn: Callable, sync: Callable | None, case: Case) -> dict:
    r, P = rank(), world_size()
    router, experts = layer(case)
    mine = nn.ModuleList(experts[e] for e in expert_ids(case, r))
    x_all, g_all = inputs(case)
    x = x_all.tensor_split(P)[r].clone().requires_grad_(sync is not None)
    record = {"out": None, "returned": None, "raised": None, "x_grad": None}
    with _Messages() as messages:
        try:
            out = fn(x, router, mine, case.k, case.capacity_factor)
        except ValueError as error:  # the checks judge whether it was asked for
            out, record["raised"] = None, str(error) or "ValueError()"
        record["returned"] = type(out).__name__
        ok = isinstance(out, torch.Tensor) and out.shape == x.shape
        if ok and sync is not None and out.requires_grad:
            out.backward(g_all.tensor_split(P)[r])
    # Bytes sent, per call as `CommCounter` counts them (all_to_all_single by its splits).
    record["sent"], record["messages"] = sum(m[2] for m in messages.log), messages.log
    if isinstance(out, torch.Tensor):
        record["out"] = out.detach().clone()
    if sync is not None and ok:
        sync(router)
        record["x_grad"] = None if x.grad is None else x.grad.clone()
        record["router_grad"] = _grads(router)[0]
        record["expert_grads"] = [_grads(expert) for expert in mine]
    return record


def run_cases(fn: Callable, sync: Callable | None, cases: list[Case]) -> dict:
    """On each rank: every case in turn, in the same order on every rank; with `sync`, the
    backward of sum(out * g) too, then `sync(router)`."""
    # An outer counter keeps torch.distributed wrapped for the whole run; each case counts
    # its own calls.
    with CommCounter(), Provenance(LECTURE_EP) as seen:
        results = [_run_case(fn, sync, case) for case in cases]
    return {"cases": results, "copied": seen.complaint()}


def judge_calls(check: str, case: Case, records: list[dict], prop: str) -> None:
    """The message rules of Parts 3 and 4: tokens travel by all-to-alls or point-to-point
    only; any other call carries at most 2 E numbers (counts per expert)."""
    __tracebackhide__ = True
    limit = 2 * case.n_experts
    for r, record in enumerate(records):
        for op, _, _, size in record["messages"]:
            if op in TOKEN_CALLS:
                continue
            if op not in SMALL_CALLS:
                fail(
                    check,
                    f"{case}: rank {r} called dist.{op}; tokens travel by all-to-alls "
                    "(dist.all_to_all_single, dist.all_to_all) or dist.send/recv/isend/irecv "
                    "only",
                    prop=prop,
                )
            if size > limit:
                fail(
                    check,
                    f"{case}: rank {r} called dist.{op} on a tensor of {size} numbers; "
                    f"collectives may carry per-expert numbers only (at most {limit} here). "
                    "Tokens go only to the ranks of their experts, by all-to-all.",
                    prop=prop,
                )
