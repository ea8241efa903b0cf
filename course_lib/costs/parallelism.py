"""What each parallelism costs: pipeline bubbles, the bytes tensor, context and expert
parallelism send per layer, and a transformer's traffic and compute per micro-batch."""

from __future__ import annotations

import math
from dataclasses import dataclass

from course_lib.costs.communication import all_reduce_bytes, all_to_all_bytes, ring_bytes

# --- pipeline parallelism --------------------------------------------------------------------


def bubble_formula(n_stages: int, m: int, chunks: int = 1) -> float:
    """Idle share of GPipe and 1F1B with P stages and m micro-batches, (P-1)/(m+P-1) (Huang
    et al., 2019); with `chunks` interleaved model chunks per stage, (P-1)/(chunks*m + P-1)
    (Narayanan et al., 2021). m = 1 is the naive pipeline, (P-1)/P."""
    return (n_stages - 1) / (chunks * m + n_stages - 1)


def zero_bubble_formula(
    n_stages: int, m: int, forward: float = 1.0, input_grad: float = 1.0, weight_grad: float = 1.0
) -> float:
    """Idle share of the ZB-H1 zero-bubble schedule (Qi et al., 2023): the backward split into
    B (input gradient) and W (weight gradient), W's filling the drain, leaves (P-1)(F + B - W)
    idle per stage beside m(F + B + W) of work; 1F1B leaves (P-1)(F + B + W)."""
    idle = (n_stages - 1) * (forward + input_grad - weight_grad)
    return idle / (m * (forward + input_grad + weight_grad) + idle)


def interleaved_peak_chunks(n_stages: int, chunks: int) -> int:
    """Micro-batch chunks of activations the first stage holds at its peak under interleaved
    1F1B with `chunks` model chunks per stage (m a multiple of P): P * chunks + P - 1, each
    1/chunks of a stage's activations, so 1 + (P-1)/(P * chunks) times 1F1B's P micro-batches
    (counted by `course_lib.pipeline.simulate`)."""
    return n_stages * chunks + n_stages - 1


def pp_boundary_bytes(activation_bytes):
    """Bytes crossing one pipeline-stage boundary per micro-batch: the activation forward and
    its gradient back, 2 * the activation."""
    return 2 * activation_bytes


# --- tensor, context and expert parallelism --------------------------------------------------


def tp_layer_bytes(activation_bytes, t: int):
    """Bytes one rank sends per transformer layer and micro-batch under Megatron tensor
    parallelism over t ranks (Shoeybi et al., 2019): two all-reduces of the sbh activation in
    forward (after attention and after the MLP) and two in backward, 4 * 2(t-1)/t * sbh.
    Sequence parallelism swaps each all-reduce for a reduce-scatter and an all-gather: the
    same bytes."""
    return 4 * all_reduce_bytes(activation_bytes, t)


def ep_bytes(token_bytes, world_size: int):
    """Bytes one rank sends per MoE layer in forward under expert parallelism over P ranks:
    an all-to-all dispatches its `token_bytes` of routed tokens to the experts' ranks and
    another brings the outputs back (combine), 2 * (P-1)/P * N with tokens spread evenly
    (GShard, Lepikhin et al., 2020). Backward does the same again."""
    return 2 * all_to_all_bytes(token_bytes, world_size)


def expert_capacity(tokens: int, n_experts: int, k: int, capacity_factor: float) -> int:
    """Tokens one expert of a mixture of experts takes per batch of T tokens, each routed to k
    of E experts: ceil(capacity_factor * T k / E) (GShard; Switch with k = 1), the even share
    of the T k choices with the factor's headroom. Rounded to 1e-9 before the ceiling, so that
    1.1 * 100 / 11 is 10 and not 11."""
    return math.ceil(round(capacity_factor * tokens * k / n_experts, 9))


def ring_attention_bytes(kv_bytes, world_size: int):
    """Bytes one rank sends per attention pass under ring attention (context parallelism over
    P ranks, Liu et al., 2023): each rank holds K and V for 1/P of the sequence and passes
    blocks around the ring P-1 times, (P-1)/P of `kv_bytes`, the K and V of the whole
    sequence."""
    return ring_bytes(kv_bytes, world_size)


def ulysses_bytes(local_bytes, world_size: int, heads: int = 1, kv_heads: int | None = None):
    """Bytes one rank sends per attention pass under DeepSpeed-Ulysses over P ranks (Jacobs et
    al., 2023): four all-to-alls (q, k and v to head shards, the output back), each of one
    `local_bytes` tensor, this rank's N/P tokens: 4 (P-1)/P * N h / P bytes for N tokens of
    width h, falling as P grows where ring attention's K/V volume does not.

    With grouped-query attention (`kv_heads` of the `heads` for K and V; `local_bytes` is the
    size of this rank's q) each rank is sent the K/V heads its query heads use: H_kv/P of them,
    but never fewer than one, so K and V each move max(H_kv, P)/H of q's bytes (for H_kv a
    divisor or multiple of P)."""
    kv_share = 1 if kv_heads is None else max(kv_heads, world_size) / heads
    return (2 + 2 * kv_share) * all_to_all_bytes(local_bytes, world_size)


def cp_layer_bytes(kv_bytes, world_size: int):
    """Bytes one rank sends per layer and micro-batch under ring attention over P ranks: K, V
    (the whole sequence's, `kv_bytes`) around the ring in forward, again in backward with
    their gradients: 3 (P-1)/P of `kv_bytes`."""
    return 3 * ring_attention_bytes(kv_bytes, world_size)


def ep_layer_bytes(token_bytes, world_size: int):
    """Bytes one rank sends per MoE layer and micro-batch under expert parallelism over P
    ranks: `ep_bytes` (dispatch and combine) in forward, and again in backward."""
    return 2 * ep_bytes(token_bytes, world_size)


# --- a transformer's shape, and what it computes and sends per micro-batch ------------------


@dataclass(frozen=True)
class TransformerShape:
    """The sizes the formulas need: layers L, hidden h, heads a, sequence s, micro-batch b,
    named as the papers write them. It describes a model to be priced, never built (GPT-3,
    Llama): the models the course runs are `models.GPTConfig`, whose d_model, n_heads,
    n_layers and seq_len are h, a, L and s."""

    layers: int
    hidden: int
    heads: int
    seq: int
    batch: int = 1


GPT3_175B = TransformerShape(layers=96, hidden=12288, heads=96, seq=2048, batch=1)


def traffic_per_microbatch(
    shape: TransformerShape,
    t: int,
    p: int,
    element_size: int = 2,
    sequence_parallel: bool = False,
) -> dict[str, float]:
    """Bytes one GPU sends per micro-batch (forward and backward) under tensor parallelism
    over t ranks (4 all-reduces of an sbh activation per layer it holds) and at one
    pipeline-stage boundary (the activation forward, its gradient back). With sequence
    parallelism the boundary activation is split over the stage's t GPUs along the sequence,
    and each sends its 1/t of it (Megatron's scatter-gather does the same without SP)."""
    activation = shape.seq * shape.batch * shape.hidden * element_size
    layers_per_stage = shape.layers / p
    return {
        "TP": layers_per_stage * tp_layer_bytes(float(activation), t),
        "PP": pp_boundary_bytes(activation) / (t if sequence_parallel else 1),
    }


def matmul_weights(shape: TransformerShape) -> int:
    """The weights of a transformer's layers that multiply, 12 L h^2: 4 h^2 in attention (q,
    k, v and the output projection) and 8 h^2 in the MLP (h -> 4h -> h), no embeddings. The
    N of 6ND that `compute_seconds`' 24 b s h^2 per layer forward counts, 2 FLOPs per weight
    and token."""
    return 12 * shape.layers * shape.hidden**2


def compute_seconds(shape: TransformerShape, t: int, p: int, flops_per_s: float) -> float:
    """Seconds one GPU computes per micro-batch: forward + backward = 3 x forward FLOPs,
    forward = 24bsh^2 + 4bs^2h per layer (the matmuls), split over t ranks and p stages."""
    s, b, h = shape.seq, shape.batch, shape.hidden
    per_layer = 3 * (24 * b * s * h * h + 4 * b * s * s * h)
    return shape.layers / p * per_layer / t / flops_per_s


def moe_compute_factor(params: float, expert_params: float, n_experts: int, k: int) -> float:
    """FLOPs per token of a mixture of experts over those of its one-expert dense shape (what
    `compute_seconds` prices): shared parameters plus k/E of the experts' are active
    (Mixtral 8x7B: 12.9B of 46.7B, against 7.3B for one expert)."""
    shared = params - expert_params
    return (shared + k * expert_params / n_experts) / (shared + expert_params / n_experts)
