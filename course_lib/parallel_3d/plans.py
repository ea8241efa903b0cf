"""What is planned: a model (its parameters, shape and global batch, with the 7B, 70B, 175B
and Mixtral-sized presets), a cluster (GPUs, nodes, links, FLOP/s), a plan (the TP, CP, PP, DP
and EP degrees, the ZeRO stage, activation checkpointing), and why a model cannot be split as a
plan asks."""

from __future__ import annotations

from dataclasses import dataclass

from course_lib.costs import GPT3_175B, TransformerShape
from course_lib.memory import GB

CHECKPOINTING = ("none", "selective", "full")


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
