"""course_lib.plots: the ring widget draws what the schedule says (checked on the data behind
the drawing, not on pixels), and the small helpers show what they are given."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from matplotlib.figure import Figure
from matplotlib.text import Annotation

from course_lib.collectives import ALL_GATHER, REDUCE_SCATTER, ring_schedule, ring_state
from course_lib.plots import (
    PHASE_COLOURS,
    RingWidget,
    draw_ring_frame,
    plot_against_formula,
    ring_frame,
    ring_steps_figure,
    show_ranks,
)


def drawn(frame):
    """Draw `frame` and read back what is on the axes: image, cell texts, arrows."""
    ax = Figure().add_subplot()
    draw_ring_frame(frame, ax)
    image = np.asarray(ax.images[0].get_array())
    texts = {
        (round(t.get_position()[1]), round(t.get_position()[0])): t.get_text()
        for t in ax.texts
        if not isinstance(t, Annotation)
    }
    arrows = [a for a in ax.texts if isinstance(a, Annotation)]
    return image, texts, arrows


@pytest.mark.parametrize("p", [2, 3, 4, 6])
def test_each_frame_shows_the_state_and_sends_the_schedule_gives(p):
    schedule = ring_schedule(p)
    for k in range(len(schedule) + 1):
        frame = ring_frame(p, k)
        state = ring_state(p, k)
        image, texts, arrows = drawn(frame)
        # the shading is the share of ranks summed into each (rank, chunk)
        expected = np.array([[len(s) / p for s in row] for row in state])
        np.testing.assert_allclose(image, expected)
        # each cell names the ranks whose pieces it holds ("a+c"), or "sum" when complete
        for r in range(p):
            for c in range(p):
                label = texts[(r, c)]
                if len(state[r][c]) == p:
                    assert label == "sum"
                elif len(state[r][c]) > 4:  # too long to spell out: a count
                    assert label == f"{len(state[r][c])}/{p}"
                else:
                    assert label == "+".join("abcdefgh"[i] for i in sorted(state[r][c]))
        if k == len(schedule):
            assert frame.arrows == [] and arrows == [] and "full sum" in frame.title
            continue
        step = schedule[k]
        assert frame.arrows == [(r, (r + 1) % p, step.send[r]) for r in range(p)]
        assert frame.phase == step.phase and step.phase in frame.title
        # one arrow per rank, the wrap-around (last rank -> rank 0) drawn as two stubs
        assert len(arrows) == p + 1
        colours = {a.arrow_patch.get_edgecolor() for a in arrows}
        assert len(colours) == 1
        # every arrow sits in the column of the chunk it carries
        columns = sorted(round(a.xy[0] - 0.38) for a in arrows)
        sent = sorted(step.send) + [step.send[p - 1]]
        assert columns == sorted(sent)


def test_phases_are_drawn_in_different_colours():
    assert PHASE_COLOURS[REDUCE_SCATTER] != PHASE_COLOURS[ALL_GATHER]
    first = drawn(ring_frame(4, 0))[2][0].arrow_patch.get_edgecolor()
    last = drawn(ring_frame(4, 5))[2][0].arrow_patch.get_edgecolor()
    assert first != last


def test_widget_redraws_the_frame_for_the_chosen_step_and_ranks():
    widget = RingWidget(4)
    assert (widget.step.min, widget.step.max, widget.step.value) == (0, 6, 0)
    assert widget.frame == ring_frame(4, 0)
    for k in (3, 6, 1):
        widget.step.value = k
        assert widget.frame == ring_frame(4, k)
        image = np.asarray(widget.figure.axes[0].images[0].get_array())
        np.testing.assert_allclose(image, ring_frame(4, k).fraction)
    widget.ranks.value = 5
    assert (widget.step.max, widget.step.value) == (8, 0)
    assert widget.frame == ring_frame(5, 0)
    widget.step.value = 8
    assert widget.frame == ring_frame(5, 8) and widget.frame.phase is None


def test_widget_refuses_a_ring_of_one():
    with pytest.raises(ValueError, match="world"):
        RingWidget(1)


def test_the_static_strip_has_one_panel_per_frame():
    fig = ring_steps_figure(3)
    panels = [ax for ax in fig.axes if ax.images]
    assert len(panels) == 2 * (3 - 1) + 1
    final = np.asarray(panels[-1].images[0].get_array())
    assert (final == 1).all()


def test_figures_show_themselves_as_png_without_pyplot():
    png = ring_steps_figure(2)._repr_png_()
    assert png.startswith(b"\x89PNG")


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
