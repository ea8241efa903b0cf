"""Lecture 10's exercises. Exercise 8: `check_plan` prices the student's own plan with the
planner's `estimate`, and says whether it fits and how its step compares with the best plan's,
and why (never which plan is best). Before it, the numbers of one plan worked out by hand
(`check_plan_memory`, `check_interleaved_bubble`, `check_plan_mfu`); after it, two predictions
of what the planner picks (`check_pipeline_with_128`, `check_pipeline_with_cp`), and the real
step's TP bytes against the run (`check_tp_bytes_per_rank`): each computes
its expected values and says why here, out of the notebook's sight, and says right or wrong
with `course_lib.exercises`."""

from __future__ import annotations

from typing import Any

from course_lib.costs import bubble_formula
from course_lib.exercises import check_choice, check_number, check_numbers
from course_lib.measure.parallel_3d.tables import CLOSE_CALL
from course_lib.memory import GB
from course_lib.parallel_3d import LLAMA_70B, Cluster, Estimate, Model, Plan, best, estimate

# check_plan's advice, by the part of memory that overflows or the cause that grows the step.
SHRINK = {
    "params": "More TP or PP ranks share the weights.",
    "optimizer_state": "ZeRO-1 shards the optimizer state over the DP group.",
    "activations": "Stage 0 holds about L layers of them whatever p: more TP, or checkpointing.",
    "recompute": "Checkpoint less (selective, not full), if the activations still fit.",
    "tp": "TP all-reduces in every layer: no wider than needed, never across nodes.",
    "pp": "Each stage boundary sends activations: fewer stages send less.",
    "bubble": "The bubble (p-1)/(m+p-1) grows with p and shrinks with m = batch / d.",
    "dp": "Each GPU all-reduces its gradients over DP: fewer per GPU (more TP or PP), ZeRO-1.",
}


def check_plan(answer: Any, model: Model, cluster: Cluster) -> bool | None:
    """Lecture 10's exercise: does the student's plan (a dict of `Plan`'s fields) fit, how does
    its step by the planner's model compare with the best plan's, and why (never which it is)."""
    if answer is ... or isinstance(answer, dict) and ... in answer.values():
        print("Not answered yet: replace each ... with your choice and run the cell again.")
        return None
    try:
        e = estimate(model, cluster, Plan(**answer))
    except (TypeError, ValueError) as error:
        print(f"✗ Not a plan the planner can price: {error}")
        return False
    used = f"{e.total_memory / GB:.0f} GB per GPU of {cluster.gpu_memory / GB:.0f} GB"
    if not e.fits:
        part = max(e.memory, key=e.memory.get)
        print(
            f"✗ Too big: {e.plan} needs {used}, {e.memory[part] / GB:.0f} GB of it {part}. "
            f"{SHRINK.get(part, '')}"
        )
        return False
    top, most = best(model, cluster) or e, max(e.seconds, key=e.seconds.get)
    print(
        f"{e.plan} fits: {used}. By the planner's model, a step of {e.step_seconds:.1f} s, "
        f"most of it {most} ({e.seconds[most]:.1f} s)."
    )
    if (slower := e.step_seconds / top.step_seconds - 1) <= CLOSE_CALL:
        print(f"✓ Right: within {CLOSE_CALL:.0%} of the planner's best, too close to call.")
        return True
    extra = {k: v - top.seconds.get(k, 0.0) for k, v in e.seconds.items()}
    cause = max(extra, key=extra.get)
    print(
        f"✗ Not yet: {slower:.0%} slower than the planner's best, most of the gap in {cause} "
        f"({extra[cause]:.1f} s more). {SHRINK.get(cause, '')}".rstrip()
    )
    return False


def check_plan_memory(by_hand_gb: object) -> bool | None:
    """GB of model state and of activations per GPU: 70B on 512 GPUs, TP 8 x PP 8 x DP 8, ZeRO-1."""
    by_hand = estimate(LLAMA_70B, Cluster(512), Plan(8, 8, 8, "zero1", "none"))
    state = sum(by_hand.memory[k] for k in ("params", "grads", "optimizer_state"))
    return check_numbers(
        by_hand_gb,
        {"model state": state / GB, "activations": by_hand.memory["activations"] / GB},
        unit="GB",
        hint=(
            "A GPU's share is N/t of L/p of the L layers, ZeRO-1 divides the 12 optimizer bytes "
            "by d; activations: min(p, m) micro-batches x L/p layers x sbh(34/t + 5as/(ht))."
        ),
    )


def check_interleaved_bubble(interleaved_bubble: object) -> bool | None:
    """The bubble of PP 4 with m = 64 micro-batches once each GPU holds v = 2 model chunks."""
    return check_number(
        interleaved_bubble,
        bubble_formula(4, 64, chunks=2),
        hint="The fill and drain are v times shorter: (P-1)/(vm + P-1).",
    )


def check_plan_mfu(mfu: object) -> bool | None:
    """The MFU of 70B on 512 GPUs as TP 8 x PP 4 x DP 16 with ZeRO-1, by the planner's model."""
    one = estimate(LLAMA_70B, Cluster(512), Plan(8, 4, 16, "zero1", "none"))
    return check_number(
        mfu,
        one.mfu,  # the planner's own: utilisation x achieved / peak FLOP/s
        hint="Model FLOPs per second = utilisation x achieved FLOP/s; divide by the peak.",
    )


DEPTHS = ("shallower", "the same", "deeper")


def check_pipeline_with_128(pipeline_with_128: object, plans: dict[int, Estimate]) -> bool | None:
    """Whether the best plan's pipeline for 175B on 512 GPUs is shallower, the same or deeper
    with a global batch of 128 than of 1536 (`plans[batch]`: the planner's best)."""
    large, small = plans[1536].plan.pp, plans[128].plan.pp
    return check_choice(
        pipeline_with_128,
        DEPTHS[(small >= large) + (small > large)],
        DEPTHS,
        why=(
            "With TP 8, p x d = 64: m = 128/d micro-batches feed p = 64/d stages, so the bubble "
            "is about 30% whatever the split. What still differs is DP's all-reduce of each "
            "GPU's gradients, once per step: a deeper pipeline gives each GPU fewer parameters "
            "to reduce."
        ),
    )


def check_pipeline_with_cp(pipeline_with_cp: object, with_cp: Estimate) -> bool | None:
    """Whether the best plan for 7B with 16 sequences of 128k on 256 GPUs, CP allowed
    (`with_cp`), keeps a pipeline."""
    return check_choice(
        pipeline_with_cp,
        "kept" if with_cp.plan.pp > 1 else "dropped",
        ["kept", "dropped"],
        why="CP gives the GPUs DP could not use a share of each sequence, with no bubble.",
    )


def check_tp_bytes_per_rank(tp_bytes_per_rank: object, run: list[dict]) -> bool | None:
    """Section 6's prediction: the bytes rank 0 sent to its TP partner in the real step's first
    step, against what it measured (`run[0]["sent"]["tp"]`, counted by `course_lib.comm`)."""
    return check_number(
        tp_bytes_per_rank,
        run[0]["sent"]["tp"],
        hint="Count the all-reduces of a block per micro-batch, then what each sends.",
    )
