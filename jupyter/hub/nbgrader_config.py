"""nbgrader as every server of the course's JupyterHub reads it: jupyterhub_config.py puts this
folder on their JUPYTER_CONFIG_PATH. The course service reads the course folder's
nbgrader_config.py after it (course id, exchange, grading)."""

import os

c = get_config()  # noqa: F821 (nbgrader provides get_config)

# A student's courses are their hub groups nbgrader-<course id> (formgrade-<course id> for
# graders): the Assignment List shows only those courses, and fetch and submit refuse others.
c.Authenticator.plugin_class = "nbgrader.auth.JupyterHubAuthPlugin"
c.Exchange.root = os.environ["COURSE_EXCHANGE"]

# Every server here runs as the hub's own OS user (SimpleLocalProcessSpawner), after whom
# nbgrader names a student by default: name each by their hub login instead. (With one OS
# user per student, a real deployment's, nbgrader's default is already right.)
if "JUPYTERHUB_USER" in os.environ and "JUPYTERHUB_SERVICE_NAME" not in os.environ:
    c.CourseDirectory.student_id = os.environ["JUPYTERHUB_USER"]
