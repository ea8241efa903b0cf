"""Training that survives failures (lecture 13): restart from sharded checkpoints, save them
without stopping, and name the rank that is slow or stuck.

    train(directory, steps=24, every=5, kill_at=13)     # on every rank, under torchrun or launch
    result = run_torchrun(["--standalone", "--nproc-per-node", "2", "--max-restarts", "1"],
                          "course_lib.fault_tolerance:train", directory, 24, 5, 13)
    loss_log(directory)                                 # (attempt, step, loss) rows of rank 0
    train_async(directory, 24, 5)                       # async checkpoints, a commit marker
    latest_checkpoint(directory, COMMITTED)             # the newest committed one
    saver = AsyncCheckpointer(); saver.save(local_state(model, optimizer), path); saver.wait()
    guarded_all_reduce(tensor, step, timeout_s=2.0)  # heartbeat, then names a missing rank
    slowest_rank(compute_seconds)                       # the straggler, from per-rank timings

A failed rank cannot be repaired in place: the job stops, torchrun's agent starts every
process again (TORCHELASTIC_RESTART_COUNT counts the attempts), and each rank reloads its own
shard of the last complete checkpoint (`zero.save_sharded` / `zero.load_sharded`, lecture 7).
The batches are a function of the step, so the steps redone after a restart compute exactly
what they computed the first time: the loss curve of an interrupted run is the loss curve of
an uninterrupted one.

By what a reader looks for:

    restart.py       train with sharded checkpoints; resume from the newest complete one
    checkpoints.py   asynchronous checkpoints of each rank's shard, durable files, the
                     commit marker that says every rank's file of a checkpoint is whole
    jobs.py          torchrun from a notebook: one agent, two nodes or two jobs at once,
                     under a timeout
    watchdog.py      heartbeats, a deadline that names the missing rank, the straggler

Import from `course_lib.fault_tolerance` itself: every public name is here.
"""

from course_lib.fault_tolerance.checkpoints import (
    COMMITTED,
    AsyncCheckpointer,
    commit,
    durable_write,
    load_local_state,
    local_state,
    save_file,
)
from course_lib.fault_tolerance.jobs import (
    TorchrunResult,
    free_port,
    free_ports,
    run_agents,
    run_jobs,
    run_torchrun,
    two_node_args,
)
from course_lib.fault_tolerance.restart import (
    BATCH,
    CONFIG,
    LOG,
    latest_checkpoint,
    lose_node,
    loss_log,
    restart_count,
    train,
    train_async,
)
from course_lib.fault_tolerance.watchdog import (
    HungRank,
    guarded_all_reduce,
    heartbeat,
    heartbeats,
    missing_ranks,
    slowest_rank,
)

__all__ = [
    "BATCH",
    "CONFIG",
    "LOG",
    "COMMITTED",
    "AsyncCheckpointer",
    "HungRank",
    "TorchrunResult",
    "commit",
    "durable_write",
    "free_port",
    "free_ports",
    "guarded_all_reduce",
    "heartbeat",
    "heartbeats",
    "latest_checkpoint",
    "load_local_state",
    "local_state",
    "lose_node",
    "loss_log",
    "missing_ranks",
    "restart_count",
    "run_agents",
    "run_jobs",
    "run_torchrun",
    "save_file",
    "slowest_rank",
    "train",
    "train_async",
    "two_node_args",
]
