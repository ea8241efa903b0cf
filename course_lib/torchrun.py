"""Run a course function under torchrun, unchanged: on a cluster, or on one CPU machine.

    torchrun --standalone --nproc-per-node 2 -m course_lib.torchrun examples/hello.py:main 8

torchrun starts the processes and sets RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous;
this entry point joins the process group (NCCL with one GPU per local rank when there are
GPUs, else gloo), calls the function with the extra arguments, prints what it returned, and
leaves the group. Inside the function, `course_lib.rank()`, `world_size()` and `device()`
answer exactly as they do under `course_lib.launch`.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import os
import runpy
import sys
from collections.abc import Callable

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
