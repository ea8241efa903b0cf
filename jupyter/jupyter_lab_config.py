"""JupyterLab as `make lab` starts it on the course (the recipe passes `--config` this file).

The recipe also creates nbgrader's exchange (nbgrader_config.py says where) before the server
starts: the Assignment List, Course List and Formgrader panels read it.
"""

import sys
from pathlib import Path

from jupyter_core.paths import jupyter_runtime_dir

c = get_config()  # noqa: F821 (Jupyter provides get_config)

HERE = Path(__file__).resolve().parent

# No "Would you like to get notified about official Jupyter news?" on the first load: the
# course runs offline, and the question is not about the course. The question comes from the
# setting settings/overrides.json answers (fetchNews); news_url stops the server's feed too.
c.LabApp.app_settings_dir = str(HERE / "settings")
c.LabApp.news_url = None

# Validate (nbgrader's toolbar button, on every notebook, lectures too) is answered by
# course_validate.py next to this file instead of nbgrader's own handler: on a lecture it says
# there is nothing to validate rather than running the whole lecture.
sys.path.insert(0, str(HERE))
from kernel_sockets import ipc_fits  # noqa: E402 (found through the line above)

c.ServerApp.jpserver_extensions = {
    "nbgrader.server_extensions.validate_assignment": False,
    "course_validate": True,
}

# Kernels talk to the server over local socket files, not TCP ports on localhost: no other user
# of the machine can connect to them, and ipykernel does not print its warning about plain-text
# TCP in the terminal on every kernel start. The files go in the runtime folder; where their
# paths would be too long for a socket's (kernel_sockets.py), kernels keep TCP.
if ipc_fits(jupyter_runtime_dir()):
    c.KernelManager.transport = "ipc"
