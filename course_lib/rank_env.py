"""What the launcher gives each rank it starts: where to meet the others (the pool's store), its
limits, and the environment variables torchrun would set (RANK, WORLD_SIZE, MASTER_ADDR, ...),
so that the same user code runs under `launch` and under `torchrun`."""

from __future__ import annotations

import os
from collections.abc import Iterable

from course_lib.backends import loopback_interface

PG_TIMEOUT_S = 3600  # torch.distributed's own timeout; the launcher's timeout comes first


def rank_spec(
    rank: int,
    world_size: int,
    backend: str,
    port: int,
    *,
    stack_file: str,
    untrusted: bool,
    preload: Iterable[str],
) -> dict:
    """Everything rank `rank` needs to start (`rank_process.RankProcess` sends it over)."""
    return {
        "rank": rank,
        "world_size": world_size,
        "backend": backend,
        "store_host": "127.0.0.1",
        "store_port": port,
        "stack_file": stack_file,
        "pg_timeout_s": PG_TIMEOUT_S,
        "untrusted": untrusted,
        "preload": list(preload),
        "env": rank_environment(rank, world_size, backend, port),
    }


def rank_environment(rank: int, world_size: int, backend: str, port: int) -> dict[str, str]:
    """What rank `rank` adds to its environment (torchrun's variables, and more)."""
    env = {
        "COURSE_LIB_WORKER": "1",
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    if backend == "nccl":
        # NCCL collectives return before they run, so a hang would show up later, at some
        # unrelated line. Blocking wait makes a collective's wait() (which every call
        # without async_op=True makes) hold the rank until it completes, as gloo does:
        # a hung rank's stack then points at the collective itself.
        env["TORCH_NCCL_BLOCKING_WAIT"] = "1"
    loopback = loopback_interface()
    if loopback:  # gloo and NCCL would otherwise listen on the host's public address
        env["GLOO_SOCKET_IFNAME"] = os.environ.get("GLOO_SOCKET_IFNAME", loopback)
        env["NCCL_SOCKET_IFNAME"] = os.environ.get("NCCL_SOCKET_IFNAME", loopback)
    return env
