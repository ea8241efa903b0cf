"""course_lib.sockets: who wrote how many bytes to whom, as the kernel counted them."""

import os
import socket
import subprocess
import sys

import pytest

from course_lib import sockets

pytestmark = pytest.mark.skipif(not sockets.available(), reason="needs Linux's socket diagnostics")

# A process that binds a socket to the given local port (shared: SO_REUSEADDR), connects to
# the given port, writes the given number of bytes, and holds the connection until its stdin
# closes.
_WRITER = """
import socket, sys
port, to, size = map(int, sys.argv[1:])
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", port))
s.connect(("127.0.0.1", to))
s.sendall(bytes(size))
print("sent", flush=True)
sys.stdin.read()
"""


def _listener() -> socket.socket:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    return server


def test_bytes_go_to_their_writer_when_two_writers_share_a_local_port():
    # Linux lets sockets that connect to different places share a local port (it does so by
    # itself with ephemeral ports): the port alone does not say which process wrote.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    first, second = _listener(), _listener()
    writers, accepted = [], []
    try:
        for server, size in ((first, 100), (second, 7)):
            to = server.getsockname()[1]
            writer = subprocess.Popen(
                [sys.executable, "-c", _WRITER, str(port), str(to), str(size)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            writers.append(writer)
            assert writer.stdout.readline().strip() == "sent"
        # The kernel counts what arrived, read or not; the connections must be ours, though.
        accepted += [first.accept()[0], second.accept()[0]]
        here, a, b = os.getpid(), writers[0].pid, writers[1].pid
        wrote = sockets.sent_between([here, a, b])
        assert wrote == {(a, here): 100, (b, here): 7, (here, a): 0, (here, b): 0}
        since = sockets.sent_since({(a, here): 60}, [here, a, b])
        assert since == [{1: 0, 2: 0}, {0: 40}, {0: 7}]
    finally:
        for writer in writers:
            writer.stdin.close()
            writer.wait(timeout=10)
        for sock in (*accepted, first, second):
            sock.close()
