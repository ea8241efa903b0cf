"""The machinery that makes grades trustworthy: answers as source, the judge, untrusted ranks,
the counted process group, the integrity fingerprint, provenance, and partial credit."""

from __future__ import annotations

import inspect
import re
import textwrap

import pytest
import torch
import torch.distributed as dist
from nbformat import from_dict
from nbgrader.utils import determine_grade

import course_lib.collectives
from course_lib import CommCounter, WorkerPool, rank, sockets, world_size
from course_lib.grading import _harness, judge, traffic
from course_lib.grading._harness import CheckFailed, Verdict, fail, share
from course_lib.grading.answers import Answer, AnswerCellError, defined_names, resolve
from course_lib.grading.messages import student_frames
from course_lib.grading.provenance import Provenance
from course_lib.launch import RankError

SETUP = "import torch\nimport torch.distributed as dist\nfrom course_lib import rank, world_size\n"
SETUP += "from course_lib.grading import check_broadcast\n"
BROADCAST = """
def broadcast(tensor, src):
    if rank() == src:
        for peer in range(world_size()):
            if peer != src:
                dist.send(tensor, dst=peer)
    else:
        dist.recv(tensor, src=src)
"""
TEST = "check_broadcast(broadcast, world_sizes=(2,), dtypes=(torch.float64,), shapes=((3,),))"


def cells(answer: str, test: str = TEST, points: float = 2) -> list[dict]:
    return [
        {"id": "setup", "role": "setup", "source": SETUP, "points": 0},
        {"id": "broadcast", "role": "answer", "source": textwrap.dedent(answer), "points": 0},
        {"id": "test_broadcast", "role": "test", "source": test, "points": points},
    ]


# --- answers --------------------------------------------------------------------------------


def test_defined_names_are_what_a_cell_binds_at_top_level():
    source = (
        "import torch.nn as nn\nfrom x import y as z\ndef f(): w = 1\nclass C: pass\na, b = 1, 2\n"
    )
    assert defined_names(source) == ["nn", "z", "f", "C", "a", "b"]


def test_resolve_runs_the_cells_once_and_hands_over_what_they_define():
    source = "calls = []\ncalls.append(1)\ndef f():\n    return len(calls)\nclass K: pass\n"
    cells_ = (("c", source),)
    (f, k), kwargs = resolve((Answer("f", cells_), Answer("K", cells_)), {"g": Answer("f", cells_)})
    assert f() == 1 and kwargs["g"] is f and isinstance(k(), k)


def test_an_answer_cell_that_needs_another_cell_says_why_it_fails():
    with pytest.raises(AnswerCellError, match="graded alone.*must not use names defined"):
        resolve((Answer("f", (("cell1", "x = helper_from_a_try_cell()"),)),), {})


def test_an_answer_never_runs_where_the_check_runs():
    answer = Answer("broadcast", (("c", BROADCAST),))
    assert answer.__name__ == "broadcast" and callable(answer)
    with pytest.raises(RuntimeError, match="runs it on a rank, never here"):
        answer(torch.zeros(1), 0)


# --- partial credit and reports -------------------------------------------------------------


def test_share_gates_on_the_result():
    weights = {"result": 0.6, "bytes": 0.4}
    assert share(weights, set()) == 1.0
    assert share(weights, {"bytes"}) == pytest.approx(0.6)
    assert share(weights, {"result"}) == 0.0
    assert share(weights, {"result", "bytes"}) == 0.0


def test_a_verdict_reports_every_failing_case_and_the_credit(capsys):
    verdict = Verdict("check_x", {"result": 0.5, "bytes": 0.5})
    for case in range(5):
        with verdict.case():
            if case % 2:
                fail("check_x", f"case {case}: too many bytes", prop="bytes")
    with pytest.raises(CheckFailed) as error:
        verdict.conclude("5 cases")
    text = str(error.value)
    assert "[bytes] failed in 2 case(s)" in text and "case 1:" in text and "case 3:" in text
    assert "50% of this part's points" in text and error.value.score == pytest.approx(0.5)
    passing = Verdict("check_y")
    with passing.case():
        pass
    passing.conclude("3 world sizes")
    assert capsys.readouterr().out == "check_y: passed. Verified 3 world sizes.\n"


@pytest.mark.parametrize("share_earned, expected", [(1.0, 4.0), (0.5, 2.0), (0.0, 0.0)])
def test_nbgrader_reads_the_judges_outputs_as_the_intended_score(share_earned, expected):
    verdict = judge.CellVerdict("t", points=4.0, weights={"result": 0.5, "bytes": 0.5})
    if share_earned < 1:
        verdict.failed = {"bytes"} if share_earned else {"result"}
        verdict.errors = [{"ename": "CheckFailed", "evalue": "..."}]
    cell = from_dict(
        {
            "cell_type": "code",
            "source": "",
            "metadata": {"nbgrader": {"grade": True, "points": 4, "grade_id": "t"}},
            "outputs": verdict.outputs(),
        }
    )
    assert determine_grade(cell) == (expected, 4.0)
    if expected:
        assert f"{expected:g} of 4 points\n" in [o.get("text") for o in cell.outputs]


def test_student_frames_leave_out_the_graders_and_torchs():
    text = (
        "Traceback (most recent call last):\n"
        '  File "/x/course_lib/grading/collectives.py", line 3, in run\n    fn()\n'
        '  File "<cell ring>", line 2, in ring\n    dist.all_reduce(t)\n'
        '  File "/v/lib/python3.11/site-packages/torch/distributed/c.py", line 9, in f\n'
        "    work.wait()\nRuntimeError: boom\n"
    )
    assert student_frames(text) == (
        "Traceback (most recent call last):\n"
        '  File "<cell ring>", line 2, in ring\n    dist.all_reduce(t)\nRuntimeError: boom\n'
    )


# --- the judge, end to end (a few launches) -------------------------------------------------


def test_the_judge_gives_full_marks_to_a_right_answer():
    (verdict,) = list(judge.grade(cells(BROADCAST)))
    assert verdict.score == 2.0 and not verdict.tampering, verdict.output


def test_the_judge_ignores_and_reports_an_answer_cell_that_rebinds_a_check():
    (verdict,) = list(judge.grade(cells(BROADCAST + "\ncheck_broadcast = lambda *a, **k: None\n")))
    assert verdict.score == 0 and "rebinds check_broadcast" in verdict.tampering[0]


@pytest.mark.parametrize(
    "patch, changed",
    [
        (
            "import course_lib.comm\ncourse_lib.comm.volume = lambda op, args: (0, 0)",
            "course_lib.comm.volume",
        ),
        # What the memory scans of the ZeRO checks rely on to see every tensor
        ("import gc\ngc.get_freeze_count = lambda: 0", "gc.get_freeze_count"),
    ],
)
def test_a_rank_that_patches_the_checks_code_scores_zero_as_tampering(patch, changed):
    (verdict,) = list(judge.grade(cells(BROADCAST + "\n" + patch + "\n")))
    assert verdict.score == 0
    assert any(f"changed {changed}" in t for t in verdict.tampering), verdict.tampering


# A wrong answer that finishes (its receivers add 1): one that deadlocks would cost the check's
# whole timeout, and test_grading_collectives already proves deadlocks fail.
WRONG = BROADCAST.replace(
    "dist.recv(tensor, src=src)", "dist.recv(tensor, src=src)\n        tensor += 1"
)


def test_a_wrong_answer_scores_zero_with_the_checks_message():
    (verdict,) = list(judge.grade(cells(WRONG)))
    assert verdict.score == 0 and not verdict.tampering
    assert verdict.outputs()[-1]["ename"] == "CheckFailed"


def test_a_failed_result_ends_the_test_cell_as_in_a_notebook():
    """Later statements cannot change a 0, so the judge does not wait for them (a deadlocked
    answer would otherwise time out once per check in the cell)."""
    test = TEST + "\nprint('the next statement ran')\n"
    (verdict,) = list(judge.grade(cells(WRONG, test)))
    assert verdict.score == 0 and "the next statement ran" not in verdict.output
    (verdict,) = list(judge.grade(cells(BROADCAST, test)))
    assert verdict.score == 2 and "the next statement ran" in verdict.output


# --- untrusted ranks ------------------------------------------------------------------------


class _Boom:
    def __reduce__(self):
        return (open, ("/tmp/course_lib_untrusted_boom", "w"))


def _return_a_trap():
    return _Boom()


def _patch_dist():
    dist.all_reduce = lambda *args, **kwargs: None
    return "patched"


def _prebound_all_reduce_counted():
    from torch.distributed import all_reduce as prebound

    t = torch.ones(4)
    with CommCounter() as counter:
        prebound(t)
        dist.group.WORLD.allreduce([t]).wait()
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 2))
        model(torch.ones(2, 3)).sum().backward()
    try:
        torch.ops.c10d.allreduce_(
            [t], dist.distributed_c10d._get_default_group(), dist.ReduceOp.SUM, None, False, -1
        )
        ops_route = "open"
    except RuntimeError:
        ops_route = "refused"
    return {"calls": dict(counter.calls), "ops_route": ops_route}


def test_an_untrusted_rank_cannot_make_the_launcher_run_code(tmp_path):
    import os

    marker = "/tmp/course_lib_untrusted_boom"
    if os.path.exists(marker):
        os.remove(marker)
    with WorkerPool(1, "gloo", untrusted=True) as pool:
        with pytest.raises(RankError, match="may return only tensors, numbers, strings"):
            pool.launch(_return_a_trap, timeout=60)
    assert not os.path.exists(marker)


def test_a_rank_that_changes_torch_distributed_fails_and_is_replaced():
    with WorkerPool(2, "gloo", untrusted=True) as pool:
        with pytest.raises(RankError) as error:
            pool.launch(_patch_dist, timeout=60)
        assert error.value.exc_type == "TamperingDetected"
        assert "torch.distributed.all_reduce" in str(error.value)
        assert pool.launch(world_size, timeout=60) == [2, 2]  # fresh, untainted workers


def _preloaded() -> list[bool]:
    import sys

    return [name in sys.modules for name in _harness.PRELOAD]


def _drop_the_answer_hook():
    from course_lib import _worker

    _worker.ARGUMENT_HOOKS = ()


def test_grading_ranks_preload_the_checks_and_dropping_the_answer_hook_is_tampering():
    """The launcher imports nothing of grading: a grading pool names what its ranks load
    before any student code, the answers' hook included, which a rank must not drop."""
    with WorkerPool(2, "gloo", untrusted=True, preload=_harness.PRELOAD) as pool:
        assert pool.launch(_preloaded, timeout=60) == [[True, True]] * 2
        with pytest.raises(RankError) as error:
            pool.launch(_drop_the_answer_hook, timeout=60)
        assert error.value.exc_type == "TamperingDetected"
        assert "ARGUMENT_HOOKS" in str(error.value)


def test_the_fork_server_a_launch_starts_after_the_checks_are_imported_preloads_them(
    run_script,
):
    """A notebook imports the checks in its set-up cell, then runs `launch` before any check:
    the fork server that launch starts loads the checks once for the grading ranks to come."""
    script = run_script(
        """
        import sys
        import course_lib.grading  # the set-up cell
        from course_lib import launch

        def loaded():
            return "course_lib.grading" in sys.modules

        print(launch(loaded, world_size=2, timeout=60))
        """
    )
    out, err = script.communicate(timeout=120)
    assert script.returncode == 0, err
    assert out.strip() == "[True, True]"


def test_grading_ranks_count_every_route_to_a_collective():
    with WorkerPool(2, "gloo", untrusted=True) as pool:
        results = pool.launch(_prebound_all_reduce_counted, timeout=60)
    for result in results:
        # the pre-bound name, the group object, and DDP's C++ reducer (plus its broadcast)
        assert result["calls"].get("all_reduce", 0) >= 3, result
        assert result["ops_route"] == "refused"


def _talk_with_counters_emptied():
    """A send and an all-reduce with every counter on the rank emptied first and put back
    after, between two marks."""
    import course_lib.comm as comm
    from course_lib import counted_group

    counted_group.mark("before")
    counters, hooks = list(comm._active), list(comm._around)
    comm._active.clear()
    comm._around.clear()
    t = torch.ones(4)
    if rank() == 0:
        dist.send(t, 1)
    else:
        dist.recv(t, 0)
    dist.all_reduce(t)
    comm._active.extend(counters)
    comm._around.extend(hooks)
    counted_group.mark("after")


def test_the_launcher_keeps_every_call_a_rank_made_even_when_its_counters_were_emptied():
    with WorkerPool(2, "gloo", untrusted=True) as pool:
        pool.launch(_talk_with_counters_emptied, timeout=60)
        tallies = pool.tallies
    assert tallies[0] == [
        ("mark", "before"),
        ("call", "send", 1, 16, 0, (0, 1), ("float32",)),
        ("call", "all_reduce", None, 16, 16, (0, 1), ("float32",)),  # 2(P-1)/P * 16 bytes
        ("mark", "after"),
    ]
    assert tallies[1][1] == ("call", "recv", 0, 0, 16, (0, 1), ("float32",))


def _send_then_around_the_group(around: str | None):
    """A counted send of 5 floats, then, maybe, an all-reduce the counters never see: on the
    counted group's inner gloo group, or with the reporter unset for its length."""
    from course_lib import counted_group

    t = torch.ones(5)
    if rank() == 0:
        dist.send(t, 1)
    else:
        dist.recv(t, 0)
    if around == "inner group":
        dist.group.WORLD._inner.allreduce([t]).wait()
    elif around == "reporter unset":
        reporter = counted_group._reporter
        counted_group.set_reporter(None)
        dist.all_reduce(t)
        counted_group.set_reporter(reporter)


@pytest.mark.skipif(not sockets.available(), reason="needs Linux's socket diagnostics")
def test_the_wire_shows_what_a_rank_sent_around_the_counted_group():
    with WorkerPool(2, "gloo", untrusted=True) as pool:
        pool.launch(_send_then_around_the_group, None, timeout=60)
        # gloo's overheads are what traffic.SEND_OVERHEAD and RECV_OVERHEAD say, exactly
        assert pool.wire == [{1: 20 + traffic.SEND_OVERHEAD}, {0: traffic.RECV_OVERHEAD}]
        seen = traffic.Traffic(pool.tallies, pool.wire)
        assert traffic.unreported_bytes(seen) == [0, 0]
        for around in ("inner group", "reporter unset"):
            pool.launch(_send_then_around_the_group, around, timeout=60)
            seen = traffic.Traffic(pool.tallies, pool.wire)
            assert all(extra > 0 for extra in traffic.unreported_bytes(seen)), around
            with pytest.raises(CheckFailed) as error:
                _harness.judge_unreported("check_x", seen)
            assert error.value.tampering


@pytest.mark.parametrize(
    "entries",
    [
        [("mark", 0), ("mark", 2), ("mark", 1)],  # out of order
        [("call", "send", 1, 4, 0, (0, 1)), ("mark", 0), ("mark", 1)],  # before the cases
        [("mark", 0), ("mark", 1), ("call", "send", 1, 4, 0, (0, 1))],  # after them
        [("mark", 0), ("mark", 1), ("mark", 1)],  # a mark too many
    ],
)
def test_calls_are_split_by_case_only_when_the_marks_are_the_checks_own(entries):
    ok = [("mark", 0), ("call", "send", 1, 4, 0, (0, 1)), ("mark", 1)]
    assert _harness.calls_by_case("check_x", [ok], 1) == [[[traffic.Sent("send", 1, 4, 0, (0, 1))]]]
    with pytest.raises(CheckFailed) as error:
        _harness.calls_by_case("check_x", [entries], 1)
    assert error.value.tampering and error.value.score == 0


# --- provenance -----------------------------------------------------------------------------


def test_provenance_sees_the_lectures_code_called_wrapped_or_pasted():
    # The ring's algorithm is collectives._ring (ring_all_reduce is a wrapper around it, too
    # short to tell a copy of from anyone's own): forbid it, then call it through the
    # lecture's public function, and paste it under another name.
    forbidden = ["course_lib.collectives._ring"]
    source = inspect.getsource(course_lib.collectives._ring)
    pasted = re.sub(r"\bflat\b", "t", source.replace("def _ring", "def mine"))
    namespace = dict(vars(course_lib.collectives))
    exec(pasted, namespace)  # noqa: S102

    def wrapper(t):
        return course_lib.collectives.ring_all_reduce(t)

    for answer in (wrapper, lambda t: namespace["mine"](t, [0])):
        with Provenance(forbidden) as seen:
            answer(torch.ones(3))  # one rank, world of 1: the ring does nothing
        assert seen.hits == forbidden and "course's own implementation" in seen.complaint()
    with Provenance(forbidden) as seen:
        torch.ones(3).sum()
    assert seen.complaint() is None


def test_provenance_notices_when_it_is_switched_off():
    import sys

    with Provenance(["course_lib.collectives.ring_all_reduce"]) as seen:
        sys.setprofile(None)
    assert "switched off" in seen.complaint()


def _call_the_graders_reference(how: str):
    """An answer that has the grader's own helper do its work (Assignment 10's layout),
    called directly or as a thread's target."""
    import threading

    from course_lib.grading.parallel_3d_layout import _partners

    if how == "directly":
        return _partners(4, 2, 1)
    found = []
    thread = threading.Thread(target=lambda: found.append(_partners(4, 2, 1)))
    thread.start()
    thread.join()
    return found[0]


@pytest.mark.parametrize("how", ["directly", "in a thread"])
def test_provenance_refuses_the_graders_own_code_called_by_the_answer(how):
    with Provenance([]) as seen:
        _call_the_graders_reference(how)
    assert seen.grader_hits == ["course_lib.grading.parallel_3d_layout._partners"], seen.hits
    assert "the grader's own code" in seen.complaint()


def _use_a_given_tool():
    """An answer using what Assignment 8's set-up cell gives: the grader's send_tensor."""
    from course_lib.grading.pipeline import recv_tensor, send_tensor

    if world_size() == 1:
        return None
    if rank() == 0:
        send_tensor(torch.ones(2, 3), 1).wait()
        return None
    return recv_tensor(0).tolist()


def test_the_tools_an_assignment_gives_are_not_refused():
    results = _harness.run_on_ranks(
        "check_x", _use_a_given_tool, world_size=2, timeout=60, what="your answer"
    )
    assert results == [None, [[1.0] * 3] * 2]


def test_every_check_refuses_the_graders_own_code():
    """The harness watches every run on the ranks, whether or not the check has a Provenance
    of its own: an answer that runs the grader's helper fails the part."""
    with pytest.raises(CheckFailed, match="the grader's own code"):
        _harness.run_on_ranks(
            "check_x",
            _call_the_graders_reference,
            "directly",
            world_size=1,
            timeout=60,
            what="your answer",
        )
    # The checks' own calls are theirs to make: here the harness calls its own function.
    shares = _harness.run_on_ranks(
        "check_x", _harness.share, {"result": 1.0}, set(), world_size=1, timeout=60, what="x"
    )
    assert shares == [1.0]


def _patch_operators(what: str):
    import torch.testing

    if what == "Tensor.__eq__":
        torch.Tensor.__eq__ = lambda a, b: torch.ones_like(a, dtype=torch.bool)
    else:
        torch.testing.assert_close = lambda *args, **kwargs: None


@pytest.mark.parametrize("what", ["Tensor.__eq__", "torch.testing.assert_close"])
def test_a_rank_that_patches_an_operator_or_torch_testing_fails_as_tampering(what):
    with WorkerPool(1, "gloo", untrusted=True) as pool:
        with pytest.raises(RankError) as error:
            pool.launch(_patch_operators, what, timeout=60)
    assert error.value.exc_type == "TamperingDetected"
    assert what.replace("Tensor", "torch.Tensor") in str(error.value)


def test_the_harness_pools_are_untrusted():
    pool = _harness.grading_pool(1)
    assert pool.untrusted and pool.backend == "gloo"
    assert pool.launch(rank, timeout=60) == [0]
