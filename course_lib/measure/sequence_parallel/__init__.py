"""What lecture 11 measures: attention's peak memory per rank against the sequence length, the
bytes ring attention and Ulysses send (with grouped-query attention too), the causal work each
rank does at each hop, and when a hop hides its transfer on an emulated network.

By what a reader looks for:

    ranks.py       on ranks: ring attention and Ulysses against one process, their peak
                   memory and bytes, the causal work per hop, torch's context parallelism,
                   tensor parallelism with and without sequence parallelism
    overlap.py     a hop's compute against its transfer on a slow network, and the wait
    figures.py     peak memory against the sequence length, the causal work per hop
    exercises.py   the lecture's exercises, checked off the page

Numbers are measured (`PeakMemory`, `CommCounter`, `WireCounter`, the scores ring attention
computed, `SlowNetwork.waited`); the formulas they are held against are in `course_lib.costs`.
"""

from course_lib.measure.sequence_parallel.exercises import (
    check_busiest_over_idlest,
    check_fewer_bytes_with_one_kv_head,
    check_memory_saving,
    check_merge,
    check_rescale,
    check_ring_bytes_per_rank,
    check_waits_at_the_largest_block,
    merge_cases,
)
from course_lib.measure.sequence_parallel.figures import plot_causal_work, plot_peak_bytes
from course_lib.measure.sequence_parallel.overlap import plot_ring_overlap, ring_overlap
from course_lib.measure.sequence_parallel.ranks import (
    METHODS,
    bytes_sent,
    causal_work,
    largest_error,
    peak_bytes,
    qkv,
    run_on_my_shard,
    sweep_gqa_bytes,
    sweep_peak_bytes,
    torch_context_parallel,
    tp_against_sp,
)

__all__ = [
    "METHODS",
    "bytes_sent",
    "causal_work",
    "check_busiest_over_idlest",
    "check_fewer_bytes_with_one_kv_head",
    "check_memory_saving",
    "check_merge",
    "check_rescale",
    "check_ring_bytes_per_rank",
    "check_waits_at_the_largest_block",
    "largest_error",
    "merge_cases",
    "peak_bytes",
    "plot_causal_work",
    "plot_peak_bytes",
    "plot_ring_overlap",
    "qkv",
    "ring_overlap",
    "run_on_my_shard",
    "sweep_gqa_bytes",
    "sweep_peak_bytes",
    "torch_context_parallel",
    "tp_against_sp",
]
