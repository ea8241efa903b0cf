"""The planner drawn (lecture 10, sections 3 and 5): each plan's seconds per step stacked by
cause, and `PlannerWidget`, a form whose menus and sliders re-plan as they move."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import ipywidgets as widgets
import numpy as np
from matplotlib.patches import Patch

from course_lib.measure.parallel_3d.tables import candidate_table, summary
from course_lib.memory import GB
from course_lib.parallel_3d import MODELS, Cluster, Estimate, Model, candidates
from course_lib.plots import NotebookFigure


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


# --- the interactive planner (exercise 8) ----------------------------------------------------


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
