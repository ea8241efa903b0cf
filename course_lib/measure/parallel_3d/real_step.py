"""How lecture 10 shows the planner (the best plan in one line, the candidates as a table, a
figure of step times by cause, a form that re-plans, the close calls, a check of the student's
plan, the grid as a table), and the one real DP x TP x PP step it runs beside it.

    print(summary(MODELS["70B"], cluster))
    print(candidate_table(candidates(MODELS["70B"], cluster)[:10]))
    plot_step_times(candidates(MODELS["70B"], cluster)[:12])
    PlannerWidget(model="70B", gpus=512)
    run = launch(train_3d, ProcessGrid(2, 2, 2), world_size=8)   # on each rank: 2 steps
    gather_dense(run, grid) vs reference_3d()                    # the same, in one process
    print(comparison_table(predicted_vs_measured(run, grid)))    # planner beside measured

The real step (`train_3d`, `step_3d`): lecture 9's TP layers, lecture 8's 1F1B schedule and
send/recv, a DP all-reduce. The grid and the planner are in `course_lib.parallel_3d`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import ipywidgets as widgets
import numpy as np
import torch
import torch.distributed as dist
from matplotlib.patches import Patch
from torch import nn

from course_lib import comm, models
from course_lib.costs import FP64_ADAMW, TransformerShape, zero_bytes
from course_lib.memory import GB
from course_lib.parallel_3d import (
    BF16,
    DIMENSIONS,
    FLAGS,
    MODELS,
    Cluster,
    Estimate,
    Model,
    Plan,
    ProcessGrid,
    best,
    candidates,
    estimate,
    new_groups,
)
from course_lib.pipeline import FORWARD, _recv, _send, schedule_order
from course_lib.plots import NotebookFigure
from course_lib.runtime import device
from course_lib.tensor_parallel import ParallelBlock
from course_lib.zero import held_bytes

# Plans whose step times differ by less than this are too close for the model to choose.
CLOSE_CALL = 0.02


def close_calls(model: Model, cluster: Cluster, **options: Any) -> list[Estimate]:
    """The fitting plans other than the best whose step time is within CLOSE_CALL of it: the
    estimate cannot tell them apart, so the choice among them is for measurements to make."""
    fitting = [e for e in candidates(model, cluster, **options) if e.fits]
    return [e for e in fitting[1:] if e.step_seconds <= (1 + CLOSE_CALL) * fitting[0].step_seconds]


# check_plan's advice, by the part of memory that overflows or the cause that grows the step.
SHRINK = {
    "params": "More TP or PP ranks share the weights.",
    "optimizer_state": "ZeRO-1 shards the optimizer state over the DP group.",
    "activations": "Stage 0 holds about L layers of them whatever p: more TP, or checkpointing.",
    "recompute": "Checkpoint less (selective, not full), if the activations still fit.",
    "tp": "TP all-reduces in every layer: no wider than needed, never across nodes.",
    "pp": "Each stage boundary sends activations: fewer stages send less.",
    "bubble": "The bubble (p-1)/(m+p-1) grows with p and shrinks with m = batch / d.",
    "dp": "Each GPU all-reduces its gradients over DP: fewer per GPU (more TP or PP), ZeRO-1.",
}


def check_plan(answer: Any, model: Model, cluster: Cluster) -> bool | None:
    """Lecture 10's exercise: does the student's plan (a dict of `Plan`'s fields) fit, how does
    its step by the planner's model compare with the best plan's, and why (never which it is)."""
    if answer is ... or isinstance(answer, dict) and ... in answer.values():
        print("Not answered yet: replace each ... with your choice and run the cell again.")
        return None
    try:
        e = estimate(model, cluster, Plan(**answer))
    except (TypeError, ValueError) as error:
        print(f"✗ Not a plan the planner can price: {error}")
        return False
    used = f"{e.total_memory / GB:.0f} GB per GPU of {cluster.gpu_memory / GB:.0f} GB"
    if not e.fits:
        part = max(e.memory, key=e.memory.get)
        print(f"✗ Too big: {e.plan} needs {used}, {e.memory[part] / GB:.0f} GB of it {part}. "
              f"{SHRINK.get(part, '')}")  # fmt: skip
        return False
    top, most = best(model, cluster) or e, max(e.seconds, key=e.seconds.get)
    print(f"{e.plan} fits: {used}. By the planner's model, a step of {e.step_seconds:.1f} s, "
          f"most of it {most} ({e.seconds[most]:.1f} s).")  # fmt: skip
    if (slower := e.step_seconds / top.step_seconds - 1) <= CLOSE_CALL:
        print(f"✓ Right: within {CLOSE_CALL:.0%} of the planner's best, too close to call.")
        return True
    extra = {k: v - top.seconds.get(k, 0.0) for k, v in e.seconds.items()}
    cause = max(extra, key=extra.get)
    print(f"✗ Not yet: {slower:.0%} slower than the planner's best, most of the gap in {cause} "
          f"({extra[cause]:.1f} s more). {SHRINK.get(cause, '')}".rstrip())  # fmt: skip
    return False


def grid_table(grid: ProcessGrid) -> str:
    """One line per rank: its coordinates and the members of its three groups."""
    width = 2 + max(len(str(g)) for k in DIMENSIONS for g in grid.groups(k))
    header = f"{'rank':>4}  {'(dp, pp, tp)':<14}"
    lines = [(header + "".join(f"{k} group".ljust(width) for k in DIMENSIONS)).rstrip()]
    for r in range(grid.world_size):
        c = grid.coords(r)
        where = f"({c['dp']}, {c['pp']}, {c['tp']})"
        groups = "".join(str(grid.group_of(r, k)).ljust(width) for k in DIMENSIONS)
        lines.append(f"{r:>4}  {where:<14}{groups}".rstrip())
    return "\n".join(lines)


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


def explain_none(model: Model, cluster: Cluster, **options: Any) -> str:
    """Why nothing fits: the plan needing the least memory, and how much it needs."""
    estimates = candidates(model, cluster, **options)
    if not estimates:
        return f"no way to split {model.name} over {cluster.gpus} GPUs (check the batch sizes)"
    least = min(estimates, key=lambda e: e.total_memory)
    return (
        f"nothing fits: the smallest plan, {least.plan}, needs {least.total_memory / GB:.0f} GB "
        f"per GPU of {cluster.gpu_memory / GB:.0f} GB; add GPUs or memory"
    )


def candidate_table(estimates: Sequence[Estimate]) -> str:
    """One row per plan: memory per GPU (GB), whether it fits, bubble, seconds per step
    by cause, and utilisation; with CP or EP in any plan, their degrees and seconds too."""
    extra = [k for k in ("cp", "ep") if any(k in e.seconds for e in estimates)]
    header = (
        f"{'tp':>3}{'pp':>4}{'dp':>5} {'zero':<6}{'ckpt':<10}{'m':>5}{'state GB':>9}{'act GB':>8}"
        f"{'total':>7} {'fits':<5}{'bubble':>7}{'compute':>8}{'recomp':>7}{'TP':>6}{'PP':>6}"
        f"{'bubble':>7}{'DP':>7}{'step s':>8}{'util':>6}{'MFU':>5} flags"
    )
    if extra:  # the degrees after dp, the seconds after PP
        names = "".join(f"{k:>4}" for k in extra)
        header = header[:12] + names + header[12:]
        at = header.index("bubble", header.index("PP"))
        header = header[: at - 1] + "".join(f"{k.upper():>6}" for k in extra) + header[at - 1 :]
    rows = [header]
    for e in estimates:
        p, s = e.plan, e.seconds
        state = e.total_memory - e.memory["activations"]
        degrees = "".join(f"{getattr(p, k):>4}" for k in extra)
        more = "".join(f"{s.get(k, 0.0):>6.2f}" for k in extra)
        rows.append(
            f"{p.tp:>3}{p.pp:>4}{p.dp:>5}{degrees} {p.zero:<6}{p.checkpointing:<10}"
            f"{e.micro_batches:>5}"
            f"{state / GB:>9.1f}{e.memory['activations'] / GB:>8.1f}{e.total_memory / GB:>7.1f}"
            f" {'yes' if e.fits else 'no':<5}{e.bubble:>7.1%}{s['compute']:>8.2f}"
            f"{s['recompute']:>7.2f}{s['tp']:>6.2f}{s['pp']:>6.2f}{more}{s['bubble']:>7.2f}"
            f"{s['dp']:>7.2f}{e.step_seconds:>8.2f}{e.utilisation:>6.0%}{e.mfu:>5.0%}"
            + f" {e.flags}".rstrip()
        )
    for flag in sorted({f for e in estimates for f in e.flags}):
        rows.append(f"{flag}: {FLAGS[flag]}")
    return "\n".join(rows)


def summary(model: Model, cluster: Cluster, **options: Any) -> str:
    """One line: the best plan for `model` on `cluster`, or why there is none."""
    where = f"{model.name} on {cluster.gpus:>4} GPUs"
    e = best(model, cluster, **options)
    if e is None:
        return f"{where}: {explain_none(model, cluster, **options)}"
    line = (
        f"{where}: {e.plan}  {e.total_memory / GB:.0f} GB/GPU ({e.free_memory / GB:.0f} free), "
        f"bubble {e.bubble:.1%}, {e.step_seconds:.1f} s/step, utilisation {e.utilisation:.0%}, "
        f"MFU {e.mfu:.0%}"
    )
    close = close_calls(model, cluster, **options)
    if close:
        gap = close[-1].step_seconds / e.step_seconds - 1
        line += (
            f"\n    {len(close)} more within {gap:.1%} ({close[0].plan}, ...): too close to call"
        )
    return line + "".join(f"\n    {flag}: {FLAGS[flag]}" for flag in e.flags)


def plot_step_times(estimates: Sequence[Estimate], title: str = "") -> NotebookFigure:
    """Seconds per step of each plan, stacked by cause; plans that do not fit are hatched."""
    fig = NotebookFigure(figsize=(8, 0.45 * len(estimates) + 1.2), layout="constrained")
    ax = fig.add_subplot()
    extra = tuple(k for k in ("cp", "ep") if any(k in e.seconds for e in estimates))
    causes = ("compute", "recompute", "tp", "pp", *extra, "bubble", "dp")
    labels = [str(e.plan) for e in estimates]
    left = np.zeros(len(estimates))
    for i, cause in enumerate(causes):
        widths = np.array([e.seconds.get(cause, 0.0) for e in estimates])
        bars = ax.barh(labels, widths, left=left, color=f"C{i}")
        for bar, e in zip(bars, estimates, strict=True):
            if not e.fits:
                bar.set_hatch("//")
                bar.set_alpha(0.5)
        left += widths
    ax.invert_yaxis()
    ax.set_xlabel("seconds per optimizer step (hatched: does not fit in memory)")
    ax.set_title(title, fontsize=10)
    handles = [Patch(color=f"C{i}", label=cause) for i, cause in enumerate(causes)]
    fig.legend(handles=handles, fontsize=8, ncols=len(causes), loc="outside upper center")
    ax.tick_params(axis="y", labelsize=8)
    return fig


# --- 5. the interactive planner (exercise 8) -------------------------------------------------


# Inter-node bandwidth per GPU: 16 Gbit/s Ethernet up to 800 Gbit/s InfiniBand (and beyond).
INTER_NODE_GB_PER_S = (1, 2, 5, 12.5, 25, 50, 100, 200, 400)


class PlannerWidget(widgets.VBox):
    """Menus and sliders for the model and the cluster; every change re-plans and shows the
    best plan and the fastest candidates. `estimates` and `best` hold what is shown (tests)."""

    def __init__(self, model: str = "70B", gpus: int = 512, top: int = 12) -> None:
        self.top = top
        kw = {"style": {"description_width": "initial"}}  # 80 px, the default, cuts labels
        self.model = widgets.Dropdown(options=list(MODELS), value=model, description="model", **kw)
        counts = [2**k for k in range(3, 13)]
        self.gpus = widgets.SelectionSlider(options=counts, value=gpus, description="GPUs", **kw)
        self.gpus_per_node = widgets.Dropdown(
            options=[4, 8], value=8, description="GPUs/node", **kw
        )
        self.memory = widgets.IntSlider(80, min=16, max=192, step=8, description="GPU GB", **kw)
        # Real clusters' link speeds, shown as written (a log slider shows 25 as "25.1").
        speeds = [(f"{v:g}", v) for v in INTER_NODE_GB_PER_S]
        self.inter = widgets.SelectionSlider(
            options=speeds, value=25, description="inter-node GB/s", **kw
        )
        batches = sorted({2**k for k in range(6, 14)} | {m.global_batch for m in MODELS.values()})
        self.batch = widgets.SelectionSlider(
            options=batches, value=MODELS[model].global_batch, description="global batch", **kw
        )
        self.output = widgets.Output()
        controls = [self.model, self.gpus, self.gpus_per_node, self.memory, self.inter, self.batch]
        super().__init__([widgets.HBox(controls[:3]), widgets.HBox(controls[3:]), self.output])
        self.estimates: list[Estimate] = []
        self.best: Estimate | None = None
        for control in controls:
            control.observe(self._replan, names="value")
        self.model.observe(self._default_batch, names="value")
        self._replan()

    def _default_batch(self, change: Any) -> None:
        """A new model starts from its own global batch (which re-plans once more)."""
        self.batch.value = MODELS[change["new"]].global_batch

    def chosen(self) -> tuple[Model, Cluster]:
        """The model and cluster the controls describe."""
        model = replace(MODELS[self.model.value], global_batch=self.batch.value)
        gpus, node, memory = self.gpus.value, self.gpus_per_node.value, self.memory.value * GB
        return model, Cluster(gpus, node, memory, inter_bandwidth=self.inter.value * 1e9)

    def _replan(self, _change: Any = None) -> None:
        model, cluster = self.chosen()
        self.estimates = candidates(model, cluster)
        self.best = next((e for e in self.estimates if e.fits), None)
        with self.output:
            self.output.clear_output(wait=True)
            print(summary(model, cluster))
            fitting = [e for e in self.estimates if e.fits]
            print(f"{len(fitting)} of {len(self.estimates)} plans fit; the fastest:")
            print(candidate_table((fitting or self.estimates)[: self.top]))


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
            inp = xs[i] if s == 0 else _recv(pipe[s - 1])[0].requires_grad_()
            out = stage(inp)
            if last:
                out = models.lm_loss(out, ys[i]) / m  # the mean over micro-batches
                loss += out.item()
            else:
                pending += _send(out, pipe[s + 1], ready=0.0)
            inputs[i], outputs[i] = inp, out
        else:
            grad = None if last else _recv(pipe[s + 1])[0]
            torch.autograd.backward(outputs.pop(i), grad)
            inp = inputs.pop(i)
            if s > 0:
                pending += _send(inp.grad, pipe[s - 1], ready=0.0)
    for work in pending:
        if isinstance(work, dist.Work):
            work.wait()
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
