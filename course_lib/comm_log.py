"""When a rank's all-reduces were launched and where it waited for one: a timeline to look at.

    with AllReduceLog() as log:
        log.phase = "backward"
        loss.backward()              # a DDP's hooks launch their buckets' all-reduces
    log.calls    # [AllReduceCall(time=..., nbytes=..., async_op=True, phase="backward"), ...]
    log.waits    # ["sync", ...]: the phase of every wait() on a Work or a Future

    with WaitLog() as waits:         # the waits alone
        ...

Both patch what the code they watch calls (`Work.wait`, `Future.wait`) and hook the
torch.distributed calls (`course_lib.comm`'s around hooks), so they live here, in the
machinery, and not in the grader: code the student's calls pass through is not the grader's.
What they record is kept on the rank, beside the code they watch: fit for a plot or a hint,
and for the one fact nothing outside the rank can see, whether code waited; which calls a rank
made, and their bytes, are counted outside it (`course_lib.counted_group`).

A wait is seen when it is a call of `wait()` from Python: a synchronous torch.distributed
call waits that way too. Polling `is_completed()` in a loop is not seen.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from course_lib import comm


@dataclass
class WaitLog:
    """The `phase` (a label the caller sets) of every `wait()` on a Work or a Future made from
    Python while the block runs. Two at a time are not supported."""

    waits: list[str] = field(default_factory=list)
    phase: str = ""

    def __enter__(self) -> WaitLog:
        self._saved = [(cls, cls.wait) for cls in (dist.Work, torch._C.Future)]
        for cls, original in self._saved:
            cls.wait = self._logged_wait(original)
        return self

    def _logged_wait(self, original: Callable) -> Callable:
        def wait(work, *args, **kwargs):
            self.waits.append(self.phase)
            return original(work, *args, **kwargs)

        return wait

    def __exit__(self, *exc_info: object) -> None:
        for cls, original in self._saved:
            cls.wait = original


@dataclass
class AllReduceCall:
    """One all-reduce: when it was launched (perf_counter seconds), its bytes, whether it
    returned unfinished (a Work), and the log's `phase` at that moment. A synchronous call
    seen only at the process group (made through a name bound earlier) returns a Work to
    torch's function, which waits for it: that wait is in `AllReduceLog.waits`."""

    time: float
    nbytes: int
    async_op: bool
    phase: str = ""


@dataclass
class AllReduceLog(WaitLog):
    """Records every all-reduce made while the block runs, and every wait for one.

    On grading ranks, whose process group reports every call, that is every route
    (`dist.all_reduce`, a name bound earlier, the group object, DDP's C++ reducer); elsewhere,
    the calls made as `dist.all_reduce(...)`. `others` holds the (op, phase) of every other
    collective."""

    calls: list[AllReduceCall] = field(default_factory=list)
    others: list[tuple[str, str]] = field(default_factory=list)

    def _hook(self, op: str, args: dict, sent: int, received: int, call: Callable):
        if op != "all_reduce":
            self.others.append((op, self.phase))
            return call()
        tensor, launched, phase = args["tensor"], time.perf_counter(), self.phase
        work = call()
        nbytes = tensor.numel() * tensor.element_size()
        self.calls.append(AllReduceCall(launched, nbytes, work is not None, phase))
        return work

    def __enter__(self) -> AllReduceLog:
        comm.add_around_hook(self._hook)
        return super().__enter__()

    def __exit__(self, *exc_info: object) -> None:
        super().__exit__(*exc_info)
        comm.remove_around_hook(self._hook)
