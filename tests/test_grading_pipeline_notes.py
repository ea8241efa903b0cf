"""Assignment 8's trainer check reads the order of forwards and backwards from notes the
stage's wrapper reports to the launcher, never from a list on the rank: the notes themselves
(`counted_group.note`, `traffic.split_with_notes`), a log rewritten on the rank that no longer
counts, notes forged or added by the student's code, and right answers that post their
messages in another order than the stage runs."""

from __future__ import annotations

import pytest
import torch

from course_lib import counted_group, rank, world_size
from course_lib.grading import CheckFailed, check_pipeline_trainer
from course_lib.grading._harness import events_by_case
from course_lib.grading.pipeline_notes import judge_sends_follow, stage_order
from course_lib.grading.pipeline_plumbing import fingerprint, watch
from course_lib.grading.provenance import Provenance
from course_lib.grading.traffic import Note, Sent, split_by_marks, split_with_notes
from tests.adapters import planted, solution
from tests.cheats.a08_pipeline import (
    LOG_REWRITTEN,
    LOG_REWRITTEN_ON_HEAP,
    NOTES_FORGED,
    PIPELINE_BY_OP_LIST,
    PIPELINE_RECEIVES_EARLY,
)

pipeline_step = solution("pipeline").pipeline_step


# --- the notes, as the launcher keeps them ---------------------------------------------------


def test_a_note_is_reported_in_its_place_among_the_calls():
    got = []
    counted_group.set_reporter(got.append)
    try:
        counted_group.mark(0)
        counted_group.note(("F", 1))
        counted_group.mark(1)
    finally:
        counted_group.set_reporter(None)
    assert got == [("mark", 0), ("note", ("F", 1)), ("mark", 1)]
    with pytest.raises(ValueError, match="a mark or a note"):
        counted_group.mark(0, _kind="call")


def test_notes_do_not_split_the_calls_into_cases():
    call = ("call", "send", 1, 8, 0, (0, 1), ("float64",))
    entries = [("mark", 0), ("note", "a"), call, ("note", "b"), ("mark", 1), call, ("mark", 2)]
    sent = Sent(*call[1:])
    assert split_by_marks(entries, 2) == [[sent], [sent]]
    assert split_with_notes(entries, 2) == [[Note("a"), sent, Note("b")], [sent]]
    # A note outside the cases is no note of the check's: split_by_marks does not see it.
    assert split_with_notes([("note", "x"), *entries], 2) is None
    assert split_by_marks([("note", "x"), *entries], 2) == [[sent], [sent]]
    with pytest.raises(CheckFailed, match="notes were reported outside any case") as info:
        events_by_case("check_x", [[*entries, ("note", "late")]], 2)
    assert info.value.tampering


def test_the_student_code_may_not_report_a_note():
    # As for a mark: the note is the check's to report (compiled from source, this test's
    # function counts as the student's code).
    namespace = {"counted_group": counted_group}
    exec("def forge():\n    counted_group.note(('F', 0))\n", namespace)
    with Provenance(()) as seen:
        namespace["forge"]()
    assert seen.grader_hits == ["course_lib.counted_group.mark"]
    stage = watch(torch.nn.Linear(2, 2))
    with Provenance(()) as seen:  # the wrapper's own notes, from the check's code, pass
        stage(torch.ones(1, 2)).sum().backward()
    assert not seen.grader_hits


def test_the_wrapper_reports_each_forward_and_backward_as_it_runs():
    got = []
    counted_group.set_reporter(got.append)
    try:
        stage = watch(torch.nn.Linear(2, 2, dtype=torch.float64))
        xs = torch.arange(8.0, dtype=torch.float64).view(4, 2).tensor_split(2)
        outs = [stage(x) for x in xs]
        outs[1].sum().backward()
        outs[0].sum().backward()
    finally:
        counted_group.set_reporter(None)
    a, b = fingerprint(xs[0]), fingerprint(xs[1])
    assert a != b
    assert got == [("note", ("F", a)), ("note", ("F", b)), ("note", ("B", b)), ("note", ("B", a))]


# --- the order, judged from the notes and the calls -------------------------------------------


def _notes(*pairs):
    return [Note((kind, fingerprint(x))) for kind, x in pairs]


def test_the_order_is_told_by_the_fingerprints():
    micro = torch.randn(8, 3, dtype=torch.float64).tensor_split(2)
    events = _notes(("F", micro[1]), ("F", micro[0]), ("B", micro[0]), ("B", micro[1]))
    assert stage_order("c", "here", events, micro, 0, 2) == [
        ("F", 1),
        ("F", 0),
        ("B", 0),
        ("B", 1),
    ]
    with pytest.raises(CheckFailed, match="ran 3 forwards and 2 backwards"):
        stage_order("c", "here", [*events, *_notes(("F", micro[0]))], micro, 0, 2)
    with pytest.raises(CheckFailed, match="notes the check's wrapper does not write") as info:
        stage_order("c", "here", [Note(("F", 0)), *events], micro, 0, 2)
    assert info.value.tampering


def test_a_message_cannot_leave_before_what_it_carries():
    # Stage 1 of 3: its input is inputs[1], what it sends on is stage 2's input, inputs[2].
    inputs = [torch.randn(8, 16, dtype=torch.float64).tensor_split(2) for _ in range(3)]
    a0 = inputs[2][0].numel() * 8
    header = Sent("send", 2, 64, 0, (0, 1, 2))
    data = Sent("send", 2, a0, 0, (0, 1, 2))
    grad = Sent("send", 0, inputs[1][0].numel() * 8, 0, (0, 1, 2))
    order = [("F", 0), ("B", 0)]
    fine = [Note("F0"), header, data, Note("B0"), header, grad]
    judge_sends_follow("c", "here", fine, order, inputs, 1)
    for early in ([header, data, Note("F0"), Note("B0")], [Note("F0"), grad, Note("B0")]):
        with pytest.raises(CheckFailed, match="more than the") as info:
            judge_sends_follow("c", "here", early, order, inputs, 1)
        assert info.value.tampering and "tampering" in str(info.value)


# --- whole answers --------------------------------------------------------------------------


def test_a_log_rewritten_on_the_rank_no_longer_counts():
    # On main each of these passed 1F1B: the judge read the log the rank kept.
    for source in (LOG_REWRITTEN, LOG_REWRITTEN_ON_HEAP):
        step = planted("pipeline", "pipeline_step", source).pipeline_step
        check_pipeline_trainer(step, "gpipe", world_sizes=(2,), n_micro=(4,))
        with pytest.raises(CheckFailed) as info:
            check_pipeline_trainer(step, "1f1b", world_sizes=(2,), n_micro=(4,))
        assert "the stage held the activations of 4 micro-batches at once" in str(info.value)


def test_notes_forged_around_the_wrapper_are_refused():
    step = planted("pipeline", "pipeline_step", NOTES_FORGED).pipeline_step
    with pytest.raises(CheckFailed) as info:
        check_pipeline_trainer(step, "1f1b", world_sizes=(2,), n_micro=(4,))
    assert "runs course_lib.counted_group.mark, the grader's own code" in str(info.value)


def _report(note):
    """A note written straight to the launcher's pipe, around everything the provenance
    refuses (note, mark, the worker's reporter): code on the rank can add notes."""
    from course_lib import _worker
    from course_lib.protocol import Tally, encode

    _worker._conn.send_bytes(encode(Tally(_worker._call_id, ("note", note))))


def _fingerprint(x):
    """The wrapper's fingerprint, written again (the grader's own is not the rank's to call)."""
    v = x.detach().flatten().to(torch.float64)
    weights = torch.linspace(1.0, 2.0, len(v), dtype=torch.float64)
    return (tuple(x.shape), *(float(s) for s in (v.sum(), (v * weights).sum(), v.abs().sum())))


def _notes_added(stage, inputs, targets, loss_fn, n_micro, schedule):
    """Right 1F1B, and a note of its own: the count no longer fits."""
    loss = pipeline_step(stage, inputs, targets, loss_fn, n_micro, schedule)
    _report(("B", _fingerprint(inputs.tensor_split(n_micro)[0])))
    return loss


def _notes_at_the_end(stage, inputs, targets, loss_fn, n_micro, schedule):
    """GPipe on the module inside the wrapper, 1F1B's notes reported after it all."""
    r, P = rank(), world_size()
    seen = {}

    class Remember(torch.nn.Module):
        def forward(self, x):
            seen[len(seen)] = _fingerprint(x)
            return stage.stage(x)

    loss = pipeline_step(Remember(), inputs, targets, loss_fn, n_micro, "gpipe")
    warmup = min(P - r - 1, n_micro)
    order = [("F", i) for i in range(warmup)]
    for i in range(n_micro - warmup):
        order += [("F", warmup + i), ("B", i)]
    for kind, i in order + [("B", i) for i in range(n_micro - warmup, n_micro)]:
        _report((kind, seen[i]))
    return loss


@pytest.mark.parametrize(
    "fn, message",
    [
        (_notes_added, "the stage ran 4 forwards and 5 backwards"),
        (_notes_at_the_end, "more than the activations of the micro-batches whose forwards"),
    ],
)
def test_notes_the_rank_reports_itself_do_not_fit(fn, message):
    with pytest.raises(CheckFailed) as info:
        check_pipeline_trainer(fn, "1f1b", world_sizes=(2,), n_micro=(4,))
    assert message in str(info.value)


def test_answers_that_post_their_messages_in_another_order_pass():
    for source in (PIPELINE_RECEIVES_EARLY, PIPELINE_BY_OP_LIST):
        step = planted("pipeline", "pipeline_step", source).pipeline_step
        for schedule in ("gpipe", "1f1b"):
            check_pipeline_trainer(step, schedule, world_sizes=(1, 3, 4), n_micro=(2, 16))
        check_pipeline_trainer(step, "1f1b", world_sizes=(4,), models=("gpt",), n_micro=(4,))
