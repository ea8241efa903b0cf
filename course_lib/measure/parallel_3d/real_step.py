"""What lecture 10 runs on ranks (sections 2 and 6): the grid's groups as the collectives see
them, and one real DP x TP x PP training step of a float64 TinyGPT (lecture 9's TP layers,
lecture 8's 1F1B schedule and send/recv, a DP all-reduce), the same training in one process,
and the step's memory and traffic beside the planner's."""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from course_lib import comm, models
from course_lib.costs import FP64_ADAMW, TransformerShape, zero_bytes
from course_lib.parallel_3d import BF16, Cluster, Model, Plan, ProcessGrid, estimate, new_groups
from course_lib.pipeline import FORWARD, schedule_order
from course_lib.pipeline.p2p import recv_shaped, send_shaped, wait_all
from course_lib.runtime import device
from course_lib.tensor_parallel import ParallelBlock
from course_lib.zero import held_bytes

# --- the grid's groups, made for real -------------------------------------------------------


def group_members(grid: ProcessGrid) -> dict[str, list[int]]:
    """On every rank: create the groups, then all-gather each rank's global rank inside each
    of its groups: who is really in my TP, PP and DP group, as the collectives see it."""
    members = {}
    for kind, group in new_groups(grid).items():
        me = torch.tensor([dist.get_rank()], device=device())
        everyone = [torch.zeros_like(me) for _ in range(dist.get_world_size(group))]
        dist.all_gather(everyone, me, group=group)
        members[kind] = [int(t.item()) for t in everyone]
    return members


# --- one real DP x TP x PP step, measured beside the planner --------------------------------

STEP_CONFIG = models.GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=4, n_layers=2, d_ff=64)
LR = 1e-2


def build_stage(grid: ProcessGrid, tp_group: dist.ProcessGroup, seed: int = 0) -> nn.Sequential:
    """On each rank: its pipeline stage of the float64 TinyGPT, every block made of lecture 9's
    tensor-parallel layers over `tp_group`; the embedding and the head stay whole (replicated
    over the TP group)."""
    dense = models.TinyGPT(STEP_CONFIG, seed=seed, dtype=torch.float64)
    layers = dense.pipeline_stages(grid.pp)[grid.coords(dist.get_rank())["pp"]]
    return nn.Sequential(
        *(ParallelBlock(x, tp_group) if isinstance(x, models.Block) else x for x in layers)
    )


def dense_names(grid: ProcessGrid, stage: nn.Sequential) -> dict[str, str]:
    """This rank's parameter names -> the dense TinyGPT's names ("1.attn.qkv.weight" ->
    "blocks.0.attn.qkv.weight")."""
    prefix = ["embed", *(f"blocks.{i}" for i in range(STEP_CONFIG.n_layers)), "head"]
    first = round(grid.coords(dist.get_rank())["pp"] * len(prefix) / grid.pp)
    return {
        name: f"{prefix[first + int(name.split('.')[0])]}.{name.split('.', 1)[1]}"
        for name, _ in stage.named_parameters()
    }


def step_3d(
    stage: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    m: int,
    grid: ProcessGrid,
    groups: dict[str, dist.ProcessGroup],
    optimizer: torch.optim.Optimizer,
) -> float | None:
    """One DP x TP x PP training step on this rank, for its DP replica's batch x, y: m
    micro-batches through the 1F1B schedule of lecture 8 (activations forward and gradients
    back by send/recv between the stages of its PP group), the TP all-reduces inside each
    block (lecture 9), then the gradients averaged over the DP group (lecture 3) and one
    optimizer step. Returns the replica's loss on the last stage, None elsewhere."""
    me = dist.get_rank()
    s, pipe = grid.coords(me)["pp"], grid.group_of(me, "pp")
    last = s == grid.pp - 1
    xs, ys = x.chunk(m), y.chunk(m)
    inputs, outputs, pending, loss = {}, {}, [], 0.0
    optimizer.zero_grad(set_to_none=True)
    for op in schedule_order("1f1b", grid.pp, m)[s]:
        i = op.micro
        if op.kind == FORWARD:
            inp = xs[i] if s == 0 else recv_shaped(pipe[s - 1]).requires_grad_()
            out = stage(inp)
            if last:
                out = models.lm_loss(out, ys[i]) / m  # the mean over micro-batches
                loss += out.item()
            else:
                pending += send_shaped(out, pipe[s + 1])
            inputs[i], outputs[i] = inp, out
        else:
            grad = None if last else recv_shaped(pipe[s + 1])
            torch.autograd.backward(outputs.pop(i), grad)
            inp = inputs.pop(i)
            if s > 0:
                pending += send_shaped(inp.grad, pipe[s - 1])
    wait_all(pending)
    for p in stage.parameters():  # the replicas' mean gradient: the whole batch's
        dist.all_reduce(p.grad, group=groups["dp"])
        p.grad /= grid.dp
    optimizer.step()
    return loss if last else None


class GroupBytes:
    """Bytes this rank sends in each kind of group while the block runs, as `comm` counts
    them: send/recv (the pipeline's, group None) go to "pp", collectives to their group."""

    def __init__(self, groups: dict[str, dist.ProcessGroup]) -> None:
        self.kind_of = {id(g): k for k, g in groups.items()}
        self.sent = {k: 0 for k in ("tp", "pp", "dp")}
        self.received, self.messages = dict(self.sent), dict(self.sent)

    def _hook(self, op: str, args: dict, sent: int, received: int, call: Any) -> object:
        kind = "pp" if op in comm.POINT_TO_POINT else self.kind_of[id(args.get("group"))]
        self.sent[kind] += sent
        self.received[kind] += received
        self.messages[kind] += 1 if sent else 0
        return call()

    def __enter__(self) -> GroupBytes:
        comm.add_around_hook(self._hook)
        return self

    def __exit__(self, *exc_info: object) -> None:
        comm.remove_around_hook(self._hook)


def train_3d(grid: ProcessGrid, steps: int = 2, batch: int = 8, m: int = 2, seed: int = 0):
    """On each rank: `steps` AdamW steps of the 3-D TinyGPT on the same seeded batches as
    `reference_3d`, this replica taking its 1/dp of each. Returns this rank's coordinates, its
    parameters under dense names, its loss, and what it measured in the first step: bytes
    held (parameters, gradients, optimizer state) and bytes sent per kind of group."""
    groups = new_groups(grid)
    stage = build_stage(grid, groups["tp"], seed)
    optimizer = torch.optim.AdamW(stage.parameters(), lr=LR)
    d, n = grid.coords(dist.get_rank())["dp"], batch // grid.dp
    losses, counts = [], []
    for x, y in step_batches(steps, batch, seed):
        rows = slice(d * n, (d + 1) * n)
        with GroupBytes(groups) as counted:
            losses.append(step_3d(stage, x[rows], y[rows], m, grid, groups, optimizer))
        counts.append(counted)
    names = dense_names(grid, stage)
    return {
        "coords": grid.coords(dist.get_rank()),
        "params": {names[k]: p.detach().clone() for k, p in stage.named_parameters()},
        "losses": losses,
        "held": {
            "params": held_bytes(stage.parameters()),
            "grads": held_bytes(p.grad for p in stage.parameters()),
            "optimizer_state": held_bytes(
                t for state in optimizer.state.values() for t in state.values() if t.dim() > 0
            ),
        },
        "sent": counts[0].sent,
        "received": counts[0].received,
        "messages": counts[0].messages,
        "numel": sum(p.numel() for p in stage.parameters()),
    }


def step_batches(steps: int, batch: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batches of token ids and next-token targets, the same in every process."""
    shape, g = (batch, STEP_CONFIG.seq_len), torch.Generator().manual_seed(seed + 1)
    xs = [torch.randint(STEP_CONFIG.vocab_size, shape, generator=g) for _ in range(steps)]
    return [(x, torch.roll(x, -1, dims=1)) for x in xs]


def reference_3d(steps: int = 2, batch: int = 8, seed: int = 0) -> dict[str, torch.Tensor]:
    """The same training in one process: the whole TinyGPT, the whole batch, torch's AdamW."""
    model = models.TinyGPT(STEP_CONFIG, seed=seed, dtype=torch.float64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    for x, y in step_batches(steps, batch, seed):
        optimizer.zero_grad()
        models.lm_loss(model(x), y).backward()
        optimizer.step()
    return {k: p.detach().clone() for k, p in model.named_parameters()}


def gather_dense(results: list[dict], grid: ProcessGrid) -> dict[str, torch.Tensor]:
    """The dense parameters put back together from the ranks of DP replica 0: column-parallel
    pieces (lecture 9: qkv as three blocks, fc) stacked by rows, row-parallel weights side by
    side, everything else (layer norms, biases after the sum, embedding, head) whole."""
    out = {}
    for ranks in grid.groups("tp"):
        if results[ranks[0]]["coords"]["dp"]:
            continue
        pieces = [results[r]["params"] for r in ranks]
        for name in pieces[0]:
            parts = [p[name] for p in pieces]
            if re.search(r"(qkv|fc)\.(weight|bias)$", name):
                k = 3 if ".qkv." in name else 1
                blocks = [t.chunk(k, dim=0) for t in parts]
                out[name] = torch.cat([b[j] for j in range(k) for b in blocks], dim=0)
            elif re.search(r"proj\.weight$", name):
                out[name] = torch.cat(parts, dim=1)
            else:
                out[name] = parts[0]
    return out


# --- the planner's numbers beside the measured ones -----------------------------------------


def tiny_model(batch: int = 8, m: int = 2, dp: int = 2) -> Model:
    """The planner's description of the TinyGPT `train_3d` trains: its parameter count, its
    shape (micro-batch batch / (dp m) sequences) and its global batch."""
    c = STEP_CONFIG
    n = models.count_parameters(models.TinyGPT(c))
    shape = TransformerShape(c.n_layers, c.d_model, c.n_heads, c.seq_len, batch // (dp * m))
    return Model("TinyGPT", n, shape, global_batch=batch)


def predicted_vs_measured(results: list[dict], grid: ProcessGrid, batch: int = 8, m: int = 2):
    """Rows (what, predicted, measured on each rank) for the first step of `train_3d`: the
    planner's `estimate` for this grid (no SP, DDP, no checkpointing), its bf16 bytes scaled
    to float64, and AdamW's state in float64 (two moments, no master copy: FP64_ADAMW)."""
    plan = Plan(grid.tp, grid.pp, grid.dp, sequence_parallel=False)
    e = estimate(tiny_model(batch, m, grid.dp), Cluster(grid.world_size, grid.world_size), plan)
    held = zero_bytes("ddp", e.params_per_gpu, grid.dp, FP64_ADAMW)
    scale = FP64_ADAMW["params"] / BF16  # the planner prices bf16 values; the run is float64
    rows = [("parameters (count)", e.params_per_gpu, [r["numel"] for r in results])]
    rows += [(f"{k} (bytes)", held[k], [r["held"][k] for r in results]) for k in held]
    for kind in ("tp", "dp"):
        rows.append(
            (f"{kind} sent (bytes)", e.traffic[kind] * scale, [r["sent"][kind] for r in results])
        )
    # The planner charges each GPU a boundary's traffic both ways (activation and gradient).
    pp = [r["sent"]["pp"] + r["received"]["pp"] for r in results]
    rows.append(("pp sent+received (bytes)", e.traffic["pp"] * scale, pp))
    return rows


def comparison_table(rows) -> str:
    """The planner's number beside each rank's measured one."""
    width = max(len(str(int(v))) for _, p, ms in rows for v in (p, *ms)) + 2
    lines = [
        f"{'per rank, first step':<26}{'planner':>{width}}"
        + "".join(f"{'rank ' + str(r):>{width}}" for r in range(len(rows[0][2])))
    ]
    for what, predicted, measured in rows:
        lines.append(
            f"{what:<26}{predicted:>{width},.0f}" + "".join(f"{v:>{width},}" for v in measured)
        )
    return "\n".join(lines)
