"""Part of Assignment 7's checks (grading/zero.py): how ZeRO-1 and ZeRO-2 ranks communicate,
judged from the launcher's tallies of their calls, never from counts kept on the ranks.

Right values alone do not show ZeRO: a rank that all-gathers the other ranks' samples can
compute the full-batch gradient itself, and one that all-gathers the full gradients holds
what it needs too. So each step's calls (marked by `zero_ranks._train_stage12`) are held to
what the notebook's algorithm needs, in bytes by `course_lib.comm.volume`, on every rank:

- **at least the model's bytes received.** A rank ends the step with the full model, so it
  receives the other ranks' updated shards, and its own shard's gradient averages the other
  ranks' gradients, which only they have: together at least one value per element of the
  model, whatever the algorithm (ring, tree, built-in or send/recv). A rank that received
  less computed the gradient from something else: the other ranks' samples.
- **at most one all-reduce of the gradients per backward, one all-gather of the
  parameters, and `SLACK` bytes, sent and received.** Per parameter of c-element shards an
  all-reduce moves 2(P-1)c elements and an all-gather (P-1)c: a reduce-scatter, an
  all-reduce (ZeRO-1), buckets, flat buffers and rings of sends all fit; all-gathering the
  full gradients moves (P-1) times a full gradient, more than an all-reduce for P > 2.
- **no call moves the inputs**: none carries integers (the token ids are the only integers
  of the training), and none moves a tensor of a share's or a global batch's size (the
  tokens, or tokens and targets, in any dtype).

The optimizer's set-up (its constructor) needs no message at all (every rank starts from the
same model); it may move at most one broadcast of the model, and never the inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from course_lib.costs.communication import ring_bytes
from course_lib.grading._harness import calls_by_case, fail
from course_lib.grading.traffic import Sent, Traffic
from course_lib.grading.zero_memory import shard_bytes
from course_lib.grading.zero_ranks import SMALL, ZeroRun, stage12_cases

# Bytes a step may move beyond its collectives: a loss, a flag, a count (as a few small
# all-reduces would). Far below a parameter's shards (the smallest parameter is 176 bytes)
# and a tenth of what all-gathering the full gradients adds, so nothing real fits in it.
SLACK = 1024


@dataclass(frozen=True)
class Budget:
    """What one step's calls may move per rank, in bytes: received at least `least`, sent
    and received at most `most`."""

    least: int
    most: int


def step_budget(model: nn.Module, ranks: int, backwards: int) -> Budget:
    """One step with `backwards` backwards on `ranks` ranks: at least the model's bytes
    received, at most `backwards` all-reduces of the (padded) gradients, one all-gather of
    the parameters and SLACK."""
    if ranks == 1:
        return Budget(0, SLACK)
    shards = shard_bytes(model, ranks)  # c elements of every parameter, in bytes
    return Budget(shard_bytes(model, 1), (2 * backwards + 1) * (ranks - 1) * shards + SLACK)


def setup_budget(model: nn.Module, ranks: int) -> Budget:
    """The optimizer's constructor: at most one broadcast of the model (P-1 copies of it
    sent by the root)."""
    return Budget(0, (ranks - 1) * shard_bytes(model, 1) + SLACK)


def backwards_in_step(run: ZeroRun, s: int, ranks: int) -> int:
    """How many backwards step s runs (`ZeroRun.backwards` on a share of batch_size / P rows)."""
    return 2 if run.accumulates(s) and run.batch_size // ranks >= 2 else 1


# --- the inputs ---------------------------------------------------------------------------


def input_elements(run: ZeroRun, ranks: int) -> dict[int, str]:
    """Element counts of what a call moving the inputs would carry, and what they are: a
    rank's share of a batch (tokens; tokens and targets) and a whole global batch."""
    share = run.batch_size // ranks * SMALL.seq_len
    whole = run.batch_size * SMALL.seq_len
    return {
        whole * 2: "a global batch's tokens and targets",
        whole: "a global batch's tokens",
        share * 2: "a rank's share of the tokens and targets",
        share: "a rank's share of the tokens",
    }


def _itemsize(dtype: str) -> int | None:
    value = getattr(torch, dtype, None)
    return torch.empty(0, dtype=value).element_size() if isinstance(value, torch.dtype) else None


def _volumes(op: str, nbytes: int, p: int) -> set[tuple[int, int]]:
    """The (sent, received) a call of `op` on an `nbytes` tensor (its piece) reports, as
    `comm.volume` counts it, in each role it can have."""
    gather_like = (p - 1) * nbytes
    if op == "all_reduce":
        ring = ring_bytes(nbytes, p, passes=2)
        return {(ring, ring)}
    if op in ("all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor"):
        return {(gather_like, gather_like)}
    if op in ("broadcast", "scatter"):
        return {(gather_like, 0), (0, nbytes)}
    if op in ("reduce", "gather"):
        return {(0, gather_like), (nbytes, 0)}
    if op == "send":
        return {(nbytes, 0)}
    if op == "recv":
        return {(0, nbytes)}
    return set()


def moved_inputs(call: Sent, run: ZeroRun, ranks: int) -> str | None:
    """What of the inputs `call` looks like it moves, or None: integers, or a tensor of an
    input's size in one of the call's dtypes."""
    integers = [d for d in call.dtypes if d.startswith(("int", "uint"))]
    if integers:
        return f"{'/'.join(integers)} tensors (the token ids are the only integers)"
    p = len(call.group)
    if p < 2:
        return None
    for dtype in call.dtypes:
        size = _itemsize(dtype)
        for elements, what in input_elements(run, ranks).items():
            if size and (call.sent, call.received) in _volumes(call.op, elements * size, p):
                return f"{elements} {dtype} values, the size of {what}"
    return None


# --- judging ------------------------------------------------------------------------------


def stage12_calls(check: str, traffic: Traffic, steps: int) -> list[list[list[Sent]]]:
    """Per rank, per case (the set-up, then each step), the calls the launcher received.
    Marks not the check's own fail the part as tampering (`calls_by_case`)."""
    __tracebackhide__ = True
    return calls_by_case(check, traffic.tallies, stage12_cases(steps))


def _describe(case: int) -> str:
    return "the optimizer's constructor" if case == 0 else f"step {case - 1}"


def judge_inputs_not_moved(
    check: str, per_case: list[list[list[Sent]]], run: ZeroRun, where: str
) -> None:
    """No call of any rank, in any case, moves the inputs."""
    __tracebackhide__ = True
    ranks = len(per_case)
    for r, cases in enumerate(per_case):
        for case, calls in enumerate(cases):
            for call in calls:
                what = moved_inputs(call, run, ranks)
                if what:
                    fail(
                        check,
                        f"rank {r}, {_describe(case)} ({where}): a {call.op} moved {what} "
                        f"({call.sent:,} bytes sent, {call.received:,} received).\nHint: "
                        "each rank trains on its own share of the batch only; what ZeRO "
                        "communicates is gradients (reduced into each rank's shard) and the "
                        "updated parameter shards (all-gathered), never the samples",
                    )


def judge_step_bytes(
    check: str, per_case: list[list[list[Sent]]], model: nn.Module, run: ZeroRun, where: str
) -> list[int]:
    """Every rank's bytes in the set-up and in every step, within their budgets; the most a
    rank sent or received in a step (for what a passing check says)."""
    __tracebackhide__ = True
    ranks = len(per_case)
    most = []
    for r, cases in enumerate(per_case):
        for case, calls in enumerate(cases):
            sent = sum(c.sent for c in calls)
            received = sum(c.received for c in calls)
            if case == 0:
                budget = setup_budget(model, ranks)
            else:
                budget = step_budget(model, ranks, backwards_in_step(run, case - 1, ranks))
                most.append(max(sent, received))
            _judge_budget(check, r, case, sent, received, budget, ranks, where)
    return most


def _judge_budget(
    check: str, r: int, case: int, sent: int, received: int, budget: Budget, ranks: int, where
) -> None:
    __tracebackhide__ = True
    at = f"rank {r}, {_describe(case)} ({where})"
    if received < budget.least:
        fail(
            check,
            f"{at}: it received {received:,} bytes; a step needs at least the model's "
            f"{budget.least:,} (the other ranks' updated shards, and their gradients for "
            "this rank's shard).\nHint: average the gradients over the ranks with a "
            "reduce-scatter (or an all-reduce), never by computing them from other ranks' "
            "samples, then all-gather the updated shards",
        )
    for verb, nbytes in (("sent", sent), ("received", received)):
        if nbytes > budget.most:
            fail(check, f"{at}: it {verb} {nbytes:,} bytes; {_allowed(case, budget, ranks)}")


def _allowed(case: int, budget: Budget, ranks: int) -> str:
    if case == 0:
        return (
            f"the constructor may move at most {budget.most:,} (one broadcast of the model "
            f"and {SLACK:,} bytes).\nHint: every rank starts from the same model: it needs "
            "no message to take its shards"
        )
    return (
        f"at most {budget.most:,} are allowed: per backward one all-reduce of the gradients "
        f"(2(P-1)c elements per parameter of c-element shards, P = {ranks}), one all-gather "
        f"of the parameters ((P-1)c elements), and {SLACK:,} bytes.\nHint: reduce-scatter "
        "the gradients so that each rank gets only its shard's average; all-gathering full "
        "gradients (or anything else) moves P-1 times the model"
    )


def verified_communication(most: list[int], model: nn.Module, ranks: int) -> str:
    """What a passing check says of the communication ("" on one rank, which has none)."""
    if ranks == 1 or not most:
        return ""
    return (
        f"; no call moved the inputs, and every rank received at least the model's "
        f"{shard_bytes(model, 1):,} bytes in each step and moved at most {max(most):,} "
        "(within one all-reduce of the gradients per backward and one all-gather of the "
        "parameters)"
    )
