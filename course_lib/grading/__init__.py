"""Grading checks: the thin, named interface between assignments, graders and tests.

A notebook's test cell calls a check with the student's function or class, e.g.
`check_ping_pong(ping, pong)`. The check runs it on several processes, compares with an
independent reference, and raises `CheckFailed` (an AssertionError) saying what is wrong.
One module per assignment topic.
"""

from course_lib.grading._harness import CheckFailed, install_ipython_display
from course_lib.grading.collectives import (
    check_all_gather,
    check_all_reduce,
    check_all_reduce_fast,
    check_broadcast,
    check_reduce,
    check_reduce_scatter,
)
from course_lib.grading.compression import check_powersgd, check_quantized_all_reduce
from course_lib.grading.compression_budget import check_compressed_training
from course_lib.grading.data_parallel import (
    check_communicate_less,
    check_ddp,
    check_sync_gradients,
)
from course_lib.grading.expert_parallel import (
    check_moe_backward,
    check_moe_dedup,
    check_moe_forward,
    check_moe_traffic,
)
from course_lib.grading.gossip import check_one_peer_schedule, check_push_sum
from course_lib.grading.parallel_3d import check_2d_training, check_process_grid
from course_lib.grading.parallel_3d_zero import check_sharded_adamw
from course_lib.grading.pipeline import (
    check_optimal_partition,
    check_pipeline_trainer,
    check_simulate_schedule,
    check_split_schedule,
)
from course_lib.grading.processes import (
    check_chain,
    check_dist_ping_pong,
    check_ping_pong,
    check_round_trip_time,
    check_spread,
)
from course_lib.grading.sequence_parallel import (
    check_balanced_backward,
    check_ring_backward,
    check_ring_memory,
    check_ulysses_backward,
)
from course_lib.grading.tensor_parallel import (
    check_column_parallel_linear,
    check_parallel_attention,
    check_parallel_mlp,
    check_row_parallel_linear,
    check_vocab_parallel_cross_entropy,
)
from course_lib.grading.zero import check_zero1, check_zero2, check_zero3, check_zero3_peak

__all__ = [
    "CheckFailed",
    "check_2d_training",
    "check_all_gather",
    "check_all_reduce",
    "check_all_reduce_fast",
    "check_balanced_backward",
    "check_broadcast",
    "check_chain",
    "check_column_parallel_linear",
    "check_communicate_less",
    "check_compressed_training",
    "check_ddp",
    "check_dist_ping_pong",
    "check_moe_backward",
    "check_moe_dedup",
    "check_moe_forward",
    "check_moe_traffic",
    "check_optimal_partition",
    "check_parallel_attention",
    "check_parallel_mlp",
    "check_ping_pong",
    "check_pipeline_trainer",
    "check_powersgd",
    "check_process_grid",
    "check_one_peer_schedule",
    "check_push_sum",
    "check_quantized_all_reduce",
    "check_reduce",
    "check_reduce_scatter",
    "check_ring_backward",
    "check_ring_memory",
    "check_round_trip_time",
    "check_spread",
    "check_row_parallel_linear",
    "check_sharded_adamw",
    "check_simulate_schedule",
    "check_split_schedule",
    "check_sync_gradients",
    "check_ulysses_backward",
    "check_vocab_parallel_cross_entropy",
    "check_zero1",
    "check_zero2",
    "check_zero3",
    "check_zero3_peak",
]

install_ipython_display()
