"""What lecture 1 checks of its exercises off the page: an expected value computed from the
lecture's fit, so that the cell holds the student's answer and one call, not an expression to
copy. The measurements, the fit and the plots are `course_lib.processes`.

    check_seconds_for_256MB(seconds_for_256MB, pipe_fit)   # alpha + n beta at n = 256 MB
"""

from __future__ import annotations

from course_lib.exercises import check_number
from course_lib.processes import LinkFit


def check_seconds_for_256MB(seconds_for_256MB: object, pipe_fit: LinkFit) -> bool | None:
    """Lecture 1: the seconds `pipe_fit`'s alpha and bandwidth give one 256 MB message."""
    return check_number(
        seconds_for_256MB,
        pipe_fit.predict(256 * 1024**2),
        rtol=0.01,
        unit="s",
        hint="t(n) = alpha + n * beta, with beta = 1 / bandwidth in seconds per byte.",
    )
