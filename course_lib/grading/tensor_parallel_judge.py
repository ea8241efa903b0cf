"""Assignment 9's layers judged, rank by rank, against the dense layer: the shards each rank
holds right after construction, its output, the gradients of its input and of its shards, the
layer computed again after its shards were secretly nudged, and its collective calls. The
dense layer's numbers are computed here, in the checking process, from the check's secret
draw; the calls are the launcher's record of what each rank's process group did
(`_harness.calls_by_case`), never a count kept on the rank.

Half a layer's points are for the numbers (`compare_held`, `compare_result`,
`compare_nudged`, `compare_dense`), half for making Megatron's collective calls
(`compare_communication`).
"""

from __future__ import annotations

import torch

from course_lib import compare
from course_lib.grading._harness import Verdict, fail
from course_lib.grading.tensor_parallel_shards import (
    Case,
    Drawn,
    block,
    dense_reference,
    expected_shards,
    nudged_params,
    rank_params,
)
from course_lib.grading.traffic import Sent

RTOL, ATOL = 1e-10, 1e-10  # float64: a sum split across ranks differs by ~1e-15


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


def compare_held(check: str, case: Case, ref: dict, result: dict, r: int, P: int) -> None:
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
            # what the student's code saw: the dense layer as this rank was given it
            seen = rank_params(case, ref["params"], r, P)[name]
            hint = _shard_hint(case, name, got[name], seen, r, P)
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


def compare_nudged(check: str, case: Case, drawn: Drawn, results: list[dict], P: int) -> None:
    """After every rank's shards were nudged, the layer must compute the dense layer that
    those shards form: a layer that kept a copy of the dense weights does not."""
    __tracebackhide__ = True
    if not all(res["nudged"] for res in results):
        return
    ref = dense_reference(case, drawn, nudged_params(case, drawn))
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


def compare_result(check: str, case: Case, ref: dict, result: dict, r: int, P: int) -> None:
    """Rank r's output, the gradient of its input and of each of its shards: the dense
    layer's (or the rank's block of it)."""
    __tracebackhide__ = True
    at = f"rank {r} ({case.describe(P)})"
    want_out, want_x = _rank_view(case, ref, r, P)
    _judge_output(check, at, case, ref, result["out"], want_out, P)
    _judge_input_grad(check, at, case, result["x_grad"], want_x, P)
    _judge_shard_grads(check, at, expected_shards(case, ref["grads"], r, P), result["grads"])


def _judge_output(
    check: str, at: str, case: Case, ref: dict, got: torch.Tensor, want: torch.Tensor, P: int
) -> None:
    __tracebackhide__ = True
    problem = compare.find_mismatch({"output": got}, {"output": want}, rtol=RTOL, atol=ATOL)
    if problem:
        hint = _output_hint(case, got, want, ref, P)
        fail(
            check,
            f"{at}: the forward output differs from the dense layer's: {problem}.\nHint: {hint}",
        )


def _judge_input_grad(
    check: str, at: str, case: Case, got: torch.Tensor | None, want: torch.Tensor, P: int
) -> None:
    __tracebackhide__ = True
    if got is None:
        fail(check, f"{at}: the input got no gradient; is the output connected to x in autograd?")
    problem = compare.find_mismatch({"x.grad": got}, {"x.grad": want}, rtol=RTOL, atol=ATOL)
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


def _judge_shard_grads(check: str, at: str, want_grads: dict, grads: dict) -> None:
    __tracebackhide__ = True
    for name, expected in want_grads.items():
        got = grads.get(name)
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


def _calls(reported: list[Sent]) -> dict:
    """Collective calls by kind, the all-gather variants as one."""
    out: dict[str, int] = {}
    for call in reported:
        kind = "all_gather" if call.op.startswith("all_gather") else call.op
        out[kind] = out.get(kind, 0) + 1
    return out


def compare_communication(
    check: str, case: Case, phases: dict[str, list[Sent]], r: int, P: int
) -> None:
    """The collectives of Megatron's layers, on every route: `phases` holds the calls rank
    r's process group reported to the launcher in the forward and in the backward pass."""
    __tracebackhide__ = True
    if P == 1:
        return
    at = f"rank {r} ({case.describe(P)})"
    forward, backward = COMMUNICATION[case.kind]
    if case.kind == "column" and case.gather_output:
        forward = {"all_gather": 1}
    for phase, want in (("forward", forward), ("backward", backward)):
        calls = _calls(phases[phase])
        if calls != want:
            fail(
                check,
                f"{at}: the {phase} pass made these collective calls: {calls or 'none'}, "
                f"expected {want or 'none'}. The tensor-parallel {case.kind} layer makes "
                f"{_WHY[case.kind]}",
                prop="communication",
            )


def compare_dense(check: str, case: Case, drawn: Drawn, result: dict, r: int, P: int) -> None:
    """The dense layer the layer was built from is as rank r was given it: the layer holds
    copies."""
    __tracebackhide__ = True
    at = f"rank {r} ({case.describe(P)})"
    was = rank_params(case, drawn.params, r, P)
    problem = compare.find_mismatch(result["dense_after"], was, rtol=0.0, atol=0.0)
    if problem:
        fail(
            check,
            f"{at}: the dense layer your layer was built from changed ({problem}): your "
            "parameters share memory with it, or your code writes into it. Hold copies "
            "(.clone() after slicing) and leave the dense layer as it was",
        )
    if result["dense_grads"]:
        fail(
            check,
            f"{at}: the dense layer's {', '.join(result['dense_grads'])} got a gradient in "
            "backward: your layer computes with the dense layer's own parameters. Hold copies "
            "of this rank's shards and compute with them",
        )


def judge_case(
    check: str,
    verdict: Verdict,
    case: Case,
    drawn: Drawn,
    results: list[dict],
    calls: list[dict[str, list[Sent]]],
    P: int,
) -> None:
    """One case on P ranks (results[r] from rank r, calls[r] its forward's and backward's
    calls as the launcher recorded them), as two of the verdict's cases: the result (every
    rank's shards and numbers against the dense layer's, then the nudged layer, then the
    dense layer left as it was), then the communication."""
    __tracebackhide__ = True
    ref = dense_reference(case, drawn)
    with verdict.case():
        for r, result in enumerate(results):
            compare_held(check, case, ref, result, r, P)
        for r, result in enumerate(results):
            compare_result(check, case, ref, result, r, P)
        compare_nudged(check, case, drawn, results, P)
        for r, result in enumerate(results):
            compare_dense(check, case, drawn, result, r, P)
    with verdict.case():
        for r, phases in enumerate(calls):
            compare_communication(check, case, phases, r, P)
