"""The leaderboard of the open parts: what a check measures reaches the gradebook (judge,
verdicts, `measurements`), a parallel grading merges it, and `make leaderboard` ranks the
passing submissions under a chosen display name or an anonymous id, escaped.

The unit tests need no nbgrader run; the last test (e2e) reads the page `make leaderboard`
writes for the class tests/grading_course.py grades.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from html.parser import HTMLParser
from pathlib import Path

import nbformat
import pytest
from nbgrader.api import Gradebook

from course_lib.grading import leaderboard, measurements
from course_lib.grading.batch import NOT_GRADED, STATUS, merge, scratch_course
from course_lib.grading.judge import grade
from course_lib.grading.verdicts import apply_verdicts
from tests.conftest import require_sandbox

MEASURE = (
    "from course_lib.grading._harness import measured\n"
    "measured('check_x', 'rounds', {value}, 'rounds', better='lower')\n"
)


def cell(cell_id: str, role: str, source: str, points: float = 0) -> dict:
    return {"id": cell_id, "role": role, "source": source, "points": points}


def test_what_a_check_measured_comes_out_with_its_cells_verdict_only():
    """The judge hands each test cell's verdict what its checks measured in the judge's own
    process, and nothing of another cell's."""
    verdicts = list(
        grade(
            [
                cell("test_open", "test", MEASURE.format(value=3), points=2),
                cell("test_other", "test", "x = 1", points=1),
            ]
        )
    )
    assert verdicts[0].measurements == [
        {"check": "check_x", "name": "rounds", "value": 3.0, "unit": "rounds", "better": "lower"}
    ]
    assert verdicts[0].score == 2 and verdicts[1].measurements == []


def test_a_cell_that_calls_a_check_twice_measures_the_sum_or_the_worst():
    """Hidden tests call the check again: bytes add up, a ratio keeps its worst."""
    twice = MEASURE.format(value=3) + MEASURE.format(value=4)
    ratio = "measured('check_y', 'balance', {v}, 'x', better='{b}', combine='worst')\n"
    imported = MEASURE.splitlines()[0] + "\n"
    worst = imported + "".join(ratio.format(v=v, b="lower") for v in (1.5, 1.2))
    best = imported + "".join(ratio.format(v=v, b="higher") for v in (0.9, 0.7))
    found = [v.measurements for v in grade([cell("t", "test", s) for s in (twice, worst, best)])]
    assert [[m["value"] for m in ms] for ms in found] == [[7.0], [1.5], [0.7]]


def test_a_measure_must_say_which_way_is_better():
    from course_lib.grading._harness import measured, take_measurements

    with pytest.raises(ValueError, match="better"):
        measured("check_x", "bytes", 1, "B", better="smaller")
    assert take_measurements() == []


def notebook(name_source: str | None, measured_value: float, score: float):
    """A graded notebook as `apply_verdicts` leaves it: one open test cell worth 2 points that
    measured `measured_value` and scored `score`, and the display-name cell."""
    test = nbformat.v4.new_code_cell("check_x(answer)")
    test.metadata["nbgrader"] = {"grade": True, "solution": False, "grade_id": "test_open"}
    test.metadata["nbgrader"]["points"] = 2
    cells = [test]
    if name_source is not None:
        name = nbformat.v4.new_code_cell(name_source)
        name.metadata["nbgrader"] = {"grade": False, "solution": True, "grade_id": "name"}
        cells.insert(0, name)
    nb = nbformat.v4.new_notebook(cells=cells)
    measure = {"check": "check_x", "name": "rounds", "value": measured_value}
    measure |= {"unit": "rounds", "better": "lower"}
    verdict = {"id": "test_open", "score": score, "points": 2, "outputs": []}
    apply_verdicts(nb, {"test_open": verdict | {"measurements": [measure]}}, logging.getLogger())
    return nb


def resources(db: Path, student: str) -> dict:
    info = {"db_url": f"sqlite:///{db}", "student": student, "assignment": "a01"}
    return {"nbgrader": info | {"notebook": "a01"}}


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ('LEADERBOARD_NAME = "Ada"', "Ada"),
        ('LEADERBOARD_NAME = ""', ""),
        ('LEADERBOARD_NAME = "  two\\n lines\\x00 "', "two lines"),
        ('LEADERBOARD_NAME = "a"\nLEADERBOARD_NAME = "b"', "b"),
        ("LEADERBOARD_NAME = open('/etc/passwd').read()", ""),  # never run: a literal only
        ("LEADERBOARD_NAME = 'x' * 100", ""),
        (f'LEADERBOARD_NAME = "{"x" * 100}"', "x" * measurements.MAX_NAME),
        ("this is not python (", ""),
        ('LEADERBOARD_NAME = "Anonymous-1234abcd"', ""),  # would pass for someone else's id
    ],
)
def test_the_display_name_is_the_string_literal_the_notebook_assigns(source, expected):
    assert measurements.display_name(notebook(source, 1, 2)) == expected


def test_autograde_stores_the_measurement_and_a_regrade_replaces_it(tmp_path):
    db = tmp_path / "gradebook.db"
    measurements.save(notebook('LEADERBOARD_NAME = "Ada"', 5, 2), resources(db, "s1"))
    measurements.save(notebook(None, 7, 1), resources(db, "s2"))
    measurements.save(notebook('LEADERBOARD_NAME = "Ada L."', 4, 2), resources(db, "s1"))
    rows = {r["student"]: r for r in measurements.rows(db)}
    assert {s: (r["value"], r["score"], r["display_name"]) for s, r in rows.items()} == {
        "s1": (4.0, 2.0, "Ada L."),
        "s2": (7.0, 1.0, ""),
    }
    assert rows["s1"]["part"] == "test_open" and rows["s1"]["points"] == 2


def test_merge_copies_a_submissions_measurements_and_drops_an_ungraded_ones(tmp_path, monkeypatch):
    """`batch.merge` (JOBS=N) copies each scratch gradebook's rows of its submission into the
    course's, replacing older ones, and a submission the grader failed on loses its rows."""
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    course_db = tmp_path / "gradebook.db"
    with Gradebook(f"sqlite:///{course_db}") as gradebook:
        gradebook.add_assignment("a01")
        gradebook.add_notebook("a01", "a01")
        gradebook.add_grade_cell("test_open", "a01", "a01", max_score=2, cell_type="code")
        for student in ("ok", "broken", "other"):
            gradebook.add_student(student)
            gradebook.add_submission("a01", student)
    for student, value in (("ok", 9), ("broken", 9), ("other", 6)):  # an older grading's
        measurements.save(notebook(None, value, 2), resources(course_db, student))
    for student in ("ok", "broken"):
        scratch = scratch_course(tmp_path, student, "a01")
        scratch.mkdir(parents=True)
        (scratch / "gradebook.db").write_bytes(course_db.read_bytes())
        (scratch / STATUS).write_text('{"exit_code": 0}')
    ok_db = scratch_course(tmp_path, "ok", "a01") / "gradebook.db"
    measurements.save(notebook('LEADERBOARD_NAME = "Okay"', 3, 2), resources(ok_db, "ok"))
    cause = {"student": "broken", "assignment": "a01", "notebook": "a01", "cause": "no judge"}
    (scratch_course(tmp_path, "broken", "a01") / NOT_GRADED).write_text(json.dumps(cause))

    merge(tmp_path)

    rows = {r["student"]: (r["value"], r["display_name"]) for r in measurements.rows(course_db)}
    assert rows == {"ok": (3.0, "Okay"), "other": (6.0, "")}


def row(student: str, value: float, score: float = 2, name: str = "", **kw) -> dict:
    base = {"assignment": "a01", "notebook": "a01", "part": "test_open", "check_name": "check_x"}
    base |= {"name": "rounds", "unit": "rounds", "better": "lower", "points": 2}
    return base | {"student": student, "value": value, "score": score, "display_name": name} | kw


def test_only_passing_parts_are_ranked_best_first_ties_sharing_a_rank():
    rows = [
        row("s1", 5, name="Five"),
        row("s2", 3, name="Three"),
        row("s3", 5, name="Also five"),
        row("s4", 1, score=1.5, name="Partial"),  # the part did not pass: not ranked
        row("s5", 9, better="higher", part="test_other", name="Up"),
        row("s6", 12, better="higher", part="test_other", name="Higher"),
    ]
    boards = leaderboard.boards(rows, b"key")
    ranked = {b.part: [(e.rank, e.name, e.value) for e in b.entries] for b in boards}
    assert ranked == {
        "test_open": [(1, "Three", 3.0), (2, "Also five", 5.0), (2, "Five", 5.0)],
        "test_other": [(1, "Higher", 12.0), (2, "Up", 9.0)],
    }


def test_the_anonymous_id_is_stable_keyed_and_not_the_student_id(tmp_path):
    secret = leaderboard.course_secret(tmp_path)
    assert leaderboard.course_secret(tmp_path) == secret  # kept in the course folder
    assert (tmp_path / leaderboard.SECRET).stat().st_mode & 0o077 == 0
    ids = {s: leaderboard.anonymous_id(secret, s) for s in ("jdoe42", "asmith7")}
    assert len(set(ids.values())) == 2
    assert all(s not in i for s, i in ids.items())
    assert leaderboard.anonymous_id(secret, "jdoe42") == ids["jdoe42"]
    assert leaderboard.anonymous_id(b"another course", "jdoe42") != ids["jdoe42"]
    (board,) = leaderboard.boards([row("jdoe42", 4)], secret)
    assert [(e.name, e.chosen) for e in board.entries] == [(ids["jdoe42"], False)]


class Text(HTMLParser):
    """The text of a page and the tags it has."""

    def __init__(self) -> None:
        super().__init__()
        self.text, self.tags = [], []

    def handle_starttag(self, tag, attrs) -> None:
        self.tags.append(tag)

    def handle_data(self, data) -> None:
        self.text.append(data)


def read_page(html: str) -> Text:
    parser = Text()
    parser.feed(html)
    return parser


def test_a_display_name_shows_as_text_never_as_markup():
    evil = '<script>alert("x")</script><img src=x onerror=alert(1)>'
    html = leaderboard.page(leaderboard.boards([row("s1", 2, name=evil)], b"key"))
    page = read_page(html)
    assert "script" not in page.tags and "img" not in page.tags
    assert evil in "".join(page.text)
    assert "<link" not in html and "http" not in html  # static, no external assets


def test_the_page_names_no_student_id_unless_chosen():
    rows = [row("jdoe42", 2), row("asmith7", 3, name="Alice")]
    text = "".join(read_page(leaderboard.page(leaderboard.boards(rows, b"key"))).text)
    assert "jdoe42" not in text and "asmith7" not in text and "Alice" in text


OPEN_PARTS = {  # the assignments whose open part reports a measurement, and its test cell
    "a01_processes": "test_spread",
    "a02_collectives": "test_all_reduce_fast",
    "a03_data_parallel": "test_communicate_less",
    "a04_gossip": "test_schedule",
    "a05_compression": "test_compressed_training",
    "a07_zero": "test_zero3_peak",
    "a08_pipeline": "test_split_schedule",
    "a09_tensor_parallel": "test_vocab_loss",
    "a10_parallel_3d": "test_sharded_adamw",
    "a11_sequence_parallel": "test_balanced",
    "a12_expert_parallel": "test_dedup",
}


@pytest.mark.parametrize("folder", ["solutions", "assignments"])
@pytest.mark.parametrize("assignment", sorted(OPEN_PARTS))
def test_the_notebook_says_what_is_published_and_offers_the_name_cell(assignment, folder):
    """After the open part's test cell: what the leaderboard publishes, then the name cell,
    anonymous until the student writes a name (a plain cell: nbgrader keeps what they wrote)."""
    from tests.conftest import ROOT

    nb = nbformat.read(ROOT / folder / assignment / f"{assignment}.ipynb", as_version=4)
    ids = [c.id for c in nb.cells]
    at = ids.index(OPEN_PARTS[assignment])
    assert ids[at + 1 : at + 3] == ["leaderboard_md", "leaderboard_name"]
    text = " ".join(nb.cells[at + 1].source.split())
    assert all(w in text for w in ("leaderboard", "anonymous", "student id", "never your code"))
    assert measurements.display_name(nb) == "" and "nbgrader" not in nb.cells[at + 2].metadata


# --- end to end: the graded class ----------------------------------------------------------


def table_rows(html: str) -> list[list[str]]:
    """Every table row's cells' text."""
    rows: list[list[str]] = []

    class Rows(HTMLParser):
        def handle_starttag(self, tag, attrs) -> None:
            if tag == "tr":
                rows.append([])
            elif tag in ("td", "th"):
                rows[-1].append("")

        def handle_data(self, data) -> None:
            if rows and rows[-1]:
                rows[-1][-1] += data

    Rows().feed(html)
    return [[cell.strip() for cell in row] for row in rows]


@pytest.mark.timeout(3600)  # the class is graded first, as for test_autograde.py
@require_sandbox
def test_make_leaderboard_ranks_the_graded_class(graded_course):
    """The class of tests/grading_course.py: "solver" chose no display name, "ada" chose
    `grading_course.LEADERBOARD[2]` (markup, which must show as text). Both passed a01's open
    part with the same solution, so they share a rank and a value; the blank release failed
    it and is not ranked. No student id appears on the page."""
    from tests.grading_course import LEADERBOARD, make

    course, _ = graded_course
    make(course, "leaderboard")
    html = (course / "leaderboard" / "index.html").read_text()
    secret = leaderboard.course_secret(course)
    assignment, student, chosen = LEADERBOARD
    spread = html.split(f"<h2>{assignment}: test_spread</h2>")[1].split("</table>")[0]
    ranked = {cells[1]: cells for cells in table_rows(spread)[1:]}
    solver = leaderboard.anonymous_id(secret, "solver")
    assert ranked[chosen][0] == ranked[solver][0] and ranked[chosen][2] == ranked[solver][2]
    assert ranked[solver][3] == "2"  # the part's points, all earned
    assert leaderboard.anonymous_id(secret, "blank") not in ranked
    assert all(name == chosen or name.startswith("anonymous-") for name in ranked)
    assert "<script" not in html.lower()
    page = "".join(read_page(html).text)
    assert not {"solver", "blank", student} & set(page.replace("-", " ").split())


# --- the open checks report what they measured ---------------------------------------------

CHAIN = '''
def spread(tensor):
    """Rank r passes the message on to rank r + 1: P - 1 rounds, too many."""
    import torch.distributed as dist

    r, p = dist.get_rank(), dist.get_world_size()
    if r:
        dist.recv(tensor, src=r - 1)
    if r + 1 < p:
        dist.send(tensor, dst=r + 1)
'''


def defined(source: str) -> dict:
    """What `source` defines, in a namespace no rank can import: shipped by value."""
    namespace = {"__name__": "leaderboard_answers"}
    exec(compile(source, "<answer>", "exec"), namespace)  # noqa: S102
    return namespace


def test_spread_reports_its_rounds_and_a_failing_spread_reports_nothing():
    """a01's open part measures the rounds (1 on 2 ranks, 2 on 3), from the launcher's
    tallies; a chain, too slow on 5 ranks, fails and measures nothing."""
    from course_lib.grading import CheckFailed, check_spread
    from course_lib.grading._harness import take_measurements
    from tests.adapters import solution

    take_measurements()
    check_spread(solution("processes").spread, world_sizes=(2, 3))
    (m,) = take_measurements()
    assert (m["check"], m["value"], m["unit"]) == ("check_spread", 3, "rounds")
    with pytest.raises(CheckFailed, match="rounds allowed"):
        check_spread(defined(CHAIN)["spread"], world_sizes=(5,))
    assert take_measurements() == []


def test_all_reduce_fast_reports_the_busiest_ranks_bytes():
    """a02's open part: on 2 ranks a float32 tensor of 4 elements, each rank sends its half
    to be summed and its summed half back: 16 bytes, as the launcher counted them."""
    import torch

    from course_lib.grading import check_all_reduce_fast
    from course_lib.grading._harness import take_measurements
    from tests.adapters import solution

    take_measurements()
    fast = solution("collectives").all_reduce_fast
    check_all_reduce_fast(fast, world_sizes=(2,), shapes=((4,),), dtypes=(torch.float32,))
    (m,) = take_measurements()
    assert (m["check"], m["value"], m["unit"]) == ("check_all_reduce_fast", 16, "B")


def _budgets() -> dict:
    """topic -> (check, the solution's answers, keyword arguments, its measure's limit)."""
    from course_lib import grading
    from course_lib.grading import (
        data_parallel_budget,
        expert_parallel_dedup,
        gossip_schedule,
        sequence_parallel_balance,
        tensor_parallel_loss,
    )
    from course_lib.grading.compression_budget import byte_budget
    from course_lib.grading.compression_cases import TrainRun
    from course_lib.grading.pipeline_schedule import makespan_allowed

    return {
        "data_parallel": (
            grading.check_communicate_less, ("communicate_less",), {"world_sizes": (2,)},
            100 * data_parallel_budget.BYTES_FRACTION,
        ),
        "gossip": (
            grading.check_one_peer_schedule, ("peer", "push_sum_step"), {"world_sizes": (4,)},
            gossip_schedule.THRESHOLD,
        ),
        "compression": (
            grading.check_compressed_training, ("Compressor",), {}, byte_budget(TrainRun(4, 0, 60)),
        ),
        "tensor_parallel": (
            grading.check_vocab_parallel_cross_entropy, ("vocab_parallel_cross_entropy",),
            {"world_sizes": (2,)}, tensor_parallel_loss.NUMBERS_PER_TOKEN,
        ),
        "sequence_parallel": (
            grading.check_balanced_backward, ("layout", "balanced_attention_backward"),
            {"world_sizes": (2, 3)}, sequence_parallel_balance.BALANCE,
        ),
        "expert_parallel": (
            grading.check_moe_dedup, ("dedup_moe",), {"world_sizes": (2,)},
            100 * expert_parallel_dedup.DEDUP_FRACTION,
        ),
        # a07, a08, a10: a share of the budget (peak, state kept) or the simulated units
        "zero": (grading.check_zero3_peak, ("shard_module",), {"steps": 1}, 100),
        "pipeline": (
            grading.check_split_schedule, ("split_schedule",), {},
            makespan_allowed(4, 4) + makespan_allowed(4, 8),
        ),
        "parallel_3d": (
            grading.check_sharded_adamw, ("make_groups", "GPT2D", "ShardedAdamW"), {}, 100,
        ),
    }  # fmt: skip


@pytest.mark.parametrize(
    "topic",
    [
        "data_parallel",
        "gossip",
        "compression",
        "tensor_parallel",
        "sequence_parallel",
        "expert_parallel",
        "zero",
        "pipeline",
        "parallel_3d",
    ],
)
def test_an_open_check_reports_the_value_it_judged_within_its_limit(topic):
    """The solution passes the open part and reports one measurement: the value the check
    held to the part's limit (lower is better), so at most that limit."""
    from course_lib.grading._harness import take_measurements
    from tests.adapters import solution

    check, names, kwargs, limit = _budgets()[topic]
    answers = solution(topic)
    take_measurements()
    check(*(getattr(answers, n) for n in names), **kwargs)
    (m,) = take_measurements()
    assert m["check"] == check.__name__ and m["better"] == "lower"
    assert 0 <= m["value"] <= limit, m
