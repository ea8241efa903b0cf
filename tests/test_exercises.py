"""course_lib.exercises: the in-lecture checks say right, not yet or unanswered, never raise,
and never print the expected value of a number the student has to find."""

from __future__ import annotations

import torch

from course_lib.exercises import (
    check_bytes_on_8_ranks,
    check_choice,
    check_function,
    check_matrix,
    check_number,
    check_numbers,
    check_warm_speedup,
    faster,
    nearest_option,
    together,
    value_and_gradient,
)


def test_a_number_within_the_tolerance_is_right(capsys):
    assert check_number(1.01e6, 1e6, rtol=0.02, unit="bytes") is True
    assert "Right" in capsys.readouterr().out
    assert check_number(15.6, 16, rtol=0, atol=0.5) is True  # a whole number, told how close
    assert "checked to within ±0.5" in capsys.readouterr().out


def test_a_wrong_number_is_told_how_far_off_without_the_answer(capsys):
    assert check_number(2e6, 1e6, rtol=0.02, hint="Set the times equal.") is False
    out = capsys.readouterr().out
    assert "2x too large" in out and "Set the times equal." in out
    assert "1e+06" not in out and "1000000" not in out
    assert check_number(0.25e6, 1e6) is False
    assert "4x too small" in capsys.readouterr().out
    assert check_number(-1, 1) is False
    assert "wrong sign" in capsys.readouterr().out
    # a near miss (64 copies for 63) in percent, where "1x too large" would say nothing
    assert check_number(64, 63, rtol=0.005) is False
    assert "1.6% too large" in capsys.readouterr().out
    assert check_number(95, 100, rtol=0.01) is False
    assert "5.0% too small" in capsys.readouterr().out
    assert check_number(100.3, 100, rtol=0.005) is True
    assert "checked to within 0.5%" in capsys.readouterr().out


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


def test_a_prediction_too_close_to_call_accepts_either_and_a_clear_one_only_the_winner(capsys):
    assert faster({"EP": 0.100, "TP": 0.115}) == ("EP", "TP")  # 15% apart: within the margin
    assert faster({"EP": 0.100, "TP": 0.300}) == "EP"
    assert faster({"EP": 0.100, "TP": 0.119}, margin=0.1) == "EP"
    close = faster({"EP": 0.100, "TP": 0.115})
    for answer in ("EP", "TP"):
        assert check_choice(answer, close, ["EP", "TP"]) is True
        assert "too close to call" in capsys.readouterr().out
    assert check_choice("TP", faster({"EP": 0.1, "TP": 0.3}), ["EP", "TP"]) is False
    assert "EP was" in capsys.readouterr().out


def test_named_numbers_are_checked_one_by_one(capsys):
    expected = {"ddp": 112.0, "zero3": 1.75}
    assert check_numbers({"ddp": 112, "zero3": 1.75}, expected, unit="GB") is True
    assert capsys.readouterr().out.count("✓") == 2
    assert check_numbers({"ddp": 112, "zero3": 3.5}, expected, hint="Divide by P.") is False
    out = capsys.readouterr().out
    assert "zero3: ✗ Not yet: 3.5 is 2x too large. Divide by P." in out
    assert "1.75" not in out
    assert check_numbers({"ddp": 112}, expected) is False  # one right, one still unanswered
    assert "zero3: Not answered yet" in capsys.readouterr().out


def test_named_numbers_unanswered_or_misnamed(capsys):
    assert check_numbers(..., {"a": 1.0}) is None
    assert check_numbers({"a": ...}, {"a": 1.0}) is None
    assert capsys.readouterr().out.count("Not answered yet") == 2
    assert check_numbers({"b": 1.0}, {"a": 1.0}) is False
    assert "Unknown names ['b']: use 'a'" in capsys.readouterr().out
    assert check_numbers(3.0, {"a": 1.0}) is False
    assert "Expected a dict" in capsys.readouterr().out


def test_several_checks_of_one_exercise_give_one_verdict():
    assert together(True, True) is True
    assert together(True, False) is False and together(True, None) is False
    assert together(None, None) is None


def test_lecture_0s_bytes_on_8_ranks_is_checked_off_the_page(capsys):
    # worked by hand: N = 4 x 1,000,000 bytes, 2(P-1)/P N = 2 x 7/8 x 4e6 = 7e6 bytes
    assert check_bytes_on_8_ranks(7_000_000) is True
    assert "✓ Right: 7e+06 bytes" in capsys.readouterr().out
    assert check_bytes_on_8_ranks(6_000_000) is False  # the 4 ranks' number
    out = capsys.readouterr().out
    assert "1.2x too small" in out and "2(P-1)/P * N with P = 8" in out
    assert "7e+06" not in out and "7000000" not in out and "7,000,000" not in out
    assert check_bytes_on_8_ranks(...) is None
    assert "Not answered yet" in capsys.readouterr().out


def test_lecture_0s_warm_speedup_takes_the_option_nearest_the_run(capsys):
    # made up: 2.5 s to start fresh workers, 4 ms a warm call, 625x: nearest 1000x on a log scale
    assert check_warm_speedup("1000x", 2.5, 4.0) is True
    assert "a warm call is one message each" in capsys.readouterr().out
    assert check_warm_speedup("100x", 2.5, 4.0) is False
    assert "1000x was" in capsys.readouterr().out
    assert check_warm_speedup(..., 2.5, 4.0) is None


def first_rows(t, rank, size):
    return t.chunk(size, dim=0)[rank]


CASES = {
    f"rank {r} of {p}": (torch.arange(24.0).reshape(6, 4), r, p) for p in (1, 2) for r in range(p)
}


def test_a_function_that_agrees_on_every_case_is_right(capsys):
    assert check_function(lambda t, r, p: t[r * 6 // p : (r + 1) * 6 // p], first_rows, CASES)
    assert "Right on all 3 cases" in capsys.readouterr().out


def test_a_function_that_differs_is_told_where_and_how_not_what(capsys):
    columns = lambda t, r, p: t.chunk(p, dim=1)[r]  # noqa: E731
    assert check_function(columns, first_rows, CASES, hint="Rows of weight.") is False
    out = capsys.readouterr().out
    assert "on rank 0 of 2" in out and "shape (6, 2), which is not the right shape" in out
    assert "(3, 4)" not in out and "Rows of weight." in out
    shifted = lambda t, r, p: t.chunk(p, dim=0)[r] + 0.5  # noqa: E731
    assert check_function(shifted, first_rows, CASES) is False
    assert (
        "on rank 0 of 1, your function returned the right shape, but values off by up to 0.5"
        in (capsys.readouterr().out)
    )
    assert check_function(lambda t, r, p: 3, first_rows, CASES) is False
    assert "a int, not a tensor" in capsys.readouterr().out


def test_a_stub_or_a_crash_never_raises(capsys):
    def stub(t, r, p): ...  # the cell as shipped

    def todo(t, r, p):
        raise NotImplementedError

    assert check_function(..., first_rows, CASES) is None
    assert check_function(stub, first_rows, CASES) is None
    assert check_function(todo, first_rows, CASES) is None
    assert capsys.readouterr().out.count("Not answered yet") == 3
    assert check_function(lambda t, r, p: t[10], first_rows, CASES) is False
    assert "on rank 0 of 1, your function raised IndexError" in capsys.readouterr().out
    assert check_function("rows", first_rows, CASES) is False
    assert "Expected a function" in capsys.readouterr().out
    assert check_function(lambda x: x + 1, lambda x: x + 1.0, {"x = 1": (1,)}) is True
    assert check_function(lambda x: [x], lambda x: [x, x], {"x = 1": (1,)}) is False
    assert "returned [1], which is not the answer" in capsys.readouterr().out
    # L01's neighbours: a list where the reference returns a tuple is the same answer
    assert check_function(lambda r, p: [r - 1, r + 1], lambda r, p: (r - 1, r + 1), [(1, 3)])
    assert (
        check_function(lambda r, p: [r + 1, r - 1], lambda r, p: (r - 1, r + 1), [(1, 3)]) is False
    )


def test_a_function_is_tried_on_every_input_and_told_where_it_differs(capsys):
    def reference(n, p):
        return 2 * (p - 1) / p * n

    assert check_function(lambda n, p: 2 * (p - 1) * n / p, reference, [(8, 2), (8, 4)]) is True
    assert "Right on all 2 cases" in capsys.readouterr().out
    # right for P = 2 only: the check names the input where it differs, not the answer
    assert check_function(lambda n, p: n, reference, [(8, 2), (8, 4)]) is False
    out = capsys.readouterr().out
    assert "on (8, 4)" in out and "1.5x too small" in out and "12" not in out


def test_a_function_that_is_or_calls_the_reference_is_refused(capsys):
    """L08's `my_bubble` once passed as `return bubble_formula(P, m, v)`: agreeing with the
    course's own answer by calling it shows nothing. Helpers of its own, and the same factory's
    wrappers (value_and_gradient), are fine."""
    from course_lib.costs import bubble_formula

    def calls_it(P, m, v):
        return bubble_formula(P, m, v)

    def calls_it_nested(P, m, v):
        return (lambda: bubble_formula(P, m, v))()

    def writes_it(P, m, v):
        fill = (P - 1) / v
        return fill / (m + fill)

    cases = [(4, 8, 1), (8, 16, 4)]
    for candidate in (bubble_formula, calls_it, calls_it_nested):
        assert check_function(candidate, bubble_formula, cases) is False
        assert "uses bubble_formula" in capsys.readouterr().out
    assert check_function(writes_it, bubble_formula, cases) is True


def test_own_code_refuses_any_route_to_the_library(capsys):
    """With own_code=True (L08's `my_bubble`), calling the reference under another name, the
    library's module, or another course_lib function that computes the answer is refused,
    read from the globals, from a closure or seen running; code of its own, with math, passes."""
    import functools
    import math

    from course_lib import costs
    from course_lib.costs import bubble_formula as bf
    from course_lib.pipeline import simulate

    cases = [(4, 8, 1), (8, 16, 4)]

    def alias(P, m, v):
        return bf(P, m, v)

    def module(P, m, v):
        return costs.bubble_formula(P, m, v)

    def simulated(P, m, v):
        return simulate(P, m, "interleaved" if v > 1 else "1f1b", chunks=v).bubble

    def closure():
        formula = costs.bubble_formula
        return lambda P, m, v: formula(P, m, v)

    def fetched(P, m, v):  # no course_lib name in its code: seen only as it runs
        return getattr(__import__("course_lib.costs").costs, "bubble_" + "formula")(P, m, v)

    wrapped = functools.partial(costs.bubble_formula)
    for candidate in (alias, module, simulated, closure(), fetched, wrapped):
        assert check_function(candidate, costs.bubble_formula, cases, own_code=True) is False
        out = capsys.readouterr().out
        assert "✗ Not yet: your function uses" in out and "Right" not in out, candidate

    def writes_it(P, m, v):
        fill = (P - 1) / v
        return fill / math.fsum((m, fill))

    assert check_function(writes_it, costs.bubble_formula, cases, own_code=True) is True
    # without own_code, a library call under another name is not looked for (other lectures)
    assert check_function(alias, costs.bubble_formula, cases) is True


def test_a_function_that_raises_or_is_a_stub_is_told_so(capsys):
    assert check_function(..., abs, [(1,)]) is None
    assert check_function(lambda n: ..., abs, [(1,)]) is None
    assert capsys.readouterr().out.count("Not answered yet") == 2
    assert check_function(lambda n: 1 / 0, abs, [(1,)]) is False
    assert "on (1), your function raised ZeroDivisionError" in capsys.readouterr().out
    assert check_function(3, abs, [(1,)]) is False
    assert "Expected a function" in capsys.readouterr().out


def test_a_matrix_is_checked_entry_by_entry_without_showing_the_answer(capsys):
    expected = torch.tensor([[0.5, 0.5], [0.5, 0.5]])
    assert check_matrix([[0.5, 0.5], [0.5, 0.5]], expected) is True
    assert "Right: all 4 entries" in capsys.readouterr().out
    assert check_matrix([[0.5, 0.5], [0.25, 0.5]], expected) is False
    out = capsys.readouterr().out
    assert "1 entries wrong, in rows [1]" in out and "row sums off at [1]" in out
    assert "column sums off at [0]" in out
    assert check_matrix([[1.0]], expected) is False
    assert "your matrix is (1, 1), it should be (2, 2)" in capsys.readouterr().out
    assert check_matrix(..., expected) is None
    assert check_matrix("ring", expected) is False
    assert "Expected a matrix" in capsys.readouterr().out


def test_a_measured_ratio_picks_the_nearest_option_on_a_log_scale():
    options = {"10x": 10, "100x": 100, "1000x": 1000}
    assert nearest_option(40, options) == "100x"  # 40 is nearer 100 than 10 on a log scale
    assert nearest_option(30, options) == "10x"
    assert nearest_option(0.6, {"same": 1, "half": 0.5}) == "half"


class _Cube(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        return 3 * x**2 * grad_output


class _CubeIgnoringTheIncomingGradient(_Cube):
    @staticmethod
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        return 3 * x**2


def test_value_and_gradient_checks_forward_and_backward_together(capsys):
    x = (torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64),)
    reference = value_and_gradient(lambda t: t**3)
    assert check_function(value_and_gradient(_Cube.apply), reference, [x], rtol=1e-12)
    # Right values, a backward that drops dL/dy: the weighted sum makes the gradient differ.
    wrong = value_and_gradient(_CubeIgnoringTheIncomingGradient.apply)
    assert check_function(wrong, reference, [x], rtol=1e-12) is False
    assert check_function(value_and_gradient(lambda t: None), reference, [x]) is None
    assert "values off" in capsys.readouterr().out
