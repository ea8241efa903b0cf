"""What lecture 7 measures beyond `course_lib.zero`: ZeRO in mixed precision, kind by kind,
and FSDP2's prefetching of all-gathers drawn on a timeline; and the checks of its exercises.

    run = train_mixed("zero2", batches)        # on every rank: bf16 compute, fp32 master
    run.kinds                                  # bytes of weights, gradients, master, moments
    mixed_table(runs, n_params); plot_mixed(runs, n_params)
    tl = prefetch_timeline(batches, prefetch=True)    # on every rank: FSDP2 events in time
    plot_timeline(per_rank_timelines)
    check_zero3_extra_gb(extra_gb)             # an exercise's check: right or wrong, and a hint
    check_torch_zero1_vs_ddp(answer, runs)     # a prediction, against the bytes measured

By what a reader looks for:

    mixed.py       ZeRO in mixed precision (explicit bf16 copies, fp32 master weights), kind
                   by kind, measured against the (2 + 2 + 12)N formula
    prefetch.py    FSDP2's all-gathers and compute on a timeline, with and without prefetching
    exercises.py   the checks of the lecture's exercises on the formulas and of its
                   predictions, whose expected values and whys the notebook does not show

Import from `course_lib.measure.zero` itself: every name is one name here.
"""

from course_lib.measure.zero.exercises import (
    check_blocks_gathered_with_prefetch,
    check_gb_per_gpu,
    check_offload,
    check_torch_zero1_vs_ddp,
    check_zero2_bytes_per_param,
    check_zero3_extra_gb,
)
from course_lib.measure.zero.mixed import (
    MIXED_KINDS,
    MIXED_TOOLS,
    MixedRun,
    mixed_table,
    plot_mixed,
    train_mixed,
)
from course_lib.measure.zero.prefetch import (
    GATHERS,
    Event,
    Timeline,
    plot_timeline,
    prefetch_timeline,
    timeline_summary,
)

__all__ = [
    "GATHERS",
    "MIXED_KINDS",
    "MIXED_TOOLS",
    "Event",
    "MixedRun",
    "Timeline",
    "check_blocks_gathered_with_prefetch",
    "check_gb_per_gpu",
    "check_offload",
    "check_torch_zero1_vs_ddp",
    "check_zero2_bytes_per_param",
    "check_zero3_extra_gb",
    "mixed_table",
    "plot_mixed",
    "plot_timeline",
    "prefetch_timeline",
    "timeline_summary",
    "train_mixed",
]
