"""The course on a local JupyterHub, as nbgrader is used for a class (`make hub` starts it).

- Users: `instructor` and two students, `alice` and `bob`, logging in with one password
  (SharedPasswordAuthenticator, JupyterHub's DummyAuthenticator with a password; the hub
  prints it). Only 127.0.0.1 can reach the hub.
- Each user's JupyterLab runs as the hub's own OS user (SimpleLocalProcessSpawner), in a
  home folder of its own under the hub's state folder.
- The course service, named after the course (nbgrader_config.py's course id): a JupyterLab
  in the course folder with nbgrader's formgrader, at /services/<course id>/; the groups
  `formgrade-<course id>` (the instructor) and `nbgrader-<course id>` (the students) say who
  may open it and who takes the course, as nbgrader's JupyterHub plugin reads them.
- One exchange for everyone (COURSE_EXCHANGE, as nbgrader_config.py reads it).

The Makefile passes where things are: COURSE_HUB_DIR (the hub's state: its database, cookie
secret, password and the users' homes), COURSE_HUB_PROXY (configurable-http-proxy, from npm),
COURSE_HUB_PORT (the port users open) and COURSE_EXCHANGE.
"""

import atexit
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
from pathlib import Path

from traitlets.config.loader import PyFileConfigLoader

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kernel_sockets import ipc_fits  # noqa: E402 (jupyter/kernel_sockets.py)

c = get_config()  # noqa: F821 (JupyterHub provides get_config)

HERE = Path(__file__).resolve().parent
COURSE = HERE.parent.parent  # the course folder: jupyter/hub/ is two levels down
STATE = Path(os.environ.get("COURSE_HUB_DIR", COURSE / ".hub")).resolve()
EXCHANGE = os.environ.get("COURSE_EXCHANGE", str(COURSE / "exchange"))
PORT = int(os.environ.get("COURSE_HUB_PORT", "8000"))
BIN = Path(sys.executable).parent  # the course's venv: jupyterhub-singleuser, alembic, nbgrader
COURSE_CONFIG = PyFileConfigLoader("nbgrader_config.py", str(COURSE)).load_config()
COURSE_ID = COURSE_CONFIG.CourseDirectory.course_id  # written once, in the course's config
INSTRUCTORS, STUDENTS = ["instructor"], ["alice", "bob"]
STATE.mkdir(parents=True, exist_ok=True)
# Started in the background (`make hub &`, a test), the hub inherits SIGINT ignored, and so would
# every server it starts: stopping one would then wait out its interrupt timeout. Python's own
# handler here makes them start with the default again.
signal.signal(signal.SIGINT, signal.default_int_handler)


def free_port() -> int:
    """A port nothing listens on now, for the hub's internal servers: only the users' port
    is fixed, so that two hubs (a test's and yours) can run side by side."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def password() -> str:
    """COURSE_HUB_PASSWORD, or one drawn once and kept in the state folder."""
    if os.environ.get("COURSE_HUB_PASSWORD"):
        return os.environ["COURSE_HUB_PASSWORD"]
    kept = STATE / "password"
    if not kept.exists():
        kept.write_text(secrets.token_urlsafe(9))  # 12 characters: the minimum is 8
        kept.chmod(0o600)
    return kept.read_text().strip()


# --- the hub, its proxy and its state ---
c.JupyterHub.ip = "127.0.0.1"
c.JupyterHub.port = PORT
c.JupyterHub.hub_ip = "127.0.0.1"
c.JupyterHub.hub_port = free_port()
c.ConfigurableHTTPProxy.api_url = f"http://127.0.0.1:{free_port()}"
c.ConfigurableHTTPProxy.command = [os.environ.get("COURSE_HUB_PROXY", "configurable-http-proxy")]
c.ConfigurableHTTPProxy.pid_file = str(STATE / "jupyterhub-proxy.pid")
c.JupyterHub.db_url = f"sqlite:///{STATE / 'jupyterhub.sqlite'}"
c.JupyterHub.cookie_secret_file = str(STATE / "jupyterhub_cookie_secret")
c.JupyterHub.pid_file = str(STATE / "jupyterhub.pid")
# Stopping the hub stops every server it started: nothing is left running after `make hub`.
c.JupyterHub.cleanup_servers = True
c.JupyterHub.cleanup_proxy = True

# --- who logs in ---
c.JupyterHub.authenticator_class = "shared-password"  # DummyAuthenticator with a password
c.SharedPasswordAuthenticator.user_password = password()
c.Authenticator.allowed_users = set(INSTRUCTORS + STUDENTS)

# --- each user's JupyterLab ---
c.JupyterHub.spawner_class = "simple"
c.SimpleLocalProcessSpawner.home_dir_template = str(STATE / "home" / "{username}")
c.Spawner.cmd = [str(BIN / "jupyterhub-singleuser")]
# The course's JupyterLab settings (jupyter/jupyter_lab_config.py: no news prompt, the course's
# Validate); Jupyter refuses to run as root unless told.
LAB_ARGS = [f"--config={COURSE / 'jupyter' / 'jupyter_lab_config.py'}"]
LAB_ARGS += ["--allow-root"] if os.geteuid() == 0 else []
c.Spawner.args = LAB_ARGS
c.Spawner.default_url = "/lab"
c.Spawner.start_timeout = 120  # a loaded 2-core machine starts a server in 6 s to a minute
c.Spawner.http_timeout = 120
HUB_ENV = {
    # nbgrader reads jupyter/hub/nbgrader_config.py (this folder) in every server of the hub
    "JUPYTER_CONFIG_PATH": str(HERE),
    "COURSE_EXCHANGE": EXCHANGE,
    "PATH": f"{BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}",  # nbgrader runs alembic
    "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
}
# Kernels talk to their server over socket files in the user's runtime folder, where their
# paths fit (jupyter_lab_config.py, kernel_sockets.py). The homes here, in the state folder, are
# almost always too deep for them, so the runtime folders go into a private folder of /tmp:
# over TCP, another process can take a kernel's port between the server's choice of it and the
# kernel's bind, and the kernel dies ("Address already in use", seen under load).
deepest = STATE / "home" / max(INSTRUCTORS + STUDENTS, key=len) / ".local/share/jupyter/runtime"
c.Spawner.environment = dict(HUB_ENV)
if not ipc_fits(str(deepest)):
    RUNTIMES = tempfile.mkdtemp(prefix="hub-runtime-")  # mode 0700
    atexit.register(shutil.rmtree, RUNTIMES, ignore_errors=True)
    c.Spawner.environment["JUPYTER_RUNTIME_DIR"] = lambda sp: f"{RUNTIMES}/{sp.user.name}"

# --- the course: groups, what they may do, and the course service ---
FORMGRADE, NBGRADER = f"formgrade-{COURSE_ID}", f"nbgrader-{COURSE_ID}"
# The hub user the course service acts as (nbgrader's grader account): the formgrader asks the
# hub for its courses. Not in allowed_users: nobody logs in as it.
GRADER = f"grader-{COURSE_ID}"
c.JupyterHub.load_groups = {
    FORMGRADE: {"users": [*INSTRUCTORS, GRADER]},
    NBGRADER: {"users": STUDENTS},
}
c.JupyterHub.load_roles = [
    # A user's server reads its owner's groups: nbgrader's JupyterHub plugin lists a student's
    # courses from them (and refuses fetch and submit in any other course).
    {
        "name": "server",
        "scopes": ["users:activity!user", "access:servers!server", "read:users:groups!user"],
    },
    {"name": FORMGRADE, "groups": [FORMGRADE], "scopes": [f"access:services!service={COURSE_ID}"]},
    # The students' Assignment List finds the course through the services API.
    {
        "name": NBGRADER,
        "groups": [NBGRADER],
        "scopes": ["list:services", f"read:services!service={COURSE_ID}"],
    },
    # Adding a student in the formgrader (or `make roster`) adds them to the course's group.
    {
        "name": f"{COURSE_ID}-service",
        "services": [COURSE_ID],
        "scopes": [
            "list:groups",
            f"read:groups!group={NBGRADER}",
            f"groups!group={NBGRADER}",
            "read:users:groups",
        ],
    },
]
c.JupyterHub.services = [
    {
        "name": COURSE_ID,
        "url": f"http://127.0.0.1:{free_port()}",
        "command": [str(BIN / "jupyterhub-singleuser"), *LAB_ARGS],
        "cwd": str(COURSE),
        "environment": {**HUB_ENV, "JUPYTERHUB_USER": GRADER, "JUPYTERHUB_DEFAULT_URL": "/lab"},
        "oauth_no_confirm": True,
        "display": True,
    }
]

print(
    f"\nThe course on JupyterHub: http://127.0.0.1:{PORT}/ (password {password()})\n"
    f"  instructor: {', '.join(INSTRUCTORS)} (the formgrader: "
    f"http://127.0.0.1:{PORT}/services/{COURSE_ID}/formgrader)\n"
    f"  students:   {', '.join(STUDENTS)}\n"
    f"  exchange:   {EXCHANGE}; the hub's files: {STATE}\n",
    flush=True,
)
