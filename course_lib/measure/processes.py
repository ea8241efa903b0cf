"""What lecture 1 checks of its exercises off the page: an expected value computed from the
lecture's fit or from what a run measured, and the why of a prediction, so that the cell holds
the student's answer and one call, not an expression to copy. The measurements, the fit and the
plots are `course_lib.processes`.

    check_threads_and_processes_take(threads_take, processes_take, seconds)  # the GIL
    check_unchanged_run(unchanged_run, runs)                                 # HOGWILD!
    check_seconds_for_256MB(seconds_for_256MB, pipe_fit)   # alpha + n beta at n = 256 MB
    check_first_deadlock(first_deadlock, finishes)         # a Pipe's send-send
"""

from __future__ import annotations

from course_lib.exercises import check_choice, check_number, nearest_option
from course_lib.processes import LinkFit

SHARES = {"the same": 1.0, "half": 0.5}
GIL_WHY = {
    "threads": "Threads take turns holding the GIL.",
    "processes": "Each has its own GIL, and gains when a free core is there to run it.",
}


def check_threads_and_processes_take(
    threads_take: object, processes_take: object, seconds: dict[str, float]
) -> tuple[bool | None, bool | None]:
    """Lecture 1: the share of the time one after another that 2 threads and 2 processes took
    (`seconds[how]`, from `threads_vs_processes`), against the option nearest each."""
    verdicts = []
    for guess, how in ((threads_take, "threads"), (processes_take, "processes")):
        share = seconds[how] / seconds["one after another"]
        print(f"{how}: {share:.2f} of the time one after another")
        verdicts.append(
            check_choice(guess, nearest_option(share, SHARES), list(SHARES), why=GIL_WHY[how])
        )
    return verdicts[0], verdicts[1]


def check_unchanged_run(unchanged_run: object, runs: dict[str, dict]) -> bool | None:
    """Lecture 1: which of `hogwild`'s runs ended with the loss it started with."""
    unchanged = [
        name for name in runs if name != "start" and runs[name]["loss"] == runs["start"]["loss"]
    ]
    return check_choice(
        unchanged_run,
        unchanged[0] if unchanged else "none",
        ["one process", "HOGWILD", "copies"],
        why="Without share_memory_(), each child updates its own copy and the parent sees none.",
    )


def check_seconds_for_256MB(seconds_for_256MB: object, pipe_fit: LinkFit) -> bool | None:
    """Lecture 1: the seconds `pipe_fit`'s alpha and bandwidth give one 256 MB message."""
    return check_number(
        seconds_for_256MB,
        pipe_fit.predict(256 * 1024**2),
        rtol=0.01,
        unit="s",
        hint="t(n) = alpha + n * beta, with beta = 1 / bandwidth in seconds per byte.",
    )


def check_first_deadlock(first_deadlock: object, finishes: dict[str, bool]) -> bool | None:
    """Lecture 1: the smallest message (`finishes[label]`: whether both sending it first
    finished, smallest first) at which a Pipe's send-send deadlocked, or "none"."""
    return check_choice(
        first_deadlock,
        next((label for label, finished in finishes.items() if not finished), "none"),
        [*finishes, "none"],
        why="The kernel buffers some bytes of a socket pair; a larger send waits for a reader.",
    )
