"""The order of a stage's forwards and backwards in Assignment 8's trainer check, read from
what the launcher received: the notes the check's wrapper of the stage reported as each ran
(`pipeline_plumbing.watch`), in their places among the stage's calls.

A note says ("F", fingerprint of the forward's input) or ("B", the same fingerprint); the
judge knows every stage's input for every micro-batch from the reference it trains, so it
tells the micro-batch by the fingerprint. Code on the rank cannot take a note back, but it
could report notes of its own, or run the stage around the wrapper: the notes must then still
fit the stage's calls, as the launcher saw them, for a stage cannot send what it has not
computed (an activation before its forward, a gradient before its backward).

    stage_order(check, at, events, micro, r, m)         ("F", i) and ("B", i), in order
    judge_sends_follow(check, at, events, order, ...)   no message before what it carries
"""

from __future__ import annotations

import math

import torch

from course_lib.grading._harness import CheckFailed, fail
from course_lib.grading.pipeline_plumbing import HEADER_BYTES, fingerprint
from course_lib.grading.traffic import Note, Sent

# A stage's input is the micro-batch's activation within float64 rounding (~1e-15 of its
# magnitude): far closer than to any other micro-batch's.
SAME_INPUT = 1e-8


def _tampering(check: str, at: str, what: str) -> None:
    __tracebackhide__ = True
    raise CheckFailed(
        f"{check}: {at}: {what}. The check's wrapper of the stage reports each forward and "
        "backward to the launcher as it runs; these reports are not its own, or the stage "
        "ran around the wrapper: code on the rank changed what the launcher records. That is "
        "tampering with the grading: this part scores 0.",
        tampering=True,
    )


def _well_formed(label: object) -> bool:
    """What `watch` reports: ("F" or "B", (shape, sum, weighted sum, sum of magnitudes))."""
    if not (isinstance(label, tuple) and len(label) == 2 and label[0] in ("F", "B")):
        return False
    seen = label[1]
    return (
        isinstance(seen, tuple)
        and len(seen) == 4
        and isinstance(seen[0], tuple)
        and all(isinstance(n, int) for n in seen[0])
        and all(isinstance(x, float) for x in seen[1:])
    )


def _same(seen: tuple, want: torch.Tensor) -> bool:
    expected = fingerprint(want)
    if seen[0] != expected[0]:
        return False
    tolerance = SAME_INPUT * expected[3] + 1e-10
    pairs = zip(seen[1:], expected[1:], strict=True)
    return all(math.isclose(a, b, rel_tol=0, abs_tol=tolerance) for a, b in pairs)


def stage_order(
    check: str, at: str, events: list[Sent | Note], micro: tuple, r: int, m: int
) -> list[tuple[str, int]]:
    """The stage's forwards and backwards in the order it ran them, as ("F", i) and ("B", i),
    i the micro-batch whose input its forward got (`micro[i]`: the rows of the batch on stage
    0, their activation from the stage before after), a backward's the forward's it ran
    through."""
    __tracebackhide__ = True
    labels = [event.label for event in events if isinstance(event, Note)]
    if not all(_well_formed(label) for label in labels):
        _tampering(check, at, "the launcher received notes the check's wrapper does not write")
    kinds = [kind for kind, _ in labels]
    forwards, backwards = kinds.count("F"), kinds.count("B")
    if (forwards, backwards) != (m, m):
        fail(
            check,
            f"{at}: the stage ran {forwards} forwards and {backwards} backwards; expected "
            f"one of each per micro-batch ({m}). Call the stage once per micro-batch, and "
            "run backward through each output exactly once",
        )
    order: list[tuple[str, int]] = []
    waiting: list[tuple[tuple, int]] = []  # (fingerprint, micro-batch): forwards not backed yet
    for kind, seen in labels:
        if kind == "F":
            same = [i for i, want in enumerate(micro) if _same(seen, want)]
            if not same:
                what = "rows of the batch" if r == 0 else f"activation from stage {r - 1}"
                fail(
                    check,
                    f"{at}: forward number {[k for k, _ in order].count('F') + 1} of the "
                    f"stage got an input that is no micro-batch's {what}; hand the stage "
                    "one micro-batch at a time (inputs.tensor_split(n_micro)[i] on stage 0, "
                    "what the stage before sent on the others)",
                )
            waiting.append((seen, same[0]))
            order.append(("F", same[0]))
            continue
        through = [k for k, (forward, _) in enumerate(waiting) if forward == seen]
        if not through:
            fail(
                check,
                f"{at}: a backward of the stage ran through no forward's output still waiting "
                "for its backward; run backward through each forward's output exactly once",
            )
        order.append(("B", waiting.pop(through[0])[1]))
    return order


def judge_sends_follow(
    check: str,
    at: str,
    events: list[Sent | Note],
    order: list[tuple[str, int]],
    inputs: list[tuple],
    r: int,
) -> None:
    """No message of the stage carries more than it had computed when it was sent: by each
    send to stage r + 1 (r - 1), the bytes sent there so far are at most those of the
    activations (gradients) of the micro-batches whose forward (backward) came before it.
    `order` is `stage_order`'s, one entry per note of `events`; `inputs[s][i]` is stage s's
    input for micro-batch i (stage s + 1's is what stage s sends on, and its gradient what
    comes back). Sends of a header's size or less are left out: they carry no data."""
    __tracebackhide__ = True
    P = len(inputs)
    done = {r + 1: 0, r - 1: 0}  # bytes computed for each neighbour
    sent = {r + 1: 0, r - 1: 0}
    ran: list[tuple[str, int]] = []
    notes = iter(order)
    for event in events:
        if isinstance(event, Note):
            kind, i = next(notes)
            ran.append((kind, i))
            if kind == "F" and r + 1 < P:
                done[r + 1] += _nbytes(inputs[r + 1][i])
            if kind == "B" and r > 0:
                done[r - 1] += _nbytes(inputs[r][i])
            continue
        if event.op != "send" or event.peer not in sent or event.sent <= HEADER_BYTES:
            continue
        sent[event.peer] += event.sent
        if sent[event.peer] > done[event.peer]:
            what = "activations" if event.peer == r + 1 else "gradients"
            work = "forwards" if event.peer == r + 1 else "backwards"
            so_far = " ".join(f"{k}{i}" for k, i in ran) or "none"
            _tampering(
                check,
                at,
                f"it had sent stage {event.peer} {sent[event.peer]} bytes, more than the "
                f"{what} of the micro-batches whose {work} it had run by then "
                f"({done[event.peer]} bytes, after {so_far}); "
                "a stage can send an activation only after the forward that computes it, a "
                "gradient only after its backward",
            )


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
