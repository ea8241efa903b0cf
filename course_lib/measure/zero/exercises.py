"""Lecture 7's exercises on the formulas, and its predictions checked against what the ranks
measured: each check computes its expected values (and says why) here, out of the notebook's
sight, and says right or wrong with `course_lib.exercises`.

    check_gb_per_gpu({"ddp": ..., "zero1": ..., "zero2": ..., "zero3": ...}, redundant_gb)
    check_zero2_bytes_per_param(zero2_bytes_per_param)
    check_torch_zero1_vs_ddp(torch_zero1_vs_ddp, runs)     # bytes received, measured
    check_zero3_extra_gb(extra_gb)
    check_blocks_gathered_with_prefetch(blocks, on, off)  # FSDP2's gathered peak, measured
    check_offload({"GPU GB": ..., "CPU GB": ..., "PCIe seconds": ...})
"""

from __future__ import annotations

from course_lib.costs import (
    MIXED_ADAMW,
    zero_bytes,
    zero_comm_bytes,
    zero_mixed_bytes,
    zero_offload_bytes,
)
from course_lib.exercises import check_choice, check_number, check_numbers, together
from course_lib.measure.zero.prefetch import Timeline
from course_lib.memory import GB
from course_lib.zero import STAGES, StageRun

PCIE = 16e9  # bytes/s each way, the exercise's PCIe link


def check_gb_per_gpu(gb_per_gpu: object, redundant_gb: object) -> bool | None:
    """GB per GPU under each stage for 13B on 32 GPUs, and the GB of DDP's copies for 7B on 64."""
    per_gpu = {s: sum(zero_bytes(s, 13e9, 32, MIXED_ADAMW).values()) / GB for s in STAGES}
    return together(
        check_numbers(
            gb_per_gpu, per_gpu, unit="GB", hint="Which kinds does this stage divide by P?"
        ),
        check_number(
            redundant_gb,
            (64 - 1) * sum(zero_bytes("ddp", 7e9, 64, MIXED_ADAMW).values()) / GB,
            rtol=0.005,  # 64 copies for 63 is 1.6% off: the mistake this question is about
            unit="GB",
            hint="One copy of the 16N bytes is needed; count the others.",
        ),
    )


def check_zero2_bytes_per_param(zero2_bytes_per_param: object) -> bool | None:
    """Bytes per parameter one rank holds under textbook ZeRO-2 in mixed precision, P = 4."""
    return check_number(
        zero2_bytes_per_param,
        sum(zero_mixed_bytes("zero2", 1, 4).values()),
        hint="bf16 weights stay whole (2 bytes); gradients and the optimizer's 12 are split by P.",
    )


def check_zero3_extra_gb(extra_gb: object) -> bool | None:
    """GB a GPU receives per step under ZeRO-3 beyond ZeRO-1: 7B's bf16 weights, 64 GPUs."""
    comm = {stage: zero_comm_bytes(stage, 2 * 7e9, 64) for stage in ("zero1", "zero3")}
    return check_number(
        extra_gb,
        (comm["zero3"] - comm["zero1"]) / GB,
        unit="GB",
        hint="Count the ring passes of each stage; each moves (P-1)/P of M.",
    )


def check_offload(offload_answer: object) -> bool | None:
    """ZeRO-Offload of 7B on 2 GPUs: GPU GB, CPU GB and PCIe seconds per step at 16 GB/s."""
    seven = zero_offload_bytes(7e9, 2)
    return check_numbers(
        offload_answer,
        {
            "GPU GB": seven["gpu"] / GB,
            "CPU GB": seven["cpu"] / GB,
            "PCIe seconds": 2 * seven["pcie_each_way"] / PCIE,
        },
        hint=(
            "The GPU keeps 2 bytes per parameter, whole; the CPU's 14 and the copies are per shard."
        ),
    )


def check_torch_zero1_vs_ddp(
    torch_zero1_vs_ddp: object, runs: dict[int, list[list[StageRun]]]
) -> bool | None:
    """Whether torch's ZeRO-1 received less, the same or more than DDP per step on 4 ranks
    (`runs[P][rank][i]`: rank's run of `STAGES[i]` on P ranks)."""
    received = {stage: runs[4][0][STAGES.index(stage)].comm_received for stage in ("ddp", "zero1")}
    ratio = received["zero1"] / received["ddp"]
    measured = "the same" if abs(ratio - 1) < 0.05 else "more" if ratio > 1 else "less"
    return check_choice(
        torch_zero1_vs_ddp,
        measured,
        ["less", "the same", "more"],
        why=f"Measured at P=4: torch's ZeRO-1 received {ratio:.2f} times what DDP received per "
        "step. DDP's all-reduce stays, and the broadcasts come on top of it.",
    )


def check_blocks_gathered_with_prefetch(
    blocks_gathered_with_prefetch: object, on: list[Timeline], off: list[Timeline]
) -> bool | None:
    """The most blocks a rank held gathered at once with forward prefetching (`on`, one
    timeline per rank; `off` without), in blocks of the largest unit's full parameters."""
    block = max(on[0].unit_bytes)  # one block's full parameters, fp32
    peaks = {
        name: max(t.gathered_peak for t in ranks) for name, ranks in (("on", on), ("off", off))
    }
    return check_choice(
        blocks_gathered_with_prefetch,
        str(round(peaks["on"] / block)),
        ["1", "2", "3"],
        why=f"Measured: one block {block:,} B, gathered peak {peaks['on']:,} B with prefetching, "
        f"{peaks['off']:,} B without. The next unit's all-gather lands while the current unit "
        "is still gathered.",
    )
