"""What lecture 8 measures about pipelines, and how it shows them.

    log = torch_pipeline_step(stage, x, y, loss_fn, m, "1f1b", 0.04, 0.08)  # torch's, timed
    logs = launch(measure_bubbles, make_stage, x, y, loss_fn, schedules, ms, fwd, bwd, ...)
    timeline = Timeline.from_logs(logs); op_seconds(timeline)   # what ran when; op lengths
    plot_schedule(timeline); PipelineWidget()           # Gantt chart; sliders for P and m
    plot_side_by_side(simulated, measured)              # the same schedules, simulated | measured
    torch_interleaved_step(pieces, x, y, loss_fn, m)    # its ScheduleInterleaved1F1B
    zero_bubble_step(stage, x, y, loss_fn, m, defer_w=True)  # backward split into B and W
    brute_force_partition(layer_times, activation_sizes, n_machines)  # every cut, to check
    profile_layers(layers, x)                           # each layer's seconds and output bytes
    check_bubble_shares(bubble, fewest_m)               # an exercise: right, or a hint
    check_first_backward(first_backward, logs)          # a prediction, against the run

By what a reader looks for:

    runs.py          torch's own schedules (torch.distributed.pipelining) run on ranks and
                     timed op by op on the wall clock (`TimedStage` sets each op's length)
    figures.py       the Gantt chart, simulated beside measured, and the widget
    partition.py     every cut by brute force (to check the DP), each layer's profile
    zero_bubble.py   backward split into B and W: simulated, and run for real
    exercises.py     the lecture's exercises: the bubble by hand and the predictions about
                     in-flight micro-batches, zero bubble's idle time, the first backward
                     and zero bubble's measured bubbles, checked off the page

The schedules, the simulator and the partition are in `course_lib.pipeline`.
"""

from course_lib.measure.pipeline.exercises import (
    check_bubble_shares,
    check_first_backward,
    check_my_bubble,
    check_one_f_one_b_in_flight,
    check_zero_bubble_idle,
    check_zero_bubble_measured,
)
from course_lib.measure.pipeline.figures import (
    PipelineWidget,
    draw_schedule,
    plot_bubbles,
    plot_schedule,
    plot_side_by_side,
)
from course_lib.measure.pipeline.partition import (
    brute_force_partition,
    profile_layers,
)
from course_lib.measure.pipeline.runs import (
    TimedStage,
    measure_bubbles,
    op_seconds,
    torch_interleaved_step,
    torch_pipeline_step,
)
from course_lib.measure.pipeline.zero_bubble import (
    INPUT_GRAD,
    WEIGHT_GRAD,
    ZB_H1,
    measure_zero_bubble,
    peak_activations,
    peak_memory,
    pending_w_peak,
    play_split_backward,
    simulate_zb_h1,
    simulate_zero_bubble,
    what_w_needs,
    zb_h1_order,
    zero_bubble_name,
    zero_bubble_order,
    zero_bubble_step,
)

__all__ = [
    "INPUT_GRAD",
    "PipelineWidget",
    "TimedStage",
    "WEIGHT_GRAD",
    "ZB_H1",
    "brute_force_partition",
    "check_bubble_shares",
    "check_first_backward",
    "check_my_bubble",
    "check_one_f_one_b_in_flight",
    "check_zero_bubble_idle",
    "check_zero_bubble_measured",
    "draw_schedule",
    "measure_bubbles",
    "measure_zero_bubble",
    "op_seconds",
    "peak_activations",
    "peak_memory",
    "pending_w_peak",
    "plot_bubbles",
    "play_split_backward",
    "plot_schedule",
    "plot_side_by_side",
    "profile_layers",
    "simulate_zb_h1",
    "simulate_zero_bubble",
    "torch_interleaved_step",
    "torch_pipeline_step",
    "what_w_needs",
    "zb_h1_order",
    "zero_bubble_name",
    "zero_bubble_order",
    "zero_bubble_step",
]
