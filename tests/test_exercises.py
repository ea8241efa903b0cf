"""course_lib.exercises: the in-lecture checks say right, not yet or unanswered, never raise,
and never print the expected value of a number the student has to find."""

from __future__ import annotations

from course_lib.exercises import check_choice, check_number


def test_a_number_within_the_tolerance_is_right(capsys):
    assert check_number(1.01e6, 1e6, rtol=0.02, unit="bytes") is True
    assert "Right" in capsys.readouterr().out


def test_a_wrong_number_is_told_how_far_off_without_the_answer(capsys):
    assert check_number(2e6, 1e6, rtol=0.02, hint="Set the times equal.") is False
    out = capsys.readouterr().out
    assert "2x too large" in out and "Set the times equal." in out
    assert "1e+06" not in out and "1000000" not in out
    assert check_number(0.25e6, 1e6) is False
    assert "4x too small" in capsys.readouterr().out
    assert check_number(-1, 1) is False
    assert "wrong sign" in capsys.readouterr().out


def test_an_unanswered_exercise_says_so_and_passes_through(capsys):
    assert check_number(..., 1.0) is None
    assert check_choice(..., "ring", ["ring", "tree"]) is None
    assert capsys.readouterr().out.count("Not answered yet") == 2


def test_not_a_number_and_not_an_option_are_said_clearly(capsys):
    assert check_number("a lot", 1.0) is False
    assert "Expected a number" in capsys.readouterr().out
    assert check_choice("star", "ring", ["ring", "tree"]) is False
    assert "not one of 'ring', 'tree'" in capsys.readouterr().out


def test_a_prediction_is_checked_against_what_was_measured(capsys):
    assert check_choice("ring", "ring", ["ring", "tree"], why="Fewest bytes.") is True
    assert "Right: ring. Fewest bytes." in capsys.readouterr().out
    assert check_choice("tree", "ring", ["ring", "tree"], why="Fewest bytes.") is False
    assert "ring was" in capsys.readouterr().out
