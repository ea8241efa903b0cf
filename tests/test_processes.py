"""course_lib.processes: message timings over Pipe/Queue and gloo, the alpha-beta fit, the plots;
course_lib.measure.processes: the lecture's exercises checked off the page."""

from __future__ import annotations

import sys

import matplotlib
import numpy as np
import pytest

from course_lib import CommCounter, RankError, WorkerPool
from course_lib.measure.processes import (
    check_first_deadlock,
    check_seconds_for_256MB,
    check_threads_and_processes_take,
    check_unchanged_run,
)
from course_lib.processes import (
    LinkFit,
    fit_latency_bandwidth,
    hogwild,
    overlap_times,
    p2p_message_times,
    pipe_message_times,
    pipe_send_send_finishes,
    plot_message_times,
    plot_overlap,
    ring_neighbours,
    threads_vs_processes,
)

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 (after choosing the backend)

SIZES = [1024, 4 * 1024**2]


@pytest.fixture(scope="module")
def pool1():
    with WorkerPool(1) as pool:
        yield pool


@pytest.fixture(scope="module")
def pool2():
    with WorkerPool(2) as pool:
        yield pool


# --- the fit ------------------------------------------------------------------------------


def test_fit_recovers_exact_latency_and_bandwidth():
    sizes = np.array([2**k for k in range(10, 27, 2)], dtype=float)
    fit = fit_latency_bandwidth(sizes, 50e-6 + sizes / 2e9)
    assert fit.alpha == pytest.approx(50e-6, rel=1e-9)
    assert fit.bandwidth == pytest.approx(2e9, rel=1e-9)


def test_fit_is_least_squares_in_relative_error():
    # Reference: numpy's weighted polyfit minimises sum((w * (y - p(x)))^2); w = 1/t makes
    # that the relative error.
    rng = np.random.default_rng(0)
    sizes = np.array([2**k for k in range(10, 27, 2)], dtype=float)
    times = (30e-6 + sizes / 1e9) * np.exp(rng.normal(0, 0.2, sizes.size))
    slope, intercept = np.polyfit(sizes, times, 1, w=1 / times)
    fit = fit_latency_bandwidth(sizes, times)
    assert intercept > 0
    assert fit.alpha == pytest.approx(intercept, rel=1e-9)
    assert fit.beta == pytest.approx(slope, rel=1e-9)


def test_fit_pins_a_negative_latency_at_zero():
    sizes = np.array([1e6, 4e6, 16e6, 64e6])
    times = sizes / 1e9 - 1e-4  # a line through a negative intercept
    fit = fit_latency_bandwidth(sizes, times)
    # Reference: the best line through the origin, t = n * x, in relative error.
    (x,), *_ = np.linalg.lstsq((sizes / times)[:, None], np.ones(4), rcond=None)
    assert fit.alpha == 0.0
    assert fit.beta == pytest.approx(x, rel=1e-9)


@pytest.mark.parametrize(
    "sizes, times, words",
    [
        ([1, 2, 3], [1.0, 2.0], "one time per size"),
        ([5], [1.0], "at least two different sizes"),
        ([5, 5], [1.0, 2.0], "at least two different sizes"),
        ([1, 2], [1.0, 0.0], "positive"),
        ([1, 2], [2.0, 1.0], "do not grow"),
    ],
)
def test_fit_rejects_bad_input(sizes, times, words):
    with pytest.raises(ValueError, match=words):
        fit_latency_bandwidth(sizes, times)


def test_link_fit_predicts_and_prints():
    fit = LinkFit(alpha=1e-4, bandwidth=1e9)
    np.testing.assert_allclose(fit.predict([0, 1e9]), [1e-4, 1 + 1e-4], rtol=1e-12)
    assert str(fit) == "alpha = 100.0 us, 1/beta = 1.00 GB/s"


def test_the_256MB_exercise_is_checked_against_the_fit_it_names(capsys):
    fit = LinkFit(alpha=50e-6, bandwidth=2e9)
    # worked by hand: 50 us + 256 x 1024**2 B / 2e9 B/s = 0.000050 + 0.134217728 s
    assert check_seconds_for_256MB(0.134267728, fit) is True
    assert "✓ Right: 0.1343 s" in capsys.readouterr().out
    assert check_seconds_for_256MB(0.268, fit) is False
    out = capsys.readouterr().out
    assert "2x too large" in out and "beta = 1 / bandwidth in seconds per byte" in out
    assert "0.1343" not in out and "0.134" not in out
    assert check_seconds_for_256MB(..., fit) is None
    assert "Not answered yet" in capsys.readouterr().out


# --- the plots ----------------------------------------------------------------------------


def test_plot_message_times_draws_points_and_fitted_line():
    sizes = [1e3, 1e5, 1e7]
    times = [2e-5, 1.2e-4, 1.1e-2]
    fig, ax = plt.subplots()
    fit = plot_message_times(ax, sizes, times, "pipe")
    points, line = ax.get_lines()
    np.testing.assert_allclose(points.get_xydata(), np.c_[sizes, times])
    np.testing.assert_allclose(line.get_ydata(), fit.predict(sizes))
    assert fit == fit_latency_bandwidth(sizes, times)
    assert (ax.get_xscale(), ax.get_yscale()) == ("log", "log")
    assert line.get_linestyle() == "--" and line.get_color() == points.get_color()
    plt.close(fig)


def test_plot_overlap_draws_the_three_times_and_their_sum():
    fig, ax = plt.subplots()
    plot_overlap(ax, {"compute": 0.02, "communicate": 0.01, "overlapped": 0.025})
    heights = [bar.get_height() for bar in ax.patches]
    np.testing.assert_allclose(heights, [20, 10, 25, 30])
    assert [t.get_text() for t in ax.get_xticklabels()][-1] == "sum"
    plt.close(fig)


# --- multiprocessing ----------------------------------------------------------------------


def grows(measure, factor: float, attempts: int = 3) -> list[float]:
    """Timings from `measure()` until the large size costs over `factor` x the small one.
    A shared machine can stall any single timing; a size that really costs nothing more
    fails every attempt."""
    for _ in range(attempts):
        times = measure()
        if times[1] > factor * times[0]:
            break
    return times


@pytest.mark.parametrize("channel", ["pipe", "queue"])
def test_pipe_message_times_grow_with_the_size(pool1, channel):
    times = grows(lambda: pool1.launch(pipe_message_times, SIZES, 2, channel, timeout=60)[0], 10)
    assert len(times) == len(SIZES) and all(t > 0 for t in times)
    # 4 MB is 4096x the bytes of 1 KB: it takes far longer
    assert times[1] > 10 * times[0], times


def test_pipe_message_times_rejects_an_unknown_channel(pool1):
    with pytest.raises(RankError, match="channel must be one of"):
        pool1.launch(pipe_message_times, SIZES, 2, "socket", timeout=30)


def test_forking_helpers_refuse_to_run_in_a_notebook_kernel(monkeypatch):
    monkeypatch.setitem(sys.modules, "ipykernel", sys)  # looks like a Jupyter kernel
    monkeypatch.delenv("COURSE_LIB_WORKER", raising=False)
    for fn, args in [
        (pipe_message_times, (SIZES,)),
        (pipe_send_send_finishes, (10,)),
        (threads_vs_processes, (10,)),
        (hogwild, (2, 10)),
    ]:
        with pytest.raises(RuntimeError, match=r"world_size=1"):
            fn(*args)


def test_pipe_send_send_finishes_for_small_messages_and_deadlocks_for_large(pool1):
    small, large = pool1.launch(
        lambda: [pipe_send_send_finishes(1024, 5.0), pipe_send_send_finishes(16 * 1024**2, 1.0)],
        timeout=30,
    )[0]
    assert small is True
    assert large is False  # each 16 MB send waits for a reader that is itself sending


def test_threads_vs_processes_times_the_three_ways(pool1):
    (seconds,) = pool1.launch(threads_vs_processes, 10_000, 2, timeout=30)
    assert list(seconds) == ["one after another", "threads", "processes"]
    assert all(s > 0 for s in seconds.values())


# --- torch.distributed point-to-point -----------------------------------------------------


def counted_p2p_times(sizes, repeats):
    with CommCounter() as counter:
        times = p2p_message_times(sizes, repeats)
    return times, dict(counter.by_op), dict(counter.calls)


def test_p2p_message_times_sends_each_size_and_agree_on_both_ranks(pool2):
    repeats = 2
    (t0, ops0, calls0), (t1, ops1, calls1) = pool2.launch(
        counted_p2p_times, SIZES, repeats, timeout=60
    )
    assert t0 == t1 and len(t0) == len(SIZES) and all(t > 0 for t in t0)
    messages = repeats + 1  # one warm-up per size
    assert ops0["send"] == [messages * sum(SIZES), 0] and calls0["send"] == messages * len(SIZES)
    assert ops1["recv"] == [0, messages * sum(SIZES)] and calls1["recv"] == messages * len(SIZES)
    assert "recv" not in ops0 and "send" not in ops1


def test_p2p_message_times_grow_with_the_size(pool2):
    times = grows(lambda: pool2.launch(p2p_message_times, SIZES, 3, timeout=60)[0], 1)
    assert times[1] > times[0], times  # 4 MB against 1 KB


def counted_overlap(nbytes, compute):
    with CommCounter() as counter:
        seconds = overlap_times(nbytes, compute, 0.002, repeats=1)
    return seconds, dict(counter.by_op)


@pytest.mark.parametrize("compute", ["cpu", "offloaded"])
def test_overlap_times_moves_the_message_twice_per_attempt(pool2, compute):
    nbytes = 100_000
    (s0, ops0), (s1, ops1) = pool2.launch(counted_overlap, nbytes, compute, timeout=60)
    assert s0 == s1 and list(s0) == ["compute", "communicate", "overlapped"]
    assert all(v > 0 for v in s0.values())
    # 2 attempts (warm-up + 1), each with a transfer alone and one overlapped
    assert ops0["isend"] == [4 * nbytes, 0] and ops1["irecv"] == [0, 4 * nbytes]
    if compute == "offloaded":
        assert s0["compute"] >= 0.002 and s0["overlapped"] >= 0.002  # it sleeps that long


def test_p2p_helpers_reject_bad_arguments(pool2):
    with pytest.raises(RankError, match="two different ranks"):
        pool2.launch(p2p_message_times, SIZES, 1, 0, 0, timeout=30)
    with pytest.raises(RankError, match="'cpu' or 'offloaded'"):
        pool2.launch(overlap_times, 10, "gpu", timeout=30)


def test_hogwild_trains_one_shared_model_and_copies_train_nothing(pool1):
    """Lock-free updates from 2 processes to shared memory train as well as one process
    taking all their steps; on an ordinary tensor each child trains its own copy, and the
    parent's weights never move."""
    (runs,) = pool1.launch(hogwild, 2, 300, timeout=60)
    start = runs["start"]["loss"]
    assert runs["one process"]["loss"] < 0.01 * start
    assert runs["HOGWILD"]["loss"] < 0.01 * start
    assert runs["copies"]["loss"] == start


def test_ring_neighbours_wrap_around_the_ends():
    assert ring_neighbours(0, 5) == (1, 4)
    assert ring_neighbours(4, 5) == (0, 3)
    assert ring_neighbours(2, 5) == (3, 1)
    assert ring_neighbours(0, 1) == (0, 0)
    with pytest.raises(ValueError, match="rank 5 is not one of 5 ranks"):
        ring_neighbours(5, 5)


def test_the_gil_check_takes_the_share_nearest_each_measured_time(capsys):
    seconds = {"one after another": 2.0, "threads": 2.1, "processes": 1.1}  # made up
    assert check_threads_and_processes_take("the same", "half", seconds) == (True, True)
    out = capsys.readouterr().out
    assert "threads: 1.05 of the time" in out and "take turns holding the GIL" in out
    assert check_threads_and_processes_take("half", "the same", seconds) == (False, False)
    assert check_threads_and_processes_take(..., ..., seconds) == (None, None)


def test_the_hogwild_check_finds_the_run_that_kept_its_starting_loss(capsys):
    runs = {  # made up
        "start": {"loss": 4.0},
        "one process": {"loss": 0.1},
        "HOGWILD": {"loss": 0.12},
        "copies": {"loss": 4.0},
    }
    assert check_unchanged_run("copies", runs) is True
    assert "the parent sees none" in capsys.readouterr().out
    assert check_unchanged_run("HOGWILD", runs) is False
    assert check_unchanged_run(..., runs) is None


def test_the_pipe_check_takes_the_smallest_send_that_deadlocked(capsys):
    finishes = {"1 KB": True, "64 KB": True, "256 KB": False, "1 MB": False}  # made up
    assert check_first_deadlock("256 KB", finishes) is True
    assert "a larger send waits for a reader" in capsys.readouterr().out
    assert check_first_deadlock("1 MB", finishes) is False
    assert check_first_deadlock("none", dict.fromkeys(finishes, True)) is True
    assert check_first_deadlock(..., finishes) is None
