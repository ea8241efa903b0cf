"""The course site (`make site`): every lecture run, a page each with its figures, an index.

The builder is tested here on small notebooks written by the tests; the site itself is built by
`make test` (COURSE_REQUIRE_SITE=1) in the background while the other tests run (building it
is how every lecture is run: tests/conftest.py), and checked page by page below, last. Run
alone, those checks read the site `make site` left, or are skipped, visibly.
"""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import os
import re
import subprocess
import sys
import time
from queue import Empty

import nbformat
import pytest

from course_lib.topics import TOPICS
from tests.conftest import ROOT, SITE

BUILDER = ROOT / "tools" / "build_site.py"
DRAWS = re.compile(r"\bplot\w*\(|\bplt\.|_figure\(")
IMAGE = re.compile(r'<img[^>]*src="data:image/png;base64,([^"]+)"')


def pngs(page: str) -> list[bytes]:
    return [base64.b64decode(data) for data in IMAGE.findall(page)]


def notebook(path, *sources: str) -> None:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])
    nbformat.write(nb, path)


def build(tmp_path, *notebooks, env=None):
    return subprocess.run(
        [sys.executable, BUILDER, *notebooks, "--out", tmp_path / "site"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def test_a_page_embeds_its_figures_and_the_index_links_it(tmp_path):
    path = tmp_path / "06_memory.ipynb"  # named as a lecture, so the index links it
    notebook(
        path,
        "import os, matplotlib.pyplot as plt\nprint(os.getcwd())",
        "plt.plot([1, 2, 3]); plt.show()",
        "plt.bar([1, 2], [3, 4]); plt.show()",
    )
    done = build(tmp_path, path)
    assert done.returncode == 0, done.stdout + done.stderr
    page = (tmp_path / "site" / "06_memory.html").read_text()
    assert len(pngs(page)) == 2 and all(p.startswith(b"\x89PNG") for p in pngs(page))
    assert str(tmp_path) in page  # the kernel ran in the notebook's folder, as nbval's does
    index = (tmp_path / "site" / "index.html").read_text()
    assert 'href="06_memory.html"' in index
    assert "00_getting_started.html" not in index  # not built: listed, but not linked
    assert "IPKernelApp" not in done.stdout + done.stderr  # no kernel warning in the log


def test_a_page_shows_no_progress_bar_frozen_where_the_run_left_it(tmp_path):
    """A bar (`course_lib.progress`, in the kernel or drawn there for rank 0 of `launch`)
    closes itself when its loop ends in JupyterLab; a saved page would keep what it last drew
    (60%, say), as if the run had stopped there. The builder's pages show the loops' own
    output only. (`jupyter nbconvert --execute` does keep such bars.)"""
    path = tmp_path / "03_data_parallel.ipynb"
    loop = "for _ in progress(range(6), '{}'):\n    time.sleep(0.5)\n"
    notebook(
        path,
        "import time\nfrom course_lib import launch\nfrom course_lib.progress import progress\n"
        + loop.format("notebook steps")
        + "print('loop done')",
        "def steps():\n"
        + "\n".join("    " + line for line in loop.format("rank steps").splitlines())
        + "\n    return 'ranks done'\n\n\nprint(launch(steps, world_size=2)[0])",
    )
    done = build(tmp_path, path)
    assert done.returncode == 0, done.stdout + done.stderr
    page = (tmp_path / "site" / "03_data_parallel.html").read_text()
    assert "loop done" in page and "ranks done" in page
    assert "it/s]" not in page and "steps:" not in page


def test_a_runtime_folder_too_deep_for_socket_files_still_runs_the_kernel(tmp_path):
    """A kernel's socket files live beside its connection file; a path longer than a socket's
    (107 bytes on Linux) kills the kernel at its start, unless the builder moves them."""
    deep = tmp_path / ("d" * 60) / "runtime"
    path = tmp_path / "00_getting_started.ipynb"
    notebook(path, "print('ran')")
    done = build(tmp_path, path, env={**os.environ, "JUPYTER_RUNTIME_DIR": str(deep)})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ran" in (tmp_path / "site" / "00_getting_started.html").read_text()
    assert "IPKernelApp" not in done.stdout + done.stderr  # still over socket files


def test_a_failing_cell_names_its_lecture_and_cell_and_leaves_no_page(tmp_path):
    good, bad = tmp_path / "00_getting_started.ipynb", tmp_path / "01_processes.ipynb"
    notebook(good, "x = 1")
    notebook(bad, "x = 1", "y = 2", "raise ValueError('planted')")
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "01_processes.html").write_text("from an earlier build")
    done = build(tmp_path, good, bad)
    assert done.returncode != 0
    assert "01_processes.ipynb, code cell 3 (\"raise ValueError('planted')\")" in done.stderr
    assert "ValueError: planted" in done.stderr
    assert (tmp_path / "site" / "00_getting_started.html").exists()  # the others still run
    assert not (tmp_path / "site" / "01_processes.html").exists()


def test_nbval_markers_keep_their_meaning(tmp_path):
    """A cell marked as raising may raise; a cell marked to skip is not run."""
    path = tmp_path / "02_collectives.ipynb"
    notebook(
        path,
        "# NBVAL_RAISES_EXCEPTION\nraise KeyError('shown')",
        "# NBVAL_SKIP\nraise ValueError('never run')",
        "print('after')",
    )
    done = build(tmp_path, path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "after" in (tmp_path / "site" / "02_collectives.html").read_text()


def builder_module():
    spec = importlib.util.spec_from_file_location("build_site", BUILDER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class MissesOnLongPolls:
    """A shell channel as nbclient#312 sees it: the reply is there, but a poll longer than
    `limit` seconds does not see it and waits out its timeout."""

    def __init__(self, limit: float, reply=None):
        self.limit, self.reply, self.polls = limit, reply, []

    async def get_msg(self, timeout=None):
        self.polls.append(timeout)
        if self.reply is not None and timeout is not None and timeout <= self.limit:
            return self.reply
        await asyncio.sleep(0.0 if timeout is None else min(timeout, 0.05))  # time is faked
        raise Empty


def test_a_reply_a_long_poll_misses_arrives_within_one_slice():
    sliced = builder_module().sliced
    channel = MissesOnLongPolls(limit=1.0, reply={"msg": "execute_reply"})
    assert asyncio.run(sliced(channel.get_msg)(timeout=300)) == {"msg": "execute_reply"}
    assert channel.polls == [1.0]  # one slice, not one 300 s poll
    # The unsliced channel waits out the whole timeout: what the wrapper is for.
    with pytest.raises(Empty):
        asyncio.run(channel.get_msg(timeout=300))


def test_no_reply_raises_empty_at_the_deadline_not_before():
    sliced = builder_module().sliced
    channel = MissesOnLongPolls(limit=0.0)
    start = time.monotonic()
    with pytest.raises(Empty):
        asyncio.run(sliced(channel.get_msg, slice_seconds=0.05)(timeout=0.3))
    assert time.monotonic() - start >= 0.25
    assert len(channel.polls) >= 5 and max(channel.polls) <= 0.05


@pytest.mark.timeout(1800)  # the first one waits for the site's build to end
@pytest.mark.parametrize("topic", TOPICS, ids=lambda t: t.name)
def test_every_lecture_has_a_page_with_its_figures(topic, built_site):
    page_path = SITE / f"{topic.number:02d}_{topic.name}.html"
    failed = built_site.find(f"FAILED {page_path.stem}.ipynb")
    assert failed < 0, built_site[failed : failed + 4000]  # the cell that raised, and why
    assert page_path.exists(), f"{topic.lecture} has no page: did it fail in `make site`?"
    page = page_path.read_text()
    assert topic.title in page
    figures = pngs(page)
    source = nbformat.read(ROOT / topic.lecture, as_version=4)
    code = "\n".join(c.source for c in source.cells if c.cell_type == "code")
    if DRAWS.search(code):  # lecture 00 draws nothing; every other lecture plots what it measures
        assert figures, f"{page_path.name} has no figure, but {topic.lecture} draws"
    assert all(f.startswith(b"\x89PNG") and len(f) > 1000 for f in figures)
    index = (SITE / "index.html").read_text()
    assert f'href="{page_path.name}"' in index
