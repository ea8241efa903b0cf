"""Run a course function under torchrun, unchanged: on a cluster, or on one CPU machine.

    torchrun --standalone --nproc-per-node 2 -m course_lib.torchrun examples/hello.py:main 8
    srun -n 2 python -m course_lib.torchrun examples/hello.py:main 8    # Slurm, no torchrun

torchrun starts the processes and sets RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous; under
a bare `srun` (one task per process) they come from Slurm's variables (`slurm_environment`).
This entry point joins the process group (NCCL with one GPU per local rank when there are
GPUs, else gloo), calls the function with the extra arguments, prints what it returned, and
leaves the group. Inside the function, `course_lib.rank()`, `world_size()` and `device()`
answer exactly as they do under `course_lib.launch`.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import os
import re
import runpy
import subprocess
import sys
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist

from course_lib import runtime


def load_function(target: str) -> Callable:
    """'path/to/file.py:name' or 'package.module:name' -> the function. A file is run under a
    name other than __main__, so its `if __name__ == "__main__":` block does not launch."""
    where, _, name = target.rpartition(":")
    if not where or not name:
        raise SystemExit(f"expected FILE.py:FUNCTION or MODULE:FUNCTION, got {target!r}")
    if where.endswith(".py"):
        namespace = runpy.run_path(where, run_name="__course_lib_torchrun__")
    else:
        namespace = vars(importlib.import_module(where))
    if name not in namespace:
        raise SystemExit(f"{where} has no function {name!r}")
    return namespace[name]


def choose_backend(backend: str, local_world_size: int, gpus: int) -> str:
    """The backend, "gloo" or "nccl", of every process on one machine: NCCL only when the
    machine has a GPU for each of its processes. Decided from what all of them see alike
    (never from a process's own LOCAL_RANK): were some to choose NCCL and others gloo,
    start-up would hang."""
    if backend == "auto":
        return "nccl" if gpus >= local_world_size else "gloo"
    if backend == "nccl" and gpus < local_world_size:
        raise SystemExit(
            f"--backend nccl needs one GPU per process: {local_world_size} processes on this "
            f"machine, {gpus} GPU{'s' if gpus != 1 else ''} visible. Use --backend gloo or "
            f"--nproc-per-node {gpus}."
        )
    return backend


def init_from_env(backend: str = "auto") -> str:
    """Join the process group torchrun describes in the environment; return the backend."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = choose_backend(backend, local_world_size, gpus)
    where = attempt_store()
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device, **where)
    else:
        dist.init_process_group("gloo", **where)
    return backend


def attempt_store() -> dict:
    """init_process_group's store arguments for this attempt of a restarted job ({} for the
    default env:// rendezvous). torchrun's agent keeps one store across restarts, so the
    addresses the dead attempt's ranks published are still in it under the same keys: a rank
    that reads a dead peer's address before the live one overwrote it connects to nothing and
    hangs in gloo's connectFullMesh. Keys under a prefix of the attempt's own avoid that."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if attempt == "0" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    return {
        "store": dist.PrefixStore(f"attempt_{attempt}", agent),
        "rank": int(os.environ["RANK"]),
        "world_size": int(os.environ["WORLD_SIZE"]),
    }


def slurm_environment(env: Mapping[str, str]) -> dict[str, str]:
    """What torchrun would have set, from what `srun` sets for each task, when srun started
    this process directly (one task per process) and torchrun did not: {} otherwise, and in a
    batch script's own process, which Slurm gives SLURM_PROCID and SLURM_NTASKS too but no
    step: it runs alone. Rank 0's node, the first of the step's nodes, holds the rendezvous,
    on MASTER_PORT if set, else on a port taken from the job and step ids, so every task of a
    step finds the same one and two steps of one job do not meet."""
    if "RANK" in env or "SLURM_PROCID" not in env or "SLURM_STEP_NUM_TASKS" not in env:
        return {}
    per_node = tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE", env["SLURM_TASKS_PER_NODE"]))
    job, step = int(env.get("SLURM_JOB_ID", 0)), int(env.get("SLURM_STEP_ID", 0))
    nodes = env.get("SLURM_STEP_NODELIST", env.get("SLURM_JOB_NODELIST", "localhost"))
    return {
        "RANK": env["SLURM_PROCID"],
        "WORLD_SIZE": env["SLURM_STEP_NUM_TASKS"],
        "LOCAL_RANK": env["SLURM_LOCALID"],
        "LOCAL_WORLD_SIZE": str(per_node[int(env.get("SLURM_NODEID", 0))]),
        "MASTER_ADDR": env.get("MASTER_ADDR") or first_host(nodes),
        # 20000-31999: below the kernel's ephemeral ports (32768 on), which a TCP client may
        # already hold; Slurm's own daemons listen on 6817-6818 by default.
        "MASTER_PORT": env.get("MASTER_PORT") or str(20000 + (100 * job + step) % 12000),
    }


def tasks_per_node(spec: str) -> list[int]:
    """Slurm's tasks per node, "2(x3),1" -> [2, 2, 2, 1]."""
    counts = []
    for part in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise ValueError(f"unexpected Slurm tasks per node: {spec!r}")
        counts += [int(match[1])] * int(match[2] or 1)
    return counts


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list ("gpu[03-04],cpu1" -> "gpu03"): `scontrol` expands
    the bracketed ranges; a plain list needs no help."""
    if "[" not in nodelist:
        return nodelist.split(",")[0]
    hosts = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True
    )
    return hosts.stdout.split()[0]


def _literal(text: str) -> object:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", help="FILE.py:FUNCTION or MODULE:FUNCTION")
    parser.add_argument("args", nargs="*", help="arguments for the function (Python literals)")
    parser.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    options = parser.parse_args(argv)
    fn = load_function(options.target)
    os.environ.update(slurm_environment(os.environ))
    init_from_env(options.backend)
    try:
        result = fn(*[_literal(a) for a in options.args])
        if result is not None:
            print(f"[rank {runtime.rank()}] returned {result!r}", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Leave without Python's clean-up. A gloo thread may still hold the last collective's
    # tensors when the function returns, and frees them as soon as it gets the GIL; if that
    # happens while the interpreter shuts down, the thread is killed inside C++ and the
    # process aborts ("terminate called without an active exception", exit code -6) after
    # its work is done: 2 runs in 8 of two torchrun agents on this machine. torchrun then
    # reports the job as failed, and the other node waits out its exit barrier.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
