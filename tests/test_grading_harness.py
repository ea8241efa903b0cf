"""What every check shares: the lectures' own implementations are not accepted as answers."""

from __future__ import annotations

import pytest

from course_lib import collectives, data_parallel, gossip, tensor_parallel
from course_lib.grading import (
    CheckFailed,
    check_bidirectional_ring_all_reduce,
    check_parallel_mlp,
    check_push_sum,
    check_sync_gradients,
)
from course_lib.grading._harness import LECTURE_MODULES, reject_lecture_code
from course_lib.grading.provenance import Provenance


@pytest.mark.parametrize(
    "check, answer, kwargs",
    [
        (check_bidirectional_ring_all_reduce, collectives.ring_all_reduce, {}),
        (check_push_sum, gossip.gossip_round, {}),
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


def test_a_file_of_a_lecture_package_is_the_lecture_too():
    """A topic's code too long for one file is a package: its functions' __module__ names the
    file (course_lib.pipeline.schedules), and the guard still knows them for the lecture's."""

    def ring_all_reduce(tensor):
        return tensor

    for module in sorted(LECTURE_MODULES):
        for inside in (f"{module}.schedules", f"{module}.parts.ring"):
            ring_all_reduce.__module__ = inside
            with pytest.raises(CheckFailed, match="the lecture's own implementation"):
                reject_lecture_code("check", ring_all_reduce)
    for elsewhere in ("course_lib.pipelines_of_mine", "__main__", "course_lib"):
        ring_all_reduce.__module__ = elsewhere
        reject_lecture_code("check", ring_all_reduce)


def test_provenance_of_a_package_sees_every_file_of_it():
    """Forbidding a package forbids what each of its files defines: the names it gathers, under
    its own name, and the private helpers, under their file's."""
    from course_lib.costs import bubble_formula, memory

    with Provenance(["course_lib.costs"]) as seen:
        memory._check_stage("zero1")
    assert seen.hits == ["course_lib.costs.memory._check_stage"]
    with Provenance(["course_lib.costs"]) as seen:
        bubble_formula(4, 8)
    assert seen.hits == ["course_lib.costs.bubble_formula"]
    with Provenance(["course_lib.costs.memory"]) as seen:
        bubble_formula(4, 8)
    assert seen.hits == []


def test_hidden_bytes_are_refused_with_what_the_rank_wrote_and_reported():
    """Bytes beyond the reported calls' (a send's tensor + 96 B of gloo headers, 48 B per recv)
    fail the part as tampering, saying what the rank wrote to each peer and what it reported:
    what it takes to tell an honest rank's overhead from hidden traffic."""
    from course_lib.grading._harness import judge_unreported
    from course_lib.grading.traffic import Traffic

    calls = [("call", "send", 1, 100, 0, (0, 1)), ("call", "recv", 1, 0, 100, (0, 1))]
    judge_unreported("check", Traffic([calls], [{1: 100 + 96 + 48}]))  # all accounted for
    with pytest.raises(CheckFailed, match="rank 0 wrote 500 bytes") as failure:
        judge_unreported("check", Traffic([calls], [{1: 100 + 96 + 48 + 500}]))
    assert failure.value.tampering
    assert "rank 0 wrote {1: 744} by peer; it reported {'recv': 1, 'send': 1} calls" in str(
        failure.value
    )
