"""Whether a kernel's socket files fit in a folder (ZeroMQ's ipc transport, instead of TCP).

A Unix socket's path must fit in `sockaddr_un.sun_path`: 107 bytes on Linux, 103 on macOS. A
kernel's socket files are named after its connection file, `kernel-<36-character id>-ipc-<N>`,
in the Jupyter runtime folder (~/.local/share/jupyter/runtime): a home deep enough (a hub's
state folder in a scratch directory, say) leaves no room, and the kernel dies binding them.
"""

import os
import uuid

import zmq
from jupyter_core.paths import jupyter_runtime_dir
from traitlets.config import Config

PATH_MAX = getattr(zmq, "IPC_PATH_MAX_LEN", 103) or 103  # ZeroMQ's limit, where it says it
LONGEST_NAME = len("kernel-") + 36 + len("-ipc-99")


def ipc_fits(folder: str) -> bool:
    """True when the socket files of a kernel whose connection file is in `folder` fit."""
    return len(os.path.join(os.path.abspath(folder), "x" * LONGEST_NAME)) <= PATH_MAX


def connection_file() -> str | None:
    """A new kernel's connection file in the runtime folder, if its sockets fit there. Named
    here, absolute, so that the sockets' paths (derived from it) are the same for the kernel,
    which runs in the notebook's folder, and for its client, which runs elsewhere."""
    runtime = jupyter_runtime_dir()
    if not ipc_fits(runtime):
        return None
    os.makedirs(runtime, mode=0o700, exist_ok=True)
    return os.path.join(runtime, f"kernel-{uuid.uuid4()}.json")


def over_socket_files(config: Config) -> Config:
    """`config` with its kernel (one: a validation's) on socket files in the runtime folder,
    where they fit (else left on TCP)."""
    found = connection_file()
    if found is not None:
        config.KernelManager.transport = "ipc"
        config.KernelManager.connection_file = found
    return config
