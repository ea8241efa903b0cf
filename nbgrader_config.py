"""nbgrader configuration: solutions/ (instructor source) -> assignments/ (student release).

All paths are relative to the course folder; run nbgrader (or `make release`,
`make autograde`, `make feedback`) from here.
"""

c = get_config()  # noqa: F821 (nbgrader provides get_config)

c.CourseDirectory.course_id = "distributed-training"
c.CourseDirectory.source_directory = "solutions"
c.CourseDirectory.release_directory = "assignments"
c.CourseDirectory.submitted_directory = "submitted"
c.CourseDirectory.autograded_directory = "autograded"
c.CourseDirectory.feedback_directory = "feedback"

# Grade with the course's kernel (`make install` registers it), whatever a submitted notebook
# names in its metadata.
c.Execute.kernel_name = "distcourse"
# Per cell. The checks stop deadlocked student code long before this, so a hung submission
# costs at most a few of their timeouts, never this.
c.Execute.timeout = 300

c.ClearSolutions.code_stub = {"python": "# YOUR CODE HERE\nraise NotImplementedError()"}
