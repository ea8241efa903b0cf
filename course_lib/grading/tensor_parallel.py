"""Checks for Assignment 5, tensor (Megatron) parallelism.

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

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from course_lib import compare
from course_lib.comm import CommCounter
from course_lib.grading._harness import fail, run_on_ranks
from course_lib.models import CausalSelfAttention, GPTConfig, MLPBlock
from course_lib.runtime import rank, world_size

DTYPE = torch.float64
RTOL, ATOL = 1e-10, 1e-10  # float64: a sum split across ranks differs by ~1e-15
WORLD_SIZES = (1, 2, 4)


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


def expected_shards(case: Case, dense: dict[str, torch.Tensor], r: int, ranks: int) -> dict:
    """Rank r's share of each dense tensor (weights, or their gradients), by name."""
    if case.kind == "column":
        rows = block(case.out_features, r, ranks)
        return {name: t[rows] for name, t in dense.items()}
    if case.kind == "row":
        return {
            name: t[:, block(case.in_features, r, ranks)] if name == "weight" else t
            for name, t in dense.items()
        }
    d = case.in_features
    first = "fc" if case.kind == "mlp" else "qkv"
    if case.kind == "mlp":
        first_rows = torch.arange(case.out_features)[block(case.out_features, r, ranks)]
        inner = case.out_features
    else:
        first_rows, inner = head_rows(d, r, ranks), d
    columns = block(inner, r, ranks)
    return {
        f"{first}.weight": dense[f"{first}.weight"][first_rows],
        f"{first}.bias": dense[f"{first}.bias"][first_rows],
        "proj.weight": dense["proj.weight"][:, columns],
        "proj.bias": dense["proj.bias"],
    }


# --- what runs on each rank ---------------------------------------------------------------


def _run_cases(cls: Callable, cases: list[Case]) -> list[dict]:
    return [_run_case(cls, case) for case in cases]


def _run_case(cls: Callable, case: Case) -> dict:
    """Build the student's layer from the dense one, run forward and backward, and record
    the weights it holds, its output, the gradients and the collectives it called."""
    r, ranks = rank(), world_size()
    dense = dense_layer(case)
    layer = cls(dense, gather_output=True) if case.gather_output else cls(dense)
    held = {name: p.detach().clone() for name, p in layer.named_parameters()}
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
        "held": held,
        "out": out.detach(),
        "x_grad": x.grad,
        "grads": {name: p.grad for name, p in layer.named_parameters()},
        "forward_calls": dict(forward_comm.calls),
        "backward_calls": dict(backward_comm.calls),
    }


# --- the dense reference, in the checking process -----------------------------------------


def _reference(case: Case) -> dict:
    dense = dense_layer(case)
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


def _compare_result(check: str, case: Case, ref: dict, result: dict, r: int, P: int) -> None:
    __tracebackhide__ = True
    at = f"rank {r} ({case.describe(P)})"
    want_out = ref["out"]
    if case.kind == "column" and not case.gather_output:
        want_out = want_out[..., block(case.out_features, r, P)]
    problem = compare.find_mismatch(
        {"output": result["out"]}, {"output": want_out}, rtol=RTOL, atol=ATOL
    )
    if problem:
        hint = _output_hint(case, result["out"], want_out, ref, P)
        fail(
            check,
            f"{at}: the forward output differs from the dense layer's: {problem}.\nHint: {hint}",
        )

    want_x = ref["x_grad"]
    if case.kind == "row":
        want_x = want_x[..., block(case.in_features, r, P)]
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


def _compare_communication(check: str, case: Case, result: dict, r: int, P: int) -> None:
    """Megatron's MLP and attention: one all-reduce in forward, one in backward."""
    __tracebackhide__ = True
    if P == 1 or case.kind not in ("mlp", "attention"):
        return
    at = f"rank {r} ({case.describe(P)})"
    for phase in ("forward", "backward"):
        calls = result[f"{phase}_calls"]
        if calls != {"all_reduce": 1}:
            fail(
                check,
                f"{at}: the {phase} pass made these collective calls: {calls or 'none'}; the "
                f"tensor-parallel {case.kind} needs exactly one all-reduce in {phase} "
                "(column-parallel in, row-parallel out: no gather in between). Call collectives "
                "as dist.all_reduce(...) so that the check can see them",
            )


# --- the checks ---------------------------------------------------------------------------


def _check(check: str, cls: Callable, cases: list[Case], world_sizes, timeout: float) -> None:
    __tracebackhide__ = True
    if not cases:
        raise ValueError("nothing to check: give at least one seed")
    for P in world_sizes:
        if P not in WORLD_SIZES:
            raise ValueError(f"world sizes must divide the layer sizes: use 1, 2 or 4, got {P}")
        results = run_on_ranks(
            check,
            _run_cases,
            cls,
            cases,
            world_size=P,
            timeout=timeout,
            what=f"your {getattr(cls, '__name__', 'layer')}",
        )
        for i, case in enumerate(cases):
            ref = _reference(case)
            for r, per_rank in enumerate(results):
                _compare_held(check, case, ref, per_rank[i], r, P)
            for r, per_rank in enumerate(results):
                _compare_result(check, case, ref, per_rank[i], r, P)
            for r, per_rank in enumerate(results):
                _compare_communication(check, case, per_rank[i], r, P)


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
    "expected_shards",
    "head_rows",
]
