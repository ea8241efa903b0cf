"""Turn a worker's faulthandler dump into a readable stack of where its main thread waits.

faulthandler prints every thread, most recent call first, without source lines. The student
wants the main thread, oldest call first, starting at their own function, with the line of
code that blocks, the way a Python traceback reads.
"""

from __future__ import annotations

import linecache
import re

_THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-fA-F]+)")
_FRAME = re.compile(r'^\s*File "(.*)", line (\d+) in (.*)$')
# Frames of the launcher's own plumbing, above the student's function.
_INTERNAL = ("course_lib/_worker.py", "course_lib/_zygote.py")


def main_thread_frames(dump: str, main_ident: int) -> list[tuple[str, int, str]]:
    """(file, line, function) of the main thread in a faulthandler dump, oldest call first."""
    frames: list[tuple[str, int, str]] = []
    in_main = False
    for line in dump.splitlines():
        header = _THREAD.match(line)
        if header:
            if in_main:
                break  # a later dump of the same thread: keep the first
            in_main = int(header.group(1), 16) == main_ident
            continue
        frame = _FRAME.match(line)
        if in_main and frame:
            frames.append((frame.group(1), int(frame.group(2)), frame.group(3)))
    frames.reverse()
    return _drop_plumbing(frames)


def _drop_plumbing(frames: list[tuple[str, int, str]]) -> list[tuple[str, int, str]]:
    """Keep the frames below the launcher's own; if there are none (the rank runs a built-in
    such as time.sleep), keep the launcher frame that called it."""
    last_internal = -1
    for i, (path, _, _) in enumerate(frames):
        if path.replace("\\", "/").endswith(_INTERNAL):
            last_internal = i
    return frames[last_internal + 1 :] or frames[last_internal:]


def format_frames(frames: list[tuple[str, int, str]]) -> str:
    """Format frames like a traceback, quoting each line from the launcher's own sources
    (which include the notebook's cells)."""
    if not frames:
        return "    (no Python frames)\n"
    out = []
    for path, lineno, function in frames:
        out.append(f'  File "{path}", line {lineno}, in {function}\n')
        source = linecache.getline(path, lineno).strip()
        if source:
            out.append(f"    {source}\n")
    return "".join(out)
