"""PowerSGD's formulas: how much smaller its low-rank factors P and Q are than the matrix, and
the elements and bytes torch's `powerSGD_hook` all-reduces per step (the hook is torch's;
Assignment 5 builds PowerSGD from scratch)."""

import math
from collections.abc import Iterable

import torch

from course_lib.compression.quantization import fp32_all_reduce_bytes

# --- PowerSGD: the compression ratio and torch's hook --------------------------------------


def powersgd_ratio(n: int, m: int, r: int) -> float:
    """How much smaller PowerSGD's P (n x r) and Q (m x r) are than an n x m matrix."""
    return n * m / ((n + m) * r)


def powersgd_elements(shapes: Iterable[torch.Size], r: int, min_rate: float = 2.0) -> dict:
    """Elements torch's powerSGD_hook all-reduces per step for parameters of `shapes`:
    P (n r per matrix), Q (m r per matrix) and the uncompressed rest (vectors, and matrices
    too small to gain `min_rate`), following the hook's own rule."""
    counts = {"P": 0, "Q": 0, "uncompressed": 0}
    for shape in shapes:
        n = shape[0]
        m = math.prod(shape[1:]) if len(shape) > 1 else 1
        r_used = min(n, m, r)
        if len(shape) > 1 and (n + m) * r_used * min_rate < n * m:
            counts["P"] += n * r_used
            counts["Q"] += m * r_used
        else:
            counts["uncompressed"] += n * m
    return counts


def powersgd_bytes(shapes: Iterable[torch.Size], r: int, world_size: int) -> int:
    """Bytes one rank sends per PowerSGD step: three fp32 ring all-reduces (the uncompressed
    tensors, then the Ps, then the Qs), each counted as 2 (P-1)/P * its bytes."""
    counts = powersgd_elements(shapes, r)
    return sum(fp32_all_reduce_bytes(c, world_size) for c in counts.values())
