"""Pipeline parallelism: schedules, their bubble, and what a cut of a model into stages costs
(lecture 8).

    order = schedule_order("1f1b", P=4, m=8)           # what each stage runs, in order
    timeline = simulate(4, 8, "1f1b")                   # when: per-stage forward/backward/idle
    timeline.bubble, bubble_formula(4, 8)               # idle share against (P-1)/(m+P-1)
    timeline = Timeline.from_logs(launch(...))          # a measured timeline, same type
    stage_time(layer_times, sync_times, first, last, machines)      # T(first -> last, m)

By what a reader looks for:

    schedules.py   the order of each stage's ops: naive, GPipe, 1F1B, interleaved 1F1B
    timeline.py    when each op ran: the simulator, a measured step's timeline, the bubble
    partition.py   cutting a model into stages: what a stage and a link after it take
    p2p.py         one tensor with its shape between two ranks (for hand-written steps)

Import from `course_lib.pipeline` itself: every public name is here.

The package holds no pipeline trainer: the lecture runs torch's own schedules
(`torch.distributed.pipelining`) and times what they did (`course_lib.measure.pipeline`), and
checks that torch's order is `schedule_order`'s. Assignment 8 asks you to write your own
pipeline trainer, `simulate_schedule` and `optimal_partition` (PipeDream's dynamic program,
which this package does not hold: the lecture tries every cut instead). The lecture's
measurements and pictures (the timed runs, the Gantt chart, the widget, the brute-force
partition, layer profiles) are in `course_lib.measure.pipeline`.
"""

from course_lib.pipeline.partition import (
    Partition,
    Stage,
    check_partition_input,
    link_times,
    partition_stages,
    stage_time,
    sync_times,
)
from course_lib.pipeline.schedules import BACKWARD, FORWARD, SCHEDULES, Op, schedule_order
from course_lib.pipeline.timeline import StageLog, Task, Timeline, bubble_fraction, simulate

__all__ = [
    "BACKWARD",
    "FORWARD",
    "SCHEDULES",
    "Op",
    "Partition",
    "Stage",
    "StageLog",
    "Task",
    "Timeline",
    "bubble_fraction",
    "check_partition_input",
    "link_times",
    "partition_stages",
    "schedule_order",
    "simulate",
    "stage_time",
    "sync_times",
]
