"""Lecture 2's measurements on ranks: whom a rank talks to (`record_peers`), how long one
all-reduce takes (`time_all_reduce`, on an emulated network with `network=`), and each
algorithm timed on this machine's loopback against the alpha-beta model
(`time_against_model`)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from course_lib.collectives import (
    ALGORITHMS,
    bytes_sent,
    model_seconds,
)
from course_lib.launch import launch
from course_lib.network import SlowNetwork

# --- measuring: who talks to whom, and how long it takes ---------------------------------


_peer_depth = threading.local()  # dist.send calls dist.isend: count the outer call only


@contextmanager
def record_peers() -> Iterator[Counter]:
    """Count, by peer rank, the messages this rank sends or receives while the block runs
    (calls through `dist.send/recv/isend/irecv`): `{peer: messages}`."""
    peers: Counter = Counter()
    # Wrap both namespaces, as CommCounter does, so that the two nest in either order.
    originals = {op: getattr(c10d, op) for op in ("send", "recv", "isend", "irecv")}

    def recorder(op: str, original: Callable) -> Callable:
        peer_arg = "dst" if "send" in op else "src"

        def recorded(tensor, *args, **kwargs):
            depth = getattr(_peer_depth, "value", 0)
            if depth == 0:
                peers[kwargs.get(peer_arg, args[0] if args else None)] += 1
            _peer_depth.value = depth + 1
            try:
                return original(tensor, *args, **kwargs)
            finally:
                _peer_depth.value = depth

        return recorded

    for op, original in originals.items():
        wrapped = recorder(op, original)
        setattr(c10d, op, wrapped)
        setattr(dist, op, wrapped)
    try:
        yield peers
    finally:
        for op, original in originals.items():
            setattr(c10d, op, original)
            setattr(dist, op, original)


def time_all_reduce(
    algorithm: str | Callable[[torch.Tensor], torch.Tensor],
    numel: int,
    repeats: int = 5,
    network: dict | None = None,
) -> float:
    """On each rank: median seconds of `repeats` all-reduces of `numel` float32s with
    `algorithm` (a name in ALGORITHMS, "torch" for dist.all_reduce, or a function such as
    `two_level_all_reduce`), after one warm-up.
    With `network` (`SlowNetwork`'s keyword arguments), each runs on that emulated network:
    message by message for the algorithms built here, by the model for torch's own."""
    if callable(algorithm):
        run = algorithm
    else:
        run = dist.all_reduce if algorithm == "torch" else ALGORITHMS[algorithm]
    tensor = torch.ones(numel)
    run(tensor)  # warm-up: first-touch memory and connection set-up are not the algorithm
    times = []
    for _ in range(repeats):
        dist.barrier()  # start together, so no rank's time includes waiting for a late one
        start = time.perf_counter()
        with SlowNetwork(**network) if network is not None else nullcontext():
            run(tensor)
        dist.barrier()  # the all-reduce is done when the slowest rank is done
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def time_against_model(
    numel: int, world_size: int, alpha: float, beta: float, repeats: int = 7
) -> tuple[dict[str, float], dict[str, float]]:
    """Time one all-reduce of `numel` float32s on `world_size` ranks of this machine (torch's
    own, then each algorithm: the slowest rank's median of `repeats`), print it next to the
    alpha-beta model's time and the bytes all ranks send together, and return
    ({name: measured seconds}, {name: model seconds})."""
    measured, model = {}, {}
    link = f"model, {8 / beta / 1e9:g} Gbit/s"
    print(f"{'algorithm':<17} {'measured here':>14} {link:>17} {'all ranks send':>15}")
    for name in ["torch", *ALGORITHMS]:
        measured[name] = max(launch(time_all_reduce, name, numel, repeats, world_size=world_size))
        if name == "torch":  # gloo's own: no model of ours, no count of its bytes
            print(f"{name:<17} {1000 * measured[name]:11.0f} ms")
            continue
        model[name] = model_seconds(name, numel, world_size, alpha, beta)
        total = sum(bytes_sent(name, numel, world_size, r) for r in range(world_size))
        print(
            f"{name:<17} {1000 * measured[name]:11.0f} ms {1000 * model[name]:14.0f} ms "
            f"{total / (4 * numel):13.0f} N"
        )
    return measured, model
