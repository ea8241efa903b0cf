"""Putting it together: 3D parallelism, from a grid of ranks to a planner (lecture 10).

    grid = ProcessGrid(tp=2, pp=2, dp=2)                # ranks <-> (dp, pp, tp) coordinates
    estimates = candidates(LLAMA_70B, Cluster(512))     # every TP x PP x DP plan, estimated
    best(LLAMA_70B, Cluster(512), cp=(1, 2, 4))         # the fastest that fits, CP allowed

By what a reader looks for:

    grid.py        the grid of ranks, its TP, PP and DP groups, and those groups made for real
    plans.py       what is planned: a model, a cluster, a plan; why a model cannot be split so
    estimates.py   what one plan costs: memory, bubble, traffic and links, seconds, MFU, flags
    planner.py     every plan of a cluster, fastest first, and the fastest that fits

Import from `course_lib.parallel_3d` itself: every name is one name here.

Every estimate is a formula of `course_lib.costs`: bytes per parameter and ZeRO (lectures
6-7), activations, TP and PP traffic and compute (lecture 9), the bubble (lecture 8), ring
attention (11) and expert all-to-alls (12). This package adds the bookkeeping: which ranks form
which group, which link each group's traffic crosses, how the pieces add up to a step time.
The lecture's tables, widget, close calls and its real 3-D step are `measure.parallel_3d`.

The model of a step (an estimate, not a simulation): a 1F1B pipeline of m micro-batches takes
m x (compute + TP + CP + EP + PP time per micro-batch) / (1 - bubble); the data-parallel
gradient traffic comes after it, not overlapped (an upper bound). Left out: the embedding and
LM head (their parameters are spread evenly over the stages), the buffers ZeRO-3 gathers,
latency, framework overheads, and the imbalance of causal ring attention. Plans are flagged
for tight memory or ZeRO-2/3 under a pipeline (`FLAGS`).
"""

from course_lib.parallel_3d.estimates import (
    BF16,
    FLAGS,
    TIGHT_MEMORY,
    Estimate,
    activation_bytes,
    dp_traffic,
    estimate,
    layers_per_stage,
    links,
    moe,
    params_per_gpu,
    plan_flags,
    state_bytes,
)
from course_lib.parallel_3d.grid import DIMENSIONS, ProcessGrid, new_groups, spans_nodes
from course_lib.parallel_3d.planner import best, candidates, factorizations
from course_lib.parallel_3d.plans import (
    CHECKPOINTING,
    GPT3,
    LLAMA_7B,
    LLAMA_70B,
    MODELS,
    MOE_8X7B,
    Cluster,
    Model,
    Plan,
    problem,
)

__all__ = [
    "BF16",
    "CHECKPOINTING",
    "DIMENSIONS",
    "FLAGS",
    "GPT3",
    "LLAMA_70B",
    "LLAMA_7B",
    "MODELS",
    "MOE_8X7B",
    "TIGHT_MEMORY",
    "Cluster",
    "Estimate",
    "Model",
    "Plan",
    "ProcessGrid",
    "activation_bytes",
    "best",
    "candidates",
    "dp_traffic",
    "estimate",
    "factorizations",
    "layers_per_stage",
    "links",
    "moe",
    "new_groups",
    "params_per_gpu",
    "plan_flags",
    "problem",
    "spans_nodes",
    "state_bytes",
]
