"""Every cost model of the course, one small function each: the lectures, the planner,
`CommCounter`, the emulated network and the checks all take their formulas from here.

    alpha_beta_time(nbytes, latency, bandwidth)     # seconds for one message
    all_reduce_bytes(nbytes, world_size)            # 2(P-1)/P * N, a ring all-reduce
    zero_bytes("zero2", n_params, world_size)       # bytes of state a rank holds under ZeRO
    activation_memory(s, b, h, a, t)                # sbh(34 + 5as/h), split by TP and SP
    bubble_formula(n_stages, m)                     # (P-1)/(m+P-1) of 1F1B and GPipe

Conventions: P (`world_size`) ranks in the group, N (`nbytes`) bytes of the whole tensor
unless a docstring says otherwise; volumes are the bytes one rank sends (in these algorithms it
receives as many). Whole bytes in, whole bytes out: an int N gives an int, rounded down, as
`CommCounter` counts it; a float N gives the exact float.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

# --- time: the alpha-beta model -------------------------------------------------------------


def alpha_beta_time(nbytes, latency: float, bandwidth: float, messages: int = 1):
    """Seconds to send `nbytes` bytes in `messages` messages one after another: each message
    pays the latency alpha (s), and the bytes cross the link at `bandwidth` (bytes/s):
    messages * alpha + N / beta (Hockney's model). Works on numpy arrays of sizes too."""
    return messages * latency + nbytes / bandwidth


def collective_steps(op: str, world_size: int) -> int:
    """Messages one after another in the textbook algorithm of collective `op`, each costing
    one latency: 2(P-1) for a ring all-reduce (reduce-scatter, then all-gather), ceil(log2 P)
    for a dissemination barrier, P-1 for a ring all-gather or reduce-scatter, a direct
    all-to-all, and the root of a flat tree."""
    p = world_size
    if op == "all_reduce":
        return 2 * (p - 1)
    if op == "barrier":
        return math.ceil(math.log2(p)) if p > 1 else 0
    return p - 1


# --- volume: bytes a rank sends in each collective -------------------------------------------


def ring_bytes(nbytes, world_size: int, passes: int = 1):
    """Bytes one rank sends in `passes` passes around a ring over an N-byte tensor cut into P
    chunks: each pass (a reduce-scatter, or an all-gather) sends the P-1 chunks that are not
    its own, (P-1)/P * N (Patarasuk and Yuan, 2009)."""
    if isinstance(nbytes, int):  # whole bytes, rounded down, as CommCounter counts them
        return passes * (world_size - 1) * nbytes // world_size
    return passes * (world_size - 1) / world_size * nbytes


def all_reduce_bytes(nbytes, world_size: int):
    """Ring all-reduce: a reduce-scatter then an all-gather, 2(P-1)/P * N per rank, nearly
    2N whatever P (bandwidth-optimal)."""
    return ring_bytes(nbytes, world_size, passes=2)


def all_gather_bytes(piece_bytes, world_size: int):
    """All-gather of one `piece_bytes` piece per rank: a rank sends (P-1) pieces, its own and
    the P-2 it passes on. A reduce-scatter into `piece_bytes` outputs sends the same, and so
    does the root of a flat-tree broadcast, scatter, gather or reduce (one piece per other
    rank)."""
    return (world_size - 1) * piece_bytes


def all_to_all_bytes(nbytes, world_size: int):
    """All-to-all of an N-byte tensor cut into P chunks: a rank sends every chunk but its own
    straight to its owner, (P-1)/P * N, the volume of one ring pass."""
    return ring_bytes(nbytes, world_size)


def host_bytes(model_bytes: int, batch_bytes: int, world_size: int) -> dict[str, tuple[int, int]]:
    """(sent, received) per step of the naive host scheme (`data_parallel.host_step`), for the
    host (rank 0) and for one worker: the host scatters the batch (it keeps its own 1/P), every
    worker sends its whole gradient to the host, and the host sends the parameters back to
    each. The host's traffic grows as (P - 1) model sizes; a ring all-reduce's stays under 2."""
    scattered = (
        (world_size - 1) * batch_bytes // world_size
    )  # all of the batch but the host's share
    return {
        "host": ((world_size - 1) * model_bytes + scattered, (world_size - 1) * model_bytes),
        "worker": (model_bytes, model_bytes + batch_bytes // world_size),
    }


def all_reduce_seconds(
    algorithm: str, nbytes: int, world_size: int, alpha: float, beta: float
) -> float:
    """Seconds one all-reduce of N bytes takes under the alpha-beta model of lecture 2 (Thakur,
    Rabenseifner and Gropp, 2005): a message of b bytes costs alpha + b * beta (beta in seconds
    per byte: 1 / bandwidth), each rank has its own full-duplex link, and a rank handles one
    message per direction at a time.

    naive 2(P-1)(a + Nb) (the root's link carries everything); tree 2 * sum over levels of
    (children of the busiest parent)(a + Nb); butterfly log2(P)(a + Nb); ring 2(P-1)(a + Nb/P);
    halving-doubling (Rabenseifner) 2 log2(P) a + 2(P-1)/P Nb.
    """
    if world_size == 1:
        return 0.0
    if algorithm == "naive":
        return 2 * (world_size - 1) * (alpha + nbytes * beta)
    if algorithm == "tree":
        messages, level_start = 0, 1  # nodes of level l are numbered 2**l - 1 .. 2**(l+1) - 2
        while level_start < world_size:  # level_start: first node of the next level down
            below = min(level_start + 1, world_size - level_start)  # nodes on the level below
            messages += min(2, below)  # the level's first parent has the most children
            level_start = 2 * level_start + 1
        return 2 * messages * (alpha + nbytes * beta)
    if algorithm == "butterfly":
        return math.log2(world_size) * (alpha + nbytes * beta)
    if algorithm == "ring":
        return collective_steps("all_reduce", world_size) * (alpha + nbytes / world_size * beta)
    if algorithm == "halving_doubling":  # rounds of N/2, N/4, ..., N/P bytes, each way
        return 2 * math.log2(world_size) * alpha + all_reduce_bytes(nbytes * beta, world_size)
    raise ValueError(f"unknown all-reduce algorithm {algorithm!r}")


def two_level_all_reduce_seconds(
    nbytes: int,
    world_size: int,
    node_size: int,
    alpha: float,
    beta: float,
    node_alpha: float,
    node_beta: float,
) -> float:
    """Seconds the alpha-beta model predicts for `collectives.two_level_all_reduce` of N
    bytes: inside each node, the leader takes in and then sends out the other k - 1 ranks'
    N bytes, 2(k-1)(a_node + N b_node) as the naive algorithm's root does; across nodes, a
    ring of the P/k leaders, `all_reduce_seconds("ring", N, P/k, a, b)`."""
    if world_size % node_size:
        raise ValueError(f"node_size {node_size} does not divide world_size {world_size}")
    inside = 2 * (node_size - 1) * (node_alpha + nbytes * node_beta)
    return inside + all_reduce_seconds("ring", nbytes, world_size // node_size, alpha, beta)


# How `CommCounter` counts each built-in collective (it cannot see inside the backend), for a
# group of P ranks, N = bytes of the tensor argument. `busiest_bytes` is the same in numbers.
COLLECTIVE_MODEL = {
    "all_reduce": "ring: sends and receives 2(P-1)/P * N",
    "all_gather": "ring: sends and receives (P-1) * N (N = this rank's tensor)",
    "all_gather_single": "ring: sends and receives (P-1) * N (N = this rank's input)",
    "all_gather_into_tensor": "ring: sends and receives (P-1) * N (N = this rank's input)",
    "reduce_scatter": "ring: sends and receives (P-1) * N (N = this rank's output)",
    "reduce_scatter_single": "ring: sends and receives (P-1) * N (N = this rank's output)",
    "reduce_scatter_tensor": "ring: sends and receives (P-1) * N (N = this rank's output)",
    "broadcast": "flat tree: the source sends (P-1) * N, every other rank receives N",
    "reduce": "flat tree: every other rank sends N, the destination receives (P-1) * N",
    "gather": "flat tree: every other rank sends N, the destination receives (P-1) * N",
    "scatter": "flat tree: the source sends (P-1) * N, every other rank receives N",
    "all_to_all_single": "direct: sends and receives all but its own chunk",
    "all_to_all": "direct: sends and receives all but its own chunk",
    "barrier": "no payload: 0 bytes",
}


def busiest_bytes(op: str, nbytes: int, world_size: int) -> int:
    """Bytes the busiest rank of collective `op` sends or receives, N = `nbytes` as
    `COLLECTIVE_MODEL` reads it (a flat tree's busiest rank is its root)."""
    if op == "all_reduce":
        return all_reduce_bytes(nbytes, world_size)
    if op == "barrier":
        return 0
    if op in ("all_to_all", "all_to_all_single"):
        return all_to_all_bytes(nbytes, world_size)
    return all_gather_bytes(nbytes, world_size)


# --- memory: bytes per parameter and ZeRO ----------------------------------------------------

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


# --- memory: activations ---------------------------------------------------------------------

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


def ulysses_bytes(local_bytes, world_size: int):
    """Bytes one rank sends per attention pass under DeepSpeed-Ulysses over P ranks (Jacobs et
    al., 2023): four all-to-alls (q, k and v to head shards, the output back), each of one
    `local_bytes` tensor, this rank's N/P tokens: 4 (P-1)/P * N h / P bytes for N tokens of
    width h, falling as P grows where ring attention's K/V volume does not."""
    return 4 * all_to_all_bytes(local_bytes, world_size)


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


def compute_seconds(shape: TransformerShape, t: int, p: int, flops_per_s: float) -> float:
    """Seconds one GPU computes per micro-batch: forward + backward = 3 x forward FLOPs,
    forward = 24bsh^2 + 4bs^2h per layer (the matmuls), split over t ranks and p stages."""
    s, b, h = shape.seq, shape.batch, shape.hidden
    per_layer = 3 * (24 * b * s * h * h + 4 * b * s * s * h)
    return shape.layers / p * per_layer / t / flops_per_s


# --- utilisation and failures ----------------------------------------------------------------


def training_flops(n_params: float, tokens: float) -> float:
    """FLOPs to train an N-parameter transformer on D tokens, 6ND (Kaplan et al., 2020): per
    token and parameter, 2 in forward (a multiply and an add) and 4 in backward (gradients of
    the inputs and of the weights). N counts the matmul weights (not embedding lookups), and
    attention's scores (12 L s h per token, the 4bs^2h of `compute_seconds`) are left out."""
    return 6 * n_params * tokens


def mfu(model_flops: float, seconds: float, peak_flops_per_s: float, devices: int = 1) -> float:
    """Model FLOPs utilisation (Chowdhery et al., 2022): the model's own FLOPs (6ND, no
    recomputation) done in `seconds`, over what `devices` devices could do at their peak."""
    return model_flops / (seconds * devices * peak_flops_per_s)


def checkpoint_interval(checkpoint_seconds: float, mtbf_seconds: float) -> float:
    """Seconds of training between checkpoints that waste the least time, sqrt(2 C M) for a
    checkpoint stalling training C seconds and a failure every M seconds on average (Young,
    1974): more often and the checkpoints cost more, less often and each failure throws more
    work away (on average half an interval)."""
    return math.sqrt(2 * checkpoint_seconds * mtbf_seconds)


# --- lecture 7: ZeRO in mixed precision, kind by kind ------------------------------------------
# The part of ZeRO_SHARDED each entry of BYTES_PER_PARAMETER belongs to.
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


# --- lecture 10: the planner's float64 run, context and expert parallelism ---------------------
# AdamW in float64, as lecture 10's real step runs it (no master copy: 8 + 8 + 2 x 8 bytes).
FP64_ADAMW = {"params": 8, "grads": 8, "optimizer_state": 16}


def cp_layer_bytes(kv_bytes, world_size: int):
    """Bytes one rank sends per layer and micro-batch under ring attention over P ranks: K, V
    (the whole sequence's, `kv_bytes`) around the ring in forward, again in backward with
    their gradients: 3 (P-1)/P of `kv_bytes`."""
    return 3 * ring_attention_bytes(kv_bytes, world_size)


def ep_layer_bytes(token_bytes, world_size: int):
    """Bytes one rank sends per MoE layer and micro-batch under expert parallelism over P
    ranks: `ep_bytes` (dispatch and combine) in forward, and again in backward."""
    return 2 * ep_bytes(token_bytes, world_size)


def moe_compute_factor(params: float, expert_params: float, n_experts: int, k: int) -> float:
    """FLOPs per token of a mixture of experts over those of its one-expert dense shape (what
    `compute_seconds` prices): shared parameters plus k/E of the experts' are active
    (Mixtral 8x7B: 12.9B of 46.7B, against 7.3B for one expert)."""
    shared = params - expert_params
    return (shared + k * expert_params / n_experts) / (shared + expert_params / n_experts)
