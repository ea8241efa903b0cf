"""What every check shares: the lectures' own implementations are not accepted as answers."""

from __future__ import annotations

import pytest

from course_lib import collectives, data_parallel, gossip, tensor_parallel
from course_lib.grading import (
    CheckFailed,
    check_all_reduce,
    check_parallel_mlp,
    check_push_sum,
    check_sync_gradients,
)
from course_lib.grading._harness import LECTURE_MODULES, reject_lecture_code


@pytest.mark.parametrize(
    "check, answer, kwargs",
    [
        (check_all_reduce, collectives.ring_all_reduce, {"bandwidth_optimal": True}),
        (check_push_sum, gossip.push_sum_step, {}),
        (check_sync_gradients, data_parallel.allreduce_gradients, {}),
        (check_parallel_mlp, tensor_parallel.ParallelMLP, {}),
    ],
)
def test_a_check_refuses_the_lectures_own_implementation(check, answer, kwargs):
    with pytest.raises(CheckFailed, match="the lecture's own implementation"):
        check(answer, **kwargs)


def test_answers_written_elsewhere_pass_the_guard():
    def push_sum_step(x, w, out_neighbors, in_neighbors):  # a student's own, in any module
        return x, w

    reject_lecture_code("check", push_sum_step, 3, "text", int, None)


def test_every_lecture_module_named_exists():
    import importlib

    for module in LECTURE_MODULES:
        importlib.import_module(module)
