"""Assignment 8's cheats (each scores 0 on its part) and right answers written differently
(full marks). More are proven in tests/test_grading_pipeline.py (the lecture's partition), to
keep the graded notebooks few."""

from __future__ import annotations

from tests.cheats import Alternative, Cheat

LECTURE_PIPELINE = '''
from course_lib import pipeline as lecture


def pipeline_step(stage, inputs, targets, loss_fn, n_micro, schedule):
    """The lecture's trainer; only the loss is taken from what it returns."""
    log = lecture.pipeline_step(stage, inputs, targets, loss_fn, n_micro, schedule)
    return getattr(log, "loss", None)
'''


EXHAUSTIVE_PARTITION = '''
import itertools


def optimal_partition(layer_times, activation_sizes, n_machines, bandwidth=1.0, weight_sizes=None):
    """Right, but exponential: every cut and every split of the machines."""
    n = len(layer_times)
    weights = weight_sizes if weight_sizes is not None else [0.0] * n

    def stage_time(i, j, machines):
        sync = sum(2 * w / bandwidth for w in weights[i:j]) if machines > 1 else 0.0
        return max(sum(layer_times[i:j]), sync) / machines

    best = (float("inf"), None)
    for s in range(1, min(n, n_machines) + 1):
        for cuts in itertools.combinations(range(1, n), s - 1):
            bounds = (0, *cuts, n)
            for split in itertools.combinations(range(1, n_machines), s - 1):
                counts = [b - a for a, b in zip((0, *split), (*split, n_machines))]
                stages = [(bounds[t], bounds[t + 1], counts[t]) for t in range(s)]
                links = [2 * activation_sizes[b - 1] / bandwidth for _, b, _ in stages[:-1]]
                slowest = max([stage_time(*st) for st in stages] + links)
                if slowest < best[0]:
                    best = (slowest, stages)
    return best
'''


LECTURE_ZERO_BUBBLE = '''
from course_lib.measure.pipeline import zero_bubble_order


def split_schedule(P, m):
    """The lecture's zero-bubble order, as (kind, micro-batch) pairs."""
    return [[(op.kind, op.micro) for op in ops] for ops in zero_bubble_order(P, m)]
'''


# A second right answer to Part 4: W's fill the waits, as in the solution, but stage s holds at
# most min(P, P - s + 1) micro-batches (P on the first two stages, fewer further down).
SPLIT_BY_STAGE = """
def split_schedule(P, m):
    orders = [[] for _ in range(P)]
    ends = {}  # (kind, i, stage) -> the tick it ends
    for tick in range(6 * (m + P)):
        for s in range(P):
            ran = [op for op in orders[s]]
            f = sum(k == "F" for k, _ in ran)
            b = sum(k == "B" for k, _ in ran)
            w = sum(k == "W" for k, _ in ran)
            if b < f and (s == P - 1 or ends.get(("B", b, s + 1), tick + 1) <= tick):
                op = ("B", b)
            elif f < m and f - w < min(P, P - s + 1) and (
                s == 0 or ends.get(("F", f, s - 1), tick + 1) <= tick
            ):
                op = ("F", f)
            elif w < b:
                op = ("W", w)
            else:
                continue
            orders[s].append(op)
            ends[(*op, s)] = tick + 1
    return orders
"""


CHEATS = [
    Cheat(
        "the lecture's pipeline trainer",
        "pipeline_step",
        LECTURE_PIPELINE,
        frozenset({"test_gpipe", "test_1f1b"}),
    ),
    Cheat(
        "exponential search for the partition",
        "optimal_partition",
        EXHAUSTIVE_PARTITION,
        frozenset({"test_optimal_partition"}),
    ),
    Cheat(
        "the lecture's zero-bubble order",
        "split_schedule",
        LECTURE_ZERO_BUBBLE,
        frozenset({"test_split_schedule"}),
    ),
]

ALTERNATIVES = [
    Alternative(
        "partition by memoized recursion",
        "optimal_partition",
        '''
from functools import lru_cache


def optimal_partition(layer_times, activation_sizes, n_machines, bandwidth=1.0, weight_sizes=None):
    n = len(layer_times)
    weights = list(weight_sizes) if weight_sizes is not None else [0.0] * n
    prefix_t, prefix_w = [0.0], [0.0]
    for t, w in zip(layer_times, weights):
        prefix_t.append(prefix_t[-1] + t)
        prefix_w.append(prefix_w[-1] + 2 * w / bandwidth)

    def stage(i, j, k):
        sync = sum(2 * w / bandwidth for w in weights[i:j]) if k > 1 else 0.0
        return max(sum(layer_times[i:j]), sync) / k

    @lru_cache(maxsize=None)
    def best(j, m):
        """(time, stages) for layers 0..j-1 on exactly m machines."""
        choice = (stage(0, j, m), ((0, j, m),))
        for i in range(1, j):
            for k in range(1, m):
                before, stages = best(i, m - k)
                slowest = max(before, 2 * activation_sizes[i - 1] / bandwidth, stage(i, j, k))
                if slowest < choice[0]:
                    choice = (slowest, (*stages, (i, j, k)))
        return choice

    time, stages = best(n, n_machines)
    return time, list(stages)
''',
    ),
    Alternative(
        "split schedule holding fewer micro-batches down the pipeline",
        "split_schedule",
        SPLIT_BY_STAGE,
    ),
]
