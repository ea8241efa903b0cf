"""What a message between processes costs: measured, fitted and plotted (Lecture 1).

    launch(pipe_message_times, SIZES, world_size=1)   # one-way seconds over a multiprocessing Pipe
    launch(p2p_message_times, SIZES, world_size=2)    # the same over torch.distributed send/recv
    fit = fit_latency_bandwidth(SIZES, times)         # t(n) = alpha + n * beta
    plot_message_times(ax, SIZES, times, "pipe")      # points and fitted line, log-log
    launch(hogwild, workers=2, world_size=1)          # lock-free SGD on shared memory
    nxt, prev = ring_neighbours(rank(), world_size())  # whom a rank sends to on a ring

Every timing is one way: the sender reads `time.perf_counter()` just before it sends, the
receiver just after the message has arrived. Both clocks are the machine's monotonic clock,
which all processes on one machine share, so the difference is the transfer time.

The multiprocessing functions fork child processes. Run them inside a launched worker
(`launch(..., world_size=1)`), never in the notebook kernel: forking a kernel that runs
several threads is not safe.
"""

from __future__ import annotations

import multiprocessing
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from course_lib import runtime
from course_lib.costs import alpha_beta_time

CHANNELS = ("pipe", "queue")


# --- multiprocessing: Pipe and Queue ------------------------------------------------------


def _refuse_in_kernel(what: str) -> None:
    """Forking a Jupyter kernel (many threads, open sockets) can hang the child: refuse."""
    if "ipykernel" in sys.modules and not runtime.is_worker():
        raise RuntimeError(
            f"{what} forks child processes and must not run in the notebook kernel; "
            f"run it in a fresh worker instead: launch({what}, ..., world_size=1)"
        )


def _fork() -> multiprocessing.context.BaseContext:
    return multiprocessing.get_context("fork")


def _stamp_arrivals(receive: Callable[[], object], clocks) -> None:
    """Child side: receive messages until None; report each one's arrival time and size."""
    while (message := receive()) is not None:
        clocks.send((time.perf_counter(), len(message)))


def pipe_message_times(
    sizes: Sequence[int], repeats: int = 3, channel: str = "pipe", timeout: float = 30.0
) -> list[float]:
    """Median one-way seconds for a `bytes` message of each size to reach a child process
    over a multiprocessing Pipe (channel="pipe") or Queue ("queue"): pickle, copy, unpickle."""
    _refuse_in_kernel("pipe_message_times")
    if channel not in CHANNELS:
        raise ValueError(f"channel must be one of {CHANNELS}, got {channel!r}")
    if repeats < 1 or any(n < 0 for n in sizes):
        raise ValueError(f"need repeats >= 1 and sizes >= 0, got {repeats=} and {sizes=}")
    fork = _fork()
    if channel == "pipe":
        inbox, outbox = fork.Pipe(duplex=False)  # (receiving end, sending end)
        send, receive = outbox.send, inbox.recv
    else:
        queue = fork.Queue()
        send, receive = queue.put, queue.get
    clocks_in, clocks_out = fork.Pipe(duplex=False)
    child = fork.Process(target=_stamp_arrivals, args=(receive, clocks_out), daemon=True)
    child.start()
    medians = []
    try:
        for n in sizes:
            payload = bytes(n)  # made before the clock starts: only the transfer is timed
            samples = []
            for attempt in range(repeats + 1):  # attempt 0 warms up the channel and is dropped
                start = time.perf_counter()
                send(payload)
                if not clocks_in.poll(timeout):
                    raise TimeoutError(f"a {n}-byte message took more than {timeout:g} s")
                arrived, length = clocks_in.recv()
                if length != n:
                    raise RuntimeError(f"sent {n} bytes but the child received {length}")
                if attempt:
                    samples.append(arrived - start)
            medians.append(float(np.median(samples)))
        send(None)
        child.join(timeout)
    finally:
        if child.is_alive():
            child.kill()
    return medians


def _send_then_receive(conn, nbytes: int) -> None:
    conn.send(bytes(nbytes))
    conn.recv()


def pipe_send_send_finishes(nbytes: int, wait: float = 2.0) -> bool:
    """Two processes on a duplex Pipe both send `nbytes` first, then receive. True if both
    finish within `wait` s; False if they deadlock (each send waits for a reader)."""
    _refuse_in_kernel("pipe_send_send_finishes")
    fork = _fork()
    left, right = fork.Pipe()
    players = [
        fork.Process(target=_send_then_receive, args=(end, nbytes), daemon=True)
        for end in (left, right)
    ]
    for player in players:
        player.start()
    deadline = time.monotonic() + wait
    for player in players:
        player.join(max(0.0, deadline - time.monotonic()))
    finished = not any(player.is_alive() for player in players)
    for player in players:
        if player.is_alive():
            player.kill()
            player.join()
    return finished


def _count_down(n: int) -> None:
    """Pure-Python work: holds the GIL the whole time."""
    while n:
        n -= 1


def threads_vs_processes(n: int = 3_000_000, workers: int = 2) -> dict[str, float]:
    """Seconds to run `workers` pure-Python count-downs of `n`: one after another, in
    threads, and in processes. Threads take turns holding the GIL; processes do not."""
    _refuse_in_kernel("threads_vs_processes")
    fork = _fork()
    times = {}
    start = time.perf_counter()
    for _ in range(workers):
        _count_down(n)
    times["one after another"] = time.perf_counter() - start
    for name, make in (("threads", threading.Thread), ("processes", fork.Process)):
        runners = [make(target=_count_down, args=(n,)) for _ in range(workers)]
        start = time.perf_counter()
        for runner in runners:
            runner.start()
        for runner in runners:
            runner.join()
        times[name] = time.perf_counter() - start
    return times


# --- HOGWILD!: processes that update one shared model without locks ----------------------


def _sgd_steps(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, steps: int, lr: float, seed: int):
    """Least-squares SGD on `w` in place, batches of 16 drawn with `seed`. Each step reads w
    and writes it back with no lock: on shared memory, other processes write in between."""
    torch.set_num_threads(1)
    draw = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        rows = torch.randint(len(x), (16,), generator=draw)
        xb, yb = x[rows], y[rows]
        w.sub_(lr * 2 * xb.T @ (xb @ w - yb) / len(rows))


def hogwild(workers: int = 2, steps: int = 1000, lr: float = 0.02) -> dict[str, dict]:
    """HOGWILD! (Niu et al., 2011) on a least-squares problem: `workers` forked processes each
    take `steps` SGD steps on one weight vector in shared memory (`share_memory_()`), with no
    lock; against one process taking all workers * steps steps, and against the same forked
    processes on an ordinary tensor, which each changes in its own copy. Returns
    {run: {"seconds", "loss"}} and the loss at the start, {"start": {"loss"}}."""
    _refuse_in_kernel("hogwild")
    fork = _fork()
    draw = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 64, generator=draw)
    y = x @ torch.randn(64, generator=draw) + 0.1 * torch.randn(4096, generator=draw)

    def loss(w: torch.Tensor) -> float:
        return torch.mean((x @ w - y) ** 2).item()

    results = {"start": {"loss": loss(torch.zeros(64))}}
    w = torch.zeros(64)
    start = time.perf_counter()
    _sgd_steps(w, x, y, workers * steps, lr, seed=0)
    results["one process"] = {"seconds": time.perf_counter() - start, "loss": loss(w)}
    for name, w in (("HOGWILD", torch.zeros(64).share_memory_()), ("copies", torch.zeros(64))):
        children = [
            fork.Process(target=_sgd_steps, args=(w, x, y, steps, lr, k + 1))
            for k in range(workers)
        ]
        start = time.perf_counter()
        for child in children:
            child.start()
        for child in children:
            child.join()
        if any(child.exitcode for child in children):
            raise RuntimeError(
                f"{name}: a child process failed, exit codes "
                f"{[child.exitcode for child in children]}"
            )
        results[name] = {"seconds": time.perf_counter() - start, "loss": loss(w)}
    return results


# --- torch.distributed point-to-point -----------------------------------------------------


def ring_neighbours(rank: int, world_size: int) -> tuple[int, int]:
    """(next, previous): the ranks `rank` sends to and receives from on a ring of
    `world_size` ranks, the last rank's next being rank 0."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not one of {world_size} ranks")
    return (rank + 1) % world_size, (rank - 1) % world_size


def _sync() -> None:
    """Wait for the GPU, so that a clock read after a GPU call sees it finished."""
    if runtime.device().type == "cuda":
        torch.cuda.synchronize()


def p2p_message_times(
    sizes: Sequence[int], repeats: int = 3, src: int = 0, dst: int = 1
) -> list[float]:
    """Run on every rank: median one-way seconds for a uint8 tensor of each size (bytes) to
    go from rank `src` to rank `dst` with blocking `dist.send` / `dist.recv`. Same list on
    every rank."""
    me, device = dist.get_rank(), runtime.device()
    if src == dst or not (0 <= src < dist.get_world_size() and 0 <= dst < dist.get_world_size()):
        raise ValueError(f"src and dst must be two different ranks, got {src=} and {dst=}")
    # stamps[i, r] = (send started on src, message arrived on dst) for size i, attempt r
    stamps = torch.zeros(len(sizes), repeats + 1, 2, dtype=torch.float64, device=device)
    for i, n in enumerate(sizes):
        message = torch.zeros(n, dtype=torch.uint8, device=device)  # recv writes into it
        for attempt in range(repeats + 1):  # attempt 0 is a warm-up and is dropped
            dist.barrier()  # both ranks start each message together
            if me == src:
                stamps[i, attempt, 0] = time.perf_counter()
                dist.send(message, dst)
            elif me == dst:
                dist.recv(message, src)
                _sync()
                stamps[i, attempt, 1] = time.perf_counter()
    dist.all_reduce(stamps)  # src filled column 0, dst column 1, the others left zeros
    one_way = stamps[:, 1:, 1] - stamps[:, 1:, 0]
    return [float(np.median(row)) for row in one_way.cpu().numpy()]


def _matmul_steps(seconds: float) -> int:
    """How many 128x128 matmuls this rank does in about `seconds`, when it has a core alone."""
    a, steps = torch.randn(128, 128), 20
    start = time.perf_counter()
    for _ in range(steps):
        torch.mm(a, a)
    return max(1, round(steps * seconds / (time.perf_counter() - start)))


def overlap_times(
    nbytes: int,
    compute: str = "cpu",
    compute_s: float = 0.02,
    repeats: int = 3,
    src: int = 0,
    dst: int = 1,
) -> dict[str, float]:
    """Run on every rank: median seconds (slowest of src and dst) to compute alone, to move
    `nbytes` from src to dst alone, and to do both at once (isend/irecv, compute, wait).

    compute="cpu": matmuls on this rank's core (a fixed count, about `compute_s` when alone);
    "offloaded": `time.sleep(compute_s)`, standing for work done elsewhere (a GPU) that
    leaves the CPU free while the rank waits for it."""
    if compute not in ("cpu", "offloaded"):
        raise ValueError(f"compute must be 'cpu' or 'offloaded', got {compute!r}")
    me, device = dist.get_rank(), runtime.device()
    message = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    a = torch.randn(128, 128)  # on the CPU even under NCCL: "cpu" compute keeps the core busy
    steps = _matmul_steps(compute_s) if compute == "cpu" else 0

    def work() -> None:
        if compute == "offloaded":
            time.sleep(compute_s)
        for _ in range(steps):
            torch.mm(a, a)
        _sync()

    def start_transfer():  # -> a work handle, or None on ranks that take no part
        if me == src:
            return dist.isend(message, dst)
        if me == dst:
            return dist.irecv(message, src)
        return None

    def communicate() -> None:
        handle = start_transfer()
        if handle is not None:
            handle.wait()
        _sync()

    def overlapped() -> None:
        handle = start_transfer()  # the message travels in the background...
        work()  # ...while this rank computes
        if handle is not None:
            handle.wait()
        _sync()

    kinds = {"compute": work, "communicate": communicate, "overlapped": overlapped}
    seconds = torch.zeros(len(kinds), repeats + 1, dtype=torch.float64, device=device)
    for attempt in range(repeats + 1):  # attempt 0 is a warm-up and is dropped
        for k, run in enumerate(kinds.values()):
            dist.barrier()
            start = time.perf_counter()
            run()
            if me in (src, dst):
                seconds[k, attempt] = time.perf_counter() - start
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # a transfer ends when both ends are done
    medians = seconds[:, 1:].median(dim=1).values.cpu().tolist()
    return dict(zip(kinds, medians, strict=True))


# --- fitting and plotting -----------------------------------------------------------------


@dataclass(frozen=True)
class LinkFit:
    """t(n) = alpha + n * beta: latency `alpha` in seconds, `bandwidth` in bytes/s, and beta =
    1 / bandwidth the seconds per byte (the course's one notation, lecture 1 to the planner)."""

    alpha: float
    bandwidth: float

    @property
    def beta(self) -> float:
        """Seconds per byte."""
        return 1 / self.bandwidth

    def predict(self, nbytes: np.ndarray | Sequence[float] | float) -> np.ndarray:
        """Seconds the model predicts for messages of `nbytes` bytes."""
        return alpha_beta_time(np.asarray(nbytes, dtype=float), self.alpha, self.bandwidth)

    def __str__(self) -> str:
        return f"alpha = {1e6 * self.alpha:.1f} us, 1/beta = {self.bandwidth / 1e9:.2f} GB/s"


def fit_latency_bandwidth(sizes: Sequence[float], times: Sequence[float]) -> LinkFit:
    """Least-squares fit of t(n) = alpha + n * beta in relative error, so that the small
    messages (which set alpha) count as much as the large ones (which set beta)."""
    n, t = np.asarray(sizes, dtype=float), np.asarray(times, dtype=float)
    if n.shape != t.shape or n.size < 2 or np.ptp(n) == 0:
        raise ValueError("need times for at least two different sizes, one time per size")
    if np.any(t <= 0):
        raise ValueError(f"times must be positive seconds, got {t.tolist()}")
    # Minimise sum(((alpha + n * beta) - t) / t)^2: linear in (alpha, beta).
    rows = np.stack([1 / t, n / t], axis=1)
    (alpha, beta), *_ = np.linalg.lstsq(rows, np.ones_like(t), rcond=None)
    if alpha < 0:  # noise can push a tiny latency below zero; pin it at zero instead
        alpha, beta = 0.0, float(np.sum(n / t) / np.sum((n / t) ** 2))
    if beta <= 0:
        raise ValueError("the times do not grow with the size: no bandwidth to fit")
    return LinkFit(float(alpha), float(1 / beta))


def plot_message_times(ax, sizes: Sequence[int], times: Sequence[float], label: str) -> LinkFit:
    """Draw measured times (points) and the fitted alpha + n*beta (dashed line, same colour)
    on log-log axes; return the fit."""
    fit = fit_latency_bandwidth(sizes, times)
    (points,) = ax.loglog(sizes, times, "o", label=f"{label} (measured)")
    ax.loglog(sizes, fit.predict(sizes), "--", color=points.get_color(), label=f"{label}: {fit}")
    ax.set_xlabel("message size n (bytes)")
    ax.set_ylabel("one-way time (s)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    return fit


def plot_overlap(ax, seconds: dict[str, float]) -> None:
    """Bars, in ms: compute alone, communication alone, both overlapped, and the sum of the
    first two (what no overlap at all would cost)."""
    labels = [*seconds, "sum"]
    values = [*seconds.values(), seconds["compute"] + seconds["communicate"]]
    bars = ax.bar(labels, [1000 * v for v in values], color=["C0", "C1", "C2", "lightgray"])
    ax.bar_label(bars, fmt="%.0f ms")
    ax.set_ylabel("milliseconds")
    ax.tick_params(axis="x", labelsize="small")
