"""Training that survives failures (lecture 13): restart from sharded checkpoints, save them
without stopping, and name the rank that is slow or stuck.

    train(directory, steps=24, every=5, kill_at=13)     # on every rank, under torchrun or launch
    result = run_torchrun(["--standalone", "--nproc-per-node", "2", "--max-restarts", "1"],
                          "course_lib.fault_tolerance:train", directory, 24, 5, 13)
    loss_log(directory)                                 # (attempt, step, loss) rows of rank 0
    saver = AsyncCheckpointer(); saver.save(local_state(model, optimizer), path); saver.wait()
    guarded_all_reduce(tensor, step, timeout_s=2.0)  # heartbeat, then names a missing rank
    slowest_rank(compute_seconds)                       # the straggler, from per-rank timings

A failed rank cannot be repaired in place: the job stops, torchrun's agent starts every
process again (TORCHELASTIC_RESTART_COUNT counts the attempts), and each rank reloads its own
shard of the last complete checkpoint (`zero.save_sharded` / `zero.load_sharded`, lecture 7).
The batches are a function of the step, so the steps redone after a restart compute exactly
what they computed the first time: the loss curve of an interrupted run is the loss curve of
an uninterrupted one.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from course_lib import data, models
from course_lib.runtime import rank, world_size
from course_lib.zero import build, load_sharded, local, measured_step, save_sharded

CONFIG = models.GPTConfig()  # the tiny GPT of every lecture: a step takes milliseconds
BATCH = 8  # sequences per step, split over the ranks
LOG = "losses.jsonl"


def restart_count() -> int:
    """Which attempt this is: 0 the first time, 1 after torchrun's first restart, ..."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


def latest_checkpoint(directory: str) -> tuple[int, str] | None:
    """(step, path) of the newest complete checkpoint in `directory`, or None. DCP writes a
    checkpoint's `.metadata` last, once every rank's shard is on disk: a checkpoint cut
    short by a crash has none, and is skipped."""
    done = [
        name
        for name in os.listdir(directory)
        if name.startswith("step_") and os.path.exists(os.path.join(directory, name, ".metadata"))
    ]
    if not done:
        return None
    name = max(done)
    return int(name.removeprefix("step_")), os.path.join(directory, name)


def train(
    directory: str, steps: int = 24, every: int = 5, kill_at: int | None = None, kill_rank: int = 1
) -> list[float]:
    """Train the tiny GPT with ZeRO-3 (FSDP2) on every rank, checkpointing after every
    `every` steps into `directory`, resuming from the newest checkpoint there. On the first
    attempt only, rank `kill_rank` dies at step `kill_at` (os._exit: no exception, no
    clean-up, as when a node loses power). Rank 0 appends each step's loss to `LOG`."""
    os.makedirs(directory, exist_ok=True)
    model = models.TinyGPT(CONFIG, seed=0)
    model, optimizer = build("zero3", model, lr=1e-2)
    x, y = data.tokens(256, CONFIG.seq_len, CONFIG.vocab_size, seed=0)
    batches = data.batches(x, y, BATCH, steps, seed=1)  # batch i depends on i only
    start, found = 0, latest_checkpoint(directory)
    if found:
        saved_step, path = found
        load_sharded(model, optimizer, path)  # every rank reads its own shard back
        start = saved_step + 1
    losses = []
    for step in range(start, steps):
        if step == kill_at and rank() == kill_rank and restart_count() == 0:
            os._exit(1)
        loss, _ = measured_step(model, optimizer, *batches[step])
        mean = torch.tensor(loss)
        dist.all_reduce(mean)  # the job's loss: the mean of the ranks' shards
        losses.append(mean.item() / world_size())
        if rank() == 0:
            row = {"attempt": restart_count(), "step": step, "loss": losses[-1]}
            with open(os.path.join(directory, LOG), "a") as log:
                log.write(json.dumps(row) + "\n")
        if (step + 1) % every == 0:
            save_sharded(model, optimizer, os.path.join(directory, f"step_{step:05d}"))
    return losses


def loss_log(directory: str) -> list[dict]:
    """Rank 0's loss log: one {"attempt", "step", "loss"} per step, in the order written."""
    with open(os.path.join(directory, LOG)) as log:
        return [json.loads(line) for line in log]


# --- running torchrun from a notebook ---------------------------------------------------------


@dataclass
class TorchrunResult:
    returncode: int
    output: str  # stdout and stderr of the agent and its workers, interleaved
    seconds: float


def run_torchrun(
    torchrun_args: list[str], target: str, *args: object, timeout: float = 120.0
) -> TorchrunResult:
    """Run `target` (MODULE:FUNCTION) under torchrun with `torchrun_args`, through
    `course_lib.torchrun`, and wait at most `timeout` seconds (then kill it and raise)."""
    return run_agents([torchrun_args], target, *args, timeout=timeout)[0]


def run_agents(
    agents_args: list[list[str]], target: str, *args: object, timeout: float = 120.0
) -> list[TorchrunResult]:
    """Start one torchrun agent per list of arguments in `agents_args`, all at once (as the
    nodes of one job would start), each running `target`; wait at most `timeout` seconds for
    all of them. On a timeout every agent and every worker is killed: nothing is left."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    start, deadline = time.perf_counter(), time.monotonic() + timeout
    # Output goes to files, not pipes: a worker that outlives its agent would hold a pipe
    # open, and reading it to the end would wait forever.
    outs = [tempfile.TemporaryFile("w+") for _ in agents_args]
    agents = []
    try:
        for agent_args, out in zip(agents_args, outs, strict=True):
            command = [sys.executable, "-m", "torch.distributed.run", *agent_args, "-m"]
            command += ["course_lib.torchrun", target, *map(str, args)]
            agents.append(
                subprocess.Popen(
                    command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
                )
            )
        seconds = []
        for agent in agents:
            agent.wait(timeout=max(0.0, deadline - time.monotonic()))
            seconds.append(time.perf_counter() - start)
    except subprocess.TimeoutExpired:
        ended = [agent.poll() for agent in agents]  # an agent that failed leaves the others
        for agent in agents:  # waiting for it at torchrun's exit barrier
            _kill_tree(agent.pid)
            agent.wait()
        said = "\n".join(
            f"--- agent {i} ({'still running' if code is None else f'exit code {code}'}):\n"
            f"{_read(out)[-3000:]}"
            for i, (code, out) in enumerate(zip(ended, outs, strict=True))
        )
        raise TimeoutError(
            f"torchrun did not finish within {timeout:g} s; its agents and workers were "
            f"killed. What each agent printed:\n{said}"
        ) from None
    finally:
        for agent in agents:  # an error while starting the second agent: stop the first
            if agent.poll() is None:
                _kill_tree(agent.pid)
                agent.wait()
        texts = [_read(out) for out in outs]
        for out in outs:
            out.close()
    return [
        TorchrunResult(a.returncode, text, s)
        for a, text, s in zip(agents, texts, seconds, strict=True)
    ]


def _read(out) -> str:
    out.seek(0)
    return out.read()


def free_port() -> int:
    """A TCP port no one listens on now (the OS picks it), for a rendezvous endpoint."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_node_args(port: int, nproc_per_node: int = 1) -> list[list[str]]:
    """torchrun arguments of two agents on this machine, as two nodes meeting through the c10d
    rendezvous at 127.0.0.1:`port`. Under c10d the agents are ranked as they arrive
    (--node-rank would be ignored); the first one hosts the rendezvous store (is_host)."""
    return [
        [
            "--nnodes",
            "2",
            "--nproc-per-node",
            str(nproc_per_node),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            f"course-{port}",
            "--rdzv-conf",
            f"is_host={int(node == 0)}",
            "--monitor-interval",
            "0.1",
        ]  # fmt: skip
        for node in range(2)
    ]


def _kill_tree(pid: int) -> None:
    """SIGKILL `pid` and every process below it. torchrun starts each worker in a session of
    its own, so killing the agent's process group would leave the workers running."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    tree, i = [pid], 0
    while i < len(tree):
        tree += children.get(tree[i], [])
        i += 1
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


# --- asynchronous sharded checkpoints ---------------------------------------------------------


def local_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """This rank's shard of the parameters and optimizer state, as plain tensors: what it
    writes to its own file."""
    state = {f"model.{k}": local(v) for k, v in model.state_dict().items()}
    for i, per_param in optimizer.state_dict()["state"].items():
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor):
                state[f"optimizer.{i}.{key}"] = local(value)
    return state


class AsyncCheckpointer:
    """Saves a state dict in a background thread. `save` only copies the tensors (the copy
    must be taken now: the next optimizer step changes the tensors in place) and returns;
    the thread writes the copy while training goes on. One save is in flight at a time: the
    next `save` first waits for the previous one."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def save(self, state: dict[str, torch.Tensor], path: str) -> None:
        self.wait()
        # On a GPU this is the device-to-host copy into pinned memory; on the CPU a clone.
        staged = {name: tensor.detach().clone() for name, tensor in state.items()}
        self._thread = threading.Thread(target=self._write, args=(staged, path), daemon=True)
        self._thread.start()

    def _write(self, staged: dict[str, torch.Tensor], path: str) -> None:
        try:
            save_file(staged, path)
        except BaseException as error:  # reported by the next wait(), in the training thread
            self._error = error

    def wait(self) -> None:
        """Block until the save in flight is on disk; raise if writing it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"rank {rank()}: writing a checkpoint failed: {error}") from error


def save_file(state: dict[str, torch.Tensor], path: str) -> None:
    """Write `state` to `path` and make it durable: write a temporary file, fsync it, then
    rename, so that a crash leaves the old file or the new one, never half of one."""
    partial = f"{path}.partial"
    with open(partial, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)


# --- a watchdog: who is slow, who never came ---------------------------------------------------


def _store() -> dist.Store:
    # The store the ranks met through (torchrun's or launch's): a small key-value server that
    # still answers when a collective hangs.
    return dist.distributed_c10d._get_default_store()


def heartbeat(step: int, compute_s: float = 0.0) -> None:
    """Tell the store: this rank reached step `step`'s collective after `compute_s` seconds
    of its own work."""
    _store().set(f"heartbeat/{rank()}", json.dumps([step, compute_s, time.time()]))


def heartbeats() -> dict[int, tuple[int, float, float]]:
    """rank -> (step, compute seconds, time) of its last heartbeat (ranks that never sent
    one are missing)."""
    keys = [f"heartbeat/{r}" for r in range(world_size())]
    seen = [r for r, key in enumerate(keys) if _store().check([key])]
    return {r: tuple(json.loads(_store().get(keys[r]))) for r in seen}


def missing_ranks(beats: dict[int, tuple], step: int, world: int) -> list[int]:
    """The ranks whose last heartbeat is older than `step`: those not at its collective."""
    return [r for r in range(world) if r not in beats or beats[r][0] < step]


class HungRank(RuntimeError):
    """A collective did not complete in time; `ranks` never arrived at it."""

    def __init__(self, message: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = ranks


def guarded_all_reduce(
    tensor: torch.Tensor, step: int, timeout_s: float = 5.0, compute_s: float = 0.0
) -> None:
    """Send this rank's heartbeat (step `step`, `compute_s` seconds of work), then all-reduce
    `tensor` (sum), but give up after `timeout_s` seconds and raise `HungRank` naming the ranks
    that never reached step `step` (from their heartbeats). A production job would then exit,
    and torchrun would restart it without the bad node."""
    heartbeat(step, compute_s)
    work = dist.all_reduce(tensor, async_op=True)
    try:
        work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError:
        beats = heartbeats()
        missing = missing_ranks(beats, step, world_size())
        seen = {r: f"step {beats[r][0]}" if r in beats else "never" for r in missing}
        raise HungRank(
            f"rank {rank()}, step {step}: the all-reduce did not complete in {timeout_s:g} s; "
            + ", ".join(f"rank {r} never arrived (last heartbeat: {s})" for r, s in seen.items()),
            missing,
        ) from None


def slowest_rank(compute_seconds: list[list[float]], factor: float = 1.5) -> int | None:
    """The straggler: the rank whose median compute time per step (compute_seconds[rank] is
    one time per step) exceeds `factor` times the median of all ranks' medians, or None. A
    median, so that one slow step (a page fault, a log write) does not brand a rank."""
    medians = [torch.tensor(times).median().item() for times in compute_seconds]
    typical = torch.tensor(medians).median().item()
    worst = max(range(len(medians)), key=medians.__getitem__)
    return worst if medians[worst] > factor * typical else None
