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
    check_bidirectional_ring_all_reduce,
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

# What the assignments' set-up cells give students from the grader besides the checks: tools
# their answers may call (plumbing, probes, sizes). Every other function of course_lib.grading
# is the grader's own, which a check refuses when the student's code calls it (`provenance`).
# tests/test_topics.py holds this table to the set-up cells' imports.
GIVEN = {
    "course_lib.grading.data_parallel": ("ProbeModel", "bucket_layout"),
    "course_lib.grading.gossip": ("in_neighbors", "out_neighbors"),
    "course_lib.grading.compression": ("BytesByKind", "all_reduce_bound", "payload_budget"),
    "course_lib.grading.zero": (
        "ADAMW",
        "SMALL",
        "ZeroRun",
        "global_batches",
        "gradient_bytes",
        "measure_memory",
        "optimizer_state_bytes",
        "reference",
        "shard_bytes",
    ),
    "course_lib.grading.pipeline": (
        "InFlightProbe",
        "recv_tensor",
        "send_tensor",
        "simulate_split",
    ),
    "course_lib.grading.parallel_3d": (
        "configuration_table",
        "formula",
        "gather_dense",
        "measure_configuration",
        "sharded_adamw_report",
        "split_counts",
    ),
    "course_lib.grading.sequence_parallel": ("causal_backward_flops",),
    "course_lib.grading.expert_parallel": (
        "dedup_cases",
        "inputs",
        "kept_rows",
        "layer",
        "row_bytes",
    ),
}

# What of the grader the student's code runs by design: functions a check hands it to call
# back (a relay to run in each process), classes whose objects a given tool returns to it
# (what send_tensor returns), and instruments its operations pass through (a memory meter
# whose callbacks run as its tensors are freed). New instruments belong in the machinery
# (course_lib.comm, course_lib.meters); these predate the rule.
HANDED = {
    "course_lib.grading.processes": ("_recording_relay",),
    "course_lib.grading.pipeline_plumbing": ("PendingSend",),
    "course_lib.grading.zero_meter": ("_Meter", "GradientMeter"),
}

__all__ = [
    "CheckFailed",
    "check_2d_training",
    "check_all_gather",
    "check_all_reduce",
    "check_all_reduce_fast",
    "check_balanced_backward",
    "check_bidirectional_ring_all_reduce",
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
