"""How lecture 10 shows the planner: its best plan in one line, the candidates as a table, a
figure of each plan's step time by cause, and a form (widget) that re-plans as the model and
the cluster change.

    print(summary(MODELS["70B"], cluster))
    print(candidate_table(candidates(MODELS["70B"], cluster)[:10]))
    plot_step_times(candidates(MODELS["70B"], cluster)[:12])
    PlannerWidget(model="70B", gpus=512)

The grid of ranks and the planner are in `course_lib.parallel_3d`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import ipywidgets as widgets
import numpy as np
from matplotlib.patches import Patch

from course_lib.memory import GB
from course_lib.parallel_3d import (
    FLAGS,
    MODELS,
    Cluster,
    Estimate,
    Model,
    best,
    candidates,
    close_calls,
)
from course_lib.plots import NotebookFigure


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
    by cause, and utilisation."""
    header = (
        f"{'tp':>3}{'pp':>4}{'dp':>5} {'zero':<6}{'ckpt':<10}{'m':>5}{'state GB':>9}{'act GB':>8}"
        f"{'total':>7} {'fits':<5}{'bubble':>7}{'compute':>8}{'recomp':>7}{'TP':>6}{'PP':>6}"
        f"{'bubble':>7}{'DP':>7}{'step s':>8}{'util':>6}{'MFU':>5} flags"
    )
    rows = [header]
    for e in estimates:
        p, s = e.plan, e.seconds
        state = e.total_memory - e.memory["activations"]
        rows.append(
            f"{p.tp:>3}{p.pp:>4}{p.dp:>5} {p.zero:<6}{p.checkpointing:<10}{e.micro_batches:>5}"
            f"{state / GB:>9.1f}{e.memory['activations'] / GB:>8.1f}{e.total_memory / GB:>7.1f}"
            f" {'yes' if e.fits else 'no':<5}{e.bubble:>7.1%}{s['compute']:>8.2f}"
            f"{s['recompute']:>7.2f}{s['tp']:>6.2f}{s['pp']:>6.2f}{s['bubble']:>7.2f}"
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
    causes = ("compute", "recompute", "tp", "pp", "bubble", "dp")
    labels = [str(e.plan) for e in estimates]
    left = np.zeros(len(estimates))
    for i, cause in enumerate(causes):
        widths = np.array([e.seconds[cause] for e in estimates])
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
        # Labels get the width they need: the default (about 80 px) cuts "global batch".
        style = {"description_width": "initial"}
        self.model = widgets.Dropdown(
            options=list(MODELS), value=model, description="model", style=style
        )
        self.gpus = widgets.SelectionSlider(
            options=[2**k for k in range(3, 13)], value=gpus, description="GPUs", style=style
        )
        self.gpus_per_node = widgets.Dropdown(
            options=[4, 8], value=8, description="GPUs/node", style=style
        )
        self.memory = widgets.IntSlider(
            80, min=16, max=192, step=8, description="GPU GB", style=style
        )
        # The link speeds of real clusters, shown as written: a log slider snaps 25 to
        # 10**1.4 and reads "25.1".
        self.inter = widgets.SelectionSlider(
            options=[(f"{v:g}", v) for v in INTER_NODE_GB_PER_S],
            value=25,
            description="inter-node GB/s",
            style=style,
        )
        batches = sorted({2**k for k in range(6, 14)} | {m.global_batch for m in MODELS.values()})
        self.batch = widgets.SelectionSlider(
            options=batches,
            value=MODELS[model].global_batch,
            description="global batch",
            style=style,
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
        cluster = Cluster(
            self.gpus.value,
            gpus_per_node=self.gpus_per_node.value,
            gpu_memory=self.memory.value * GB,
            inter_bandwidth=self.inter.value * 1e9,
        )
        return model, cluster

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
