"""Every cost model of the course, one small function each: the lectures, the planner,
`CommCounter`, the emulated network and the checks all take their formulas from here.

    alpha_beta_time(nbytes, latency, bandwidth)     # seconds for one message
    all_reduce_bytes(nbytes, world_size)            # 2(P-1)/P * N, a ring all-reduce
    zero_bytes("zero2", n_params, world_size)       # bytes of state a rank holds under ZeRO
    activation_memory(s, b, h, a, t)                # sbh(34 + 5as/h), split by TP and SP
    bubble_formula(n_stages, m)                     # (P-1)/(m+P-1) of 1F1B and GPipe

By what a reader looks for:

    communication.py   the alpha-beta model; bytes and seconds of each collective
    memory.py          bytes per parameter, ZeRO's stages and ZeRO-Offload, activations
    parallelism.py     pipeline bubbles; what tensor, context and expert parallelism send;
                       a transformer's traffic and compute per micro-batch
    utilisation.py     training FLOPs, MFU, the checkpoint interval

Import from `course_lib.costs` itself: every formula is one name here.

Conventions: P (`world_size`) ranks in the group, N (`nbytes`) bytes of the whole tensor
unless a docstring says otherwise; volumes are the bytes one rank sends (in these algorithms it
receives as many). Whole bytes in, whole bytes out: an int N gives an int, rounded down, as
`CommCounter` counts it; a float N gives the exact float.
"""

from course_lib.costs.communication import (
    COLLECTIVE_MODEL,
    all_gather_bytes,
    all_reduce_bytes,
    all_reduce_seconds,
    all_to_all_bytes,
    alpha_beta_time,
    busiest_bytes,
    collective_steps,
    host_bytes,
    ring_bytes,
    two_level_all_reduce_seconds,
)
from course_lib.costs.memory import (
    ACTIVATION_TERMS,
    BYTES_PER_PARAMETER,
    FP32_ADAMW,
    FP64_ADAMW,
    MIXED_ADAMW,
    MIXED_KIND_GROUP,
    ZERO_PASSES,
    ZERO_SHARDED,
    activation_memory,
    zero_bytes,
    zero_comm_bytes,
    zero_mixed_bytes,
    zero_offload_bytes,
)
from course_lib.costs.parallelism import (
    GPT3_175B,
    TransformerShape,
    bubble_formula,
    compute_seconds,
    cp_layer_bytes,
    ep_bytes,
    ep_layer_bytes,
    expert_capacity,
    interleaved_peak_chunks,
    matmul_weights,
    moe_compute_factor,
    pp_boundary_bytes,
    ring_attention_bytes,
    tp_layer_bytes,
    traffic_per_microbatch,
    ulysses_bytes,
    zero_bubble_formula,
)
from course_lib.costs.utilisation import (
    checkpoint_interval,
    mfu,
    training_flops,
)

__all__ = [
    "ACTIVATION_TERMS",
    "BYTES_PER_PARAMETER",
    "COLLECTIVE_MODEL",
    "FP32_ADAMW",
    "FP64_ADAMW",
    "GPT3_175B",
    "MIXED_ADAMW",
    "MIXED_KIND_GROUP",
    "TransformerShape",
    "ZERO_PASSES",
    "ZERO_SHARDED",
    "activation_memory",
    "all_gather_bytes",
    "all_reduce_bytes",
    "all_reduce_seconds",
    "all_to_all_bytes",
    "alpha_beta_time",
    "bubble_formula",
    "busiest_bytes",
    "checkpoint_interval",
    "collective_steps",
    "compute_seconds",
    "cp_layer_bytes",
    "ep_bytes",
    "ep_layer_bytes",
    "expert_capacity",
    "host_bytes",
    "interleaved_peak_chunks",
    "matmul_weights",
    "mfu",
    "moe_compute_factor",
    "pp_boundary_bytes",
    "ring_attention_bytes",
    "ring_bytes",
    "tp_layer_bytes",
    "traffic_per_microbatch",
    "training_flops",
    "two_level_all_reduce_seconds",
    "ulysses_bytes",
    "zero_bubble_formula",
    "zero_bytes",
    "zero_comm_bytes",
    "zero_mixed_bytes",
    "zero_offload_bytes",
]
