"""Build the student edition of the course: what students get instead of this repository.

    python tools/student_edition.py DEST        (or: make student)

DEST receives the committed lectures, assignments (the generated student versions), the
library and the tests that hold no answers, with a README and a Makefile cut to what students
use. Left out: `solutions/` (answers and hidden tests), the tests that carry right
implementations or grade solutions (`tests/test_grading_*.py`, `tests/test_autograde.py`, the
cheat suite), `bench/` (it runs the solutions), the instructors' tools and CI. A test
(`tests/test_student_edition.py`) builds it and checks that no solution region and no hidden
test is in it.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Paths (relative to the repository) that never go to students.
EXCLUDED = (
    re.compile(r"^solutions/"),
    re.compile(r"^tests/test_grading_.*\.py$"),
    re.compile(r"^tests/test_autograde\.py$"),
    re.compile(r"^tests/test_cheats\.py$"),
    re.compile(r"^tests/test_student_edition\.py$"),
    re.compile(r"^tests/test_topics\.py$"),  # the maintainers' layout, solutions/ included
    re.compile(r"^tests/cheats/"),
    # Instructor tooling: the planted bugs quote solution lines; adapters reads solutions/.
    re.compile(r"^tests/grading_course\.py$"),
    re.compile(r"^tests/adapters\.py$"),
    # The instructor's cycle (exchange, roster, schedule, LMS archives): targets students lack.
    re.compile(r"^tests/test_exchange\.py$"),
    re.compile(r"^tests/test_course_admin\.py$"),
    re.compile(r"^tests/test_hub\.py$"),
    re.compile(r"^jupyter/hub/"),  # `make hub`: the course on JupyterHub, its formgrader
    # For the course's maintainers.
    re.compile(r"^docs/"),
    re.compile(r"^CONTRIBUTING\.md$"),
    re.compile(r"^bench/"),
    # Students build the site (`make test` does) and may try srun on a cluster of their own.
    re.compile(r"^tools/(?!build_site\.py$|slurm\.sh$)"),
    re.compile(r"^\.ci/"),
    re.compile(r"^nbgrader_config\.py$"),
)

STUDENT_NBGRADER_CONFIG = '''"""nbgrader for students: Validate uses the course's kernel."""

c = get_config()  # noqa: F821 (nbgrader provides get_config)

c.CourseDirectory.course_id = "distributed-training"
c.Execute.kernel_name = "distcourse"
c.Execute.timeout = 300
'''

NOTICE = (
    "> This is the **student edition** of the course: lectures, assignments and the library. "
    "Write your answers in `assignments/`; the test cells check them as you go.\n\n"
)


def committed_files() -> list[str]:
    listing = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return [path for path in listing.stdout.splitlines() if path]


def shipped(path: str) -> bool:
    return not any(pattern.search(path) for pattern in EXCLUDED)


def _drop_sections(text: str, headings: tuple[str, ...]) -> str:
    """Markdown without the `## ` sections whose heading starts with one of `headings`."""
    out, skipping = [], False
    for line in text.splitlines(keepends=True):
        if line.startswith("## "):
            skipping = line[3:].startswith(headings)
        if not skipping:
            out.append(line)
    return "".join(out)


# What the repository's README says of the instructors' targets (`make lock`, `make bench`),
# cut for students; tests/test_student_edition.py fails if the README names a file or a target
# the edition lacks, so a new mention shows up there.
INSTRUCTOR_SENTENCES = (
    (
        re.compile(
            r" To change a version, edit its pin\s+in `pyproject\.toml`, run `make lock`"
            r".*?\.(?=\n)",
            re.S,
        ),
        "",
    ),
    (re.compile(r"`make bench` \([^)]*\),\s*"), ""),
    (re.compile(r",\s*`make lock` \(see above\)\."), "."),
)

# The repository's Layout section describes solutions/, the grading tests and the tools, which
# the edition leaves out: students get this one.
STUDENT_LAYOUT = """## Layout

Each topic has one short name, carried by every file about it: lecture 07 is
`lectures/07_zero.ipynb`, its code `course_lib/zero.py`, the assignment that follows it
`assignments/a07_zero/a07_zero.ipynb` (an assignment takes its lecture's number), its checks
`course_lib/grading/zero.py` and the tests of its code `tests/test_zero.py`.
`course_lib/topics.py` lists the topics.

```
lectures/       the lecture notebooks, in order: NN_<topic>.ipynb
assignments/    the assignments, aNN_<topic>/aNN_<topic>.ipynb: write your answers there
course_lib/     the library the notebooks import: the machinery (launch and its parts pool,
                calls, errors, rank_process, protocol; runtime, comm, network, costs, models,
                data, compare, plots, magic, torchrun) and one module per lecture topic;
                topics.py lists the topics
course_lib/measure/  what a lecture measures and draws, where that is long, under the topic's
                name
course_lib/grading/  the checks the assignments' test cells call
tests/          tests of course_lib (test_<topic>.py), of the notebooks' kernel and of the set-up
jupyter/        how `make lab` runs JupyterLab: its config, settings and the server side of
                nbgrader's Validate button
tools/          build_site.py: every lecture run into HTML pages (`make site`, `make test`);
                slurm.sh: a one-node Slurm cluster on this machine, to try `srun`
examples/       the torchrun and Slurm examples
```

"""


def _replace_section(text: str, heading: str, section: str) -> str:
    """Markdown with the `## heading` section replaced by `section` (appended if absent)."""
    out, skipping, done = [], False, False
    for line in text.splitlines(keepends=True):
        if line.startswith("## "):
            skipping = line[3:].startswith(heading)
            if skipping and not done:
                out.append(section)
                done = True
        if not skipping:
            out.append(line)
    return "".join(out) if done else "".join(out) + "\n" + section


def student_readme(text: str) -> str:
    text = _drop_sections(text, ("For instructors", "Development"))
    text = _replace_section(text, "Layout", STUDENT_LAYOUT)
    for pattern, replacement in INSTRUCTOR_SENTENCES:
        text = pattern.sub(replacement, text)
    title, _, rest = text.partition("\n\n")
    return f"{title}\n\n{NOTICE}{rest}"


INSTRUCTOR_TARGETS = (
    "lock",
    "test-e2e",
    "test-all",
    "bench",
    "release",
    "autograde",
    "feedback",
    "student",
    "roster",
    "zip-collect",
    "hub",
)


def student_makefile(text: str) -> str:
    """The Makefile without the instructors' targets, the lock's rewriting and the benchmarks."""
    text = re.sub(r"\n# --- instructors:.*?(?=\nclean:)", "\n", text, flags=re.S)
    text = re.sub(r"\nbench: install\n(\t.*\n)+", "\n", text)
    text = re.sub(r"\n# Rewrite requirements\.lock[^\n]*\n(\w[^\n]*\n)+(\t[^\n]*\n)+", "\n", text)
    phony = re.search(r"^\.PHONY:(.*?)(?<!\\)\n", text, flags=re.M | re.S)
    kept = [t for t in phony.group(1).replace("\\\n", " ").split() if t not in INSTRUCTOR_TARGETS]
    text = text[: phony.start()] + ".PHONY: " + " ".join(kept) + "\n" + text[phony.end() :]
    return re.sub(r"\n{3,}", "\n\n", text)


def build(dest: Path) -> list[str]:
    """Write the student edition into `dest` (emptied first); return the files written."""
    if dest.exists():
        shutil.rmtree(dest)
    written = []
    for path in committed_files():
        if not shipped(path):
            continue
        source, target = ROOT / path, dest / path
        target.parent.mkdir(parents=True, exist_ok=True)
        if path == "README.md":
            target.write_text(student_readme(source.read_text()))
        elif path == "Makefile":
            target.write_text(student_makefile(source.read_text()))
        else:
            shutil.copy2(source, target)
        written.append(path)
    (dest / "nbgrader_config.py").write_text(STUDENT_NBGRADER_CONFIG)
    return [*written, "nbgrader_config.py"]


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: python tools/student_edition.py DEST")
    dest = Path(sys.argv[1]).resolve()
    if dest == ROOT or ROOT in dest.parents and dest.name in ("", "."):
        sys.exit("DEST must be a new folder, not the repository")
    files = build(dest)
    print(f"Student edition: {len(files)} files in {dest}")


if __name__ == "__main__":
    main()
