"""What lecture 13 measures and draws: the loss curve of a restarted run against an
uninterrupted one, what the agents of a job that lost a node did and what each attempt
trained, the stall of blocking against asynchronous checkpoints, a straggler and a hung rank
found by the watchdog, and MFU on this CPU and in the planner's plans.

Functions whose docstring says "on each rank" run inside `launch`; the others in the notebook.
The checks of the lecture's exercises (`check_steps_redone`, on the restart,
`check_minutes_between_checkpoints`, on Young's rule, and `check_named_rank`, on the hung rank)
compute their expected values and say why here, out of the notebook's sight.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import statistics
import tempfile
import time
from datetime import timedelta

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from course_lib import data, models
from course_lib.costs import checkpoint_interval, matmul_weights, mfu, training_flops
from course_lib.exercises import check_choice, check_number
from course_lib.fault_tolerance import (
    AsyncCheckpointer,
    TorchrunResult,
    guarded_all_reduce,
    local_state,
    save_file,
)
from course_lib.parallel_3d import LLAMA_7B, LLAMA_70B, Cluster, best
from course_lib.runtime import rank
from course_lib.zero import build

# --- 1. the restart --------------------------------------------------------------------------


def check_steps_redone(steps_redone: object, redone: list[int]) -> bool | None:
    """Lecture 13's restart prediction: how many steps the restarted attempt computed again
    (`redone`: the steps of attempt 1 before the crash's step, from the loss log)."""
    return check_number(
        steps_redone,
        len(redone),
        hint="Find the newest checkpoint complete when rank 1 died: which steps after it were "
        "already done?",
    )


def plot_restart(log: list[dict], reference: list[float], kill_at: int):
    """The restarted run's losses (each attempt in its own colour) over the uninterrupted
    run's, the failure marked."""
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.plot(reference, color="lightgray", lw=6, label="uninterrupted run")
    for attempt in sorted({row["attempt"] for row in log}):
        rows = [row for row in log if row["attempt"] == attempt]
        steps = [row["step"] for row in rows]
        ax.plot(steps, [row["loss"] for row in rows], "o-", ms=3, label=f"attempt {attempt}")
    ax.axvline(kill_at, color="red", ls="--", label=f"rank 1 dies (step {kill_at})")
    ax.set(xlabel="step", ylabel="loss", title="A rank killed, the job restarted by torchrun")
    ax.legend()
    return fig


# --- 1. a node lost: what each agent saw, what each attempt trained -------------------------

# The last line of a traceback: "RuntimeError: [.../pair.cc:553] Connection closed by peer ..."
_ERROR = re.compile(r"^(?:\[rank\d+\]: )?(?:[\w.]+\.)?(\w+(?:Error|Exception))(?:: (.*))?$")


def agents_report(results: list[TorchrunResult]) -> list[str]:
    """One line per torchrun agent of a job: how and when it ended (from the start of the
    job), and the errors it and its workers printed, each by its class and first sentence.
    Agent 0 is the one that hosts the rendezvous (`two_node_args`)."""
    lines = []
    for i, result in enumerate(results):
        who = f"agent {i}{' (hosts the rendezvous)' if i == 0 else ''}"
        if result.returncode == -signal.SIGKILL:
            ended = "killed with its node (SIGKILL)"
        else:
            ended = f"exit code {result.returncode}"
        errors = []
        for line in result.output.splitlines():
            match = _ERROR.match(line.strip())
            if match:
                name, message = match.group(1), (match.group(2) or "").split("] ")[-1]
                error = f"{name}: {message.split('. ')[0]}" if message else name
                if error not in errors:
                    errors.append(error)
        said = f"; printed {'; '.join(errors)}" if errors else ""
        lines.append(f"{who}: {ended} after {result.seconds:.0f} s{said}")
    return lines


def attempts_report(log: list[dict], reference: list[float]) -> list[str]:
    """One line per attempt of a restarted job's loss log: its steps, its world size, and its
    largest |loss - the uninterrupted run's loss| at the same steps."""
    lines = []
    for attempt in sorted({row["attempt"] for row in log}):
        rows = [row for row in log if row["attempt"] == attempt]
        gap = max(abs(row["loss"] - reference[row["step"]]) for row in rows)
        ranks = rows[0]["world_size"]
        lines.append(
            f"attempt {attempt}: steps {rows[0]['step']}-{rows[-1]['step']} on {ranks} "
            f"rank{'s' if ranks > 1 else ''}, largest |loss - uninterrupted| {gap:.1e}"
        )
    return lines


# --- 2. checkpoint stalls ----------------------------------------------------------------------

STALL_MODES = ("no checkpoint", "blocking (ours)", "async (ours)", "dcp.save", "dcp.async_save")


def checkpoint_stall(
    mode: str, steps: int = 7, every: int = 2, width: int = 1536, batch: int = 4
) -> dict[str, list[float]]:
    """On each rank: train an MLP with ZeRO-3 (about 3 x 4 x width^2 bytes of parameters and
    AdamW state, split over the ranks) and save a sharded checkpoint after every `every` steps
    by `mode` (one of `STALL_MODES`). Returns {"stall": seconds the training loop was held by
    each save call, "step": seconds of each step, its save included}."""
    if mode not in STALL_MODES:
        raise ValueError(f"mode must be one of {STALL_MODES}, got {mode!r}")
    mlp = models.MLP((256, width, width, 256), seed=0).layers  # a Sequential: FSDP shards each
    model, optimizer = build("zero3", mlp, lr=1e-3)
    x, y = data.regression(batch, 256, 256, seed=rank())
    saver, pending = AsyncCheckpointer(), None
    # dcp.async_save's own group: the saving thread's collectives must not interleave with the
    # training loop's on the same group (gloo would pair them wrongly). Made before the loop,
    # so that making it is not timed as part of the first save.
    group = dist.new_group(backend="gloo") if mode == "dcp.async_save" else None
    box = [tempfile.mkdtemp() if rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)  # one folder for all ranks, as DCP needs
    folder, times, stalls = box[0], [], []
    for step in range(steps):
        start = time.perf_counter()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if (step + 1) % every == 0 and mode != "no checkpoint":
            path = os.path.join(folder, f"step_{step}")
            held = time.perf_counter()
            if mode == "blocking (ours)":
                save_file(local_state(model, optimizer), f"{path}.rank{rank()}")
            elif mode == "async (ours)":
                saver.save(local_state(model, optimizer), f"{path}.rank{rank()}")
            else:
                model_state, optimizer_state = get_state_dict(model, optimizer)
                state = {"model": model_state, "optimizer": optimizer_state}
                if mode == "dcp.save":
                    dcp.save(state, checkpoint_id=path)
                else:
                    if pending is not None:
                        pending.result()  # one save in flight at a time, as ours
                    pending = dcp.async_save(state, checkpoint_id=path, process_group=group)
            stalls.append(time.perf_counter() - held)
        times.append(time.perf_counter() - start)
    saver.wait()
    if pending is not None:
        pending.result()
    dist.barrier()  # no rank deletes the folder while another still writes to it
    if rank() == 0:
        shutil.rmtree(folder)
    return {"stall": stalls or [0.0], "step": times}


def median_range(seconds: list[float]) -> tuple[float, float, float]:
    """(median, fastest, slowest) of `seconds`, in milliseconds."""
    ms = [1e3 * t for t in seconds]
    return statistics.median(ms), min(ms), max(ms)


def stall_lines(runs: dict[str, dict[str, list[float]]]) -> list[str]:
    """One line per mode of `checkpoint_stall`: the stall of each save call and the steps
    (save included, the first step left out: it warms up), each as median (fastest-slowest)."""
    lines = []
    for mode, run in runs.items():
        held, step = median_range(run["stall"]), median_range(run["step"][1:])
        lines.append(
            f"{mode:<16} held {held[0]:4.0f} ms ({held[1]:3.0f}-{held[2]:3.0f}) per checkpoint; "
            f"steps {step[0]:4.0f} ms ({step[1]:3.0f}-{step[2]:3.0f})"
        )
    return lines


def plot_stall(runs: dict[str, dict[str, list[float]]]):
    """The median stall per checkpoint of each mode, a bar each, a line from its fastest to its
    slowest save."""
    fig, ax = plt.subplots(figsize=(8, 3))
    spread = {mode: median_range(r["stall"]) for mode, r in runs.items()}
    median = [m for m, _, _ in spread.values()]
    error = [[m - lo for m, lo, _ in spread.values()], [hi - m for m, _, hi in spread.values()]]
    bars = ax.bar(list(spread), median, yerr=error, capsize=3, color="tab:blue")
    ax.bar_label(bars, fmt="%.0f ms", padding=2)
    ax.set(ylabel="ms the loop is held (median)", title="What a checkpoint costs the training loop")
    return fig


def check_minutes_between_checkpoints(minutes_between_checkpoints: object) -> bool | None:
    """Young's interval in minutes for a 30 s checkpoint stall and a failure every 3 hours."""
    return check_number(
        minutes_between_checkpoints,
        checkpoint_interval(30, 3 * 3600) / 60,
        hint="sqrt(2 * C * M), with C and M in seconds; then convert to minutes.",
    )


# --- 3. the watchdog ------------------------------------------------------------------------


def watched_steps(
    steps: int = 8,
    slow_rank: int | None = None,
    delay_s: float = 0.05,
    hang_rank: int | None = None,
    hang_at: int = 3,
    timeout_s: float = 2.0,
) -> list[float]:
    """On each rank: `steps` steps of some work and an all-reduce with a deadline
    (`guarded_all_reduce`); rank `slow_rank` sleeps `delay_s` more per step, rank `hang_rank`
    stops for good at step `hang_at`. Returns this rank's compute seconds per step."""
    a = torch.randn(192, 192, generator=torch.Generator().manual_seed(rank()))
    compute = []
    for step in range(steps):
        start = time.perf_counter()
        for _ in range(4):
            a = torch.tanh(a @ a) / 2  # the step's own work
        if rank() == slow_rank:
            time.sleep(delay_s)  # a slower GPU, a noisy neighbour, a throttled CPU
        if rank() == hang_rank and step == hang_at:
            time.sleep(3600)  # a dead-locked data loader, a GPU that stopped answering
        compute.append(time.perf_counter() - start)
        guarded_all_reduce(a, step, timeout_s, compute_s=compute[-1])
    return compute


def monitored_barrier_report(hang_rank: int = 1, timeout_s: float = 1.0) -> str:
    """On each rank: torch's own check, `dist.monitored_barrier` (gloo only): rank 0 waits for
    every other rank and names those that did not come. Rank `hang_rank` never calls it."""
    if rank() == hang_rank:
        time.sleep(1.5 * timeout_s)  # late: the barrier has given up by then
        return "(this rank never arrived)"
    try:
        dist.monitored_barrier(timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
    except RuntimeError as error:
        return str(error).splitlines()[0]
    return "every rank arrived"


def plot_compute(compute: list[list[float]], straggler: int | None):
    """Each rank's median compute seconds per step, the straggler in red."""
    fig, ax = plt.subplots(figsize=(6, 2.8))
    medians = [torch.tensor(t).median().item() * 1e3 for t in compute]
    colors = ["tab:red" if r == straggler else "tab:blue" for r in range(len(compute))]
    ax.bar([f"rank {r}" for r in range(len(compute))], medians, color=colors)
    ax.set(ylabel="ms of compute per step (median)", title="Who makes everyone wait")
    return fig


NAMED_RANKS = ("rank 0", "rank 1", "ranks 0, 2, 3")


def check_named_rank(named_rank: object, error: BaseException) -> bool | None:
    """Lecture 13's hang prediction: which rank the error raised on rank 0 names as never
    having arrived at the all-reduce (its `fault_tolerance.HungRank`'s `ranks`, which the
    launcher's `RankError` carries as `attributes["ranks"]`)."""
    missing = getattr(error, "attributes", {}).get("ranks")
    if not isinstance(missing, list):
        raise ValueError(
            f"expected the RankError of a HungRank (with the ranks it names), got {error!r:.200}"
        )
    listed = ", ".join(map(str, missing)) or "none"
    named = f"rank {missing[0]}" if len(missing) == 1 else f"ranks {listed}"
    return check_choice(
        named_rank,
        named,
        NAMED_RANKS,
        why="The waiting ranks time out; the heartbeats say who is missing: the one stuck at "
        "step 2.",
    )


# --- 4. MFU ---------------------------------------------------------------------------------

MFU_CONFIG = models.GPTConfig(vocab_size=256, seq_len=128, d_model=256, n_heads=4, n_layers=4)


def matmul_peak(n: int = 1024, repeats: int = 10) -> float:
    """FLOP/s of this process's best n x n float32 matmul (2n^3 FLOPs): the practical peak
    of this CPU, the number MFU is measured against."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    best_s = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best_s = min(best_s, time.perf_counter() - start)
    return 2 * n**3 / best_s


def matmul_parameters(model: models.TinyGPT) -> int:
    """N of 6ND: every parameter but the embedding tables (looked up, not multiplied)."""
    return models.count_parameters(model) - models.count_parameters(model.embed)


def gpt_step_seconds(batch: int = 4, steps: int = 3, config=MFU_CONFIG) -> tuple[float, int, int]:
    """(best seconds per training step, N, tokens per step) of the course's GPT trained by
    AdamW in this process."""
    model = models.TinyGPT(config, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = data.tokens(batch, config.seq_len, config.vocab_size, seed=0)
    best_s = float("inf")
    for _ in range(steps):
        start = time.perf_counter()
        models.lm_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        best_s = min(best_s, time.perf_counter() - start)
    return best_s, matmul_parameters(model), batch * config.seq_len


def planner_mfu() -> dict[str, dict]:
    """MFU of the planner's best plan for 7B on 64 GPUs and 70B on 512 (lecture 10), by 6ND
    against the GPUs' peak (`Cluster.peak_flops_per_s`), N counted as in `matmul_parameters`
    (the weights that multiply, no embeddings), beside the planner's own MFU (which counts
    attention's scores too), with N and the step's seconds by kind."""
    rows = {}
    for model, gpus in ((LLAMA_7B, 64), (LLAMA_70B, 512)):
        cluster = Cluster(gpus)
        plan = best(model, cluster)
        shape = model.shape
        # The N of the planner's FLOPs (`costs.compute_seconds`); its model card's N adds the
        # embeddings.
        n_params = matmul_weights(shape)
        tokens = model.global_batch * shape.seq
        rows[model.name] = {
            "plan": str(plan.plan),
            "gpus": gpus,
            "n_params": n_params,
            "card_params": model.params,
            "attention_share": shape.seq / (6 * shape.hidden),  # 12 L s h over 6N = 72 L h^2
            "step_seconds": plan.step_seconds,
            "mfu": mfu(
                training_flops(n_params, tokens),
                plan.step_seconds,
                cluster.peak_flops_per_s,
                gpus,
            ),
            "planner_mfu": plan.mfu,
            "seconds": plan.seconds,
            "assumed": cluster.flops_per_s / cluster.peak_flops_per_s,
        }
    return rows


def plot_planner_mfu(rows: dict[str, dict]):
    """Each plan's step as stacked seconds: the model's math, then what it waits for. A kind
    keeps one colour in every row (the plans need not have the same kinds)."""
    kinds = list(dict.fromkeys(kind for row in rows.values() for kind in row["seconds"]))
    colours = {kind: f"C{i % 10}" for i, kind in enumerate(kinds)}
    fig, ax = plt.subplots(figsize=(8, 2.8))
    labelled: set[str] = set()
    for i, row in enumerate(rows.values()):
        left = 0.0
        for kind, seconds in row["seconds"].items():
            share = seconds / row["step_seconds"]
            label = kind if kind not in labelled else "_nolegend_"
            ax.barh(i, share, left=left, color=colours[kind], label=label)
            labelled.add(kind)
            left += share
    ax.set_yticks(range(len(rows)), [f"{n}: {r['plan']}" for n, r in rows.items()])
    ax.set(xlabel="share of the step", title="Where a planned step goes")
    ax.legend(ncol=6, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.35))
    return fig
