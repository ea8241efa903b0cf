"""Benchmark: the zero-bubble pipeline's measured bubble against 1F1B's, measured in one run.

    python bench/zero_bubble.py

4 ranks hold TinyGPT's 4 stages; each op sleeps F = B = W = 40 ms after its compute (torch's
1F1B: its backward B + W = 80 ms in one op). For m = 4, 8 and 16 each schedule runs one step
(`measure_zero_bubble`) and its bubble is read from the ranks' wall-clock timestamps, next to
the simulator's and the formulas. Target: zero bubble with W's deferred / 1F1B near the formulas'
ratio (0.41 for m = 8), and at most 0.6; the 1F1B-memory variant in between.
"""

from __future__ import annotations

from course_lib import data, launch, models, rank, world_size
from course_lib.costs import bubble_formula, zero_bubble_formula
from course_lib.measure.pipeline import measure_zero_bubble, simulate_zero_bubble
from course_lib.pipeline import Timeline, simulate

P, TIMES = 4, (0.04, 0.04, 0.04)


def stage():
    return models.TinyGPT(seed=0).pipeline_stages(world_size())[rank()]


def main() -> None:
    x, y = data.tokens(16, seed=1)
    print(f"{'m':>3} {'schedule':<27}{'measured':>9}{'simulated':>10}{'formula':>8}{'/ 1F1B':>8}")
    for m in (4, 8, 16):
        logs = launch(measure_zero_bubble, stage, x, y, models.lm_loss, m, TIMES, world_size=P)
        simulated = {
            "1f1b": (simulate(P, m, "1f1b", 1, 2).bubble, bubble_formula(P, m)),
            "zero bubble, 1F1B's memory": (simulate_zero_bubble(P, m).bubble, None),
            "zero bubble, W's deferred": (
                simulate_zero_bubble(P, m, defer_w=True).bubble,
                zero_bubble_formula(P, m),
            ),
        }
        reference = Timeline.from_logs([log["1f1b"] for log in logs]).bubble
        for name, (sim, formula) in simulated.items():
            measured = Timeline.from_logs([log[name] for log in logs]).bubble
            print(
                f"{m:>3} {name:<27}{measured:>9.1%}{sim:>10.1%}"
                f"{'-' if formula is None else f'{formula:.1%}':>8}"
                f"{measured / reference:>8.2f}"
            )


if __name__ == "__main__":
    main()
