"""Checks for Assignment 9, tensor (Megatron) parallelism.

    check_column_parallel_linear(ColumnParallelLinear)   y_r = x A_r^T + b_r, x.grad all-reduced
    check_row_parallel_linear(RowParallelLinear)         y = sum_r x_r A_r^T + b, one all-reduce
    check_parallel_mlp(ParallelMLP)                      MLPBlock: column, GELU, row
    check_parallel_attention(ParallelSelfAttention)      CausalSelfAttention split by heads

Every layer is built on each rank from the same dense layer (`torch.nn.Linear`,
`course_lib.models.MLPBlock`, `course_lib.models.CausalSelfAttention`, seeded, float64), run
forward on the same input, and backward with the same upstream gradient. Its output, the
gradient of its input and the gradients of its weight shards must equal the dense layer's, on
1, 2 and 4 ranks, to float64 rounding.

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
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from course_lib import compare
from course_lib.comm import CommCounter
from course_lib.grading._harness import RESULT, Verdict, fail, run_on_ranks
from course_lib.grading.provenance import Provenance
from course_lib.models import CausalSelfAttention, GPTConfig, MLPBlock
from course_lib.runtime import rank, world_size

DTYPE = torch.float64
RTOL, ATOL = 1e-10, 1e-10  # float64: a sum split across ranks differs by ~1e-15
WORLD_SIZES = (1, 2, 4)
# A layer's points: half for its result (the shards it holds, its output and gradients), half
# for making Megatron's collective calls, which count only when the result is right.
TP_WEIGHTS = {RESULT: 0.5, "communication": 0.5}


@dataclass(frozen=True)
class Case:
    """One layer to check: which kind, its sizes and the seed of its weights and data."""

    kind: str  # "column", "row", "mlp" or "attention"
    seed: int = 0
    in_features: int = 8  # d_model for "mlp" and "attention"
    out_features: int = 12  # d_ff for "mlp"; unused for "attention"
    n_heads: int = 4
    bias: bool = True
    gather_output: bool = False
    batch: tuple[int, ...] = (3, 5)  # leading dimensions of the input

    def describe(self, ranks: int) -> str:
        if self.kind in ("column", "row"):
            extra = ", gather_output=True" if self.gather_output else ""
            extra += "" if self.bias else ", bias=False"
            what = f"nn.Linear({self.in_features}, {self.out_features}{extra})"
        elif self.kind == "mlp":
            what = f"MLPBlock(d_model={self.in_features}, d_ff={self.out_features})"
        else:
            what = f"CausalSelfAttention(d_model={self.in_features}, n_heads={self.n_heads})"
        return f"{what}, seed {self.seed}, input {self.input_shape()}, on {ranks} rank(s)"

    def input_shape(self) -> tuple[int, ...]:
        return (*self.batch, self.in_features)

    def output_features(self) -> int:
        return self.out_features if self.kind in ("column", "row") else self.in_features


def dense_layer(case: Case) -> nn.Module:
    """The seeded float64 dense layer that the parallel one is built from."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(case.seed)
        if case.kind in ("column", "row"):
            return nn.Linear(case.in_features, case.out_features, bias=case.bias, dtype=DTYPE)
        config = GPTConfig(d_model=case.in_features, d_ff=case.out_features, n_heads=case.n_heads)
        if case.kind == "mlp":
            return MLPBlock(config, DTYPE)
        return CausalSelfAttention(config, DTYPE)


def _data(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """The input x and the upstream gradient of the whole output (same on every rank)."""
    g = torch.Generator().manual_seed(10_000 + case.seed)
    x = torch.randn(case.input_shape(), generator=g, dtype=DTYPE)
    grad = torch.randn((*case.batch, case.output_features()), generator=g, dtype=DTYPE)
    return x, grad


def block(n: int, r: int, ranks: int) -> slice:
    """Rank r's contiguous block of n rows or columns."""
    return slice(r * n // ranks, (r + 1) * n // ranks)


def head_rows(d_model: int, r: int, ranks: int) -> torch.Tensor:
    """Rows of the dense qkv weight that rank r holds: its heads' q rows, then k, then v."""
    rows = torch.arange(d_model)[block(d_model, r, ranks)]
    return torch.cat([rows, rows + d_model, rows + 2 * d_model])


def shard_index(case: Case, name: str, r: int, ranks: int) -> tuple | None:
    """Where rank r's share of dense parameter `name` sits in it (`dense[index]`), or None
    for a parameter every rank holds whole (a row-parallel bias)."""
    if case.kind == "column":
        return (block(case.out_features, r, ranks),)
    if case.kind == "row":
        return (slice(None), block(case.in_features, r, ranks)) if name == "weight" else None
    if name == "proj.bias":
        return None
    inner = case.out_features if case.kind == "mlp" else case.in_features
    if name == "proj.weight":
        return (slice(None), block(inner, r, ranks))
    if case.kind == "mlp":  # fc: a block of rows
        return (torch.arange(case.out_features)[block(case.out_features, r, ranks)],)
    return (head_rows(case.in_features, r, ranks),)  # qkv: this rank's heads' q, k, v rows


def expected_shards(case: Case, dense: dict[str, torch.Tensor], r: int, ranks: int) -> dict:
    """Rank r's share of each dense tensor (weights, or their gradients), by name."""
    out = {}
    for name, t in dense.items():
        index = shard_index(case, name, r, ranks)
        out[name] = t if index is None else t[index]
    return out


def assemble(case: Case, dense: dict[str, torch.Tensor], shards: list[dict]) -> dict:
    """The dense parameters with every rank's shard written back in its place (shared
    tensors from rank 0): the layer the ranks compute together."""
    out = {name: t.clone() for name, t in dense.items()}
    for r, held in enumerate(shards):
        for name in out:
            index = shard_index(case, name, r, len(shards))
            if index is not None:
                out[name][index] = held[name]
            elif r == 0:
                out[name] = held[name].clone()
    return out


# --- what runs on each rank ---------------------------------------------------------------


# The lecture's tensor-parallel module answers every part as it stands: an answer that runs
# any of it, or a copy, is not the student's own.
LECTURE_TP = ("course_lib.tensor_parallel", "course_lib.measure.tensor_parallel")


def _run_cases(cls: Callable, cases: list[Case]) -> dict:
    with Provenance(LECTURE_TP) as seen:
        results = [_run_case(cls, case) for case in cases]
    return {"cases": results, "copied": seen.complaint()}


def _run_case(cls: Callable, case: Case) -> dict:
    """Build the student's layer from the dense one, run forward and backward, and record
    the weights it holds, its output, the gradients and the collectives it called. Then
    nudge every shard it holds by a secret amount and run forward and backward again: the
    layer must compute with the shards the ranks hold, not with a copy of the dense layer."""
    r, ranks = rank(), world_size()
    dense = dense_layer(case)
    layer = cls(dense, gather_output=True) if case.gather_output else cls(dense)
    held = {name: p.detach().clone() for name, p in layer.named_parameters()}
    first = _forward_backward(case, layer, r, ranks)
    grads = {name: _copy(p.grad) for name, p in layer.named_parameters()}
    nudged = _nudge(case, layer, r, ranks)
    second = _forward_backward(case, layer, r, ranks) if nudged is not None else None
    return {"held": held, **first, "grads": grads, "nudged": nudged, "after_nudge": second}


def _copy(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().clone()


def _forward_backward(case: Case, layer: nn.Module, r: int, ranks: int) -> dict:
    x, grad = _data(case)
    if case.kind == "row":  # the input arrives split by features
        x = x[..., block(case.in_features, r, ranks)]
    x = x.clone().requires_grad_(True)
    if case.kind == "column" and not case.gather_output:  # the output stays split
        grad = grad[..., block(case.out_features, r, ranks)]
    with CommCounter() as forward_comm:
        out = layer(x)
    with CommCounter() as backward_comm:
        out.backward(grad)
    return {
        "out": out.detach(),
        "x_grad": x.grad,
        "forward_calls": dict(forward_comm.calls),
        "backward_calls": dict(backward_comm.calls),
    }


def _nudge(case: Case, layer: nn.Module, r: int, ranks: int) -> dict | None:
    """Add a secret random amount to each sharded parameter, in place, as an optimizer step
    would; return the parameters after it (None if they are not the expected ones)."""
    params = dict(layer.named_parameters())
    if set(params) != {name for name, _ in dense_layer(case).named_parameters()}:
        return None  # _compare_held reports it
    g = torch.Generator().manual_seed(secrets.randbits(62))
    with torch.no_grad():
        for name, p in params.items():
            if shard_index(case, name, r, ranks) is not None:
                p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
            p.grad = None
    return {name: p.detach().clone() for name, p in params.items()}


# --- the dense reference, in the checking process -----------------------------------------


def _reference(case: Case, params: dict | None = None) -> dict:
    dense = dense_layer(case)
    if params is not None:
        dense.load_state_dict(params)
    x, grad = _data(case)
    x.requires_grad_(True)
    out = dense(x)
    out.backward(grad)
    return {
        "params": {n: p.detach() for n, p in dense.named_parameters()},
        "out": out.detach(),
        "x_grad": x.grad,
        "grads": {n: p.grad for n, p in dense.named_parameters()},
        "upstream": grad,
    }


# --- comparing ----------------------------------------------------------------------------


def _shard_hint(case: Case, name: str, got: torch.Tensor, full: torch.Tensor, r: int, P: int):
    """Why a held weight is not the expected shard, when the mistake is a common one."""
    if case.kind == "attention" and name == "qkv.weight" and got.shape[0] == full.shape[0] // P:
        if torch.equal(got, full[block(full.shape[0], r, P)]):
            return (
                "it is block r of all 3*d_model rows, which mixes queries, keys and values "
                "of different heads. Take this rank's heads' rows from each of q, k and v "
                "(rows h*head_dim.. of each d_model-row third) and stack them q, k, v"
            )
    if got.dim() == 2 and got.shape == full[r::P].shape and torch.equal(got, full[r::P]):
        return "it holds every P-th row (full[r::P]); hold one contiguous block of rows"
    if got.dim() == 2 and got.shape[::-1] == full.shape[::-1][:2] and got.shape != full.shape:
        return "is the weight split along the right dimension (rows = output features)?"
    return (
        "column-parallel layers hold a block of the weight's rows (output features), "
        "row-parallel layers a block of its columns (input features) and the whole bias"
    )


def _compare_held(check: str, case: Case, ref: dict, result: dict, r: int, P: int) -> None:
    __tracebackhide__ = True
    at = f"rank {r} ({case.describe(P)})"
    want = expected_shards(case, ref["params"], r, P)
    got = result["held"]
    if set(got) != set(want):
        fail(
            check,
            f"{at}: the layer's parameters are named {sorted(got)}, expected {sorted(want)} "
            "(register this rank's shards as nn.Parameters with these names, and nothing else)",
        )
    for name, expected in want.items():
        problem = compare.find_mismatch({name: got[name]}, {name: expected}, rtol=0.0, atol=0.0)
        if problem:
            hint = _shard_hint(case, name, got[name], ref["params"][name], r, P)
            fail(check, f"{at}: right after construction, {problem}.\nHint: {hint}")


def _output_hint(case: Case, got: torch.Tensor, want: torch.Tensor, ref: dict, P: int) -> str:
    bias_name = {"row": "bias", "mlp": "proj.bias", "attention": "proj.bias"}.get(case.kind)
    bias = ref["params"].get(bias_name) if bias_name else None
    if P > 1 and bias is not None and got.shape == want.shape:
        if torch.allclose(got, want + (P - 1) * bias, rtol=1e-8, atol=1e-8):
            return (
                f"it is the right output plus {P - 1} extra copies of the bias: add the "
                "row-parallel bias once, after the all-reduce, not on every rank before it"
            )
    if case.kind in ("row", "mlp", "attention") and P > 1:
        return (
            "the partial outputs x_r A_r^T of the ranks must be summed with one all-reduce "
            "in forward (backward passes the gradient through unchanged)"
        )
    return "check which block of rows this rank holds and how the output is formed"


def _rank_view(case: Case, ref: dict, r: int, P: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The output and input gradient rank r should have: the dense layer's, or its block."""
    want_out, want_x = ref["out"], ref["x_grad"]
    if case.kind == "column" and not case.gather_output:
        want_out = want_out[..., block(case.out_features, r, P)]
    if case.kind == "row":
        want_x = want_x[..., block(case.in_features, r, P)]
    return want_out, want_x


def _compare_nudged(check: str, case: Case, results: list[dict], P: int) -> None:
    """After every rank's shards were nudged, the layer must compute the dense layer that
    those shards form: a layer that kept a copy of the dense weights does not."""
    __tracebackhide__ = True
    if any(res["nudged"] is None for res in results):
        return
    dense = {name: p.detach() for name, p in dense_layer(case).named_parameters()}
    ref = _reference(case, assemble(case, dense, [res["nudged"] for res in results]))
    for r, res in enumerate(results):
        want_out, want_x = _rank_view(case, ref, r, P)
        got = res["after_nudge"]
        problem = compare.find_mismatch(
            {"output": got["out"], "x.grad": got["x_grad"]},
            {"output": want_out, "x.grad": want_x},
            rtol=RTOL,
            atol=ATOL,
        )
        if problem:
            fail(
                check,
                f"rank {r} ({case.describe(P)}): after the check changed the shards your layer "
                f"holds (its parameters, in place, as an optimizer step would), {problem}.\n"
                "Hint: compute with the parameters the layer registers, and only with them: "
                "no copy of the dense layer's weights, nothing cached from them at construction",
            )


def _compare_result(check: str, case: Case, ref: dict, result: dict, r: int, P: int) -> None:
    __tracebackhide__ = True
    at = f"rank {r} ({case.describe(P)})"
    want_out, want_x = _rank_view(case, ref, r, P)
    problem = compare.find_mismatch(
        {"output": result["out"]}, {"output": want_out}, rtol=RTOL, atol=ATOL
    )
    if problem:
        hint = _output_hint(case, result["out"], want_out, ref, P)
        fail(
            check,
            f"{at}: the forward output differs from the dense layer's: {problem}.\nHint: {hint}",
        )

    if result["x_grad"] is None:
        fail(check, f"{at}: the input got no gradient; is the output connected to x in autograd?")
    problem = compare.find_mismatch(
        {"x.grad": result["x_grad"]}, {"x.grad": want_x}, rtol=RTOL, atol=ATOL
    )
    if problem:
        hint = (
            "each rank's backward gives only its own shard's part of the input's gradient; "
            "the input must pass through a function that is the identity in forward and "
            "all-reduces the gradient in backward"
            if case.kind != "row" and P > 1
            else "the gradient of the input must equal the dense layer's"
        )
        fail(
            check,
            f"{at}: the input's gradient differs from the dense layer's: {problem}.\nHint: {hint}",
        )

    want_grads = expected_shards(case, ref["grads"], r, P)
    for name, expected in want_grads.items():
        got = result["grads"].get(name)
        if got is None:
            fail(check, f"{at}: parameter {name!r} got no gradient in backward")
        problem = compare.find_mismatch(
            {f"{name}.grad": got}, {f"{name}.grad": expected}, rtol=RTOL, atol=ATOL
        )
        if problem:
            fail(
                check,
                f"{at}: the gradient of this rank's shard differs from the same block of the "
                f"dense layer's gradient: {problem}",
            )


# The collectives each layer makes when P > 1, forward and backward (gather_output=True adds
# one all-gather to a column-parallel forward).
COMMUNICATION = {
    "column": ({}, {"all_reduce": 1}),
    "row": ({"all_reduce": 1}, {}),
    "mlp": ({"all_reduce": 1}, {"all_reduce": 1}),
    "attention": ({"all_reduce": 1}, {"all_reduce": 1}),
}
_WHY = {
    "column": "no communication in forward (all-gather only with gather_output=True); one "
    "all-reduce of the input's gradient in backward",
    "row": "one all-reduce of the partial outputs in forward; none in backward",
    "mlp": "column-parallel in, row-parallel out, no gather in between: one all-reduce in "
    "forward, one in backward",
    "attention": "one all-reduce in forward (in proj), one in backward (on the input)",
}


def _calls(counted: dict) -> dict:
    """Collective calls by kind, the all-gather variants as one."""
    out: dict[str, int] = {}
    for op, n in counted.items():
        kind = "all_gather" if op.startswith("all_gather") else op
        out[kind] = out.get(kind, 0) + n
    return out


def _compare_communication(check: str, case: Case, result: dict, r: int, P: int) -> None:
    """The collectives of Megatron's layers, on every route (the grading ranks count them
    at the process group)."""
    __tracebackhide__ = True
    if P == 1:
        return
    at = f"rank {r} ({case.describe(P)})"
    forward, backward = COMMUNICATION[case.kind]
    if case.kind == "column" and case.gather_output:
        forward = {"all_gather": 1}
    for phase, want in (("forward", forward), ("backward", backward)):
        calls = _calls(result[f"{phase}_calls"])
        if calls != want:
            fail(
                check,
                f"{at}: the {phase} pass made these collective calls: {calls or 'none'}, "
                f"expected {want or 'none'}. The tensor-parallel {case.kind} layer makes "
                f"{_WHY[case.kind]}",
                prop="communication",
            )


# --- the checks ---------------------------------------------------------------------------


def _check(check: str, cls: Callable, cases: list[Case], world_sizes, timeout: float) -> None:
    __tracebackhide__ = True
    if not cases:
        raise ValueError("nothing to check: give at least one seed")
    for P in world_sizes:
        if P not in WORLD_SIZES:
            raise ValueError(f"world sizes must divide the layer sizes: use 1, 2 or 4, got {P}")
    verdict = Verdict(check, TP_WEIGHTS)
    for P in world_sizes:
        found = run_on_ranks(
            check,
            _run_cases,
            cls,
            cases,
            world_size=P,
            timeout=timeout,
            what=f"your {getattr(cls, '__name__', 'layer')}",
        )
        if found[0]["copied"]:
            fail(check, found[0]["copied"])
        for i, case in enumerate(cases):
            ref = _reference(case)
            results = [per_rank["cases"][i] for per_rank in found]
            with verdict.case():
                for r, result in enumerate(results):
                    _compare_held(check, case, ref, result, r, P)
                for r, result in enumerate(results):
                    _compare_result(check, case, ref, result, r, P)
                _compare_nudged(check, case, results, P)
            with verdict.case():
                for r, result in enumerate(results):
                    _compare_communication(check, case, result, r, P)
    kinds = {"column": "column-parallel linear", "row": "row-parallel linear"}
    what = kinds.get(cases[0].kind, cases[0].kind)
    forward, backward = COMMUNICATION[cases[0].kind]
    calls = f"forward {_said(forward)}, backward {_said(backward)}"
    if any(case.gather_output for case in cases):
        calls += " (one all_gather in forward with gather_output=True)"
    verified = (
        f"{len(cases)} {what} case(s) on {', '.join(str(P) for P in world_sizes)} rank(s): "
        "every rank's shards, output, input gradient and shard gradients equal the dense "
        f"layer's (rtol {RTOL:g}, atol {ATOL:g}), also with secretly changed shards"
    )
    if max(world_sizes) > 1:
        verified += f"; the collective calls were Megatron's: {calls}"
    verdict.conclude(verified)


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


__all__ = [
    "Case",
    "block",
    "check_column_parallel_linear",
    "check_parallel_attention",
    "check_parallel_mlp",
    "check_row_parallel_linear",
    "dense_layer",
    "assemble",
    "expected_shards",
    "head_rows",
    "shard_index",
]
