"""The launcher from a real Jupyter kernel: cell-defined functions, the magic, interrupts,
restarts and a killed kernel."""

from __future__ import annotations

import os
import queue
import signal
import time

import nbformat
import pytest
from jupyter_client.manager import start_new_kernel
from nbclient import NotebookClient

from tests.conftest import ROOT, alive, all_gone


def notebook(*cells: str, raises: tuple[int, ...] = ()) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    for i, source in enumerate(cells):
        cell = nbformat.v4.new_code_cell(source)
        if i in raises:
            cell.metadata["tags"] = ["raises-exception"]
        nb.cells.append(cell)
    return nb


def text_of(cell) -> str:
    """Everything a cell showed: streams, results and errors."""
    parts = []
    for out in cell.outputs:
        if out.output_type == "stream":
            parts.append(out.text)
        elif out.output_type == "execute_result":
            parts.append(out.data.get("text/plain", ""))
        elif out.output_type == "error":
            parts.append(f"{out.ename}: {out.evalue}")
    return "".join(parts)


def test_cell_defined_functions_classes_and_magic_run_on_the_ranks():
    nb = notebook(
        "from course_lib import launch, rank\nimport torch, torch.distributed as dist",
        "def hello(x):\n    print('hi from', rank())\n    return x * rank()",
        "launch(hello, 3, world_size=2)",
        # a class defined in a cell; its class attribute starts fresh on every call
        "class Counter:\n    n = 0\n\ndef bump():\n    Counter.n += 1\n    return Counter.n",
        "launch(bump, world_size=2), launch(bump, world_size=2)",
        "scale = 10",
        "%%distributed -n 2\nt = torch.ones(1) * (rank() + 1) * scale\ndist.all_reduce(t)\n"
        "print('total', t.item())\nt.item()",
        "def boom():\n    raise ValueError('raised in a notebook cell')",
        "launch(boom, world_size=2)",
        raises=(8,),
    )
    NotebookClient(
        nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": ROOT}}
    ).execute()
    cells = nb.cells
    assert "[rank 0] hi from 0" in text_of(cells[2]) and "[rank 1] hi from 1" in text_of(cells[2])
    assert "[0, 3]" in text_of(cells[2])
    assert "([1, 1], [1, 1])" in text_of(cells[4])
    magic = text_of(cells[6])
    assert "[rank 0] total 30.0" in magic and "[rank 1] total 30.0" in magic
    assert "[30.0, 30.0]" in magic
    error = text_of(cells[8])
    assert error.startswith("RankError: rank 0 of 2 raised ValueError: raised in a notebook cell")
    assert "raise ValueError('raised in a notebook cell')" in error, "cell source not quoted"


class Kernel:
    """A live kernel to which cells are sent one at a time."""

    def __init__(self) -> None:
        self.manager, self.client = start_new_kernel(kernel_name="python3", cwd=str(ROOT))

    def start(self, code: str) -> str:
        return self.client.execute(code)

    def finish(self, msg_id: str, timeout: float = 120) -> tuple[dict, str]:
        """Wait for the cell's reply; return it and everything the cell printed."""
        out = []
        deadline = time.monotonic() + timeout
        reply = None
        while reply is None or self._busy(msg_id):
            if time.monotonic() > deadline:
                raise TimeoutError(f"cell did not finish; output so far: {''.join(out)}")
            if reply is None:
                try:
                    msg = self.client.get_shell_msg(timeout=0.1)
                    if msg["parent_header"].get("msg_id") == msg_id:
                        reply = msg["content"]
                except queue.Empty:
                    pass
            out += self._drain_iopub(msg_id)
        return reply, "".join(out)

    def wait_for(self, msg_id: str, *texts: str, timeout: float = 60) -> str:
        """Wait until the running cell has printed all of `texts`; return what it printed."""
        out = []
        deadline = time.monotonic() + timeout
        while not all(text in "".join(out) for text in texts):
            if time.monotonic() > deadline:
                raise TimeoutError(f"cell did not print {texts}; output so far: {''.join(out)}")
            out += self._drain_iopub(msg_id)
        return "".join(out)

    def run(self, code: str, timeout: float = 120) -> str:
        reply, out = self.finish(self.start(code), timeout)
        assert reply["status"] == "ok", out + str(reply)
        return out

    def _busy(self, msg_id: str) -> bool:
        return not getattr(self, "_idle", {}).get(msg_id, False)

    def _drain_iopub(self, msg_id: str) -> list[str]:
        out = []
        while True:
            try:
                msg = self.client.get_iopub_msg(timeout=0.05)
            except queue.Empty:
                return out
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            content = msg["content"]
            if msg["msg_type"] == "stream":
                out.append(content["text"])
            elif msg["msg_type"] == "execute_result":
                out.append(content["data"].get("text/plain", ""))
            elif msg["msg_type"] == "error":
                out.append(f"{content['ename']}: {content['evalue']}")
            elif msg["msg_type"] == "status" and content["execution_state"] == "idle":
                self.__dict__.setdefault("_idle", {})[msg_id] = True

    def close(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)


@pytest.fixture
def kernel():
    k = Kernel()
    yield k
    k.close()


SETUP = """
import os, subprocess, time
from course_lib import launch
from course_lib.launch import default_pool
from course_lib.rank_process import fork_server

def wait_forever():
    print("waiting", flush=True)
    time.sleep(300)

def sleep_with_child(folder):
    child = subprocess.Popen(["sleep", "300"])
    open(os.path.join(folder, f"child-{child.pid}"), "w").close()
    time.sleep(300)

launch(lambda: None, world_size=2)
print("PIDS", *default_pool().pids, fork_server().pid, os.getpid())
"""


def pids_from(output: str) -> list[int]:
    line = next(line for line in output.splitlines() if line.startswith("PIDS"))
    return [int(p) for p in line.split()[1:]]


def test_interrupting_the_kernel_stops_every_rank(kernel):
    *workers, _server, _kernel_pid = pids_from(kernel.run(SETUP))
    msg_id = kernel.start("launch(wait_forever, world_size=2, timeout=600)")
    # Interrupt once both ranks are in the call (a fixed sleep is too short on a busy machine)
    before = kernel.wait_for(msg_id, "[rank 0] waiting", "[rank 1] waiting")
    kernel.manager.interrupt_kernel()
    reply, out = kernel.finish(msg_id, timeout=30)
    out = before + out
    assert reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt"
    assert "Interrupted: stopped all 2 ranks" in out
    assert "--- rank 0 ---" in out and "--- rank 1 ---" in out
    assert "in wait_forever" in out and "time.sleep(300)" in out, out
    assert all_gone(workers, 5)
    assert "[7, 7]" in kernel.run("launch(max, 7, 3, world_size=2)")  # the pool comes back


def wait_for_children(folder, count: int) -> list[int]:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        found = [int(p.name.split("-")[1]) for p in folder.glob("child-*")]
        if len(found) >= count:
            return found
        time.sleep(0.05)
    raise TimeoutError("the ranks did not start their children")


def test_kernel_restart_and_kernel_death_leave_no_process(kernel, tmp_path):
    # Restart while a call runs whose ranks have started children.
    pids = pids_from(kernel.run(SETUP))[:-1]
    kernel.start(f"launch(sleep_with_child, {str(tmp_path)!r}, world_size=2, timeout=600)")
    children = wait_for_children(tmp_path, 2)
    assert all(alive(pid) for pid in pids + children)
    kernel.manager.restart_kernel(now=True)
    assert all_gone(pids + children, 10), "workers survived a kernel restart"

    # SIGKILL of the kernel itself, with warm idle workers and the fork server running.
    kernel.client.wait_for_ready(timeout=60)
    *pids, kernel_pid = pids_from(kernel.run(SETUP))
    assert all(alive(pid) for pid in pids)
    os.kill(kernel_pid, signal.SIGKILL)
    assert all_gone(pids, 10), "workers survived the kernel's death"
