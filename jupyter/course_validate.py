"""The Validate button (nbgrader's, on the toolbar of every notebook) as the course wants it.

nbgrader's JupyterLab extension puts Validate on every notebook, lectures included, and its
server side runs whatever notebook it is given. This server extension answers the same
requests (`/assignments/validate`, `/nbgrader_version`) in place of
`nbgrader.server_extensions.validate_assignment`, which jupyter_lab_config.py turns off:

- a notebook without nbgrader test cells (a lecture) gets one sentence saying there is nothing
  to validate, at once, instead of a run of the whole lecture that ends in "Success!";
- an assignment is validated by nbgrader, unchanged. (What an untouched assignment shows,
  "... is not written yet", comes from the checks' messages, course_lib/grading/_harness.py.)

It lives here, outside course_lib, so that the server does not import torch.
"""

from __future__ import annotations

import json
from pathlib import Path

from jupyter_server.utils import url_path_join
from kernel_sockets import over_socket_files  # beside this file (jupyter_lab_config.py)
from nbgrader.server_extensions.validate_assignment.handlers import (
    NbGraderVersionHandler,
    ValidateAssignmentHandler,
)


def has_tests(notebook: Path) -> bool:
    """Whether a notebook has nbgrader test (grade) cells, i.e. something to validate."""
    cells = json.loads(notebook.read_text(encoding="utf-8")).get("cells", [])
    return any(cell.get("metadata", {}).get("nbgrader", {}).get("grade") for cell in cells)


class CourseValidateHandler(ValidateAssignmentHandler):
    def load_config(self):
        # Validation's kernel on socket files, as the lab's (jupyter_lab_config.py): over TCP,
        # another process can take its port between the choice and the bind, and it dies.
        return over_socket_files(super().load_config())

    def validate_notebook(self, path: str) -> dict:
        root = Path(self.root_dir).resolve()
        target = (root / path).resolve()
        if target.is_relative_to(root) and target.is_file() and not has_tests(target):
            return {
                "success": False,
                "value": f"{path} has no test cells, so there is nothing to validate: "
                "Validate checks an assignment (the notebooks in assignments/). To check a "
                "lecture, run all its cells.",
            }
        return super().validate_notebook(path)


def _jupyter_server_extension_points() -> list[dict]:
    return [{"module": "course_validate"}]


def _load_jupyter_server_extension(serverapp) -> None:
    web_app = serverapp.web_app
    web_app.settings["root_dir"] = serverapp.root_dir
    base_url = web_app.settings["base_url"]
    web_app.add_handlers(
        ".*$",
        [
            (url_path_join(base_url, "/assignments/validate"), CourseValidateHandler),
            (url_path_join(base_url, "/nbgrader_version"), NbGraderVersionHandler),
        ],
    )
