"""How lecture 5 trains and shows training with compressed gradients: every method of
`course_lib.compression` as a DDP comm hook (`build_ddp`) in one training loop
(`train_compressed`), loss curves against steps or seconds; the quantization error as a
histogram; a slow-network run as a table, and step time swept over bandwidths; and the checks
of the lecture's exercises, their expected values and whys off the page.

    run = train_compressed("powersgd", batches, sizes=(8, 4))   # on every rank, in `launch`

    plot_loss_curves(loss_curves(runs, against="time"), "seconds")
    plot_quantization_error(gradient, [None, 256])
    times = sweep_bandwidth(("fp32", "int8"), [12.5e6, 125e6], batches, 5e-3, sizes=(8, 4))
    check_momentum_ends(momentum_ends, last10)          # a prediction, against the runs

By what a reader looks for:

    training.py    the 8-bit all-reduce on its own, the one training loop of every method,
                   loss curves, the quantization error seen whole
    network.py     the slow network: the bytes and seconds per step as tables, the sweep over
                   bandwidths
    exercises.py   the checks of the lecture's exercises (`check_powersgd_ratio`,
                   `check_momentum_ends`, `check_fastest_at_100Mbit`)

Import from `course_lib.measure.compression` itself: every name is one name here.
"""

from course_lib.measure.compression.exercises import (
    check_fastest_at_100Mbit,
    check_momentum_ends,
    check_powersgd_ratio,
)
from course_lib.measure.compression.network import (
    network_table,
    plot_step_time_vs_bandwidth,
    slow_network_table,
    sweep_bandwidth,
)
from course_lib.measure.compression.training import (
    CompressionLog,
    build_ddp,
    loss_curves,
    mean_losses,
    measure_int8_all_reduce,
    plot_loss_curves,
    plot_quantization_error,
    train_compressed,
)

__all__ = [
    "CompressionLog",
    "build_ddp",
    "check_fastest_at_100Mbit",
    "check_momentum_ends",
    "check_powersgd_ratio",
    "loss_curves",
    "mean_losses",
    "measure_int8_all_reduce",
    "network_table",
    "plot_loss_curves",
    "plot_quantization_error",
    "plot_step_time_vs_bandwidth",
    "slow_network_table",
    "sweep_bandwidth",
    "train_compressed",
]
