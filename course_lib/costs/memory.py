"""Memory costs: bytes per parameter of training state, what each ZeRO stage keeps on a rank
(and sends per step), ZeRO-Offload, and the activations a transformer layer keeps."""

from __future__ import annotations

from collections.abc import Mapping

from course_lib.costs.communication import ring_bytes

# --- bytes per parameter and ZeRO -----------------------------------------------------------

# The mixed-precision AdamW budget, bytes per parameter (ZeRO paper, Rajbhandari et al. 2020,
# section 3.1): the model computes in bf16, and AdamW updates an fp32 master copy with two fp32
# moments. 2 + 2 + 12 = 16 bytes.
BYTES_PER_PARAMETER = {
    "weights": 2,  # bf16 copy used by forward and backward
    "gradients": 2,  # bf16, produced by backward
    "master weights": 4,  # fp32 copy the optimizer updates; small updates survive rounding
    "optimizer: exp_avg": 4,  # Adam's first moment m, fp32
    "optimizer: exp_avg_sq": 4,  # Adam's second moment v, fp32
}

# The same, grouped as ZeRO shards them. In fp32 the parameters *are* the weights AdamW
# updates (no master copy): 4 + 4 + two 4-byte moments. In mixed precision the bf16 weights
# and gradients take 2 bytes each, and the optimizer keeps 12: the master copy and the moments.
FP32_ADAMW = {"params": 4, "grads": 4, "optimizer_state": 8}
MIXED_ADAMW = {
    "params": BYTES_PER_PARAMETER["weights"],
    "grads": BYTES_PER_PARAMETER["gradients"],
    "optimizer_state": sum(
        b for k, b in BYTES_PER_PARAMETER.items() if k not in ("weights", "gradients")
    ),
}
# AdamW in float64, as lecture 10's real step runs it (no master copy: 8 + 8 + 2 x 8 bytes).
FP64_ADAMW = {"params": 8, "grads": 8, "optimizer_state": 16}
ZERO_SHARDED = {  # which kinds of state each stage divides among the P ranks
    "ddp": (),
    "zero1": ("optimizer_state",),
    "zero2": ("optimizer_state", "grads"),
    "zero3": ("optimizer_state", "grads", "params"),
}
# Ring passes over the model per step (each (P-1)/P of its bytes): DDP all-reduces the
# gradients (2); ZeRO-1/2 reduce-scatter them and all-gather the parameters (1 + 1); ZeRO-3
# all-gathers the parameters for forward and again for backward, and reduce-scatters the
# gradients (1 + 1 + 1).
ZERO_PASSES = {"ddp": 2, "zero1": 2, "zero2": 2, "zero3": 3}


def _check_stage(stage: str) -> None:
    if stage not in ZERO_SHARDED:
        raise ValueError(f"unknown stage {stage!r}; use one of {', '.join(ZERO_SHARDED)}")


def zero_bytes(
    stage: str, n_params: float, world_size: int, bytes_per_param: Mapping[str, float] = FP32_ADAMW
) -> dict[str, float]:
    """Bytes of each kind of state in `bytes_per_param` (params, grads, optimizer_state) one
    rank holds under ZeRO `stage` with `world_size` ranks (ZeRO paper, figure 1): the kinds the
    stage shards are divided by P, the others are whole."""
    _check_stage(stage)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return {
        kind: b * n_params / (world_size if kind in ZERO_SHARDED[stage] else 1)
        for kind, b in bytes_per_param.items()
    }


def zero_comm_bytes(stage: str, model_bytes: float, world_size: int) -> float:
    """Bytes one rank receives (and sends) per step under ZeRO `stage` with ring collectives,
    `ZERO_PASSES` ring passes over the model: 2(P-1)/P M for DDP, ZeRO-1 and ZeRO-2, 3(P-1)/P M
    for ZeRO-3 (ZeRO paper, section 7)."""
    _check_stage(stage)
    # In float bytes, like `zero_bytes`: the textbook's share, not a count of whole bytes.
    return ring_bytes(float(model_bytes), world_size, passes=ZERO_PASSES[stage])


def zero_offload_bytes(n_params: float, world_size: int = 1) -> dict[str, float]:
    """ZeRO-Offload (Ren et al., 2021) over ZeRO-2 with P GPUs, bytes per GPU and per step:
    the GPU keeps only the 16-bit parameters (2N; gradients are streamed out as backward makes
    them); the CPU keeps this GPU's 1/P of the 16-bit gradients and of the fp32 master
    weights and Adam's two moments ((2 + 12)N/P, as the paper places them) and runs Adam
    there; across PCIe go the GPU's 16-bit gradient shard down and the updated 16-bit
    parameter shard back up (2N/P each way)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return {
        "gpu": 2 * n_params,
        "cpu": 14 * n_params / world_size,
        "pcie_each_way": 2 * n_params / world_size,
    }


# ZeRO in mixed precision, kind by kind (lecture 7): the part of ZeRO_SHARDED each entry of
# BYTES_PER_PARAMETER belongs to.
MIXED_KIND_GROUP = {
    "weights": "params",
    "gradients": "grads",
    "master weights": "optimizer_state",
    "optimizer: exp_avg": "optimizer_state",
    "optimizer: exp_avg_sq": "optimizer_state",
}


def zero_mixed_bytes(stage: str, n_params: float, world_size: int) -> dict[str, float]:
    """Bytes of each kind (2 + 2 + 4 + 4 + 4 per parameter) one rank holds under ZeRO `stage`
    on `world_size` ranks: the finer split of `zero_bytes(..., MIXED_ADAMW)`."""
    _check_stage(stage)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return {
        kind: b * n_params / (world_size if MIXED_KIND_GROUP[kind] in ZERO_SHARDED[stage] else 1)
        for kind, b in BYTES_PER_PARAMETER.items()
    }


# --- activations ----------------------------------------------------------------------------

# What one transformer layer keeps for backward in 16-bit training with dropout (Korthikanti et
# al., 2022, "Reducing Activation Recomputation in Large Transformer Models", section 4), for
# s tokens per sequence, b sequences, hidden size h and a heads. Each term: (what, bytes in
# units of sbh or of as^2b, is it split by tensor parallelism?). 2 bytes per 16-bit value,
# 1 byte per dropout-mask entry.
ACTIVATION_TERMS = [
    ("LayerNorm inputs (2 layer norms)", 4, "sbh", False),
    ("attention: QKV projection input", 2, "sbh", False),
    ("attention: Q and K, for QK^T", 4, "sbh", True),
    ("attention: softmax output", 2, "as^2b", True),
    ("attention: softmax dropout mask", 1, "as^2b", True),
    ("attention: dropout output, for x V", 2, "as^2b", True),
    ("attention: V", 2, "sbh", True),
    ("attention: output projection input", 2, "sbh", True),
    ("attention: dropout mask", 1, "sbh", False),
    ("MLP: first linear input", 2, "sbh", False),
    ("MLP: GeLU input (4h wide)", 8, "sbh", True),
    ("MLP: second linear input (4h wide)", 8, "sbh", True),
    ("MLP: dropout mask", 1, "sbh", False),
]


def activation_memory(
    s: int,
    b: int,
    h: int,
    a: int,
    t: int = 1,
    *,
    sequence_parallel: bool = False,
    recompute_attention: bool = False,
) -> float:
    """Bytes of activations one transformer layer keeps, from `ACTIVATION_TERMS`:
    sbh(34 + 5as/h) alone; sbh(10 + 24/t + 5as/(ht)) with tensor parallelism over t ranks;
    sbh(34/t + 5as/(ht)) with sequence parallelism too (it splits the other terms along the
    sequence); `recompute_attention` (selective recomputation) drops the as^2b terms."""
    total = 0.0
    for _, coefficient, unit, split_by_tp in ACTIVATION_TERMS:
        if unit == "as^2b" and recompute_attention:
            continue
        size = coefficient * (s * b * h if unit == "sbh" else a * s * s * b)
        total += size / t if split_by_tp or sequence_parallel else size
    return total
