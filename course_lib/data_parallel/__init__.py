"""Data parallelism: the naive host scheme, all-reduce data parallel, and a look inside DDP.

    host_step(model, opt, loss_fn, x, y)                  # rank 0 is the host
    log = train_data_parallel(model, opt, loss_fn, batches)  # all-reduce DP, with timings
    accumulation_step(ddp_model, opt, loss_fn, micro_batches)  # k backwards, one all-reduce
    losses = local_sgd(model, opt, loss_fn, batches, every=8)  # average parameters every 8
    timeline = DDPTimeline(ddp_model)                     # when each layer / bucket ran
    plot_timeline({r: log.events for r, log in enumerate(logs)})

Every rank holds the whole model. The host scheme routes all gradients and parameters through
rank 0; all-reduce data parallel averages gradients among equals. `DDPTimeline` watches torch's
own DistributedDataParallel (buckets, overlap) through autograd hooks and a DDP comm hook; it
never replaces DDP's bucketing.

By what a reader looks for:

    sync.py       gradients (or parameters) as one flat tensor, averaged by one all-reduce:
                  `allreduce_gradients`, `average_parameters`
    host.py       the naive host (parameter-server) scheme: `host_step`
    loops.py      `train_data_parallel` (timings, a straggler); fewer all-reduces:
                  `accumulation_step`, `local_sgd`
    timeline.py   `DDPTimeline`, watching backward and DDP's buckets; `plot_timeline`

Import from `course_lib.data_parallel` itself: every name is one here.
"""

from course_lib.data_parallel.host import (
    HOST,
    host_step,
)
from course_lib.data_parallel.loops import (
    LossFn,
    TrainLog,
    accumulation_step,
    local_sgd,
    straggle,
    train_data_parallel,
)
from course_lib.data_parallel.sync import (
    allreduce_gradients,
    average_parameters,
    flat_gradients,
    flat_parameters,
    gradients,
)
from course_lib.data_parallel.timeline import (
    DDPTimeline,
    Event,
    plot_timeline,
    timed_allreduce_hook,
)

__all__ = [
    "DDPTimeline",
    "Event",
    "HOST",
    "LossFn",
    "TrainLog",
    "accumulation_step",
    "allreduce_gradients",
    "average_parameters",
    "flat_gradients",
    "flat_parameters",
    "gradients",
    "host_step",
    "local_sgd",
    "plot_timeline",
    "straggle",
    "timed_allreduce_hook",
    "train_data_parallel",
]
