"""What lecture 12 measures: how many tokens each expert gets and how many are dropped, what
capacity costs against dropless, that expert parallelism equals one process, the bytes its
all-to-alls send, and its step time on an emulated slow network against tensor parallelism
with as many parameters.

By what a reader looks for:

    routing.py     the lecture's layer and data; tokens per expert, the share dropped at each
                   capacity factor, SGD on the balancing loss alone
    dropless.py    capacity against dropless, counted by running the layer: drops, padded
                   rows, the largest expert batch
    ranks.py       on ranks: expert parallelism against one process, the all-to-alls' bytes,
                   step times on a slow network against tensor parallelism
    exercises.py   the lecture's exercises, checked off the page

The formulas the numbers are held against are in `course_lib.costs`; the layer is in
`course_lib.expert_parallel`.
"""

from course_lib.measure.expert_parallel.dropless import (
    DROPLESS,
    capacity_work,
    check_no_drop_factor,
    expert_rows,
    lecture_capacity_work,
    plot_capacity_work,
    print_capacity_work,
)
from course_lib.measure.expert_parallel.exercises import (
    DROPPED,
    check_capacity,
    check_dropped_at_one,
    check_ep_forward_bytes,
    check_faster_ep_or_tp,
    check_worst_balance_loss,
)
from course_lib.measure.expert_parallel.ranks import (
    bytes_sent,
    largest_errors,
    plot_step_times,
    step_spread,
    step_times,
    sweep_step_times,
    torch_all_to_all,
)
from course_lib.measure.expert_parallel.routing import (
    D_FF,
    D_MODEL,
    N_EXPERTS,
    K,
    balance_router,
    balanced,
    batch,
    dropped_share,
    expert_load,
    plot_balancing,
    plot_dropped_share,
    plot_expert_load,
    small_moe,
)

__all__ = [
    "D_FF",
    "D_MODEL",
    "DROPLESS",
    "DROPPED",
    "K",
    "N_EXPERTS",
    "balance_router",
    "balanced",
    "batch",
    "bytes_sent",
    "capacity_work",
    "check_capacity",
    "check_dropped_at_one",
    "check_ep_forward_bytes",
    "check_faster_ep_or_tp",
    "check_no_drop_factor",
    "check_worst_balance_loss",
    "dropped_share",
    "expert_load",
    "expert_rows",
    "largest_errors",
    "lecture_capacity_work",
    "plot_balancing",
    "plot_capacity_work",
    "plot_dropped_share",
    "plot_expert_load",
    "plot_step_times",
    "print_capacity_work",
    "small_moe",
    "step_spread",
    "step_times",
    "sweep_step_times",
    "torch_all_to_all",
]
