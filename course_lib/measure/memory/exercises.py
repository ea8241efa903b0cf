"""Lecture 6's exercises, checked with their expected values off the page: the cell holds the
student's answers and one call, not the formula that computes them nor the why of a prediction.

    check_sgd_budget(sgd_bytes_per_parameter, gpus_for_13B)   # model states of SGD, 13B
    check_first_steps(first_steps, ours)                       # fp16 loss scaling, as run
    check_s_part_overtakes(s_part_overtakes, split)            # the s x s part, as measured
    check_course_vs_formula(course_vs_formula, saved, s, b, h, a)  # the course's block
    check_smallest_peak(smallest_peak_units, best_k)           # checkpointing 64 layers
"""

from __future__ import annotations

import math

from course_lib.costs import BYTES_PER_PARAMETER, activation_memory
from course_lib.exercises import check_choice, check_number, together
from course_lib.measure.memory.activations import SequenceSplit
from course_lib.measure.memory.mixed_precision import ScaledStep
from course_lib.memory import checkpoint_units, divisors


def check_sgd_budget(sgd_bytes_per_parameter: object, gpus_for_13B: object) -> bool | None:
    """Lecture 6: mixed-precision SGD's bytes per parameter, and the 80 GB GPUs a 13B needs."""
    sgd = {kind: b for kind, b in BYTES_PER_PARAMETER.items() if kind != "optimizer: exp_avg_sq"}
    return together(
        check_number(
            sgd_bytes_per_parameter,
            sum(sgd.values()),
            unit="bytes",
            hint="Go through the five rows of the table: which one does SGD not need?",
        ),
        check_number(
            gpus_for_13B,
            math.ceil(13e9 * sum(sgd.values()) / 80e9),
            rtol=0,
            atol=0.5,
            hint="Bytes per parameter x 13e9, over 80e9 bytes, rounded up.",
        ),
    )


FIRST_STEPS = ("the loss becomes NaN", "steps are skipped, then it trains", "nothing is skipped")


def check_first_steps(first_steps: object, ours: list[ScaledStep]) -> bool | None:
    """Lecture 6: what the first fp16 steps from S = 2^24 did (`ours`, `scaled_training`'s
    steps): a NaN loss, skipped steps, or nothing skipped."""
    if any(math.isnan(step.loss) for step in ours):
        happened = FIRST_STEPS[0]
    else:
        happened = FIRST_STEPS[1] if ours[0].skipped else FIRST_STEPS[2]
    return check_choice(
        first_steps,
        happened,
        FIRST_STEPS,
        why="Gradients times 2^24 pass 65,504 in backward: inf, so the step is skipped and S "
        "halved until backward fits in fp16. A skipped step never touches the weights: no NaN "
        "reaches them.",
    )


OVERTAKES = ("before 128", "between 128 and 256", "not by 256")


def check_s_part_overtakes(s_part_overtakes: object, split: SequenceSplit) -> bool | None:
    """Lecture 6: at which sequence length the saved s x s part outgrew the rest (`split`,
    measured by `sequence_split` up to 256 tokens)."""
    over = next(
        (s for s, q, r in zip(split.seqs, split.square, split.rest, strict=True) if q > r), None
    )
    measured = OVERTAKES[2] if over is None else OVERTAKES[0] if over <= 128 else OVERTAKES[1]
    return check_choice(
        s_part_overtakes,
        measured,
        OVERTAKES,
        why=(
            "Our fp32 model saves about 70 bytes per sbh for the rest (fp32 doubles each 16-bit "
            "value) but 4 per attention score (the formula counts 5: 16-bit scores, a dropout "
            "mask, the dropout's output), so the crossover moves from 34h/(5a) = 68 to about "
            "70h/(4a) = 175."
        ),
    )


AGAINST_FORMULA = ("more than 2x", "between 1x and 2x", "fewer than the formula")


def check_course_vs_formula(
    course_vs_formula: object, saved: int, s: int, b: int, h: int, a: int
) -> bool | None:
    """Lecture 6: the bytes the course's fp32 block saved (`saved`, measured at s, b, h, a)
    against sbh(34 + 5as/h)."""
    ratio = saved / activation_memory(s, b, h, a)
    return check_choice(
        course_vs_formula,
        AGAINST_FORMULA[0]
        if ratio > 2
        else AGAINST_FORMULA[1]
        if ratio > 1
        else AGAINST_FORMULA[2],
        AGAINST_FORMULA,
        why=f"Measured {ratio:.2f}x the formula. At 5as/h = {5 * a * s / h:.0f}, attention "
        "outweighs the 34: its 4 fp32 bytes per score against the formula's 5 count more than "
        "64 against 34.",
    )


def check_smallest_peak(smallest_peak_units: object, best_k: object) -> bool | None:
    """Lecture 6: the least peak of 64 layers checkpointed in k equal segments, and that k."""
    peaks = {k: checkpoint_units(64, k) for k in divisors(64)}
    return together(
        check_number(
            smallest_peak_units,
            min(peaks.values()),
            rtol=0,
            atol=0.5,
            unit="units",
            hint="The peak is k segment inputs plus one segment of n/k layers.",
        ),
        check_number(
            best_k, min(peaks, key=peaks.get), rtol=0, atol=0.5, hint="Where is n/k + k least?"
        ),
    )
