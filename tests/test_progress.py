"""Progress bars: drawn by the launching process only, silent where nobody watches."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import time

import pytest

from course_lib import launch, progress
from course_lib.pool import WorkerPool
from tests.conftest import ROOT

SCRIPT = """
import time
from course_lib import progress
progress.DELAY_S = {delay}
print(sum(x for x in progress.progress(range(4), "counting") if not time.sleep(0.05)))
"""


def run_script(delay: float, terminal: bool, env: dict | None = None) -> str:
    """Run a loop under progress() with stderr on a terminal or a pipe; return all output."""
    code = SCRIPT.format(delay=delay)
    environ = {**os.environ, "COURSE_PROGRESS": "", **(env or {})}
    if not terminal:
        done = subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, env=environ, capture_output=True, text=True
        )
        return done.stdout + done.stderr
    leader, follower = pty.openpty()
    # A terminal 100 columns wide (a new pty has 0, and tqdm draws a bar that wide).
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, env=environ, stdout=follower, stderr=follower
    )
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the terminal closed: the process is done
            break
        if not chunk:
            break
        chunks.append(chunk)
    proc.wait(timeout=60)
    os.close(leader)
    return b"".join(chunks).decode(errors="replace")


def test_a_terminal_shows_the_bar():
    out = run_script(delay=0, terminal=True)
    assert "counting" in out and "4/4" in out, out
    assert "6" in out  # the loop still yields every item: 0 + 1 + 2 + 3


def test_no_bar_when_output_is_not_a_terminal_unless_forced():
    assert run_script(delay=0, terminal=False).strip() == "6"
    forced = run_script(delay=0, terminal=False, env={"COURSE_PROGRESS": "1"})
    assert "counting" in forced and "4/4" in forced


def test_no_bar_for_a_loop_shorter_than_the_delay():
    out = run_script(delay=30, terminal=True)
    assert "counting" not in out and "6" in out


def slow_loop(steps: int) -> int:
    from course_lib.progress import progress

    for _ in progress(range(steps), "rank steps"):
        time.sleep(0.15)
    return steps


@pytest.fixture
def shown(monkeypatch):
    monkeypatch.setenv("COURSE_PROGRESS", "1")
    monkeypatch.setattr(progress, "DELAY_S", 0.0)


def test_rank_zero_reports_and_the_launcher_draws_one_bar(shown, capfd):
    assert launch(slow_loop, 6, world_size=2) == [6, 6]
    err = capfd.readouterr().err
    drawn = [line for line in err.replace("\r", "\n").splitlines() if "rank steps" in line]
    assert drawn, err
    # Drawn here, not by the ranks: their output lines carry a "[rank k]" prefix.
    assert not any("[rank" in line for line in drawn), drawn
    assert any(re.search(r"rank steps: .*\d/6", line) for line in drawn), drawn


def test_an_untrusted_pool_shows_no_bar(shown, capfd):
    with WorkerPool(2, untrusted=True) as pool:
        assert pool.launch(slow_loop, 3) == [3, 3]
    assert "rank steps" not in capfd.readouterr().err


def test_ranks_started_by_the_fallback_method_report_too(shown, capfd):
    """`python -m course_lib._worker` runs as __main__: reports must go through the module
    `course_lib.progress` imports, which holds the connection."""
    with WorkerPool(2, start_method="subprocess") as pool:
        assert pool.launch(slow_loop, 4) == [4, 4]
    assert re.search(r"rank steps: .*\d/4", capfd.readouterr().err)


def test_a_loop_that_breaks_off_then_starts_again_gets_a_new_bar(shown, monkeypatch):
    created = []
    real_bar = progress.bar
    monkeypatch.setattr(progress, "bar", lambda *a: created.append(real_bar(*a)) or created[-1])
    bars = progress.RemoteBars(shown=True)
    bars.update("epochs", 3, 10, finished=False)  # the loop broke off at 3 of 10
    bars.update("epochs", 1, 10, finished=False)  # the same loop, started again
    bars.update("epochs", 10, 10, finished=True)
    bars.close()
    assert [b.n for b in created] == [3, 10]
