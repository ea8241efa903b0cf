"""Running torchrun from a notebook: one agent or several (as the nodes of one job), under a
timeout that kills every agent and worker, and the arguments of two nodes on one machine."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass


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
