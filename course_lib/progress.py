"""Progress bars for long loops: a widget in JupyterLab, text in a terminal, else nothing.

    for n in progress(sizes, "all-reduce sizes"):
        ...

In the notebook (or script) process the bar is tqdm's. On ranks started by `launch`, rank 0
tells the launcher how far it is and the launcher draws the one bar in the notebook: bars
drawn by the ranks themselves would come out as text mixed with their prints, once per rank.
Other ranks, and every rank of an untrusted pool (autograding), show nothing.

A bar appears only once a loop has run for `DELAY_S`, so quick loops stay silent, and only
where output goes to a notebook or a terminal: not under pytest or in a CI log (tqdm's
`disable=None`). COURSE_PROGRESS=0 turns bars off everywhere, COURSE_PROGRESS=1 forces them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

from course_lib.runtime import is_worker, rank

T = TypeVar("T")
DELAY_S = 2.0  # a loop shorter than this shows no bar at all
SEND_EVERY_S = 0.25  # how often rank 0 reports to the launcher


def _disable() -> bool | None:
    """tqdm's `disable`: None lets tqdm decide (off when stderr is not a terminal)."""
    return {"0": True, "1": False}.get(os.environ.get("COURSE_PROGRESS", ""), None)


def bar(total: int | None, desc: str):
    """A tqdm bar in this process (a widget in a notebook kernel), subject to `_disable`."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, delay=DELAY_S, leave=False, disable=_disable())


def progress(items: Iterable[T], desc: str, total: int | None = None) -> Iterator[T]:
    """Yield `items`, showing how many are done (of `total`, or of len(items))."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    if is_worker():
        return _reported(items, desc, total) if rank() == 0 else iter(items)
    if rank() != 0:  # torchrun: one bar per job, from rank 0
        return iter(items)
    return _drawn(items, desc, total)


def _drawn(items: Iterable[T], desc: str, total: int | None) -> Iterator[T]:
    with bar(total, desc) as b:
        for item in items:
            yield item
            b.update()


def _reported(items: Iterable[T], desc: str, total: int | None) -> Iterator[T]:
    from course_lib import _worker

    last = 0.0
    done = 0
    for item in items:
        yield item
        done += 1
        if time.monotonic() - last >= SEND_EVERY_S or done == total:
            _worker.report_progress(desc, done, total)
            last = time.monotonic()
    _worker.report_progress(desc, done, total, finished=True)


class RemoteBars:
    """The launcher's side: draws the bars its rank 0 reports during one call."""

    def __init__(self, shown: bool) -> None:
        self.shown = shown
        self._bars: dict[str, object] = {}

    def update(self, desc: str, done: int, total: int | None, finished: bool) -> None:
        if not self.shown:
            return
        b = self._bars.get(desc)
        if b is not None and done < b.n:  # a new loop of the same name (the last one broke off)
            b.close()
            b = None
        if b is None:
            b = self._bars[desc] = bar(total, desc)
        b.update(done - b.n)
        if finished:
            b.close()
            del self._bars[desc]

    def close(self) -> None:
        for b in self._bars.values():
            b.close()
        self._bars.clear()
