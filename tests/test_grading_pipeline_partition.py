"""Assignment 8's partition check accepts right implementations and rejects wrong ones, and
an exponential search, or the lecture's own search of every cut, earns nothing."""

from __future__ import annotations

import math
import random

import pytest

from course_lib.grading import CheckFailed, check_optimal_partition
from course_lib.grading.pipeline_partition import (
    LARGE_OPTIMA,
    PartitionProblem,
    brute_force_partition,
    large_partition_problems,
    partition_problems,
    partition_time,
)
from course_lib.measure.pipeline import brute_force_partition as lecture_partition
from tests.adapters import mutant, planted, solution
from tests.cheats.a08_pipeline import EXHAUSTIVE_PARTITION

A08 = solution("pipeline")


def not_implemented(*args, **kwargs):
    raise NotImplementedError()


# --- the optimal partition ----------------------------------------------------------------


optimal_partition = A08.optimal_partition


def partition_greedy(layer_times, activation_sizes, n_machines, bandwidth=1.0, weight_sizes=None):
    """Wrong: one machine per stage, layers cut where the running time passes its share (its
    time computed as an answer would, without the grader's helpers)."""
    n = len(layer_times)
    k = min(n, n_machines)
    share, stages, start, acc = sum(layer_times) / k, [], 0, 0.0
    for j, t in enumerate(layer_times):
        acc += t
        left = k - len(stages) - 1
        if left and acc >= share and n - (j + 1) >= left:
            stages.append([start, j + 1, 1])
            start, acc = j + 1, 0.0
    stages.append([start, n, 1])
    stages[-1][2] += n_machines - sum(s[2] for s in stages)
    weights = weight_sizes if weight_sizes is not None else [0.0] * n

    def stage_time(i, j, machines):
        sync = sum(2 * w / bandwidth for w in weights[i:j]) if machines > 1 else 0.0
        return max(sum(layer_times[i:j]), sync) / machines

    links = [2 * activation_sizes[b - 1] / bandwidth for _, b, _ in stages[:-1]]
    return max([stage_time(*s) for s in stages] + links), [tuple(s) for s in stages]


def partition_ignoring_communication(layer_times, activation_sizes, n_machines, **kwargs):
    value, stages = optimal_partition(
        layer_times, [0.0] * len(activation_sizes), n_machines, **kwargs
    )
    return value, stages


# Named mutation: the last stage always gets one machine (m' = 1 only).
partition_one_machine_per_stage = mutant(
    "pipeline",
    "optimal_partition",
    ("for m_last in range(1, m):", "for m_last in range(1, min(m, 2)):"),
).optimal_partition


def test_optimal_partition_accepts_a_right_implementation():
    check_optimal_partition(optimal_partition, seeds=(0, 1, 2, 3, 4, 5))


def test_brute_force_agrees_with_a_hand_solved_case():
    # 4, 1, 1, 1, 1 on 2 machines: {4} | {1, 1, 1, 1} takes 4; nothing beats the slow layer.
    problem = PartitionProblem((4.0, 1.0, 1.0, 1.0, 1.0), (0.1,) * 5, 2)
    assert brute_force_partition(problem) == 4.0
    # 6, 1, 1 on 3 machines: all layers on 3 replicas (8/3) beats one machine per stage (6).
    problem = PartitionProblem((6.0, 1.0, 1.0), (0.1,) * 3, 3)
    assert brute_force_partition(problem) == pytest.approx(8.0 / 3)
    assert partition_time(problem, [(0, 1, 1), (1, 2, 1), (2, 3, 1)]) == 6.0
    # A cut where the activation is large costs 2 a / bandwidth: 10 here, so cut elsewhere.
    problem = PartitionProblem((1.0, 1.0, 1.0, 1.0), (0.2, 5.0, 0.2, 1.0), 2, (1.0,) * 4)
    assert partition_time(problem, [(0, 2, 1), (2, 4, 1)]) == 10.0
    assert brute_force_partition(problem) == 3.0
    # Weight sync: replicas of a layer with w = 4.5 all-reduce for 2 * 4.5 = 9 > 6 computing.
    problem = PartitionProblem((6.0,), (0.0,), 3, (4.5,))
    assert brute_force_partition(problem) == pytest.approx(3.0)


def test_brute_force_partition_matches_the_solutions_dynamic_program():
    """The lecture's search of every cut against Assignment 8's dynamic program (the
    instructor's solution): the same slowest part, on stages that cover the layers in order."""
    rng = random.Random(0)
    for trial in range(150):
        n, machines = rng.randint(1, 6), rng.randint(1, 5)
        times = [rng.uniform(0.1, 3.0) for _ in range(n)]
        acts = [rng.uniform(0.0, 2.0) for _ in range(n)]
        weights = [rng.uniform(0.0, 2.0) for _ in range(n)] if trial % 2 else None
        bandwidth = rng.choice([0.5, 1.0, 4.0])
        args = (times, acts, machines, bandwidth, weights)
        brute = lecture_partition(*args)
        assert math.isclose(brute.time, optimal_partition(*args)[0], rel_tol=1e-12), args
        assert [s.first for s in brute.stages] == [0] + [s.last + 1 for s in brute.stages[:-1]]
        assert brute.stages[-1].last == n - 1
        assert sum(s.machines for s in brute.stages) == machines
        single = lecture_partition(*args, replicate=False)
        assert all(s.machines == 1 for s in single.stages)


def test_the_problems_separate_the_wrong_partitions():
    problems = partition_problems((0,))
    for wrong in (
        partition_greedy,
        partition_ignoring_communication,
        partition_one_machine_per_stage,
    ):
        assert any(
            wrong(*p.args(), **p.kwargs())[0] > brute_force_partition(p) + 1e-9
            or wrong(*p.args(), **p.kwargs())[0]
            != partition_time(p, wrong(*p.args(), **p.kwargs())[1])
            for p in problems
        ), wrong.__name__


@pytest.mark.parametrize(
    "fn, message",
    [
        (partition_greedy, "the best split takes"),
        (partition_ignoring_communication, "but its stages"),
        (partition_one_machine_per_stage, "the best split takes"),
        (not_implemented, "raised NotImplementedError"),
    ],
)
def test_optimal_partition_rejects_wrong_implementations(fn, message):
    with pytest.raises(CheckFailed) as info:
        check_optimal_partition(fn)
    assert str(info.value).startswith("check_optimal_partition: ")
    assert message in str(info.value)


# --- answers that are not the student's own work ---------------------------------------------


# Right, but exponential: every cut and every split of the machines (the cheat's own text).
partition_exhaustive = planted(
    "pipeline", "optimal_partition", EXHAUSTIVE_PARTITION
).optimal_partition


def partition_from_the_lecture(
    layer_times, activation_sizes, n_machines, bandwidth=1.0, weight_sizes=None
):
    """Right on small problems: the lecture's search of every cut, its stages renumbered."""
    from course_lib.measure.pipeline import brute_force_partition as lecture

    found = lecture(layer_times, activation_sizes, n_machines, bandwidth, weight_sizes)
    return found.time, [(s.first, s.last + 1, s.machines) for s in found.stages]


def test_large_problems_take_a_dynamic_program_not_a_search(capsys):
    check_optimal_partition(optimal_partition, seeds=(), large=(0, 1))
    assert " small and 2 large problem(s): every returned split covers" in (capsys.readouterr().out)
    with pytest.raises(CheckFailed, match="exponential time; the dynamic program"):
        check_optimal_partition(partition_exhaustive, seeds=(), large=(0,), large_timeout=3)
    # The exhaustive search is right where it can finish: only its time is refused.
    check_optimal_partition(partition_exhaustive, seeds=(0,))


def test_the_lectures_partition_is_refused():
    with pytest.raises(CheckFailed, match="runs course_lib.measure.pipeline"):
        check_optimal_partition(partition_from_the_lecture)


def test_the_stored_optima_are_the_instructors_dynamic_program():
    """The large problems' optima ship as numbers (the dynamic program that finds them is the
    part): each is what the solution's dynamic program finds today."""
    for problem in large_partition_problems(tuple(LARGE_OPTIMA)):
        value, _ = optimal_partition(*problem.args(), **problem.kwargs())
        assert value == pytest.approx(LARGE_OPTIMA[problem.seed], rel=1e-12, abs=0), problem.seed
    with pytest.raises(ValueError, match="no stored optimum for large problem"):
        large_partition_problems((len(LARGE_OPTIMA),))
