"""How lecture 10 shows the planner (the best plan in one line, the candidates as a table, a
figure of step times by cause, a form that re-plans, the close calls, the checks of the
exercises and of the student's plan, the grid as a table), and the one real DP x TP x PP step
it runs beside it.

    print(summary(MODELS["70B"], cluster))
    print(candidate_table(candidates(MODELS["70B"], cluster)[:10]))
    plot_step_times(candidates(MODELS["70B"], cluster)[:12])
    PlannerWidget(model="70B", gpus=512)
    run = launch(train_3d, ProcessGrid(2, 2, 2), world_size=8)   # on each rank: 2 steps
    gather_dense(run, grid) vs reference_3d()                    # the same, in one process
    print(comparison_table(predicted_vs_measured(run, grid)))    # planner beside measured

By what a reader looks for:

    tables.py       the planner in text: the best plan and the close calls, the candidates,
                    why nothing fits, the grid as a table
    plan_check.py   the exercises' checks: one plan's memory, interleaved bubble and MFU by
                    hand, check_plan, the verdict on the student's own plan, and the
                    predictions of the pipeline's depth with a small batch and with CP
    figures.py      step times by cause as a figure, and PlannerWidget, the form that re-plans
    real_step.py    what runs on ranks: the groups as the collectives see them, the real step
                    and its single-process reference, its numbers beside the planner's

Import from `course_lib.measure.parallel_3d` itself: every name is one name here.

The real step (`train_3d`, `step_3d`): lecture 9's TP layers, lecture 8's 1F1B schedule and
send/recv, a DP all-reduce. The grid and the planner are in `course_lib.parallel_3d`.
"""

from course_lib.measure.parallel_3d.figures import (
    INTER_NODE_GB_PER_S,
    PlannerWidget,
    plot_step_times,
)
from course_lib.measure.parallel_3d.plan_check import (
    SHRINK,
    check_interleaved_bubble,
    check_pipeline_with_128,
    check_pipeline_with_cp,
    check_plan,
    check_plan_memory,
    check_plan_mfu,
    check_tp_bytes_per_rank,
)
from course_lib.measure.parallel_3d.real_step import (
    LR,
    STEP_CONFIG,
    GroupBytes,
    build_stage,
    comparison_table,
    dense_names,
    gather_dense,
    group_members,
    predicted_vs_measured,
    reference_3d,
    step_3d,
    step_batches,
    tiny_model,
    train_3d,
)
from course_lib.measure.parallel_3d.tables import (
    CLOSE_CALL,
    candidate_table,
    close_calls,
    explain_none,
    grid_table,
    summary,
)

__all__ = [
    "CLOSE_CALL",
    "INTER_NODE_GB_PER_S",
    "LR",
    "SHRINK",
    "STEP_CONFIG",
    "GroupBytes",
    "PlannerWidget",
    "build_stage",
    "candidate_table",
    "check_interleaved_bubble",
    "check_pipeline_with_128",
    "check_pipeline_with_cp",
    "check_plan",
    "check_plan_memory",
    "check_plan_mfu",
    "check_tp_bytes_per_rank",
    "close_calls",
    "comparison_table",
    "dense_names",
    "explain_none",
    "gather_dense",
    "grid_table",
    "group_members",
    "plot_step_times",
    "predicted_vs_measured",
    "reference_3d",
    "step_3d",
    "step_batches",
    "summary",
    "tiny_model",
    "train_3d",
]
