"""Lecture 10's measurements, moved whole into real_step.py (the next commit splits them)."""

from course_lib.measure.parallel_3d.real_step import *  # noqa: F403
