"""Lecture 8's exercise checks: each accepts the right answer, refuses a wrong one with a hint
that does not give it away, and says "Not answered yet" to the placeholder."""

from __future__ import annotations

from types import SimpleNamespace

from course_lib.costs import bubble_formula, zero_bubble_formula
from course_lib.measure.pipeline import (
    check_bubble_shares,
    check_first_backward,
    check_my_bubble,
    check_one_f_one_b_in_flight,
    check_zero_bubble_idle,
    check_zero_bubble_measured,
    simulate_zero_bubble,
)
from course_lib.pipeline import simulate


def test_my_bubble_check_refuses_the_library_and_takes_the_formula_written_out(capsys):
    def written(P, m, v):
        return (P - 1) / (v * m + P - 1)

    assert check_my_bubble(written) is True
    from course_lib.costs import bubble_formula as formula

    assert check_my_bubble(lambda P, m, v: formula(P, m, v)) is False
    assert check_my_bubble(lambda P, m, v: simulate(P, m, "interleaved", chunks=v).bubble) is False
    assert capsys.readouterr().out.count("from course_lib") == 2


def test_the_bubble_exercise_takes_7_over_15_7_over_71_and_227(capsys):
    """P = 8: (P-1)/(m+P-1) is 7/15 for m = 8 and 7/71 for m = 64; under 3% needs
    7/(m+7) < 0.03, m > 226.3, so 227 (by hand, not from the formula's code)."""
    right = {"P=8, m=8": 7 / 15, "P=8, m=64": 7 / 71}
    assert check_bubble_shares(right, 227) is True
    assert capsys.readouterr().out.count("✓ Right") == 3
    assert check_bubble_shares({**right, "P=8, m=8": 7 / 8}, 226) is False  # m = 1's bubble
    out = capsys.readouterr().out
    assert "Idle stage-time over all stage-time" in out and "m is a whole number" in out
    assert "0.4667" not in out and "227" not in out
    assert check_bubble_shares({"P=8, m=8": ..., "P=8, m=64": ...}, ...) is None
    assert "Not answered yet" in capsys.readouterr().out


def test_the_in_flight_check_reads_the_simulated_peaks_of_stages_0_and_3(capsys):
    one_f = SimpleNamespace(peak_in_flight=lambda s: 4 - s)  # made up: P - s, P = 4
    assert check_one_f_one_b_in_flight("4", "1", one_f) == (True, True)
    assert "Stage s holds at most P - s" in capsys.readouterr().out
    assert check_one_f_one_b_in_flight("8", "2", one_f) == (False, False)  # GPipe holds all m
    assert check_one_f_one_b_in_flight(..., ..., one_f) == (None, None)


def test_the_zero_bubble_check_takes_the_nearest_share_of_1f1bs_idle_time(capsys):
    one_f = SimpleNamespace(makespan=30.0, bubble=0.3)  # made up: 9 idle per stage
    deferred = SimpleNamespace(makespan=24.0, bubble=0.125)  # 3 idle: a third
    assert check_zero_bubble_idle("a third of", one_f, deferred) is True
    assert "0.33 of 1F1B's idle time" in capsys.readouterr().out
    assert check_zero_bubble_idle("half of", one_f, deferred) is False
    assert check_zero_bubble_idle(..., one_f, deferred) is None


def test_the_measured_zero_bubble_check_reads_the_runs_bubbles_and_ws_owed(capsys):
    """Simulated timelines stand in for the runs: 1F1B's bubble (P-1)/(m+P-1), the deferred
    schedule's (P-1)(F+B-W) idle beside m(F+B+W) (the formulas of course_lib.costs), and the
    last stage owing all m = 8 W's at once."""
    deferred = simulate_zero_bubble(4, 8, defer_w=True)
    runs = {"1f1b": simulate(4, 8, "1f1b", forward_s=1, backward_s=2), deferred.schedule: deferred}
    right = {"1f1b": bubble_formula(4, 8), deferred.schedule: zero_bubble_formula(4, 8)}
    assert check_zero_bubble_measured(right, 8, runs, deferred.schedule) == (True, True)
    # the formulas stay right when the machine adds 4 points of idle time of its own
    late = {name: 0.04 + value for name, value in right.items()}
    assert check_zero_bubble_measured(late, 8, runs, deferred.schedule) == (True, True)
    capsys.readouterr()
    wrong = {"1f1b": 0.5, deferred.schedule: 0.0}
    assert check_zero_bubble_measured(wrong, 1, runs, deferred.schedule) == (False, False)
    assert "Which stage runs each B soonest" in capsys.readouterr().out
    assert check_zero_bubble_measured(..., ..., runs, deferred.schedule) == (None, None)


def test_the_first_backward_check_finds_the_rank_whose_b0_started_first(capsys):
    def log(stage, b0_start):  # made up: each rank's forward of micro-batch 0, then its B
        tasks = [
            SimpleNamespace(kind="F", micro=0, start=stage),
            SimpleNamespace(kind="B", micro=0, start=b0_start),
        ]
        return SimpleNamespace(stage=stage, tasks=tasks)

    logs = [log(0, 9.0), log(1, 8.0), log(2, 7.0), log(3, 6.0)]
    assert check_first_backward("rank 3", logs) is True
    assert "on the last rank" in capsys.readouterr().out
    assert check_first_backward("rank 0", logs) is False
    assert check_first_backward(..., logs) is None
