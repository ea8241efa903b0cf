"""The course in JupyterLab as students and instructors see it, in a real browser.

`make lab` starts JupyterLab (the Makefile's own recipe, with a fresh Jupyter home) and
Playwright drives Debian's Chromium: a lecture runs clean, its figure is an image, the planner
widget responds to a slider, Validate on an untouched assignment says what to write, and the
formgrader lists the assignments. Without Chromium (a student's laptop) these tests are
skipped, visibly; CI (.ci/run) sets COURSE_REQUIRE_BROWSER=1, and there they must run.

Notebooks are opened from copies in a scratch folder of the course (removed afterwards), since
JupyterLab saves what it opens: Validate saves first, and autosave would write outputs.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from tests.conftest import ROOT

CHROMIUM = os.environ.get("COURSE_CHROMIUM") or shutil.which("chromium")
LECTURE = ROOT / "lectures" / "10_parallel_3d.ipynb"  # runs in seconds: a widget and a figure
ASSIGNMENT = ROOT / "assignments" / "a04_gossip"  # an untouched one fails fast, every part
SECONDS = 1000  # Playwright counts milliseconds


def _missing() -> str | None:
    if CHROMIUM is None:
        return "no Chromium found (Debian: apt-get install chromium; or set COURSE_CHROMIUM)"
    if importlib.util.find_spec("playwright") is None:
        return "the playwright package is missing (make install installs it)"
    return None


if _missing() and os.environ.get("COURSE_REQUIRE_BROWSER") != "1":
    pytestmark = pytest.mark.skip(reason=f"browser tests skipped: {_missing()}")


@dataclass
class Lab:
    base: str  # http://127.0.0.1:PORT
    token: str
    scratch: Path  # a folder inside the course; JupyterLab's paths start with scratch.name

    def url(self, path: str) -> str:
        return f"{self.base}/{path}?token={self.token}"

    def copy(self, source: Path) -> str:
        """Copy a notebook or a folder into the scratch folder; its path for JupyterLab."""
        target = self.scratch / source.name
        (shutil.copytree if source.is_dir() else shutil.copy)(source, target)
        return f"{self.scratch.name}/{source.name}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(url: str) -> bool:
    with contextlib.suppress(OSError):
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    return False


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM lets Jupyter shut its kernels down; whatever is left after 15 s is killed."""
    family = [process.pid]
    with contextlib.suppress(psutil.NoSuchProcess):
        family += [p.pid for p in psutil.Process(process.pid).children(recursive=True)]
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(15)
    except subprocess.TimeoutExpired:
        pass
    for pid in family:  # kernels run in sessions of their own
        with contextlib.suppress(psutil.NoSuchProcess):
            psutil.Process(pid).kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(5)


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    """JupyterLab from `make lab`, with a fresh Jupyter home; stopped after the tests."""
    if _missing():  # and COURSE_REQUIRE_BROWSER=1, else the tests are skipped
        pytest.fail(f"COURSE_REQUIRE_BROWSER=1, but {_missing()}")
    home = tmp_path_factory.mktemp("jupyter-home")
    token, port = secrets.token_hex(16), _free_port()
    env = {
        **os.environ,
        "JUPYTER_CONFIG_DIR": str(home / "config"),
        "JUPYTER_DATA_DIR": str(home / "data"),
        "JUPYTER_RUNTIME_DIR": str(home / "runtime"),
    }
    # Every cell in the page, not only those scrolled into view, so the test can read them all.
    settings = home / "config" / "lab" / "user-settings" / "@jupyterlab" / "notebook-extension"
    settings.mkdir(parents=True)
    (settings / "tracker.jupyterlab-settings").write_text('{"windowingMode": "none"}')
    args = f"--no-browser --port={port} --IdentityProvider.token={token}"
    log = (home / "lab.log").open("w+")
    scratch = Path(tempfile.mkdtemp(prefix="browser-test-", dir=ROOT))
    url, process = f"http://127.0.0.1:{port}", None
    try:
        process = subprocess.Popen(
            ["make", "--no-print-directory", "lab", f"LAB_ARGS={args}"],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # one killpg reaches make and the server
        )
        deadline = time.monotonic() + 90
        while not _answers(f"{url}/api/status?token={token}"):
            if process.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                pytest.fail(f"`make lab` did not serve JupyterLab within 90 s:\n{log.read()}")
            time.sleep(0.2)
        yield Lab(url, token, scratch)
    finally:
        if process is not None:
            _stop(process)
        shutil.rmtree(scratch, ignore_errors=True)
        log.close()


@pytest.fixture(scope="module")
def page(lab: Lab):
    """One Chromium tab; every wait in it gives up after 30 s unless it says otherwise."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=["--no-sandbox"], timeout=60 * SECONDS
        )
        context = browser.new_context(viewport={"width": 1500, "height": 1000})
        context.set_default_timeout(30 * SECONDS)
        try:
            yield context.new_page()
        finally:
            browser.close()


def open_notebook(page, lab: Lab, path: str, kernel: bool = True) -> None:
    page.goto(lab.url(f"lab/tree/{path}") + "&reset")  # reset: a fresh layout
    page.locator(".jp-NotebookPanel .jp-Cell").first.wait_for()
    if not kernel:
        return
    # Connected to its kernel when the status bar says "<kernel name> | Idle" (cells run before
    # that are dropped, not queued).
    page.locator(".jp-StatusBar-TextItem", has_text=re.compile(r"\| Idle$")).wait_for(
        timeout=90 * SECONDS
    )


def menu(page, top: str, item: str) -> None:
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(f"^{top}$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(f"^{item}$")).click()


def cell_prompts(page) -> list[str]:
    return page.locator(".jp-NotebookPanel .jp-CodeCell .jp-InputPrompt").all_inner_texts()


def test_a_lecture_runs_clean_with_a_figure_and_a_widget_that_responds(page, lab):
    open_notebook(page, lab, lab.copy(LECTURE))
    menu(page, "Run", "Run All Cells")
    # Finished when no cell waits or runs ([*]); a cell that fails stops the rest unrun ([ ]).
    page.wait_for_function(
        """() => {
            const prompts = [...document.querySelectorAll(
                '.jp-NotebookPanel .jp-CodeCell .jp-InputPrompt')];
            return prompts.some(p => /\\[\\d+\\]/.test(p.textContent))
                && !prompts.some(p => p.textContent.includes('*'));
        }""",
        timeout=120 * SECONDS,
        polling=250,
    )
    assert page.get_by_text("official Jupyter news").count() == 0  # JupyterLab's news prompt
    stderr = page.locator("[data-mime-type='application/vnd.jupyter.stderr']").all_inner_texts()
    errors = [text for text in stderr if "Traceback" in text or "Error" in text]
    assert not errors, "the lecture raised:\n" + "\n".join(errors)
    prompts = cell_prompts(page)
    assert all(re.search(r"\[\d+\]", p) for p in prompts), f"cells left unrun: {prompts}"

    figure = page.locator(".jp-RenderedImage img").first
    figure.wait_for()
    assert figure.evaluate("img => img.naturalWidth > 100 && img.complete")

    planner = page.locator(".jupyter-widgets.widget-vbox").last
    planner.wait_for()
    # A label is cut ("global bat...") when its text is wider than its box; ellipsis hides
    # the overflow from scrollWidth, so the text is measured in the label's own font.
    text_fits = """e => {
        const ctx = document.createElement('canvas').getContext('2d');
        ctx.font = getComputedStyle(e).font;
        return ctx.measureText(e.innerText).width <= e.getBoundingClientRect().width;
    }"""
    for label in planner.locator(".widget-label").all():
        assert label.evaluate(text_fits), f"label {label.inner_text()!r} is cut"
    bandwidth = planner.locator(".widget-slider", has_text="inter-node GB/s")
    assert bandwidth.locator(".widget-readout").inner_text().strip() == "25"
    shown = planner.locator(".widget-output")
    before = shown.inner_text()
    assert "plans fit" in before
    bandwidth.locator(".noUi-handle").focus()
    page.keyboard.press("ArrowLeft")
    page.wait_for_function(
        "([node, before]) => node.innerText !== before",
        arg=[shown.element_handle(), before],
    )
    assert bandwidth.locator(".widget-readout").inner_text().strip() == "12.5"

    # Validate is on every notebook's toolbar; on a lecture it says there is nothing to do.
    page.locator(".jp-NotebookPanel .validate-button").click()
    dialog = page.locator(".jp-Dialog")
    dialog.wait_for()
    assert "has no test cells, so there is nothing to validate" in dialog.inner_text()
    dialog.get_by_role("button", name="Ok").click()


def test_validate_on_an_untouched_assignment_says_what_to_write(page, lab):
    folder = lab.copy(ASSIGNMENT)
    open_notebook(page, lab, f"{folder}/{ASSIGNMENT.name}.ipynb", kernel=False)  # runs elsewhere
    page.locator(".jp-NotebookPanel .validate-button").click()
    message = page.locator(".jp-Dialog #validation-message")
    message.wait_for(timeout=150 * SECONDS)  # nbgrader runs the whole notebook
    text = message.inner_text()
    assert "The following cell failed" in text
    assert "push_sum_step is not written yet" in text, text
    assert "Traceback" not in text, text
    page.locator(".jp-Dialog").get_by_role("button", name="Ok").click()


def test_the_formgrader_lists_the_assignments(page, lab):
    if not (ROOT / "solutions").is_dir():
        pytest.skip("no solutions/ here (the student edition): nothing for the formgrader")
    page.goto(lab.url("formgrader"))
    names = page.locator("#main-table tr td.name")
    names.first.wait_for()
    sources = {p.name for p in (ROOT / "solutions").iterdir() if p.is_dir()}
    assert sources <= set(names.all_inner_texts())
    assert page.locator("#warning-exchange").count() == 0  # the exchange is there
    # Release (into the exchange) is offered only when the exchange works.
    release = page.locator("#main-table td.release .glyphicon-cloud-upload")
    assert release.count() >= len(sources)


def test_the_assignment_list_reads_the_courses_exchange(page, lab):
    page.goto(lab.url("lab") + "&reset")
    menu(page, "Nbgrader", "Assignment List")
    panel = page.locator("#nbgrader-assignment-list")
    # Loaded: either the (empty) list of released assignments or an error in its place.
    shown = "#released_assignments_list_placeholder, #released_assignments_list_error"
    panel.locator(shown).locator("visible=true").first.wait_for()
    text = panel.inner_text()
    assert "Error" not in text and "does not exist" not in text, text
