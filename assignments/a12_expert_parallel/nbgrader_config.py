"""nbgrader settings for this assignment's folder: `nbgrader validate` runs the notebook with
the course's kernel (and finds a configuration here, so it does not warn that none exists)."""

c = get_config()  # noqa: F821 (nbgrader provides get_config)

c.Execute.kernel_name = "distcourse"
c.Execute.timeout = 300
