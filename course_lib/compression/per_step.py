"""Every method side by side (lecture 5's slow network): `METHODS`, and per step the bytes
one rank sends, the messages one after another, and the seconds they take on the alpha-beta
model."""

import math
from collections.abc import Sequence

import torch

from course_lib.compression.error_feedback import Sign, TopK
from course_lib.compression.powersgd import powersgd_bytes
from course_lib.compression.quantization import CHUNK, fp32_all_reduce_bytes, int8_allgather_bytes
from course_lib.costs import all_gather_bytes, all_reduce_bytes, alpha_beta_time, collective_steps

ONE_BUCKET_MB = 1024  # DDP bucket size larger than any model here
METHODS = (
    "fp32",
    "fp16",
    "bf16",
    "int8",
    "topk",
    "topk+ef",
    "dgc",
    "sign",
    "sign+ef",
    "vote",
    "powersgd",
)


# --- the formulas for every method, per step ------------------------------------------------


def bytes_per_step(
    method: str,
    shapes: Sequence[torch.Size],
    world_size: int,
    *,
    chunk_size: int = CHUNK,
    topk_fraction: float = 0.01,
    powersgd_rank: int = 4,
) -> int:
    """Bytes one rank sends per step under `method` for parameters of `shapes` in one DDP
    bucket (PowerSGD: once compression has started)."""
    numel = sum(math.prod(shape) for shape in shapes)
    if method == "fp32":
        return fp32_all_reduce_bytes(numel, world_size)
    if method in ("fp16", "bf16"):
        return all_reduce_bytes(2 * numel, world_size)
    if method == "int8":
        return int8_allgather_bytes(numel, world_size, chunk_size)
    if method.startswith("topk") or method == "dgc":
        return all_gather_bytes(TopK(topk_fraction).payload_bytes(numel), world_size)
    if method.startswith("sign") or method == "vote":
        return all_gather_bytes(Sign().payload_bytes(numel), world_size)
    if method == "powersgd":
        return powersgd_bytes(shapes, powersgd_rank, world_size)
    raise ValueError(f"unknown method {method!r}; use one of {', '.join(METHODS)}")


def latency_steps(method: str, world_size: int) -> int:
    """Messages one after another per step: a ring all-reduce takes 2(P-1), an all-gather or
    an all-to-all P-1; PowerSGD runs three all-reduces, int8 two all-gathers (scales, codes)."""
    collectives = {
        "fp32": ("all_reduce",),
        "fp16": ("all_reduce",),
        "bf16": ("all_reduce",),
        "int8": ("all_gather", "all_gather"),
        "powersgd": ("all_reduce",) * 3,
    }
    return sum(collective_steps(op, world_size) for op in collectives.get(method, ("all_gather",)))


def comm_seconds(
    method: str,
    shapes: Sequence[torch.Size],
    world_size: int,
    bandwidth: float,
    latency: float,
    **options,
) -> float:
    """Network time per step, alpha-beta model: latency_steps * latency + bytes / bandwidth."""
    sent = bytes_per_step(method, shapes, world_size, **options)
    return alpha_beta_time(sent, latency, bandwidth, messages=latency_steps(method, world_size))
