"""Lecture 10's code, moved whole into estimates.py (the next commit splits it by topic)."""

from course_lib.parallel_3d.estimates import *  # noqa: F403
