"""Putting it together: 3D parallelism, from a grid of ranks to a planner (lecture 10).

    grid = ProcessGrid(tp=2, pp=2, dp=2)                # ranks <-> (dp, pp, tp) coordinates
    estimates = candidates(LLAMA_70B, Cluster(512))     # every TP x PP x DP plan, estimated
    best(LLAMA_70B, Cluster(512), cp=(1, 2, 4))         # the fastest that fits, CP allowed

Every estimate is a formula of `course_lib.costs`: bytes per parameter and ZeRO (lectures
6-7), activations, TP and PP traffic and compute (lecture 9), the bubble (lecture 8), ring
attention (11) and expert all-to-alls (12). This module adds the bookkeeping: which ranks form
which group, which link each group's traffic crosses, how the pieces add up to a step time.
The lecture's tables, widget, close calls and its real 3-D step are `measure.parallel_3d`.

The model of a step (an estimate, not a simulation): a 1F1B pipeline of m micro-batches takes
m x (compute + TP + CP + EP + PP time per micro-batch) / (1 - bubble); the data-parallel
gradient traffic comes after it, not overlapped (an upper bound). Left out: the embedding and
LM head (their parameters are spread evenly over the stages), the buffers ZeRO-3 gathers,
latency, framework overheads, and the imbalance of causal ring attention. Plans are flagged
for tight memory or ZeRO-2/3 under a pipeline (`FLAGS`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

import numpy as np
import torch.distributed as dist

from course_lib import costs
from course_lib.costs import (
    GPT3_175B,
    MIXED_ADAMW,
    TransformerShape,
    activation_memory,
    bubble_formula,
    compute_seconds,
    traffic_per_microbatch,
    zero_bytes,
    zero_comm_bytes,
)
from course_lib.memory import GB, divisors
from course_lib.zero import STAGES

DIMENSIONS = ("tp", "pp", "dp")  # innermost (neighbouring ranks) first, as in picotron
CHECKPOINTING = ("none", "selective", "full")
BF16 = 2  # bytes per value of activations and gradients in mixed precision

# --- 1. one grid of ranks, every group derived from it ----------------------------------------


@dataclass(frozen=True)
class ProcessGrid:
    """tp x pp x dp ranks laid out as a (dp, pp, tp) array: rank = (d * pp + p) * tp + t.

    Tensor-parallel partners are neighbouring ranks, so with TP no larger than a node they
    share a node (ranks are numbered node by node). The pipeline comes next, data parallelism
    is outermost."""

    tp: int
    pp: int
    dp: int

    def __post_init__(self) -> None:
        for name in DIMENSIONS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def _array(self) -> np.ndarray:
        return np.arange(self.world_size).reshape(self.dp, self.pp, self.tp)

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's position on each axis: {"tp": t, "pp": p, "dp": d}."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in a grid of {self.world_size} ranks")
        d, p, t = np.unravel_index(rank, (self.dp, self.pp, self.tp))
        return {"tp": int(t), "pp": int(p), "dp": int(d)}

    def groups(self, kind: str) -> list[list[int]]:
        """Every group of `kind` ("tp", "pp" or "dp"): the ranks that differ only in that
        coordinate, in the order of that coordinate (a pipeline group lists stages 0, 1, ...)."""
        if kind not in DIMENSIONS:
            raise ValueError(f"unknown group kind {kind!r}; use one of {DIMENSIONS}")
        axis = {"dp": 0, "pp": 1, "tp": 2}[kind]
        # Move the axis last: each row is then one group.
        rows = np.moveaxis(self._array(), axis, -1).reshape(-1, getattr(self, kind))
        return sorted(row.tolist() for row in rows)

    def group_of(self, rank: int, kind: str) -> list[int]:
        """The `kind` group that `rank` belongs to."""
        self.coords(rank)  # validates the rank
        return next(g for g in self.groups(kind) if rank in g)


def spans_nodes(ranks: Sequence[int], gpus_per_node: int) -> bool:
    """True if `ranks` sit on more than one node (ranks are numbered node by node)."""
    return len({r // gpus_per_node for r in ranks}) > 1


def new_groups(grid: ProcessGrid) -> dict[str, dist.ProcessGroup]:
    """Create every group of the grid with `dist.new_group` and return this rank's three.
    Call it on every rank: each rank must take part in creating every group, in one order."""
    if dist.get_world_size() != grid.world_size:
        raise ValueError(
            f"the grid has {grid.world_size} ranks but the process group {dist.get_world_size()}; "
            f"launch with world_size={grid.world_size}"
        )
    mine = {}
    for kind in DIMENSIONS:
        for ranks in grid.groups(kind):
            group = dist.new_group(ranks)
            if dist.get_rank() in ranks:
                mine[kind] = group
    return mine


# --- 2. what is planned: a model and a cluster ----------------------------------------------


@dataclass(frozen=True)
class Model:
    """A transformer to train: its parameters, its shape (with `shape.batch` the micro-batch,
    in sequences) and the global batch of one optimizer step, in sequences. A mixture of
    experts has `num_experts` per layer, `top_k` per token, `expert_params` of its params."""

    name: str
    params: float
    shape: TransformerShape
    global_batch: int
    num_experts: int = 1  # 1: dense
    top_k: int = 1
    expert_params: float = 0.0


LLAMA_7B = Model("7B", 6.7e9, TransformerShape(32, 4096, 32, 4096, 1), global_batch=1024)
LLAMA_70B = Model("70B", 70e9, TransformerShape(80, 8192, 64, 4096, 1), global_batch=1024)
GPT3 = Model("175B", 175e9, GPT3_175B, global_batch=1536)
# Mixtral 8x7B's sizes: 8 experts of 3 x 4096 x 14336 in each of 32 layers, 2 per token.
MOE_8X7B = Model("8x7B", 46.7e9, TransformerShape(32, 4096, 32, 4096, 1), 1024, 8, 2, 45.1e9)
MODELS = {m.name: m for m in (LLAMA_7B, LLAMA_70B, GPT3)}  # dense: the widget's menu


@dataclass(frozen=True)
class Cluster:
    """GPUs in nodes of `gpus_per_node`, linked inside a node at `intra_bandwidth` and between
    nodes at `inter_bandwidth` (bytes/s per GPU), each computing `flops_per_s` (achieved, not
    peak) of a `peak_flops_per_s` peak. Defaults: A100 80 GB nodes with NVLink (300 GB/s) and
    200 Gbit/s InfiniBand per GPU, at about half the bf16 peak of 312 TFLOP/s (NVIDIA's data
    sheet, dense)."""

    gpus: int
    gpus_per_node: int = 8
    gpu_memory: float = 80 * GB
    intra_bandwidth: float = 300e9
    inter_bandwidth: float = 25e9
    flops_per_s: float = 150e12
    peak_flops_per_s: float = 312e12

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.gpus_per_node < 1:
            raise ValueError(f"need at least one GPU per node and one GPU, got {self}")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise ValueError(
                f"{self.gpus} GPUs do not fill whole nodes of {self.gpus_per_node}; "
                f"use a multiple of {self.gpus_per_node}"
            )


@dataclass(frozen=True)
class Plan:
    """One way to train: TP x CP x PP x DP ranks, a ZeRO stage over the DP group (one of
    `zero.STAGES`), activation checkpointing (`CHECKPOINTING`), sequence parallelism. CP
    splits each sequence (ring attention); EP splits a MoE's experts over `ep` of the DP
    ranks (Megatron's layout: the other dp / ep ranks hold copies of the same experts)."""

    tp: int
    pp: int
    dp: int
    zero: str = "ddp"
    checkpointing: str = "none"
    sequence_parallel: bool = True
    cp: int = 1
    ep: int = 1

    def __str__(self) -> str:
        sp = "+SP" if self.sequence_parallel and self.tp > 1 else ""
        cp = f" x CP{self.cp}" if self.cp > 1 else ""
        ep = f" (EP{self.ep})" if self.ep > 1 else ""
        ranks = f"TP{self.tp}{sp}{cp} x PP{self.pp} x DP{self.dp}{ep}"
        return f"{ranks} {self.zero} ckpt={self.checkpointing}"

    @property
    def gpus(self) -> int:
        return self.tp * self.cp * self.pp * self.dp


def factorizations(cluster: Cluster, cp: int = 1) -> list[tuple[int, int, int]]:
    """Every (tp, pp, dp) with tp * cp * pp * dp = GPUs and tp dividing a node: TP never
    crosses nodes, its all-reduces are on the critical path of every layer."""
    node, gpus = min(cluster.gpus, cluster.gpus_per_node), cluster.gpus
    return [
        (tp, pp, gpus // (tp * cp * pp))
        for tp in divisors(node)
        if gpus % (tp * cp) == 0
        for pp in divisors(gpus // (tp * cp))
    ]


def problem(model: Model, tp: int, pp: int, dp: int, cp: int = 1, ep: int = 1) -> str | None:
    """Why `model` cannot be split as tp x cp x pp x dp with ep, or None if it can."""
    s = model.shape
    if s.heads % tp or s.hidden % tp:
        return f"{s.heads} heads / hidden {s.hidden} do not split over tp={tp}"
    if pp > s.layers:
        return f"pp={pp} stages for {s.layers} layers"
    if model.global_batch % (dp * s.batch):
        return f"global batch {model.global_batch} is not a multiple of dp x micro-batch"
    if s.seq % cp:
        return f"a sequence of {s.seq} does not split over cp={cp}"
    if dp % ep or model.num_experts % ep:
        return f"ep={ep} must divide dp={dp} and the {model.num_experts} experts"
    return None


# --- 3. the estimates ------------------------------------------------------------------------


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


# --- 4. the planner -------------------------------------------------------------------------


def candidates(
    model: Model,
    cluster: Cluster,
    zero_stages: Iterable[str] = STAGES,
    checkpointing: Iterable[str] = CHECKPOINTING,
    sequence_parallel: bool = True,
    cp: Iterable[int] = (1,),
    ep: Iterable[int] = (1,),
) -> list[Estimate]:
    """Every plan that can split `model` on `cluster` (fitting in memory or not), fastest
    first: each (tp, pp, dp) factorization with TP inside a node, for each CP and EP degree
    asked for (only 1 by default), each ZeRO stage and each checkpointing choice. With dp = 1
    every ZeRO stage is the same plan: only the first of `zero_stages` is kept."""
    zero_stages, checkpointing = tuple(zero_stages), tuple(checkpointing)
    if not zero_stages or not checkpointing:
        raise ValueError("give at least one ZeRO stage and one checkpointing choice")
    estimates = [
        estimate(model, cluster, Plan(tp, pp, dp, zero, ckpt, sequence_parallel, c, e))
        for c in cp
        for tp, pp, dp in factorizations(cluster, c)
        for e in ep
        if problem(model, tp, pp, dp, c, e) is None
        for zero in (zero_stages if dp > 1 else zero_stages[:1])
        for ckpt in checkpointing
    ]
    return sorted(estimates, key=lambda e: (e.step_seconds, e.total_memory))


def best(model: Model, cluster: Cluster, **options: Any) -> Estimate | None:
    """The fastest plan that fits in GPU memory, or None if none does."""
    return next((e for e in candidates(model, cluster, **options) if e.fits), None)
