"""The class leaderboard of the open parts: `make leaderboard` writes leaderboard/index.html.

    python -m course_lib.grading.leaderboard [--course DIR] [--out leaderboard/index.html]

Each assignment's open part measures something in the checking process (rounds, bytes, peak
memory, balance, makespan: `_harness.measured`), which `make autograde` stores per submission
in the gradebook (`course_lib.grading.measurements`). The page has one table per open part:
the submissions that passed it (full points; a part that failed measures nothing worth
ranking), best first, ties sharing a rank. It shows what a student chose to publish and
nothing else: the display name written in the notebook's `LEADERBOARD_NAME` cell, else an
anonymous id (a keyed hash of the student id with a secret kept in the course folder,
`SECRET`: the same in every assignment, and nobody without the secret can tell whose it is),
the value and the points. Never a student id nobody chose, never code. The page is static, with
no external assets, and every string on it is escaped (a display name is student input).
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import html
import os
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path

from course_lib.grading.measurements import ANONYMOUS
from course_lib.grading.measurements import rows as stored_rows

SECRET = ".leaderboard-secret"  # in the course folder, beside gradebook.db
OUT = Path("leaderboard") / "index.html"


def course_secret(course: Path) -> bytes:
    """The course's key for anonymous ids, made (readable by its owner only) on first use."""
    path = course / SECRET
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
    return path.read_text().strip().encode()


def anonymous_id(secret: bytes, student: str) -> str:
    """A student's name on the page when they chose none: stable for the course (the same in
    every assignment and every run), and not the student id nor derivable from it without
    the secret."""
    digest = hmac.new(secret, student.encode(), hashlib.sha256).hexdigest()
    return f"{ANONYMOUS}-{digest[:8]}"


@dataclass(frozen=True)
class Entry:
    rank: int
    name: str
    chosen: bool  # a display name the student chose, or an anonymous id
    value: float
    score: float


@dataclass(frozen=True)
class Board:
    """One open part's ranking: assignment, the test cell (part), what it measures."""

    assignment: str
    part: str
    check: str
    name: str
    unit: str
    better: str
    points: float
    entries: tuple[Entry, ...]


def boards(rows: list[dict], secret: bytes) -> list[Board]:
    """The rankings of the stored measurements (`measurements.rows`): per assignment, part and
    measure, the submissions whose part earned its full points, best value first; equal
    values share a rank (1, 1, 3)."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        if row["points"] > 0 and row["score"] >= row["points"]:
            key = (row["assignment"], row["part"], row["check_name"], row["name"])
            groups.setdefault(key, []).append(row)
    out = []
    for (assignment, part, check, name), group in sorted(groups.items()):
        better = group[0]["better"]
        group.sort(key=lambda r: (r["value"] if better == "lower" else -r["value"], r["student"]))
        entries, rank = [], 0
        for i, row in enumerate(group):
            if i == 0 or row["value"] != group[i - 1]["value"]:
                rank = i + 1
            chosen = bool(row["display_name"])
            shown = row["display_name"] if chosen else anonymous_id(secret, row["student"])
            entries.append(Entry(rank, shown, chosen, row["value"], row["score"]))
        # by display name, then anonymous id: the student id never orders what the page shows
        entries.sort(key=lambda e: (e.rank, not e.chosen, e.name))
        unit, points = group[0]["unit"], group[0]["points"]
        out.append(Board(assignment, part, check, name, unit, better, points, tuple(entries)))
    return out


def number(value: float) -> str:
    """A measured value as the page shows it: integers with thousands separators."""
    if value == int(value) and abs(value) < 1e15:
        return f"{int(value):,}"
    return f"{value:.4g}"


STYLE = (
    "body{font-family:sans-serif;margin:2em;max-width:48em}"
    "table{border-collapse:collapse;margin-bottom:2em}"
    "td,th{border:1px solid #ccc;padding:.3em .8em;text-align:left}"
    "td.num{text-align:right}.anon{color:#666;font-style:italic}"
)


def page(boards_: list[Board], title: str = "Leaderboard of the open parts") -> str:
    """The leaderboard as one static HTML page (no scripts, no external assets), every string
    escaped."""
    e = html.escape
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{e(title)}</title><style>{STYLE}</style></head><body>",
        f"<h1>{e(title)}</h1>",
        "<p>Submissions whose open part passed, ranked by what the grader measured. A name is "
        "the one its student chose in the notebook (<code>LEADERBOARD_NAME</code>); the others "
        "are anonymous.</p>",
    ]
    if not boards_:
        parts.append("<p>No open part has passed yet.</p>")
    for b in boards_:
        parts += [
            f"<h2>{e(b.assignment)}: {e(b.part)}</h2>",
            f"<p>Measured by {e(b.check)}: {e(b.name)}, in {e(b.unit)} ({e(b.better)} is "
            f"better). The part is worth {number(b.points)} point(s).</p>",
            "<table><thead><tr><th>rank</th><th>name</th>"
            f"<th>{e(b.name)} ({e(b.unit)})</th><th>points</th></tr></thead><tbody>",
        ]
        for entry in b.entries:
            name = e(entry.name) if entry.chosen else f'<span class="anon">{e(entry.name)}</span>'
            parts.append(
                f'<tr><td class="num">{entry.rank}</td><td>{name}</td>'
                f'<td class="num">{number(entry.value)}</td>'
                f'<td class="num">{number(entry.score)}</td></tr>'
            )
        parts.append("</tbody></table>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def write(course: Path, out: Path) -> list[Board]:
    """Write the course's leaderboard page to `out`; its boards."""
    db = course / "gradebook.db"
    if not db.exists():
        raise SystemExit(f"no gradebook.db in {course}: run `make autograde` first")
    found = boards(stored_rows(db), course_secret(course))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page(found), encoding="utf-8")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_lib.grading.leaderboard")
    parser.add_argument("--course", type=Path, default=Path.cwd())
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    course = args.course.resolve()
    out = args.out or course / OUT
    found = write(course, out)
    ranked = sum(len(b.entries) for b in found)
    print(f"Leaderboard written to {out}: {len(found)} open part(s), {ranked} ranked submission(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
