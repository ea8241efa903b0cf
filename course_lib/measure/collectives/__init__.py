"""What lecture 2 measures and draws: the ring step by step, and all-reduce against its model.

    from course_lib.measure.collectives import RingWidget, ring_steps_figure
    from course_lib.measure.collectives import AllReduceModelWidget, plot_all_reduce_sweep

- `RingWidget(4)`: a slider over the steps of the ring all-reduce, drawing a rank x chunk grid
  (what each rank holds, how much of it is summed) and arrows for what each rank sends next.
  It draws `course_lib.collectives.ring_state` / `ring_schedule`, the schedule the ring
  implementation runs, so the picture and the code cannot disagree.
- `ring_steps_figure(4)`: every step as a strip of small panels, for reading without widgets.
- `record_peers()` counts whom a rank talks to; `time_all_reduce(algorithm, N)` times one
  all-reduce (on an emulated network with `network=`).
- `time_against_model(N, P, alpha, beta)` times each algorithm on this machine's loopback and
  prints the table of measured and modelled times.
- `sweep_all_reduce(sizes, network)` (on every rank, under `launch`) times each algorithm of
  `course_lib.collectives`, and the two-level all-reduce, on an emulated network;
  `plot_all_reduce_sweep` draws the times over the alpha-beta model's lines and marks where
  the model's fastest algorithm changes.
- `AllReduceModelWidget()`: sliders for latency, bandwidth and ranks over the model's lines.
- the checks of the lecture's exercises (`check_crossover`, `check_fastest_at_4kB`,
  `check_naive_over_ring_at_16MB`, `check_faster_on_two_nodes`): their expected values and
  whys off the page.

By what a reader looks for:

    ring.py        the ring all-reduce drawn, step by step
    timing.py      whom a rank talks to, and how long an all-reduce takes
    sweep.py       all-reduce against its model on an emulated network, and the model's lines
    exercises.py   the checks of the lecture's exercises

Import from `course_lib.measure.collectives` itself: every name is one name here.
"""

from course_lib.measure.collectives.exercises import (
    check_crossover,
    check_faster_on_two_nodes,
    check_fastest_at_4kB,
    check_naive_over_ring_at_16MB,
)
from course_lib.measure.collectives.ring import (
    PHASE_COLOURS,
    RANK_LETTERS,
    RingFrame,
    RingWidget,
    draw_ring_frame,
    ring_figure,
    ring_frame,
    ring_steps_figure,
)
from course_lib.measure.collectives.sweep import (
    TWO_LEVEL,
    AllReduceModelWidget,
    crossovers,
    fastest,
    model_lines,
    plot_all_reduce_sweep,
    sweep_all_reduce,
    two_level_model,
)
from course_lib.measure.collectives.timing import (
    record_peers,
    time_against_model,
    time_all_reduce,
)

__all__ = [
    "PHASE_COLOURS",
    "RANK_LETTERS",
    "TWO_LEVEL",
    "AllReduceModelWidget",
    "RingFrame",
    "RingWidget",
    "check_crossover",
    "check_faster_on_two_nodes",
    "check_fastest_at_4kB",
    "check_naive_over_ring_at_16MB",
    "crossovers",
    "draw_ring_frame",
    "fastest",
    "model_lines",
    "plot_all_reduce_sweep",
    "record_peers",
    "ring_figure",
    "ring_frame",
    "ring_steps_figure",
    "sweep_all_reduce",
    "time_against_model",
    "time_all_reduce",
    "two_level_model",
]
