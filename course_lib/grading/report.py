"""After `make autograde`: which submissions tampered with the grading, and how.

    python -m course_lib.grading.report [autograded]

Reads the test cells of every autograded notebook (`autograded/<student>/<assignment>/`),
where the judge recorded what it detected (`metadata.course_lib.tampering`), prints one line
per finding and writes them to `tampering.csv` (empty but for its header when there are
none). Such parts already scored 0; the report is for the instructor to follow up.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import nbformat


def findings(autograded: Path) -> list[dict[str, str]]:
    rows = []
    for path in sorted(autograded.glob("*/*/*.ipynb")):
        student, assignment = path.parent.parent.name, path.parent.name
        for cell in nbformat.read(path, as_version=4).cells:
            for what in cell.metadata.get("course_lib", {}).get("tampering", []):
                rows.append(
                    {"student": student, "assignment": assignment, "cell": cell.id, "what": what}
                )
    return rows


def main() -> None:
    autograded = Path(sys.argv[1] if len(sys.argv) > 1 else "autograded")
    rows = findings(autograded)
    with open("tampering.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["student", "assignment", "cell", "what"])
        writer.writeheader()
        writer.writerows(rows)
    for row in rows:
        first_line = row["what"].splitlines()[0][:160]
        print(f"TAMPERING {row['student']} / {row['assignment']} / {row['cell']}: {first_line}")
    print(f"{len(rows)} tampering finding(s) written to tampering.csv")


if __name__ == "__main__":
    main()
