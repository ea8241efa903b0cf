"""course_lib.plots: the small helpers show what they are given."""

from __future__ import annotations

import torch

from course_lib.plots import plot_against_formula, show_ranks


def test_plot_against_formula_draws_both_series():
    x = [1, 2, 3]
    fig = plot_against_formula(x, {"ring": [0, 4, 5]}, {"ring": [0, 4, 5.3]}, "P", "bytes")
    lines = {line.get_label(): list(line.get_ydata()) for line in fig.axes[0].lines}
    assert lines == {"ring: formula": [0, 4, 5.3], "ring: measured": [0, 4, 5]}


def test_show_ranks_prints_one_row_per_rank(capsys):
    show_ranks([{"before": torch.tensor([1, 2]), "after": None}, {"before": 3, "after": 4}])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["before", "after"]
    assert lines[1].split() == ["rank", "0", "[1,", "2]", "-"]
    assert lines[2].split() == ["rank", "1", "3", "4"]
