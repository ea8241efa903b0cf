"""Checks for Assignment 9, tensor (Megatron) parallelism.

    check_column_parallel_linear(ColumnParallelLinear)   y_r = x A_r^T + b_r, x.grad all-reduced
    check_row_parallel_linear(RowParallelLinear)         y = sum_r x_r A_r^T + b, one all-reduce
    check_parallel_mlp(ParallelMLP)                      MLPBlock: column, GELU, row
    check_parallel_attention(ParallelSelfAttention)      CausalSelfAttention split by heads
    check_vocab_parallel_cross_entropy(fn)               the loss of vocabulary-split logits

Every layer is built on each rank from a dense layer (`torch.nn.Linear`,
`course_lib.models.MLPBlock`, `course_lib.models.CausalSelfAttention`, float64) whose weights
the check draws from a secret, new at every call, in the checking process; rank r's copy
holds only rank r's shard (zeros elsewhere: a rank holds nothing of the others' shards). It is
run forward on the input and backward with the upstream gradient as a rank of the layer
holds them (drawn there too). Its output, the gradient of its input and the gradients of its
weight shards must equal the dense layer's, computed in the checking process, on 1, 2 and 4
ranks, to float64 rounding; the layer holds copies, so the dense layer it was built from
stays as it was (values and no gradients). Its collective calls are judged from the
launcher's record of what each rank's process group did, forward and backward apart.

Sharding (P ranks, rank r, "block r of n" = rows or columns r*n/P .. (r+1)*n/P - 1):
- column-parallel: `weight` holds block r of the dense weight's rows (output features),
  `bias` block r of the bias; forward returns block r of the output features (or all of
  them with gather_output=True).
- row-parallel: `weight` holds block r of the dense weight's columns (input features),
  `bias` the whole bias, added once after the all-reduce; forward takes block r of the input
  features and returns the whole output.
- MLP: `fc` column-parallel, `proj` row-parallel. Attention: rank r owns heads
  r*H/P .. (r+1)*H/P - 1; `qkv.weight` holds those heads' query rows, then their key rows,
  then their value rows; `proj` is row-parallel.

The checks stand on their parts:
    tensor_parallel_shards.py   the cases, their secret draws, where each rank's shard sits
    tensor_parallel_ranks.py    what runs on each rank: the layer built, run, nudged, run again
    tensor_parallel_judge.py    each rank's shards, numbers and collective calls judged
    tensor_parallel_loss.py     Part 5: the loss without the full logits, and its byte budget
"""

from __future__ import annotations

from collections.abc import Callable

from course_lib.calls import PerRank
from course_lib.grading._harness import (
    RESULT,
    Verdict,
    calls_by_case,
    fail,
    judge_unreported,
    measured,
    new_secret,
    run_on_ranks,
)
from course_lib.grading.tensor_parallel_judge import ATOL, COMMUNICATION, RTOL, judge_case
from course_lib.grading.tensor_parallel_loss import (
    LOSS_WORLD_SIZES,
    NUMBERS_PER_TOKEN,
    VOCAB,
    draw_loss,
    judge_loss_case,
    loss_cases,
    loss_given,
    run_loss_cases,
)
from course_lib.grading.tensor_parallel_ranks import MARKS_PER_CASE, run_cases
from course_lib.grading.tensor_parallel_shards import (
    Case,
    assemble,
    block,
    dense_layer,
    draw,
    expected_shards,
    given,
    head_rows,
    shard_index,
)

WORLD_SIZES = (1, 2, 4)
# A layer's points: half for its result (the shards it holds, its output and gradients), half
# for making Megatron's collective calls, which count only when the result is right.
TP_WEIGHTS = {RESULT: 0.5, "communication": 0.5}


def _check(check: str, cls: Callable, cases: list[Case], world_sizes, timeout: float) -> None:
    __tracebackhide__ = True
    if not cases:
        raise ValueError("nothing to check: give at least one seed")
    for P in world_sizes:
        if P not in WORLD_SIZES:
            raise ValueError(f"world sizes must divide the layer sizes: use 1, 2 or 4, got {P}")
    verdict = Verdict(check, TP_WEIGHTS)
    what = f"your {getattr(cls, '__name__', 'layer')}"
    for P in world_sizes:
        drawn = [draw(case, new_secret(), P) for case in cases]
        shares = PerRank(
            [[given(case, d, r, P) for case, d in zip(cases, drawn, strict=True)] for r in range(P)]
        )
        found, traffic = run_on_ranks(
            check, run_cases, cls, cases, shares, world_size=P, timeout=timeout, what=what,
            traffic=True,
        )  # fmt: skip
        if found[0]["copied"]:
            fail(check, found[0]["copied"])
        # Bytes on a rank's sockets that no reported call accounts for: calls made around
        # the counted group (its inner gloo group, say). Judged where a rank reported only
        # sends and receives, or nothing: a layer that hides all its all-reduces.
        judge_unreported(check, traffic)
        # Per rank, per case: the calls its process group reported in the forward (mark
        # 4i + 1) and in the backward (4i + 2) of the first pass.
        marked = calls_by_case(check, traffic.tallies, MARKS_PER_CASE * len(cases))
        for i, case in enumerate(cases):
            results = [per_rank["cases"][i] for per_rank in found]
            calls = [
                {"forward": mine[MARKS_PER_CASE * i + 1], "backward": mine[MARKS_PER_CASE * i + 2]}
                for mine in marked
            ]
            judge_case(check, verdict, case, drawn[i], results, calls, P)
    verdict.conclude(_verified(cases, world_sizes))


def _verified(cases: list[Case], world_sizes: tuple[int, ...]) -> str:
    """What a passing check verified: the cases, the numbers and the collective calls."""
    kinds = {"column": "column-parallel linear", "row": "row-parallel linear"}
    what = kinds.get(cases[0].kind, cases[0].kind)
    forward, backward = COMMUNICATION[cases[0].kind]
    calls = f"forward {_said(forward)}, backward {_said(backward)}"
    if any(case.gather_output for case in cases):
        calls += " (one all_gather in forward with gather_output=True)"
    verified = (
        f"{len(cases)} {what} case(s) on {', '.join(str(P) for P in world_sizes)} rank(s): "
        "every rank's shards, output, input gradient and shard gradients equal the dense "
        f"layer's (rtol {RTOL:g}, atol {ATOL:g}), also with secretly changed shards, and the "
        "dense layer stayed as it was"
    )
    if max(world_sizes) > 1:
        verified += f"; the collective calls were Megatron's: {calls}"
    return verified


def _said(calls: dict[str, int]) -> str:
    return ", ".join(f"{n} {op}" for op, n in calls.items()) or "none"


def check_column_parallel_linear(
    ColumnParallelLinear: Callable,  # noqa: N803 (a class)
    *,
    world_sizes: tuple[int, ...] = WORLD_SIZES,
    seeds: tuple[int, ...] = (0,),
    timeout: float = 30.0,
) -> None:
    """`ColumnParallelLinear(linear, gather_output=False)` holds block r of the rows of
    linear.weight (and of its bias); forward returns block r of the output features (all of
    them with gather_output=True); x.grad is the dense layer's (all-reduced in backward)."""
    __tracebackhide__ = True
    cases = [
        Case("column", seed=s, in_features=8 + 4 * s, out_features=12, bias=b, gather_output=g)
        for s in seeds
        for b, g in ((True, False), (False, False), (True, True))
    ]
    _check("check_column_parallel_linear", ColumnParallelLinear, cases, world_sizes, timeout)


def check_row_parallel_linear(
    RowParallelLinear: Callable,  # noqa: N803 (a class)
    *,
    world_sizes: tuple[int, ...] = WORLD_SIZES,
    seeds: tuple[int, ...] = (0,),
    timeout: float = 30.0,
) -> None:
    """`RowParallelLinear(linear)` holds block r of the columns of linear.weight and the whole
    bias; forward takes block r of the input features and returns the whole output (partial
    products summed by an all-reduce, bias added once after it)."""
    __tracebackhide__ = True
    cases = [
        Case("row", seed=s, in_features=12, out_features=8 + 4 * s, bias=b)
        for s in seeds
        for b in (True, False)
    ]
    _check("check_row_parallel_linear", RowParallelLinear, cases, world_sizes, timeout)


def check_parallel_mlp(
    ParallelMLP: Callable,  # noqa: N803 (a class)
    *,
    world_sizes: tuple[int, ...] = WORLD_SIZES,
    seeds: tuple[int, ...] = (0,),
    timeout: float = 30.0,
) -> None:
    """`ParallelMLP(block)` for a course_lib.models.MLPBlock: `fc` column-parallel, GELU on the
    local features, `proj` row-parallel; one all-reduce in forward and one in backward."""
    __tracebackhide__ = True
    cases = [Case("mlp", seed=s, in_features=8, out_features=16 + 8 * s) for s in seeds]
    _check("check_parallel_mlp", ParallelMLP, cases, world_sizes, timeout)


def check_parallel_attention(
    ParallelSelfAttention: Callable,  # noqa: N803 (a class)
    *,
    world_sizes: tuple[int, ...] = WORLD_SIZES,
    seeds: tuple[int, ...] = (0,),
    timeout: float = 30.0,
) -> None:
    """`ParallelSelfAttention(attn)` for a course_lib.models.CausalSelfAttention: rank r
    computes heads r*H/P .. (r+1)*H/P - 1 (`qkv` holds their q, k, v rows), `proj` is
    row-parallel; one all-reduce in forward and one in backward."""
    __tracebackhide__ = True
    cases = [
        Case("attention", seed=s, in_features=16, n_heads=4 * (1 + s % 2), batch=(2, 5))
        for s in seeds
    ]
    _check("check_parallel_attention", ParallelSelfAttention, cases, world_sizes, timeout)


def check_vocab_parallel_cross_entropy(
    vocab_parallel_cross_entropy: Callable,
    *,
    world_sizes: tuple[int, ...] = (2, 4),
    seeds: tuple[int, ...] = (0,),
    timeout: float = 30.0,
) -> None:
    """`vocab_parallel_cross_entropy(local_logits, targets)`, rank r holding columns
    r*V/P .. (r+1)*V/P - 1 of the (tokens, V) logits: the mean cross-entropy on every rank,
    each rank's block of the gradient in backward, neither argument changed in place, and at
    most NUMBERS_PER_TOKEN float64 numbers per token sent (and received) by a rank, forward
    and backward together."""
    __tracebackhide__ = True
    check = "check_vocab_parallel_cross_entropy"
    if not seeds:
        raise ValueError("nothing to check: give at least one seed")
    for P in world_sizes:
        if P not in LOSS_WORLD_SIZES:
            raise ValueError(f"world sizes must divide V = {VOCAB}: use 1 to 4, got {P}")
    cases = [case for seed in seeds for case in loss_cases(seed)]
    verdict, most = Verdict(check), 0
    for P in world_sizes:
        drawn = [draw_loss(case, new_secret(), P) for case in cases]
        shares = PerRank([[loss_given(*d, r, P) for d in drawn] for r in range(P)])
        found, traffic = run_on_ranks(
            check, run_loss_cases, vocab_parallel_cross_entropy, cases, shares, world_size=P,
            timeout=timeout, what="your vocab_parallel_cross_entropy", traffic=True,
        )  # fmt: skip
        if found[0]["copied"]:
            fail(check, found[0]["copied"])
        judge_unreported(check, traffic)  # as for the layers (`_check`)
        marked = calls_by_case(check, traffic.tallies, len(cases))  # per rank, per case
        for i, case in enumerate(cases):
            results = [per_rank["cases"][i] for per_rank in found]
            calls = [mine[i] for mine in marked]
            most = max(most, judge_loss_case(check, verdict, case, drawn[i], results, calls, P))
    verdict.conclude(
        f"{len(cases)} cases (V = {VOCAB}, float64, logits near 1000 among them, each rank's "
        f"block secret) on {', '.join(str(P) for P in world_sizes)} rank(s): neither "
        "local_logits nor targets changed in place; every rank's loss equals "
        f"F.cross_entropy's on the whole logits and its gradient is its block of the full "
        f"gradient (rtol {RTOL:g}, atol {ATOL:g}); a rank sent or received at most "
        f"{most:g} numbers per token (budget {NUMBERS_PER_TOKEN})"
    )
    what = "numbers per token the busiest rank sent or received"
    measured(check, what, most, "float64 numbers / token", combine="worst")


__all__ = [
    "Case",
    "block",
    "check_column_parallel_linear",
    "check_parallel_attention",
    "check_parallel_mlp",
    "check_row_parallel_linear",
    "check_vocab_parallel_cross_entropy",
    "dense_layer",
    "assemble",
    "expected_shards",
    "head_rows",
    "shard_index",
]
