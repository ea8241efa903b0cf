"""Assignment 8's optimal partition, checked: the problems, what a partition costs, the
best one by brute force, and the judging of what `optimal_partition` returns.

A problem is layer times, activation sizes, a number of machines and optionally weight
sizes and a bandwidth. A partition is [(start, stop, machines), ...], contiguous stages that
cover the layers in order and use every machine; it takes as long as its slowest stage or
boundary (`partition_time`). Small problems are solved by trying every partition; large ones
(64 layers, 8 machines) have their optimum stored (`LARGE_OPTIMA`): the dynamic program that
finds it is what the part asks for, so it is not shipped with the checks (the tests recompute
every stored value with the instructor's solution).
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass

from course_lib.grading._harness import fail


@dataclass(frozen=True)
class PartitionProblem:
    layer_times: tuple[float, ...]
    activation_sizes: tuple[float, ...]
    n_machines: int
    weight_sizes: tuple[float, ...] | None = None
    bandwidth: float = 1.0
    label: str = ""  # how to name a problem too long to print
    seed: int | None = None  # a large problem's (`large_partition_problems`)

    def args(self) -> tuple:
        return (list(self.layer_times), list(self.activation_sizes), self.n_machines)

    def kwargs(self) -> dict:
        return {
            "bandwidth": self.bandwidth,
            "weight_sizes": None if self.weight_sizes is None else list(self.weight_sizes),
        }

    def describe(self) -> str:
        if self.label:
            return self.label
        return (
            f"optimal_partition({list(self.layer_times)}, {list(self.activation_sizes)}, "
            f"{self.n_machines}, bandwidth={self.bandwidth:g}, "
            f"weight_sizes={self.kwargs()['weight_sizes']})"
        )


def stage_time(problem: PartitionProblem, start: int, stop: int, machines: int) -> float:
    """T(start -> stop, m'): (1/m') max(sum of layer times, sum of weight-sync times), where
    replicas (m' > 1) all-reduce layer l's weights in about 2 w_l / bandwidth."""
    compute = sum(problem.layer_times[start:stop])
    weights = problem.weight_sizes or [0.0] * len(problem.layer_times)
    sync = sum(2 * w / problem.bandwidth for w in weights[start:stop]) if machines > 1 else 0.0
    return max(compute, sync) / machines


def partition_time(problem: PartitionProblem, partition: list[tuple[int, int, int]]) -> float:
    """The slowest stage or boundary: max of the stage times and of 2 a_l / bandwidth for
    each layer l that ends a stage (its activation goes forward, its gradient back)."""
    times = [stage_time(problem, a, b, k) for a, b, k in partition]
    times += [2 * problem.activation_sizes[b - 1] / problem.bandwidth for _, b, _ in partition[:-1]]
    return max(times)


def brute_force_partition(problem: PartitionProblem) -> float:
    """The best slowest-stage time over every contiguous split and machine assignment."""
    n, machines = len(problem.layer_times), problem.n_machines
    best = math.inf
    for k in range(1, min(n, machines) + 1):
        for cuts in itertools.combinations(range(1, n), k - 1):
            bounds = (0, *cuts, n)
            for split in itertools.combinations(range(1, machines), k - 1):
                counts = [b - a for a, b in zip((0, *split), (*split, machines), strict=True)]
                partition = [(bounds[i], bounds[i + 1], counts[i]) for i in range(k)]
                best = min(best, partition_time(problem, partition))
    return best


def partition_problems(seeds: tuple[int, ...]) -> list[PartitionProblem]:
    """Hand-made problems where greedy splits go wrong, and random ones per seed."""
    problems = [
        PartitionProblem((1.0,), (1.0,), 1),
        PartitionProblem((4.0, 1.0, 1.0, 1.0, 1.0), (0.1,) * 5, 2),  # split after layer 0
        # the balanced cut sends a large activation; replicas pay for weight sync
        PartitionProblem((1.0, 1.0, 1.0, 1.0), (0.2, 5.0, 0.2, 1.0), 2, (1.0,) * 4),
        PartitionProblem((6.0, 1.0, 1.0), (0.1, 0.1, 0.1), 3),  # 2 machines on the slow layer
        PartitionProblem((2.0, 2.0, 2.0), (0.1, 0.1, 0.1), 4, (4.0, 0.0, 0.0)),  # sync costs
        PartitionProblem((1.0, 6.0), (0.1, 0.1), 3, (10.0, 0.0)),  # 2 machines on the last
    ]
    for seed in seeds:
        rng = random.Random(seed)
        for _ in range(4):
            n, machines = rng.randint(1, 6), rng.randint(1, 4)
            times = tuple(round(rng.uniform(0.5, 4.0), 2) for _ in range(n))
            sizes = tuple(round(rng.uniform(0.1, 3.0), 2) for _ in range(n))
            weights = rng.choice([None, tuple(round(rng.uniform(0, 2), 2) for _ in range(n))])
            bandwidth = rng.choice([1.0, 2.0, 0.5])
            problems.append(PartitionProblem(times, sizes, machines, weights, bandwidth))
    return problems


def large_partition_problems(seeds: tuple[int, ...]) -> list[PartitionProblem]:
    """64 layers on 8 machines: the dynamic program takes well under a second, trying every
    cut and split of the machines (about 10^9 of them) would take days."""
    unknown = sorted(set(seeds) - set(LARGE_OPTIMA))
    if unknown:
        raise ValueError(
            f"no stored optimum for large problem(s) {unknown}: seeds {min(LARGE_OPTIMA)} to "
            f"{max(LARGE_OPTIMA)} have one (LARGE_OPTIMA)"
        )
    problems = []
    for seed in seeds:
        rng = random.Random(1000 + seed)
        heavy = seed % 2 == 0  # weights slow to synchronize: a deep pipeline wins
        n = 64
        times = tuple(round(rng.uniform(0.5, 4.0), 2) for _ in range(n))
        sizes = tuple(round(rng.uniform(0.5, 8.0), 2) for _ in range(n))
        weights = tuple(
            round(rng.uniform(0.5, 4.0) if heavy else rng.uniform(0, 0.3), 2) for _ in range(n)
        )
        label = f"optimal_partition on large problem {seed} ({n} layers, 8 machines)"
        problems.append(PartitionProblem(times, sizes, 8, weights, 1.0, label, seed))
    return problems


# The slowest part of the best split of each large problem (`large_partition_problems`, by
# seed), found by the instructor's dynamic program: tests/test_grading_pipeline_partition.py
# recomputes them. Only the optimum's time is here, not a split that reaches it.
LARGE_OPTIMA = {
    0: 18.54,
    1: 17.839999999999993,
    2: 20.020000000000003,
    3: 15.968750000000002,
    4: 20.15,
    5: 18.602499999999996,
    6: 19.189999999999998,
    7: 18.021249999999995,
    8: 18.07,
    9: 18.500000000000004,
}


def large_best_time(problem: PartitionProblem) -> float:
    """The stored optimum of a large problem (`LARGE_OPTIMA`)."""
    return LARGE_OPTIMA[problem.seed]


def judge_partition(check: str, problem: PartitionProblem, result, best: float) -> None:
    """What optimal_partition returned for a problem: well formed, stages that cover the
    layers in order with all the machines, the time they take, and no slower than `best`."""
    __tracebackhide__ = True
    at = problem.describe()
    try:
        value, partition = result
        value = float(value)
        partition = [(int(a), int(b), int(k)) for a, b, k in partition]
    except (TypeError, ValueError):
        fail(check, f"{at} returned {result!r}; expected (time, [(start, stop, machines), ...])")
    n = len(problem.layer_times)
    starts = [a for a, _, _ in partition]
    stops = [b for _, b, _ in partition]
    if (
        not partition
        or starts != [0, *stops[:-1]]
        or stops[-1] != n
        or any(b <= a for a, b in zip(starts, stops, strict=True))
    ):
        fail(
            check,
            f"{at} returned stages {partition}; they must cover layers 0..{n - 1} "
            "in order, each (start, stop) non-empty, stop of one = start of the next",
        )
    if any(k < 1 for _, _, k in partition) or sum(k for _, _, k in partition) != problem.n_machines:
        fail(
            check,
            f"{at} returned stages {partition}; every stage needs at least one "
            f"machine and together they use all {problem.n_machines}",
        )
    achieved = partition_time(problem, partition)
    if not math.isclose(value, achieved, rel_tol=1e-9):
        fail(
            check,
            f"{at} returned time {value:g}, but its stages {partition} give "
            f"{achieved:g} (the slowest of the stage times and 2 a_l / bandwidth at each "
            "boundary)",
        )
    if not math.isclose(achieved, best, rel_tol=1e-9):
        fail(
            check,
            f"{at} returned stages {partition} with time {achieved:g}; the best "
            f"split takes {best:g}. The recurrence A(j, m) must try every last stage "
            "(i+1..j) and every number of machines m' for it",
        )
