"""course_lib: the small library behind the distributed-training course notebooks.

    from course_lib import launch, rank, world_size, device, CommCounter

One module per topic: `launch` (workers from a notebook cell), `runtime` (who am I),
`comm` (counting bytes), `models` and `data` (seeded toy models and data), `compare`
(single-process references and parameter-by-parameter comparison), `magic` (the
`%%distributed` cell magic), `torchrun` (the same functions on a cluster), and the lectures'
plumbing: `pipes` (message costs, lecture 1), `collectives` (all-reduce algorithms and the
ring's schedule, lecture 2), `data_parallel` (host scheme, all-reduce DP, DDP timelines,
lecture 3), `memory` (bytes of weights, gradients, optimizer state and activations;
checkpointing, lecture 6), `sharding` (torch's DDP, ZeroRedundancyOptimizer and FSDP2 measured
against the ZeRO formulas; sharded checkpoints, lecture 7), `plots` (figures and widgets).
`grading` holds the assignments' checks.
"""

import sys

from course_lib.comm import CommCounter
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
    "LaunchError",
    "LaunchTimeout",
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
