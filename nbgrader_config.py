"""nbgrader configuration: solutions/ (instructor source) -> assignments/ (student release).

All paths are relative to the course folder; run nbgrader (or `make release`,
`make autograde`, `make feedback`) from here.
"""

import os
from pathlib import Path

c = get_config()  # noqa: F821 (nbgrader provides get_config)

c.CourseDirectory.course_id = "distributed-training"
c.CourseDirectory.source_directory = "solutions"
c.CourseDirectory.release_directory = "assignments"
c.CourseDirectory.submitted_directory = "submitted"
c.CourseDirectory.autograded_directory = "autograded"
c.CourseDirectory.feedback_directory = "feedback"

# nbgrader's exchange: the directory that release_assignment, fetch_assignment, submit, collect,
# release_feedback and fetch_feedback pass notebooks through. On one machine it is exchange/ in
# the course folder; on JupyterHub, point COURSE_EXCHANGE at a directory every user can reach
# (nbgrader's usual /srv/nbgrader/exchange).
c.Exchange.root = os.environ.get(
    "COURSE_EXCHANGE", str(Path(__file__).resolve().parent / "exchange")
)

# Grade with the course's kernel (`make install` registers it), whatever a submitted notebook
# names in its metadata.
c.Execute.kernel_name = "distcourse"
# Per cell. The checks stop deadlocked student code long before this, so a hung submission
# costs at most a few of their timeouts, never this.
c.Execute.timeout = 300

c.ClearSolutions.code_stub = {"python": "# YOUR CODE HERE\nraise NotImplementedError()"}

# Autograding runs each submission in a sandbox and scores its test cells in a separate clean
# process that never runs student code (course_lib/grading/autograde.py explains both). It
# takes the place of nbgrader's own Execute step; the other steps are nbgrader's.
# The course's classes are named by their import path, not imported here: importing
# course_lib.grading loads every check, and torch with them (2 s of CPU), which only the
# commands that use one need (autograde, export, zip_collect); release, feedback, db and the
# exchange's commands start without them.
from nbconvert.preprocessors import ClearMetadataPreprocessor  # noqa: E402
from nbgrader.preprocessors import (  # noqa: E402
    AssignLatePenalties,
    CheckCellMetadata,
    IgnorePattern,
    LimitOutput,
    SaveAutoGrades,
)

c.Autograde.autograde_preprocessors = [
    "course_lib.grading.autograde.GradeInSandbox",
    IgnorePattern,
    ClearMetadataPreprocessor,
    LimitOutput,
    SaveAutoGrades,
    AssignLatePenalties,
    CheckCellMetadata,
]

# The course around grading (course_lib/grading/course_admin.py): late penalties by the rules of
# schedule.csv (`make release` stores its due dates in the gradebook), grades.csv as
# `nbgrader export` writes it, and Canvas archives for `nbgrader zip_collect`.
c.AssignLatePenalties.plugin_class = "course_lib.grading.course_admin.SchedulePenalty"
c.SchedulePenalty.schedule = str(Path(__file__).resolve().parent / "schedule.csv")
c.ExportApp.plugin_class = "course_lib.grading.course_admin.GradesExport"
c.ZipCollectApp.collector_plugin = "course_lib.grading.course_admin.CanvasCollector"
