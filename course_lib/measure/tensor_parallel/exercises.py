"""Lecture 9's exercises, checked off the page: the TP-over-PP ratio worked out by hand, and the
predictions of the all-reduces each layer runs, checked against what the ranks counted; each
computes its expected value and says why here, out of the notebook's sight."""

from __future__ import annotations

from course_lib.costs import (
    GPT3_175B,
    traffic_per_microbatch,
)
from course_lib.exercises import check_choice, check_number
from course_lib.measure.tensor_parallel.layers import LayerRun

# --- the exercise on links ---------------------------------------------------------------------


def check_tp_over_pp(tp_over_pp: object) -> bool | None:
    """The exercise: how many times PP's bytes TP sends per micro-batch, GPT-3 at t=4, p=16."""
    other = traffic_per_microbatch(GPT3_175B, t=4, p=16)
    return check_number(
        tp_over_pp,
        other["TP"] / other["PP"],
        hint="Layers per stage x 4 all-reduces x 2(t-1)/t, against 2 for the boundary.",
    )


# --- the predictions of all-reduces, checked against what the ranks counted ---------------------

OPS = ("identity", "all-reduce")


def check_f_and_g_backward(
    f_backward: object, g_backward: object, fg_calls: dict[str, tuple[int, int]]
) -> tuple[bool | None, bool | None]:
    """What f and g run in backward, from the all-reduces rank 0 counted (`fg_calls[name]`:
    forward, backward, from `f_and_g_all_reduces`)."""
    return (
        check_choice(
            f_backward,
            OPS[min(fg_calls["f"][1], 1)],
            OPS,
            why="X's gradient is the sum of every rank's part, so the ranks add them up.",
        ),
        check_choice(
            g_backward,
            OPS[min(fg_calls["g"][1], 1)],
            OPS,
            why="Y is replicated: its gradient is already whole on every rank.",
        ),
    )


def _all_reduces(run: LayerRun) -> tuple[int, int]:
    """The all-reduces a layer's run counted, (forward, backward)."""
    return run.forward_calls.get("all_reduce", 0), run.backward_calls.get("all_reduce", 0)


def check_head_loss_backward(head_loss_backward: object, head_loss: list[LayerRun]) -> bool | None:
    """How many all-reduces the column-parallel head and the vocabulary-parallel loss ran in
    backward (`head_loss`: each rank's run, rank 0's counted)."""
    return check_choice(
        head_loss_backward,
        str(_all_reduces(head_loss[0])[1]),
        ["0", "1", "3", "4"],
        why="The loss's gradient is local; the head's f all-reduces the gradient of its input.",
    )


def _layer(runs: dict[int, list[dict]], name: str) -> LayerRun:
    """Rank 0's run of layer `name` on 2 ranks (`runs[t][rank]["layers"]`)."""
    return next(run for run in runs[2][0]["layers"] if run.layer == name)


def check_row_backward_all_reduces(
    row_backward_all_reduces: object, runs: dict[int, list[dict]]
) -> bool | None:
    """How many all-reduces a row-parallel layer ran in backward, on 2 ranks."""
    return check_choice(
        row_backward_all_reduces,
        str(_all_reduces(_layer(runs, "row"))[1]),
        ["0", "1", "2"],
        why="g is an all-reduce forward and the identity backward.",
    )


def check_block_all_reduces(block_all_reduces: object, runs: dict[int, list[dict]]) -> bool | None:
    """How many all-reduces a transformer block ran, forward and backward together, on 2 ranks."""
    return check_choice(
        block_all_reduces,
        str(sum(_all_reduces(_layer(runs, "block")))),
        ["2", "4", "6", "8"],
        why="Attention and the MLP: each a column/row pair, with one f and one g.",
    )
