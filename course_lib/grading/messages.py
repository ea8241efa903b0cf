"""How a failing check reads to the student: its message in lines `nbgrader validate` keeps
whole, an answer still raising its placeholder explained in a sentence, and a rank's
traceback reduced to the student's own frames, with a hint where one error has a known cause.

    wrap(text, width, first)        lines of at most `width` characters (the first: `first`)
    explain_placeholders(message)   "f is not written yet" for a placeholder's traceback
    student_frames(text)            a traceback without the grader's, torch's and Python's frames
    hint_for(traceback)             a hint for an error with a known cause, or ""
"""

from __future__ import annotations

import re
import textwrap

DISPLAY_WIDTH = 80
PREFIX = "CheckFailed: "


def wrap(text: str, width: int, first: int | None = None) -> str:
    lines = []
    for line in text.splitlines():
        indent = line[: len(line) - len(line.lstrip())]
        lines += textwrap.wrap(
            line,
            first if first is not None and not lines else width,
            subsequent_indent=indent + "  ",
            break_long_words=False,
        ) or [""]
    return "\n".join(lines)


# The traceback of an answer still raising its placeholder, `raise NotImplementedError()`: an
# untouched assignment shows a sentence saying what to write, not the traceback (Validate shows
# every failing test cell at once).
_PLACEHOLDER = re.compile(
    r"Traceback \(most recent call last\):\n"
    r"(?:(?:[ \t].*)?\n)*?"  # the frames before the last
    r'  File "[^"]*", line \d+, in (?P<fn>[\w.<>]+)\n'
    r"(?: +raise NotImplementedError(?:\(\))?\n)?"
    r"(?: *\^+\n)?"
    r"NotImplementedError[ \t]*(?:\n|$)"
)


def explain_placeholders(message: str) -> str:
    return _PLACEHOLDER.sub(
        lambda m: (
            f"{m['fn']} is not written yet: it still raises the placeholder "
            f"NotImplementedError. Replace `raise NotImplementedError()` in {m['fn']}'s cell with "
            "your code, run that cell, then this one.\n"
        ),
        message,
    )


_FRAME = re.compile(r'^  File "(?P<file>[^"]+)", line \d+, in .*$')
_LIBRARY = re.compile(r"(/course_lib/|/site-packages/|/lib/python3\.\d+/|^<frozen )")


def student_frames(text: str) -> str:
    """A rank's traceback with the grader's, torch's and Python's own frames left out: the
    student's lines and the error remain."""
    out, keep = [], True
    for line in text.splitlines():
        match = _FRAME.match(line)
        if match:
            keep = not _LIBRARY.search(match.group("file"))
        elif not line.startswith("    "):
            keep = True  # the end of a frame: an exception line, a note, a header
        if keep:
            out.append(line)
    return "\n".join(out) + "\n"


def hint_for(traceback_text: str) -> str:
    if "Expected a value of type '__torch__.torch.classes.c10d.ProcessGroup" in traceback_text:
        return (
            "\nHint: this called a torch.distributed operator (torch.ops.c10d) directly; that "
            "route is not open here. Use the torch.distributed functions the part allows.\n"
        )
    return ""
