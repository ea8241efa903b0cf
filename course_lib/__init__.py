"""course_lib: the small library behind the distributed-training course notebooks.

    from course_lib import launch, rank, world_size, device, CommCounter

One module per topic.

The machinery: `launch` (workers from a notebook cell), `runtime` (who am I), `comm` (counting
bytes: by the textbook algorithm, and as written to the sockets), `network` (an emulated slow
network and stragglers), `magic` (the `%%distributed` cell magic), `torchrun` (the same
functions on a cluster), `models` and `data` (seeded toy models and data), `compare`
(single-process references, parameter-by-parameter comparison), `plots` (figures and widgets),
`progress` (progress bars for long loops, drawn in the notebook even for rank 0's loops),
`grading` (the assignments' checks, and how autograding runs them: a judge that never runs
student code, a sandbox), `counted_group` (the process group of grading ranks, which reports
every call to `comm`), `_integrity` (has a rank's code changed the libraries the checks
measure with?).

`costs`: every cost model (alpha-beta time, collective volumes, ZeRO and activation memory,
the bubble, TP/PP/CP/EP traffic), one function each, shared by lectures, planner and checks.

The launcher's parts, one module each (besides `_zygote`, the fork server, and `_worker`, a
rank):
- `pool`: `WorkerPool`, warm ranks reused call after call;
- `calls`: one call: the function pickled by value, the ranks' answers gathered;
- `errors`: what a failed call raises, and the messages that say where each rank was;
- `rank_process`: the launcher's handle on one rank's process, and its start methods;
- `protocol`: the messages between the launcher, the fork server and the ranks.

The lectures' plumbing, one module each (a package of files, where one file would be too long
to read: `data_parallel`, `compression`, `pipeline`, `parallel_3d`):
- `processes` (1): message costs over pipes and gloo;
- `collectives` (2): all-reduce algorithms and the ring's schedule;
- `data_parallel` (3): host scheme, all-reduce DP, DDP timelines, accumulation, local SGD;
- `gossip` (4): topologies, gossip averaging, push-sum (in one process, and asynchronous), group
  all-reduce;
- `compression` (5): torch's 8-bit quantization, error feedback, majority vote, PowerSGD's formulas;
- `memory` (6): bytes of weights, gradients, optimizer state and activations; checkpointing;
- `zero` (7): torch's ZeRO-1 and FSDP2 against the ZeRO formulas; sharded checkpoints;
- `pipeline` (8): schedules and their bubble, a real GPipe/1F1B pipeline, stage partition;
- `tensor_parallel` (9): Megatron layers, their traffic and activation memory;
- `parallel_3d` (10): the grid of ranks and its groups, a TP x PP x DP planner;
- `sequence_parallel` (11): ring attention, Ulysses, Megatron's sequence parallelism;
- `expert_parallel` (12): a top-k router with capacity, experts on ranks via all-to-all;
- `fault_tolerance` (13): restarts from sharded checkpoints, async saves, a watchdog.

What a lecture measures and draws, where that is long, is in `measure/<topic>.py` (or
`measure/<topic>/`), and so are the checks of its exercises, which compute the expected value
off the page.
"""

import sys

from course_lib.calls import PerRank
from course_lib.comm import CommCounter, WireCounter
from course_lib.launch import (
    LaunchError,
    LaunchTimeout,
    RankError,
    WorkerDied,
    WorkerPool,
    launch,
    shutdown,
)
from course_lib.magic import load_ipython_extension
from course_lib.runtime import device, local_rank, rank, world_size

__all__ = [
    "CommCounter",
    "WireCounter",
    "LaunchError",
    "LaunchTimeout",
    "PerRank",
    "RankError",
    "WorkerDied",
    "WorkerPool",
    "device",
    "launch",
    "load_ipython_extension",
    "local_rank",
    "rank",
    "shutdown",
    "world_size",
]


def _register_magic() -> None:
    """Make `%%distributed` available as soon as a notebook imports course_lib."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is not None:
        load_ipython_extension(shell)


_register_magic()
