"""What runs on each rank for Assignment 11's checks: the rank's shard of q, k, v cut from a
seeded sequence, the student's attention run on it, and what its messages did (calls, peers,
bytes), recorded for `sequence_parallel.py` to judge against a single-process reference.

    Case                         one run: world size, heads, tokens, head size, causal, seed
    inputs(case)                 the whole sequence's q, k, v (every rank draws the same)
    shard(x, r, P)               rank r's tokens: chunk r of torch.tensor_split(tokens, P)
    run_cases(fn, cases)         what every rank runs: one record per case
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from course_lib import comm
from course_lib.comm import POINT_TO_POINT, CommCounter
from course_lib.grading.provenance import Provenance
from course_lib.runtime import rank, world_size

# Lecture 11's module answers both parts as it stands (and its `attention`, `merge_block` and
# `_all_to_all` are the pieces of them): an answer that runs any of it, or a copy, is not the
# student's own.
LECTURE_SP = ("course_lib.sequence_parallel",)
# float64: the online softmax adds the blocks in another order than one softmax does, which
# moves the result by ~1e-15; a merge gone wrong moves it by 1e-2 or more.
RTOL, ATOL = 1e-9, 1e-12


@dataclass(frozen=True)
class Case:
    """One run of an attention: P ranks, `heads` heads of `head_dim`, `tokens` in all."""

    world_size: int
    heads: int
    tokens: int
    head_dim: int
    causal: bool
    seed: int

    def __str__(self) -> str:
        mask = "causal" if self.causal else "not causal"
        return (
            f"world size {self.world_size}, {self.heads} heads, {self.tokens} tokens, "
            f"head_dim {self.head_dim}, {mask}, seed {self.seed}"
        )


def inputs(case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole sequence's q, k, v, (heads, tokens, head_dim) float64, from the case's seed.
    Scores spread over several units, so that a softmax merged wrongly shows."""
    g = torch.Generator().manual_seed(10_007 * case.seed + 101 * case.tokens + case.heads)
    shape = (case.heads, case.tokens, case.head_dim)
    q, k, v = (torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(3))
    return 1.5 * q, 1.5 * k, v


def shard(x: torch.Tensor, r: int, P: int) -> torch.Tensor:
    """Rank r's contiguous shard of the tokens (dim -2), as torch.tensor_split cuts them."""
    return x.tensor_split(P, dim=-2)[r].contiguous()


class _Messages:
    """While active: every torch.distributed call of this rank, whatever route it took, as
    (op, peer, bytes sent). On grading ranks the process group reports every call."""

    def __enter__(self) -> _Messages:
        self.log: list[tuple[str, int | None, int]] = []
        comm.add_around_hook(self._seen)
        return self

    def _seen(self, op, args, sent, received, call):
        peer = None
        if op in POINT_TO_POINT:
            names = ("dst", "group_dst") if op in ("send", "isend") else ("src", "group_src")
            peer = next((args[n] for n in names if args.get(n) is not None), None)
        self.log.append((op, peer, int(sent)))
        return call()

    def __exit__(self, *exc_info: object) -> None:
        comm.remove_around_hook(self._seen)


class _Largest(TorchDispatchMode):
    """While active: the most elements of any tensor an operation made on this rank (the
    whole sequence's K, or a row of scores over every key, is larger than any block)."""

    def __init__(self) -> None:
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self.most = max(self.most, leaf.numel())
        return out


def _run_case(fn: Callable, case: Case) -> dict:
    r, P = rank(), world_size()
    q, k, v = (shard(x, r, P) for x in inputs(case))
    with CommCounter() as counter, _Messages() as messages, _Largest() as largest:
        try:
            out = fn(q.clone(), k.clone(), v.clone(), causal=case.causal)
            raised = None
        except ValueError as error:  # the checks judge whether it was asked for
            out, raised = None, str(error) or "ValueError()"
    return {
        "out": out.detach().clone() if isinstance(out, torch.Tensor) else None,
        "returned": type(out).__name__,
        "raised": raised,
        "sent": counter.bytes_sent,
        "messages": messages.log,
        "largest": largest.most,
    }


def run_cases(fn: Callable, cases: list[Case]) -> dict:
    """On each rank: every case in turn, in the same order on every rank."""
    # An outer counter keeps torch.distributed wrapped for the whole run; each case counts
    # its own calls.
    with CommCounter(), Provenance(LECTURE_SP) as seen:
        results = [_run_case(fn, case) for case in cases]
    return {"cases": results, "copied": seen.complaint()}
