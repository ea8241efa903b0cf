"""Whether a kernel's socket files fit in a folder (ZeroMQ's ipc transport, instead of TCP).

A Unix socket's path must fit in `sockaddr_un.sun_path`: 107 bytes on Linux, 103 on macOS. A
kernel's socket files are named after its connection file, `kernel-<36-character id>-ipc-<N>`,
in the Jupyter runtime folder (~/.local/share/jupyter/runtime): a home deep enough (a hub's
state folder in a scratch directory, say) leaves no room, and the kernel dies binding them.
"""

import os

import zmq

PATH_MAX = getattr(zmq, "IPC_PATH_MAX_LEN", 103) or 103  # ZeroMQ's limit, where it says it
LONGEST_NAME = len("kernel-") + 36 + len("-ipc-99")


def ipc_fits(folder: str) -> bool:
    """True when the socket files of a kernel whose connection file is in `folder` fit."""
    return len(os.path.join(os.path.abspath(folder), "x" * LONGEST_NAME)) <= PATH_MAX
