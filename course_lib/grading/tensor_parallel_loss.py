"""Part of Assignment 9's checks (grading/tensor_parallel.py): a loss without the full logits.

A column-parallel LM head leaves rank r of P with the logits of its block of the vocabulary,
columns r*V/P .. (r+1)*V/P - 1. The student's `vocab_parallel_cross_entropy(local_logits,
targets)` returns the mean cross-entropy over the tokens, the same on every rank, and its
backward gives each rank its block of the full gradient. The checking process draws the whole
logits and the targets from a secret, new at every call (`draw_loss`), and sends each rank
only its block of the logits and the targets (`course_lib.calls.PerRank`: no rank can know
another's block but by messages); a rank sends back its loss and gradient, and its logits and
targets as the call left them. The reference is computed in the checking process. It judges

- its inputs: the call changes neither its block of the logits nor the targets in place;
- the numbers: loss and gradient against `F.cross_entropy` on the whole logits in the
  checking process (float64, `RTOL` / `ATOL`), on cases with ordinary logits, with logits
  near 1000 (exp overflows float64 above 709: an answer that does not subtract a maximum
  fails there) and with every target in one rank's block;
- a measurement: the bytes each rank sends and receives, forward and backward together, as
  the launcher recorded every call of the rank's process group while it happened
  (`_harness.calls_by_case`; never a count kept on the rank), may not exceed
  `NUMBERS_PER_TOKEN` float64 numbers per token (`budget_bytes`). Gathering the logits costs
  (P-1) V/P numbers per token (`gathered_logits_bytes`), 48 at V = 96 and P = 2.

Several answers fit: all-reduces of a maximum, a sum of exponentials and the target's logit
(2(P-1)/P numbers per token each); one all-gather of each rank's (maximum, sum, target logit)
and a log-sum-exp computed locally (3(P-1)); with or without communication in backward.

The budget's two formulas live here, next to the check, rather than in `course_lib.costs`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from course_lib import compare, counted_group
from course_lib.costs import all_gather_bytes
from course_lib.grading._harness import Verdict, fail
from course_lib.grading.provenance import Provenance
from course_lib.grading.tensor_parallel_judge import ATOL, RTOL
from course_lib.grading.tensor_parallel_ranks import LECTURE_TP
from course_lib.grading.tensor_parallel_shards import block
from course_lib.grading.traffic import Sent

VOCAB = 96  # divides by 1, 2, 3 and 4
NUMBERS_PER_TOKEN = 12  # what a rank may send (and receive) per token, forward + backward
ELEMENT_SIZE = 8  # float64
LOSS_WORLD_SIZES = (1, 2, 3, 4)


def budget_bytes(tokens: int, element_size: int = ELEMENT_SIZE) -> int:
    """The most a rank may send, or receive, for one loss's forward and backward."""
    return NUMBERS_PER_TOKEN * tokens * element_size


def gathered_logits_bytes(
    tokens: int, vocab: int, world_size: int, element_size: int = ELEMENT_SIZE
) -> int:
    """What one rank sends to all-gather the logits: (P-1) blocks of V/P logits per token."""
    return all_gather_bytes(tokens * (vocab // world_size) * element_size, world_size)


@dataclass(frozen=True)
class LossCase:
    """Logits of `tokens` tokens over the vocabulary: `offset + spread * N(0, 1)`; targets
    uniform over the vocabulary, or all in the last rank's block; both drawn from a secret
    (`draw_loss`); `seed` names the case. The loss is multiplied by `upstream` before backward
    (the gradient must follow it)."""

    name: str
    seed: int
    tokens: int
    spread: float = 3.0
    offset: float = 0.0
    last_block_only: bool = False
    upstream: float = 1.0

    def describe(self, ranks: int) -> str:
        return f"{self.name} ({self.tokens} tokens, V = {VOCAB}, seed {self.seed}, {ranks} rank(s))"


def loss_cases(seed: int) -> list[LossCase]:
    return [
        LossCase("ordinary logits", seed, tokens=24, upstream=1.0 + seed),
        LossCase("logits near 1000", seed, tokens=16, spread=300.0, offset=800.0, upstream=0.5),
        LossCase("targets in the last block", seed, tokens=9, last_block_only=True, upstream=2.0),
    ]


def draw_loss(case: LossCase, secret: int, ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole (tokens, V) logits and the targets, from `secret`, in the checking process."""
    g = torch.Generator().manual_seed(secret)
    shape = (case.tokens, VOCAB)
    logits = case.offset + case.spread * torch.randn(shape, generator=g, dtype=torch.float64)
    last = block(VOCAB, ranks - 1, ranks)
    low, high = (last.start, last.stop) if case.last_block_only else (0, VOCAB)
    return logits, torch.randint(low, high, (case.tokens,), generator=g)


def loss_given(logits: torch.Tensor, targets: torch.Tensor, r: int, ranks: int) -> tuple:
    """What rank r is sent: its block of the logits' columns, and the targets (every rank
    holds them all, as after a column-parallel LM head)."""
    return logits[:, block(VOCAB, r, ranks)].clone(), targets.clone()


# --- on each rank ------------------------------------------------------------------------


def run_loss_cases(fn: Callable, cases: list[LossCase], given: list[tuple]) -> dict:
    """On each rank: every case on this rank's share of it (`given`, one (block of the
    logits, targets) per case); mark i opens case i's calls, mark n closes the last."""
    with Provenance(LECTURE_TP) as seen:
        results = []
        for i, (case, (local, targets)) in enumerate(zip(cases, given, strict=True)):
            counted_group.mark(i)
            results.append(_run_loss(fn, case, local, targets))
        counted_group.mark(len(cases))
    return {"cases": results, "copied": seen.complaint()}


def _run_loss(fn: Callable, case: LossCase, local: torch.Tensor, targets: torch.Tensor) -> dict:
    """The loss on this rank's block of the logits and its backward; sends back what the
    call returned, the gradient and the inputs as it left them."""
    local = local.requires_grad_(True)
    loss = fn(local, targets)
    problem = _not_a_loss(loss)
    if problem is None:
        (loss * case.upstream).backward()
    return {
        "problem": problem,
        "loss": None if problem else loss.detach().clone(),
        "grad": None if local.grad is None else local.grad.detach().clone(),
        "logits_after": local.detach().clone(),
        "targets_after": targets.clone(),
    }


def _not_a_loss(loss: object) -> str | None:
    if not isinstance(loss, torch.Tensor):
        return f"it returned a {type(loss).__name__}, not a tensor"
    if loss.dim() != 0:
        return f"it returned a tensor of shape {tuple(loss.shape)}, not one number (the mean)"
    if not loss.requires_grad:
        return "its loss does not require grad: backward cannot reach local_logits"
    return None


# --- in the checking process ---------------------------------------------------------------


def _reference(case: LossCase, logits: torch.Tensor, targets: torch.Tensor) -> dict:
    logits = logits.clone().requires_grad_(True)
    loss = F.cross_entropy(logits, targets)
    (loss * case.upstream).backward()
    return {"loss": loss.detach(), "grad": logits.grad}


def _ops(calls: list[Sent]) -> dict[str, int]:
    out: dict[str, int] = {}
    for call in calls:
        out[call.op] = out.get(call.op, 0) + 1
    return out


def judge_loss_case(
    check: str,
    verdict: Verdict,
    case: LossCase,
    drawn: tuple[torch.Tensor, torch.Tensor],
    results: list,
    calls: list[list[Sent]],
    P: int,
) -> float:
    """Inputs and numbers, then bytes, of one case on P ranks (results[r] from rank r,
    calls[r] the calls its process group reported during the case), each as a case of the
    verdict; returns the most a rank sent or received, in float64 numbers per token."""
    __tracebackhide__ = True
    logits, targets = drawn
    ref = _reference(case, logits, targets)
    with verdict.case():
        for r, res in enumerate(results):
            _judge_inputs(check, case, res, loss_given(logits, targets, r, P), r, P)
        for r, res in enumerate(results):
            _judge_numbers(check, case, ref, res, r, P)
    sent = [sum(c.sent for c in mine) for mine in calls]
    received = [sum(c.received for c in mine) for mine in calls]
    most = max(max(s, g) for s, g in zip(sent, received, strict=True))
    with verdict.case():
        allowed = budget_bytes(case.tokens)
        for r in range(P):
            if max(sent[r], received[r]) > allowed:
                gathered = gathered_logits_bytes(case.tokens, VOCAB, P)
                fail(
                    check,
                    f"rank {r}, {case.describe(P)}: forward and backward sent "
                    f"{sent[r]:,} bytes and received {received[r]:,} ({_ops(calls[r])}); "
                    f"at most {allowed:,} allowed ({NUMBERS_PER_TOKEN} float64 numbers per "
                    f"token). Gathering the logits would send {gathered:,}.\nHint: the loss "
                    "needs a few numbers per token from each rank, never its logits",
                    prop="bytes",
                )
    return most / (case.tokens * ELEMENT_SIZE)


def _judge_inputs(check: str, case: LossCase, res: dict, given: tuple, r: int, P: int) -> None:
    """The call left this rank's block of the logits and the targets as it was given them."""
    __tracebackhide__ = True
    local, targets = given
    pairs = (
        ("targets", res["targets_after"], targets, "targets - first"),
        ("local_logits", res["logits_after"], local, "local_logits - top"),
    )
    for name, after, before, instead in pairs:
        if not torch.equal(after, before):
            changed = int((after != before).sum()) if after.shape == before.shape else "all"
            fail(
                check,
                f"rank {r}, {case.describe(P)}: your vocab_parallel_cross_entropy changed "
                f"{name} in place ({changed} of {before.numel()} entries differ after the "
                "call); the caller still needs them as they were: compute with new tensors "
                f"({instead}, not an in-place -= or [...] =)",
            )


def _judge_numbers(check: str, case: LossCase, ref: dict, res: dict, r: int, P: int) -> None:
    __tracebackhide__ = True
    at = f"rank {r}, {case.describe(P)}"
    if res["problem"]:
        fail(check, f"{at}: {res['problem']}")
    got = {"loss": res["loss"], "local_logits.grad": res["grad"]}
    if res["grad"] is None:
        fail(check, f"{at}: local_logits got no gradient in backward")
    want = {"loss": ref["loss"], "local_logits.grad": ref["grad"][:, block(VOCAB, r, P)]}
    problem = compare.find_mismatch(got, want, rtol=RTOL, atol=ATOL)
    if not problem:
        return
    hint = "the loss is the mean over the tokens; the gradient follows the upstream gradient"
    if not all(torch.isfinite(t).all() for t in got.values()):
        hint = (
            "exp() of a logit above 709 is inf in float64: subtract each token's largest "
            "logit over the whole vocabulary (all ranks) before exponentiating"
        )
    fail(check, f"{at}: against F.cross_entropy on the whole logits, {problem}.\nHint: {hint}")
