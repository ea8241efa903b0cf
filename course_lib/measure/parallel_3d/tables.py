"""The planner in text, as lecture 10 prints it: the grid as a table, the best plan in one line
with the plans too close to call, the candidates as a table, and why nothing fits."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from course_lib.memory import GB
from course_lib.parallel_3d import (
    DIMENSIONS,
    FLAGS,
    Cluster,
    Estimate,
    Model,
    ProcessGrid,
    best,
    candidates,
)

# Plans whose step times differ by less than this are too close for the model to choose.
CLOSE_CALL = 0.02


def close_calls(model: Model, cluster: Cluster, **options: Any) -> list[Estimate]:
    """The fitting plans other than the best whose step time is within CLOSE_CALL of it: the
    estimate cannot tell them apart, so the choice among them is for measurements to make."""
    fitting = [e for e in candidates(model, cluster, **options) if e.fits]
    if not fitting:
        return []
    fastest = fitting[0].step_seconds
    return [e for e in fitting[1:] if e.step_seconds <= (1 + CLOSE_CALL) * fastest]


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
