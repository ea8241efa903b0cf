"""Running torchrun from a notebook: one agent, several (as the nodes of one job) or several
jobs at once, under a timeout that kills every agent and worker, and the arguments of two
nodes on one machine."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass
class TorchrunResult:
    returncode: int
    output: str  # stdout and stderr of the agent and its workers, interleaved
    seconds: float  # from the start of all agents to this one's end


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
    return _run([(agent_args, args) for agent_args in agents_args], target, timeout)


def run_jobs(
    jobs: Mapping[str, tuple[list[list[str]], Sequence[object]]],
    target: str,
    timeout: float = 120.0,
) -> dict[str, list[TorchrunResult]]:
    """Several torchrun jobs at once, each {name: (its agents' arguments, its arguments for
    `target`)}, as `run_agents` runs one: the jobs' waits (a rendezvous timeout, say) overlap.
    Returns each job's results, one per agent."""
    results = _run([(a, args) for agents, args in jobs.values() for a in agents], target, timeout)
    out, first = {}, 0
    for name, (agents, _) in jobs.items():
        out[name], first = results[first : first + len(agents)], first + len(agents)
    return out


def _run(
    agents: list[tuple[list[str], Sequence[object]]], target: str, timeout: float
) -> list[TorchrunResult]:
    """Start an agent for each (torchrun arguments, arguments of `target`), wait for all."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    start, deadline = time.perf_counter(), time.monotonic() + timeout
    # Output goes to files, not pipes: a worker that outlives its agent would hold a pipe
    # open, and reading it to the end would wait forever.
    outs = [tempfile.TemporaryFile("w+") for _ in agents]
    processes = []
    try:
        for (agent_args, args), out in zip(agents, outs, strict=True):
            command = [sys.executable, "-m", "torch.distributed.run", *agent_args, "-m"]
            command += ["course_lib.torchrun", target, *map(str, args)]
            processes.append(
                subprocess.Popen(
                    command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
                )
            )
        # Poll them all, so that each agent's time is when it ended, not when it was reaped.
        seconds: list[float | None] = [None] * len(processes)
        while None in seconds:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(command, timeout)
            for i, process in enumerate(processes):
                if seconds[i] is None and process.poll() is not None:
                    seconds[i] = time.perf_counter() - start
            time.sleep(0.05)
    except subprocess.TimeoutExpired:
        ended = [process.poll() for process in processes]  # an agent that failed leaves the
        for process in processes:  # others waiting for it at torchrun's exit barrier
            _kill_tree(process.pid)
            process.wait()
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
        for process in processes:  # an error while starting the second agent: stop the first
            if process.poll() is None:
                _kill_tree(process.pid)
                process.wait()
        texts = [_read(out) for out in outs]
        for out in outs:
            out.close()
    return [
        TorchrunResult(p.returncode, text, s)
        for p, text, s in zip(processes, texts, seconds, strict=True)
    ]


def _read(out) -> str:
    out.seek(0)
    return out.read()


def free_port() -> int:
    """A TCP port no one listens on now (the OS picks it), for a rendezvous endpoint."""
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """`n` different TCP ports no one listens on now: all held open while the OS picks, so
    that it cannot pick one twice."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def two_node_args(
    port: int,
    nproc_per_node: int = 1,
    nnodes: str = "2",
    max_restarts: int = 0,
    **rdzv_conf: float,
) -> list[list[str]]:
    """torchrun arguments of two agents on this machine, as two nodes meeting through the c10d
    rendezvous at 127.0.0.1:`port`. Under c10d the rendezvous numbers the nodes itself, by
    address and then process id (--node-rank would be ignored): agent 0, started first, has
    the lower process id and is node 0. Agent 0 also hosts the rendezvous store (is_host): if
    it dies, so does the rendezvous. `nnodes` is a number or an elastic range ("1:2");
    `rdzv_conf` adds rendezvous settings (join_timeout, last_call_timeout,
    keep_alive_interval, keep_alive_max_attempt: seconds)."""
    extra = "".join(f",{key}={value:g}" for key, value in rdzv_conf.items())
    return [
        [
            "--nnodes",
            nnodes,
            "--nproc-per-node",
            str(nproc_per_node),
            "--max-restarts",
            str(max_restarts),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            f"course-{port}",
            "--rdzv-conf",
            f"is_host={int(node == 0)}{extra}",
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
