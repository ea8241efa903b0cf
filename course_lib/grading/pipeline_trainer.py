"""Assignment 8's trainer check, judged in the checking process: each step of each run,
stage by stage, against the single-process reference (`pipeline_cases`), and its calls and
the order of its forwards and backwards from what the launcher received.

The ranks ran `pipeline_step` on their own stage and data (`pipeline_ranks`) and sent back,
as plain data, per step: the stage's gradients, its parameters after an SGD step, what it
returned and its unwaited sends. The launcher received, as they happened, every call of each
rank and, among them, the notes of the check's wrapper of the stage: which forward and which
backward ran, with a fingerprint of the forward's input (`pipeline_notes`). The judge holds
every stage's order of ("F", i) and ("B", i), read from those notes, to the schedule's and
to the stage's messages, every step's gradients, parameters and loss to the reference, and
every step's calls (`_harness.events_by_case`) to point-to-point messages between
neighbouring stages carrying at least the activations and their gradients.
"""

from __future__ import annotations

import math

import torch

from course_lib import compare
from course_lib.grading._harness import fail
from course_lib.grading.pipeline_cases import PipelineRun, reference_steps
from course_lib.grading.pipeline_notes import judge_sends_follow, stage_order
from course_lib.grading.pipeline_plumbing import in_flight_bound, peak_in_flight, schedule_order
from course_lib.grading.traffic import Note, Sent

RTOL, ATOL = 1e-10, 1e-10  # float64; micro-batch sums differ from the whole batch by ~1e-16

# --- judging, in the checking process -------------------------------------------------------


def judge_run(
    check: str, schedule: str, run: PipelineRun, results: list[list], events: list[list]
) -> None:
    """Every step of a run, stage by stage, against single-process training of the run's
    model (trained here); results[r] and events[r] are rank r's, one entry per step (events:
    its calls and the notes among them). Stops at the first failing step."""
    __tracebackhide__ = True
    for s, ref in enumerate(reference_steps(run, len(results))):
        compare_step(check, schedule, run, s, ref, results, [per_rank[s] for per_rank in events])


def compare_step(
    check: str,
    schedule: str,
    run: PipelineRun,
    s: int,
    ref: dict,
    results: list[list],
    events: list[list[Sent | Note]],
) -> None:
    """Step s of a run on every stage (results[r] is rank r's list of steps, events[r] the
    calls the launcher saw rank r make in this step, and the notes of its forwards and
    backwards among them): the calls, the schedule and what it returned, stage by stage;
    then the numbers, stage by stage; then the loss the last stage returned."""
    __tracebackhide__ = True
    P, m = len(results), run.n_micro
    where = run.describe(P)
    at = [f"stage {r}, step {s} ({where}, {schedule})" for r in range(P)]
    for r, per_rank in enumerate(results):  # what each stage did, then what it computed
        step = per_rank[s]
        calls = [event for event in events[r] if isinstance(event, Sent)]
        _judge_calls(check, at[r], calls, step["unwaited"], r, ref["inputs"])
        order = stage_order(check, at[r], events[r], ref["inputs"][r], r, m)
        judge_sends_follow(check, at[r], events[r], order, ref["inputs"], r)
        _judge_schedule(check, at[r], order, schedule, P, m, r)
        _judge_returned(check, at[r], step["returned"], last=r == P - 1)
    for r, per_rank in enumerate(results):
        _judge_numbers(check, at[r], per_rank[s], ref, m)
    loss = results[-1][s]["loss"]
    if not math.isclose(loss, ref["loss"], rel_tol=1e-9):
        fail(
            check,
            f"step {s} ({where}, {schedule}): the last stage returned the loss {loss!r}, "
            f"expected the full-batch loss {ref['loss']:.10g} (the sum of the micro-batch "
            "losses, each divided by n_micro)",
        )


def _nbytes(micro: tuple[torch.Tensor, ...]) -> int:
    return sum(t.numel() * t.element_size() for t in micro)


def _judge_calls(
    check: str, at: str, calls: list[Sent], unwaited: int, r: int, inputs: list[tuple]
) -> None:
    """The stage's calls, as the launcher received them: point-to-point messages only, with
    its neighbouring stages only, the activations of every micro-batch sent on and their
    gradients sent back (at least their bytes: float64 activations, as computed here); and
    every send of send_tensor waited for."""
    __tracebackhide__ = True
    P = len(inputs)
    ops = {call.op for call in calls} - {"send", "recv"}
    if ops:
        fail(
            check,
            f"{at}: used {sorted(ops)}; a pipeline only passes activations and "
            "gradients between neighbouring stages with send/recv (or isend/irecv)",
        )
    peers = {call.peer for call in calls} - {r - 1, r + 1}
    if peers:
        fail(
            check,
            f"{at}: sent to or received from rank(s) {sorted(peers, key=str)}; a stage "
            f"passes activations and gradients only to its neighbouring stages (ranks "
            f"{r - 1} and {r + 1})",
        )
    for peer, what in ((r + 1, "activations"), (r - 1, "gradients of its input")):
        if not 0 <= peer < P:
            continue
        # Stage r + 1's input is what stage r sends on; its gradient, what r + 1 sends back.
        want = _nbytes(inputs[max(r, peer)])
        sent = sum(call.sent for call in calls if call.op == "send" and call.peer == peer)
        if sent < want:
            fail(
                check,
                f"{at}: sent stage {peer} {sent} bytes, fewer than the {want} bytes of the "
                f"{what} of all {len(inputs[0])} micro-batches; every micro-batch's {what} "
                f"must travel to stage {peer} as a message (the stages' weights are on "
                "their own ranks only)",
            )
    if unwaited:
        fail(
            check,
            f"{at}: {unwaited} send(s) that send_tensor started were never "
            ".wait()-ed before pipeline_step returned; call .wait() on every send it returns "
            "(until then the message may still be under way)",
        )


def _said(order: list[tuple[str, int]]) -> str:
    return " ".join(f"{kind}{i}" for kind, i in order)


def _judge_schedule(
    check: str, at: str, order: list[tuple[str, int]], schedule: str, P: int, m: int, r: int
) -> None:
    """Stage r's forwards and backwards, micro-batch by micro-batch, in the schedule's order
    (and so no more micro-batches in flight than it keeps)."""
    __tracebackhide__ = True
    peak, bound = peak_in_flight(kind for kind, _ in order), in_flight_bound(schedule, P, m, r)
    if peak > bound:
        fail(
            check,
            f"{at}: the stage held the activations of {peak} micro-batches at "
            f"once (forward done, backward not yet); 1F1B keeps at most min(m, P - r) = "
            f"{bound}: after {min(P - r - 1, m)} warm-up forwards, run each next forward "
            "right before a backward",
        )
    expected = schedule_order(schedule, P, m, r)
    if order != expected:
        fail(
            check,
            f"{at}: the stage ran {_said(order)}; the {schedule} schedule runs "
            f"{_said(expected)} on stage {r} of {P} (Fi, Bi: the forward, the backward of "
            "micro-batch i; each in micro-batch order)",
        )


def _judge_returned(check: str, at: str, returned: str, last: bool) -> None:
    """The whole-batch loss as a float from the last stage, None from the others."""
    __tracebackhide__ = True
    said = "None" if returned == "NoneType" else f"a {returned}"
    if last and returned != "float":
        fail(
            check,
            f"{at}: the last stage returned {said}; return the whole-batch loss as a float "
            "(a tensor's .item() is one)",
        )
    if not last and returned != "NoneType":
        fail(
            check,
            f"{at}: the stage returned {said}; only the last stage returns the loss, the "
            "others return None",
        )


def _grad_hint(got: torch.Tensor, want: torch.Tensor, handed: torch.Tensor, m: int) -> str:
    """Why a gradient differs, when the mistake is a common one: `want` is the full-batch
    gradient, `handed` what .grad held before the step."""
    scale = max(1e-12, want.abs().max().item())

    def close(a: torch.Tensor, b: torch.Tensor) -> bool:
        return torch.allclose(a, b, rtol=1e-6, atol=1e-9 * scale)

    added = got - handed
    if close(got, want):
        return (
            "it is the full-batch gradient alone: what .grad held when pipeline_step "
            "started is gone. Let backward add into .grad; do not zero it (zero_grad()) or "
            "assign it"
        )
    if m > 1 and close(added, m * want):
        return (
            f"it is n_micro = {m} times the full-batch gradient: divide each micro-batch's "
            "loss by n_micro before its backward, so that the sum over micro-batches is the "
            "mean over the whole batch"
        )
    if m > 1 and close(added, want / m):
        return f"it is 1/{m} of the full-batch gradient: is the loss divided by n_micro twice?"
    return (
        "every micro-batch's backward must add into .grad (do not zero gradients between "
        "micro-batches), with the gradient of each activation sent back to the stage that "
        "produced it"
    )


def _judge_numbers(check: str, at: str, step: dict, ref: dict, m: int) -> None:
    """A stage's .grad (what it held before the step plus the full-batch gradient) and its
    parameters after SGD: single-process training's."""
    __tracebackhide__ = True
    for name, got in step["grads"].items():
        want, handed = ref["grads"][name], ref["handed"][name]
        if got is None:
            fail(
                check,
                f"{at}: {name!r} has no .grad after the step. The check hands .grad over "
                "holding a value and backward adds to it: do not set it to None "
                "(zero_grad()), and let backward reach this stage",
            )
        problem = compare.find_mismatch({name: got}, {name: handed + want}, rtol=RTOL, atol=ATOL)
        if problem:
            fail(
                check,
                f"{at}: .grad is not what it held before the step plus the gradient of "
                f"single-process training on the whole batch: {problem}.\n"
                f"Hint: {_grad_hint(got, want, handed, m)}",
            )
    problem = compare.find_mismatch(
        step["params"], {n: ref["params"][n] for n in step["params"]}, rtol=RTOL, atol=ATOL
    )
    if problem:
        fail(check, f"{at}: after an SGD step, {problem}; do you change the weights?")
