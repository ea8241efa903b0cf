"""Run every lecture and write the course site: one HTML page per lecture, with its outputs.

    make site                                       # build/site/index.html and a page each
    python tools/build_site.py lectures/06_memory.ipynb --out /tmp/site   # some lectures

This is also the test that every lecture runs: `make test` builds the site instead of running
the lectures a second time under nbval. As with `pytest --nbval-lax`, a cell that raises fails
its lecture (unless tagged `raises-exception` or marked `# NBVAL_RAISES_EXCEPTION`; cells
marked `# NBVAL_SKIP` are not run), each cell may take 300 s, and the kernel is this
environment's Python, started in lectures/. A failure names the lecture and the cell. Figures
are embedded in the pages as PNG; widgets keep the state they had when the lecture ended.
"""

from __future__ import annotations

import argparse
import atexit
import os
import re
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path
from queue import Empty

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "jupyter"))
from kernel_sockets import connection_file  # noqa: E402

from course_lib.topics import TOPICS  # noqa: E402

CELL_TIMEOUT = 300  # seconds, as `make test`'s nbval run allowed
COLOURS = re.compile(r"\x1b\[[0-9;]*m")  # IPython colours tracebacks; logs read them plain


class LectureFailed(Exception):
    """A lecture's cell raised, timed out or killed the kernel."""


POLL_SLICE = 1.0  # seconds


def sliced(get_msg, slice_seconds: float = POLL_SLICE):
    """`get_msg` (an async channel's), waiting in short polls up to the same deadline.

    nbclient waits for a cell's reply with one `shell_channel.get_msg(timeout=300)`. After a
    cell that shows a widget, that one long poll sometimes misses the reply and returns only
    at its timeout: the lecture loses 300 s and nothing fails (jupyter/nbclient#312). Each
    new poll first looks whether a message is already waiting, so polling in slices finds
    the reply within a slice of its arrival; `Empty` is raised only at the caller's deadline.
    """

    async def in_slices(timeout: float | None = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                return await get_msg(
                    timeout=slice_seconds if left is None else min(left, slice_seconds)
                )
            except Empty:
                if left is not None and left <= slice_seconds:
                    raise

    return in_slices


class Client(NotebookClient):
    """nbclient's runner, its shell channel polled in slices (see `sliced`), talking to its
    kernel over local socket files: over TCP, ipykernel warns on every start that the
    traffic is unencrypted, a line that would sit in every build's log. The kernel runs with
    progress bars off."""

    def create_kernel_manager(self):
        km = super().create_kernel_manager()
        km.transport = "ipc"
        # A runtime folder too deep for the sockets' paths gives way to a private one in /tmp.
        found = connection_file()
        if found is None:
            private = tempfile.mkdtemp(prefix="kernel-sockets-")
            atexit.register(shutil.rmtree, private, ignore_errors=True)
            found = str(Path(private) / f"kernel-{uuid.uuid4()}.json")
        km.connection_file = found
        return km

    async def async_start_new_kernel(self, **kwargs):
        # No progress bars (`course_lib.progress`): a page keeps what a bar last drew, a live
        # signal with nothing to say once the run is over.
        kwargs.setdefault("env", {**os.environ, "COURSE_PROGRESS": "0"})
        await super().async_start_new_kernel(**kwargs)

    async def async_start_new_kernel_client(self):
        kc = await super().async_start_new_kernel_client()
        kc.shell_channel.get_msg = sliced(kc.shell_channel.get_msg)
        return kc


def _prepare(nb: nbformat.NotebookNode) -> None:
    """Carry nbval's markers over to what nbclient understands."""
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        if "# NBVAL_SKIP" in cell.source:  # shown, not run; the cells keep their numbers
            cell.metadata.setdefault("tags", []).append("skip-execution")
        if "# NBVAL_RAISES_EXCEPTION" in cell.source:
            cell.metadata.setdefault("tags", []).append("raises-exception")


def _failed_cell(nb: nbformat.NotebookNode) -> tuple[int, nbformat.NotebookNode] | None:
    """The first code cell with an error output that was not allowed to raise."""
    code = [c for c in nb.cells if c.cell_type == "code"]
    for number, cell in enumerate(code, 1):
        allowed = "raises-exception" in cell.metadata.get("tags", [])
        if not allowed and any(o.output_type == "error" for o in cell.get("outputs", [])):
            return number, cell
    return None


def execute(path: Path) -> nbformat.NotebookNode:
    """Run the notebook at `path` top to bottom in a fresh kernel; raise LectureFailed
    naming the lecture and the cell that failed."""
    nb = nbformat.read(path, as_version=4)
    _prepare(nb)
    client = Client(
        nb,
        timeout=CELL_TIMEOUT,
        kernel_name="python3",  # this environment's Python, as nbval's --nbval-current-env
        resources={"metadata": {"path": str(path.parent)}},
    )
    try:
        client.execute()
    except (CellExecutionError, CellTimeoutError, DeadKernelError) as error:
        name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        failed = _failed_cell(nb)
        if failed is None:  # a timeout or a dead kernel leaves no error output
            running = [c for c in nb.cells if c.cell_type == "code" and c.execution_count]
            where = f"after code cell {len(running)}" if running else "in its first cell"
            raise LectureFailed(f"{name}: {type(error).__name__} {where}: {error}") from None
        number, cell = failed
        first_line = cell.source.strip().splitlines()[0] if cell.source.strip() else ""
        message = COLOURS.sub("", str(error))
        raise LectureFailed(f"{name}, code cell {number} ({first_line!r}):\n{message}") from None
    return nb


def _html(nb: nbformat.NotebookNode) -> str:
    from nbconvert import HTMLExporter

    body, _ = HTMLExporter(template_name="lab").from_notebook_node(nb)
    # Links between lectures go to their pages.
    return re.sub(r'href="(\d\d_\w+)\.ipynb', r'href="\1.html', body)


MATHJAX = (
    "<script>window.MathJax = {tex: {inlineMath: [['$', '$']]}};</script>\n"
    '<script src="https://cdn.jsdelivr.net/npm/mathjax@3/es5/tex-chtml.js"></script>\n'
)
LINK = re.compile(r'<a href="([^"]*)">(.*?)</a>')


def course_map() -> str:
    """The README's course table, as HTML (tests/test_topics.py holds it to the topic table
    of course_lib/topics.py)."""
    import mistune

    readme = (ROOT / "README.md").read_text()
    if "\n## The course\n" not in readme:
        sys.exit("README.md has no '## The course' section: the site's index is made from it")
    section = readme.split("\n## The course\n", 1)[1].split("\n## ", 1)[0]
    return mistune.create_markdown(plugins=["table"])(section)


def index_page(pages: dict[str, str]) -> str:
    """The course map, each lecture linking its page; other links (assignments, files of the
    repository) become plain text, as the site holds only the lectures."""

    def relink(match: re.Match) -> str:
        stem = Path(match[1]).stem
        return f'<a href="{pages[stem]}">{match[2]}</a>' if stem in pages else match[2]

    return (
        "<!DOCTYPE html>\n<html><head><meta charset='utf-8'>"
        "<title>Distributed deep-learning training, hands on</title>\n"
        + MATHJAX
        + "</head><body>\n<h1>Distributed deep-learning training, hands on</h1>\n"
        "<p>The lectures, run top to bottom with their outputs.</p>\n"
        + LINK.sub(relink, course_map())
        + "</body></html>\n"
    )


def build(lectures: list[Path], out: Path) -> list[str]:
    """Run each lecture, write its page and the index into `out`; return the failures."""
    out.mkdir(parents=True, exist_ok=True)
    failures = []
    for path in lectures:
        start = time.perf_counter()
        try:
            nb = execute(path)
        except LectureFailed as failure:
            failures.append(str(failure))
            print(f"FAILED {failure}", flush=True)
            (out / f"{path.stem}.html").unlink(missing_ok=True)  # no stale page
            continue
        (out / f"{path.stem}.html").write_text(_html(nb))
        print(f"{path.name}: ran in {time.perf_counter() - start:.0f} s", flush=True)
    pages = {p.stem: p.name for p in out.glob("*.html") if p.stem != "index"}
    (out / "index.html").write_text(index_page(pages))
    return failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("lectures", nargs="*", type=Path, help="default: every lecture")
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "site")
    args = parser.parse_args()
    lectures = [p.resolve() for p in args.lectures] or [ROOT / t.lecture for t in TOPICS]
    failures = build(lectures, args.out)
    if failures:
        sys.exit(f"{len(failures)} of {len(lectures)} lectures failed:\n" + "\n".join(failures))
    print(f"site written to {args.out}/index.html")


if __name__ == "__main__":
    main()
