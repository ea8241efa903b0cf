"""What one plan costs (lecture 10, section 3): memory per GPU, the bubble, the bytes each kind
of group sends over the link it crosses, seconds per step by cause, MFU, and flags for what the
numbers do not say. The model of a step, and what it leaves out: `course_lib.parallel_3d`."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache

from course_lib import costs
from course_lib.costs import (
    MIXED_ADAMW,
    activation_memory,
    bubble_formula,
    compute_seconds,
    traffic_per_microbatch,
    zero_bytes,
    zero_comm_bytes,
)
from course_lib.parallel_3d.grid import ProcessGrid, spans_nodes
from course_lib.parallel_3d.plans import CHECKPOINTING, Cluster, Model, Plan, problem
from course_lib.zero import STAGES

BF16 = 2  # bytes per value of activations and gradients in mixed precision


@dataclass(frozen=True)
class Estimate:
    """What one plan costs per GPU and per optimizer step. Bytes are per GPU (memory: the most
    loaded GPU, pipeline stage 0); seconds are per step."""

    plan: Plan
    micro_batches: int
    params_per_gpu: float
    memory: dict[str, float]  # params, grads, optimizer_state, activations: bytes per GPU
    fits: bool
    bubble: float
    traffic: dict[str, float]  # tp, pp, (cp, ep if > 1), dp: bytes each GPU sends per step
    links: dict[str, str]  # the same kinds: "intra-node" or "inter-node"
    seconds: dict[str, float]  # compute, recompute, tp, pp, (cp, ep), bubble, dp: per step
    useful_seconds: float  # the model's own forward + backward math, no recomputation
    mfu: float  # model FLOPs per second over the GPU's peak
    free_memory: float  # bytes per GPU left for what the model leaves out (see TIGHT_MEMORY)
    flags: str = ""  # letters of FLAGS: what the numbers do not say about this plan

    @property
    def total_memory(self) -> float:
        return sum(self.memory.values())

    @property
    def step_seconds(self) -> float:
        return sum(self.seconds.values())

    @property
    def utilisation(self) -> float:
        """Share of the step spent on the model's own math (an MFU at the assumed FLOP/s)."""
        return self.useful_seconds / self.step_seconds


# Under this share of free GPU memory a plan is flagged: the CUDA context, the allocator's
# fragmentation and the communication buffers (none of them modelled) take a few GB.
TIGHT_MEMORY = 0.10

# What the numbers of a plan do not say, by the letter the candidate table marks it with.
FLAGS = {
    "M": f"tight memory: under {TIGHT_MEMORY:.0%} of the GPU free for the CUDA context, the "
    "allocator's fragmentation and communication buffers (none modelled)",
    "Z": "ZeRO-2/3 with a pipeline: gradients reduce-scattered (ZeRO-3: parameters gathered "
    "too) for every micro-batch; DeepSpeed's pipeline engine refuses it, Megatron pairs PP "
    "with ZeRO-1",
}


def plan_flags(plan: Plan, free_memory: float, cluster: Cluster) -> str:
    """The letters of FLAGS that apply to a plan."""
    tight = 0 <= free_memory < TIGHT_MEMORY * cluster.gpu_memory
    zero_with_pp = plan.pp > 1 and plan.zero in ("zero2", "zero3")
    return ("M" if tight else "") + ("Z" if zero_with_pp else "")


def moe(model: Model) -> float:
    """A MoE's FLOPs per token over those of its one-expert dense shape (1 if dense)."""
    m = model
    return costs.moe_compute_factor(m.params, m.expert_params, m.num_experts, m.top_k)


def layers_per_stage(model: Model, pp: int) -> int:
    """Layers of the largest stage: it decides memory and time."""
    return math.ceil(model.shape.layers / pp)


def params_per_gpu(model: Model, plan: Plan, experts: bool | None = None) -> float:
    """Parameters a GPU computes with: 1/tp of each layer of the largest stage (before ZeRO
    shards them over the DP group), the experts' 1/ep more. `experts`: only the experts'
    (True), only the others (False), all (None)."""
    share = layers_per_stage(model, plan.pp) / model.shape.layers / plan.tp
    dense = 0.0 if experts else (model.params - model.expert_params) * share
    return dense + (0.0 if experts is False else model.expert_params * share / plan.ep)


def state_bytes(model: Model, plan: Plan) -> dict[str, float]:
    """Bytes per GPU of bf16 weights, bf16 gradients and AdamW's fp32 state (16 bytes per
    parameter, lecture 6) for its share of the parameters, with the plan's ZeRO stage over
    the DP group (lecture 7): dp x cp ranks hold copies of the same weights, dp x cp / ep
    of the same experts."""
    ranks = plan.dp * plan.cp
    dense = zero_bytes(plan.zero, params_per_gpu(model, plan, False), ranks, MIXED_ADAMW)
    if not model.expert_params:
        return dense
    expert = zero_bytes(plan.zero, params_per_gpu(model, plan, True), ranks // plan.ep, MIXED_ADAMW)
    return {k: dense[k] + expert[k] for k in dense}


def activation_bytes(model: Model, plan: Plan, micro_batches: int) -> float:
    """Activations stage 0 holds at its peak: under 1F1B it keeps min(P, m) micro-batches in
    flight, each `layers_per_stage` layers of Korthikanti's bytes per layer (lecture 9).
    Full checkpointing keeps only each layer's input, plus one layer recomputed at a time."""
    shape = replace(model.shape, seq=model.shape.seq // plan.cp)  # a CP rank's tokens
    s, b, h, a = shape.seq, shape.batch, shape.hidden, shape.heads
    t, sp = plan.tp, plan.sequence_parallel
    in_flight = min(plan.pp, micro_batches) * layers_per_stage(model, plan.pp)
    if plan.checkpointing == "full":
        layer_input = BF16 * s * b * h / (t if sp else 1)
        return in_flight * layer_input + activation_memory(s, b, h, a, t, sequence_parallel=sp)
    selective = plan.checkpointing == "selective"
    per_layer = activation_memory(
        s, b, h, a, t, sequence_parallel=sp, recompute_attention=selective
    )
    return in_flight * per_layer


def dp_traffic(zero: str, model_bytes: float, dp: int, micro_batches: int) -> float:
    """Bytes a GPU sends per step in its DP group for `model_bytes` of bf16 gradients.
    DDP and ZeRO-1 accumulate gradients over the micro-batches and all-reduce once
    (2(P-1)/P M). ZeRO-2 keeps only a shard of the gradients, so it reduce-scatters after
    every micro-batch, then all-gathers the parameters once: (m+1)(P-1)/P M. ZeRO-3 gathers
    the parameters twice and reduce-scatters once per micro-batch: 3m(P-1)/P M."""
    once = zero_comm_bytes(zero, model_bytes, dp)  # the lecture-7 formula, one micro-batch
    per_step = {"ddp": 1, "zero1": 1, "zero2": (micro_batches + 1) / 2, "zero3": micro_batches}
    return once * per_step[zero]


@lru_cache(maxsize=4096)
def _link(tp: int, pp: int, dp: int, kind: str, node: int) -> str:
    spans = any(spans_nodes(g, node) for g in ProcessGrid(tp, pp, dp).groups(kind))
    return "inter-node" if spans else "intra-node"


def links(plan: Plan, cluster: Cluster) -> dict[str, str]:
    """The link each kind of group crosses: inter-node if any of its groups spans nodes.
    CP sits between TP and PP: a block of tp x cp neighbouring ranks holds a TP group and its
    CP partners. An EP group is ep neighbouring members of a DP group."""
    n, tp, cp, pp, dp = cluster.gpus_per_node, plan.tp, plan.cp, plan.pp, plan.dp
    out = {
        "tp": _link(tp, cp * pp, dp, "tp", n),
        "pp": _link(tp * cp, pp, dp, "pp", n),
        "dp": _link(tp * cp, pp, dp, "dp", n),
    }
    if cp > 1:
        out["cp"] = _link(tp * cp, pp, dp, "tp", n)  # the block of tp x cp neighbours
    if plan.ep > 1:
        out["ep"] = _link(tp * cp * pp, plan.ep, dp // plan.ep, "pp", n)
    return out


def estimate(model: Model, cluster: Cluster, plan: Plan) -> Estimate:
    """Memory per GPU, bubble, traffic and time per step of `plan` for `model` on `cluster`."""
    if plan.gpus != cluster.gpus:
        raise ValueError(f"{plan} uses {plan.gpus} GPUs, not {cluster.gpus}")
    if plan.zero not in STAGES or plan.checkpointing not in CHECKPOINTING:
        raise ValueError(f"zero must be one of {STAGES}, checkpointing one of {CHECKPOINTING}")
    reason = problem(model, plan.tp, plan.pp, plan.dp, plan.cp, plan.ep)
    if reason:
        raise ValueError(f"cannot plan {plan} for {model.name}: {reason}")
    m = model.global_batch // (plan.dp * model.shape.batch)
    # A CP rank holds 1/cp of each sequence: its activations, TP and PP bytes are those of a
    # sequence cp times shorter; its compute is 1/cp of the whole (attention sees every key).
    stage = replace(model.shape, layers=layers_per_stage(model, plan.pp))
    short = replace(stage, seq=stage.seq // plan.cp)

    memory = state_bytes(model, plan)
    memory["activations"] = activation_bytes(model, plan, m)

    # Per micro-batch on one GPU (lecture 9): compute, TP all-reduces, PP send/receive.
    compute = compute_seconds(stage, plan.tp, 1, cluster.flops_per_s) * moe(model) / plan.cp
    s, b, h = stage.seq, stage.batch, stage.hidden
    recompute = {
        "none": 0.0,
        "full": compute / 3,  # one more forward (forward is a third of forward + backward)
        # Selective recomputation redoes the attention scores, QK^T and scores x V: 4bs^2h.
        "selective": stage.layers * 4 * b * s * s * h / plan.tp / plan.cp / cluster.flops_per_s,
    }[plan.checkpointing]
    per_micro = traffic_per_microbatch(
        short, plan.tp, 1, element_size=BF16, sequence_parallel=plan.sequence_parallel
    )
    tp_bytes = per_micro["TP"] * (1.5 if plan.checkpointing == "full" else 1)  # forward's 2 of 4
    pp_bytes = 0.0 if plan.pp == 1 else per_micro["PP"]
    link = links(plan, cluster)
    bandwidth = {"intra-node": cluster.intra_bandwidth, "inter-node": cluster.inter_bandwidth}
    tp_s, pp_s = tp_bytes / bandwidth[link["tp"]], pp_bytes / bandwidth[link["pp"]]
    extra = {}  # CP and EP bytes per micro-batch, only for plans that have them
    if plan.cp > 1:  # ring attention: K and V (this TP rank's heads) of the whole sequence
        extra["cp"] = stage.layers * costs.cp_layer_bytes(2 * BF16 * s * b * h / plan.tp, plan.cp)
    if plan.ep > 1:  # all-to-alls of this rank's tokens, each sent to top_k experts
        tokens = BF16 * short.seq * b * h * model.top_k
        extra["ep"] = stage.layers * costs.ep_layer_bytes(tokens, plan.ep)
    extra_s = sum(v / bandwidth[link[k]] for k, v in extra.items())

    # The 1F1B pipeline: m micro-batches of work stretched by the bubble (lecture 8).
    bubble = bubble_formula(plan.pp, m)
    busy = m * (compute + recompute + tp_s + pp_s + extra_s)
    ranks = plan.dp * plan.cp  # CP ranks average their gradients like DP ranks
    dp_bytes = dp_traffic(plan.zero, BF16 * params_per_gpu(model, plan, False), ranks, m)
    if model.expert_params:
        expert = BF16 * params_per_gpu(model, plan, True)
        dp_bytes += dp_traffic(plan.zero, expert, ranks // plan.ep, m)
    seconds = {
        "compute": m * compute,
        "recompute": m * recompute,
        "tp": m * tp_s,
        "pp": m * pp_s,
        **{k: m * v / bandwidth[link[k]] for k, v in extra.items()},
        "bubble": busy / (1 - bubble) - busy,
        "dp": dp_bytes / bandwidth[link["dp"]],
    }
    whole = compute_seconds(model.shape, plan.tp, plan.pp, cluster.flops_per_s)
    exact = whole * moe(model) / plan.cp
    free = cluster.gpu_memory - sum(memory.values())
    step = sum(seconds.values())
    return Estimate(
        plan=plan,
        micro_batches=m,
        params_per_gpu=params_per_gpu(model, plan),
        memory=memory,
        fits=sum(memory.values()) <= cluster.gpu_memory,
        bubble=bubble,
        traffic={
            "tp": m * tp_bytes,
            "pp": m * pp_bytes,
            **{k: m * v for k, v in extra.items()},
            "dp": dp_bytes,
        },
        links=link,
        seconds=seconds,
        useful_seconds=m * exact,
        # The model's FLOPs ran at flops_per_s during useful_seconds; MFU sets them against
        # what the GPU could do at its peak during the whole step.
        mfu=costs.mfu(m * exact * cluster.flops_per_s, step, cluster.peak_flops_per_s),
        free_memory=free,
        flags=plan_flags(plan, free, cluster),
    )
