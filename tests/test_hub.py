"""The course on JupyterHub, as a class uses nbgrader, in a real browser.

`make hub` starts the hub (jupyter/hub/jupyterhub_config.py) from a course folder in a scratch
directory, with a01_processes cut to tests/grading_class.SHORT. The instructor releases it in
the formgrader (the course service); alice and bob log in, fetch it in JupyterLab's Assignment
List, each writes the part tests/test_exchange.SOLVES gives them in the notebook's editor, alice
validates, both submit; the instructor collects, autogrades each submission (in the sandbox),
generates and releases feedback, all by the formgrader's buttons (which run nbgrader's collect,
autograde, generate_feedback and release_feedback in the course service); alice fetches her
feedback and reads her points. Then, through alice's own server, neither bob's files nor his
submission nor his feedback can be reached, and she sees only the course her hub groups give
her.

Every server here runs as the hub's OS user (`make hub` is a try-out, see the README): what
keeps alice from bob is what the servers' APIs allow, which is what this checks.

Skipped, visibly, without Chromium or bubblewrap (COURSE_REQUIRE_BROWSER=1 and
COURSE_REQUIRE_SANDBOX=1 make it required, as in CI). Measured on a shared 2-core machine:
2 min 20 s in all (100 s of it in the hub, the rest `make release` and the hub's start), and
3 min 50 s with a load average near 7; alice's Validate takes about 20 s and each sandboxed
autograde about 30 s.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import nbformat
import pytest

from tests.conftest import ROOT, require_sandbox
from tests.grading_class import SHORT, keep_only
from tests.grading_course import COURSE_FILES, VENV, make
from tests.test_browser import CHROMIUM, SECONDS, _free_port, _missing, _stop, menu
from tests.test_exchange import MAX, SOLVES, solve

pytestmark = [pytest.mark.e2e, require_sandbox, pytest.mark.timeout(900)]
if _missing() and os.environ.get("COURSE_REQUIRE_BROWSER") != "1":
    pytestmark.append(pytest.mark.skip(reason=f"browser tests skipped: {_missing()}"))

A = "a01_processes"
PROXY = ROOT / ".hub" / "node_modules" / ".bin" / "configurable-http-proxy"  # `make hub`'s


@dataclass
class Hub:
    base: str  # http://127.0.0.1:PORT
    password: str
    course: Path
    course_id: str
    homes: Path  # the users' home folders
    exchange: Path
    log: Path  # what the hub, its servers and their kernels printed

    def service(self, path: str = "") -> str:
        return f"{self.base}/services/{self.course_id}/{path}"


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory, request) -> Iterator[Hub]:
    """`make hub` in a scratch course folder, a01 released by `make release`; stopped, with
    every server, kernel and grading process it started, after the tests."""
    if _missing():  # and COURSE_REQUIRE_BROWSER=1, else the tests are skipped
        pytest.fail(f"COURSE_REQUIRE_BROWSER=1, but {_missing()}")
    tmp = tmp_path_factory.mktemp("hub")
    course = tmp / "course"
    course.mkdir()
    for name in COURSE_FILES:
        shutil.copy2(ROOT / name, course / name)  # copy2 keeps mtimes: no reinstall
    shutil.copytree(ROOT / "jupyter", course / "jupyter", ignore=shutil.ignore_patterns("__py*"))
    shutil.copytree(ROOT / "solutions" / A, course / "solutions" / A)
    keep_only(course / "solutions" / A / f"{A}.ipynb", SHORT)
    make(course, "release")
    password, port = secrets.token_hex(8), _free_port()
    exchange = tmp / "exchange"
    variables = [f"HUB_DIR={tmp / 'hub'}", f"HUB_PORT={port}", f"EXCHANGE={exchange}"]
    if PROXY.exists():  # else `make hub` installs one into HUB_DIR
        variables.append(f"CHP={PROXY}")
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    env.update(COURSE_HUB_PASSWORD=password, COURSE_EXCHANGE=str(exchange))
    log = (tmp / "hub.log").open("w+")
    process = subprocess.Popen(
        ["make", "-s", f"VENV={VENV}", "-o", str(VENV / ".course-installed"), "hub", *variables],
        cwd=course,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        # Up once the hub says so: after the course service (which starts with it) answers.
        while "JupyterHub is now running at" not in _read(log):
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"`make hub` did not start within 180 s:\n{_read(log)[-6000:]}")
            time.sleep(0.3)
        homes = tmp / "hub" / "home"
        yield Hub(base, password, course, "distributed-training", homes, exchange, tmp / "hub.log")
    finally:
        _stop(process)
        if request.session.testsfailed:
            print(f"\nthe hub's log ({tmp / 'hub.log'}) ends:\n{_read(log)[-3000:]}")


def _read(log) -> str:
    log.seek(0)
    return log.read()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=["--no-sandbox"], timeout=60 * SECONDS
        )
        try:
            yield chromium
        finally:
            chromium.close()


def log_in(browser, hub: Hub, user: str, then: str = ""):
    """A page of a fresh browser context, `user` logged in and sent to `then` (a path on the
    hub; by default, their JupyterLab: the hub starts their server)."""
    # Every cell in the page, not only those scrolled into view, so the test can find them all
    # (a user setting: their home's ~/.jupyter).
    settings = hub.homes / user / ".jupyter/lab/user-settings/@jupyterlab/notebook-extension"
    settings.mkdir(parents=True, exist_ok=True)
    (settings / "tracker.jupyterlab-settings").write_text('{"windowingMode": "none"}')
    context = browser.new_context(viewport={"width": 1500, "height": 1000})
    context.set_default_timeout(60 * SECONDS)
    page = context.new_page()
    page.goto(f"{hub.base}/hub/login?next={quote(then, safe='')}")
    page.locator("#username_input").fill(user)
    page.locator("#password_input").fill(hub.password)
    page.locator("#login_submit").click()
    return page


def open_lab(page, hub: Hub, user: str) -> None:
    """JupyterLab of `user`, once the hub has started their server (login leads there)."""
    page.wait_for_url(re.compile(f"/user/{user}/lab"), timeout=150 * SECONDS)
    page.locator(".jp-LauncherCard, .jp-DirListing").first.wait_for(timeout=90 * SECONDS)


def assignment_list(page):
    menu(page, "Nbgrader", "Assignment List")
    panel = page.locator("#nbgrader-assignment-list")
    panel.locator("#released_assignments_list").wait_for()
    return panel


def answer(hub: Hub, cell_id: str, tmp: Path) -> tuple[str, str]:
    """The release's answer cell `cell_id` (its stub) and the solution's code for it, as
    tests/test_exchange.solve fills it in."""
    release, scratch = hub.course / "assignments" / A / f"{A}.ipynb", tmp / f"{cell_id}.ipynb"
    shutil.copy(release, scratch)
    solve(scratch, hub.course / "solutions" / A / f"{A}.ipynb", cell_id)
    stub, code = (
        next(c for c in nbformat.read(nb, as_version=4).cells if c.id == cell_id).source
        for nb in (release, scratch)
    )
    return stub, code


def write_answer(page, stub: str, code: str) -> None:
    """Open the fetched notebook and replace the answer cell `stub` by `code`, typed into its
    editor; save."""
    page.goto(page.url.split("/lab")[0] + f"/lab/tree/{A}/{A}.ipynb")
    cell = page.locator(".jp-NotebookPanel .jp-CodeCell", has_text=stub.splitlines()[0]).first
    cell.locator(".cm-content").click()
    page.keyboard.press("Control+A")
    page.keyboard.insert_text(code)  # as pasted: no auto-indent or closing brackets
    page.keyboard.press("Escape")  # leave the editor
    page.keyboard.press("Control+S")
    page.wait_for_function("() => !document.querySelector('.jp-mod-dirty')")  # saved


@pytest.fixture
def shots(browser, tmp_path, request):
    """If the test fails, a screenshot of every open page, for a look (the paths are printed)."""
    failed = request.session.testsfailed
    yield
    if request.session.testsfailed == failed:
        return
    for i, page in enumerate(p for c in browser.contexts for p in c.pages):
        path = tmp_path / f"page-{i}.png"
        with contextlib.suppress(Exception):
            page.screenshot(path=path, timeout=10 * SECONDS)
            print(f"\n{page.url}: {path}")


def test_a_class_on_jupyterhub(hub, browser, tmp_path, shots):
    started = time.monotonic()
    # The students' servers start while the instructor releases a01 (the instructor has no
    # server of their own to start: the formgrader is the course service's).
    students = {student: log_in(browser, hub, student) for student in SOLVES}
    formgrader = hub.service("formgrader").removeprefix(hub.base)
    teacher = log_in(browser, hub, "instructor", then=formgrader)
    row = teacher.locator("#main-table tr", has=teacher.locator("td.name", has_text=A))
    row.locator("td.release a").click()  # nbgrader release_assignment
    row.locator("td.collect a").wait_for()  # offered once released

    codes = {}
    for student, (cell, _) in SOLVES.items():
        page = students[student]
        open_lab(page, hub, student)
        panel = assignment_list(page)
        released = panel.locator("#released_assignments_list .list_item", has_text=A)
        released.get_by_role("button", name="Fetch").click()
        fetched = panel.locator("#fetched_assignments_list .list_item", has_text=A).first
        fetched.wait_for()
        assert (hub.homes / student / A / f"{A}.ipynb").is_file()
        stub, code = answer(hub, cell, tmp_path)
        write_answer(page, stub, code)
        # the longest line the student wrote, to tell whose submission a page shows
        codes[student] = max((x.strip() for x in code.splitlines() if x not in stub), key=len)

    alice = students["alice"]
    alice.locator(".jp-NotebookPanel .validate-button").click()
    message = alice.locator(".jp-Dialog #validation-message")
    message.wait_for(timeout=150 * SECONDS)  # nbgrader runs the whole notebook
    text = message.inner_text()
    assert "check_chain" in text and "is not written yet" in text, text  # bob's part
    assert "check_ping_pong" not in text, text  # hers passes
    alice.locator(".jp-Dialog").get_by_role("button", name="Ok").click()

    for page in students.values():
        panel = assignment_list(page)
        fetched = panel.locator("#fetched_assignments_list .list_item", has_text=A).first
        fetched.get_by_role("button", name="Submit").click()
        panel.locator("#submitted_assignments_list .list_item", has_text=A).first.wait_for()

    # The instructor: collect, autograde each submission, then feedback, in the formgrader.
    teacher.goto(hub.service("formgrader"))
    row.locator("td.collect a").click()  # nbgrader collect
    close_modal(teacher, "Successfully collected")
    teacher.goto(hub.service(f"formgrader/manage_submissions/{A}"))
    for student in SOLVES:
        line = teacher.locator("#main-table tr", has=teacher.locator("td", has_text=student))
        line.locator("td.autograde a").click()  # nbgrader autograde A --student student
        close_modal(teacher, f"Successfully autograded '{A}' for student '{student}'")
    teacher.goto(hub.service("formgrader"))
    row.locator("td.generate-feedback a").click()  # nbgrader generate_feedback
    close_modal(teacher, "Successfully generated feedback")
    row.locator("td.release-feedback a").click()  # nbgrader release_feedback
    close_modal(teacher, "Successfully released feedback")

    # alice fetches her feedback and reads her points.
    panel = assignment_list(alice)
    submitted = panel.locator("#submitted_assignments_list .list_item", has_text=A).first
    submitted.get_by_role("button", name="Fetch Feedback").click()
    link = submitted.get_by_text("view feedback")
    link.wait_for()
    feedback = sorted((hub.homes / "alice" / A / "feedback").glob(f"*/{A}.html"))
    assert len(feedback) == 1, feedback
    stamp = feedback[0].parent.name
    alice.goto(alice.url.split("/lab")[0] + f"/files/{A}/feedback/{stamp}/{A}.html")
    shown = alice.locator("body").inner_text()
    assert f"Score: 3.0 / {MAX}" in shown  # tests/test_exchange.py's score for her part
    # Every kernel, the notebooks' and Validate's, talked over socket files (kernel_sockets.py):
    # ipykernel warns over TCP, where a port another process takes meanwhile kills the kernel.
    assert "Kernel is running over TCP" not in hub.log.read_text()
    assert codes["alice"] in shown and codes["bob"] not in shown  # hers, not bob's
    print(f"the class's cycle took {time.monotonic() - started:.0f} s")

    # Through alice's own server: her files are hers; bob's submission and feedback are not
    # hers to list, fetch or read.
    user = f"{hub.base}/user/alice"
    assert alice.request.get(f"{user}/api/contents/{A}").ok
    for path in ("../bob", f"../bob/{A}/{A}.ipynb", str(hub.homes / "bob")):
        # quoted whole, so that the URL is not normalized before the server sees the dots
        response = alice.request.get(f"{user}/api/contents/{quote(path, safe='')}")
        assert response.status in (403, 404), (path, response.status, response.text()[:200])
    # Her courses are her hub groups (nbgrader's JupyterHub plugin): a course released in the
    # same exchange that she does not take is not hers to see.
    (hub.exchange / "another-course" / "outbound" / A).mkdir(parents=True)
    assert alice.request.get(f"{user}/courses").json() == {
        "success": True,
        "value": [hub.course_id],
    }
    listed = alice.request.get(f"{user}/assignments?course_id={hub.course_id}").json()
    assert listed["success"], listed
    owners = {s["student_id"] for a in listed["value"] for s in a.get("submissions", [])}
    assert owners == {"alice"}, json.dumps(listed)[:2000]


def close_modal(page, says: str) -> None:
    """The formgrader's answer to a button: a dialog that must say `says` (else its log)."""
    modal = page.locator(".modal-dialog").first
    modal.wait_for(timeout=300 * SECONDS)
    text = modal.inner_text()
    assert says in text, text[-3000:]
    modal.locator(".modal-footer button").first.click()
    modal.wait_for(state="detached")
