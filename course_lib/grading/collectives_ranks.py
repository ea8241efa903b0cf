"""Assignment 2's checks, what runs on each rank: the student's collective on this rank's own
inputs, case after case, and what it left in the tensors it was given.

A rank holds nothing else. The other ranks' inputs and the result torch would give are drawn
and computed in the checking process (`collectives_cases`), and the calls each rank makes are
reported to the launcher as they happen (`course_lib.counted_group`), between the marks that
say which case they belong to: the rank does not keep the tallies the check judges by.

    Case                    one run of a collective (world size, shape, dtype, seed, root)
    run_cases(kind, fn, cases, inputs)  what every rank runs: one record per case
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from course_lib import counted_group
from course_lib.comm import RequestLog
from course_lib.grading.provenance import Provenance

# Lecture 2's module holds working collectives built from send and recv (naive, tree,
# butterfly and ring all-reduces): an answer that runs them, or a copy, is not the student's.
LECTURE = ("course_lib.collectives",)


@dataclass(frozen=True)
class Case:
    """One run of a collective: on how many ranks, with what tensor, from/to which root."""

    world_size: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    seed: int
    root: int | None = None  # src of a broadcast, dst of a reduce

    def __str__(self) -> str:
        dtype = str(self.dtype).replace("torch.", "")
        root = "" if self.root is None else f", root rank {self.root}"
        return f"world size {self.world_size}, {dtype}, shape {self.shape}, seed {self.seed}{root}"


def _arguments(kind: str, case: Case, given: dict) -> tuple[tuple, dict]:
    """The student's arguments for one case, from this rank's inputs (copies: the inputs are
    kept to see what the call changed), and the tensors to read back afterwards."""
    if kind in ("broadcast", "reduce"):
        tensor = given["tensor"].clone()
        return (tensor, case.root), {"tensor": tensor}
    if kind == "all_reduce":
        tensor = given["tensor"].clone()
        return (tensor,), {"tensor": tensor}
    if kind == "all_gather":
        slots = [t.clone() for t in given["tensor_list"]]
        tensor = given["tensor"].clone()
        return (list(slots), tensor), {"slots": slots, "tensor": tensor}
    if kind == "reduce_scatter":
        output = given["output"].clone()
        inputs = [t.clone() for t in given["input_list"]]
        return (output, list(inputs)), {"output": output, "input_list": inputs}
    raise ValueError(kind)


def _run_case(kind: str, fn: Callable, case: Case, given: dict) -> dict:
    args, kept = _arguments(kind, case, given)
    with RequestLog() as log:
        try:
            returned = fn(*args)
        except BaseException as exc:
            if hasattr(exc, "add_note"):  # Python 3.11+: the traceback then names the case
                exc.add_note(f"(while checking: {case})")
            raise
    record = {
        "returned": returned if isinstance(returned, torch.Tensor) else None,
        "unwaited": log.unwaited(),
        "rebound": [],
        "changed": [],
    }
    if kind == "all_gather":
        tensor_list = args[0]
        record["got"] = {f"tensor_list[{i}]": t for i, t in enumerate(kept["slots"])}
        record["rebound"] = [
            f"tensor_list[{i}]"
            for i, t in enumerate(kept["slots"])
            if i >= len(tensor_list) or tensor_list[i] is not t
        ]
        record["changed"] = ["tensor"] if not torch.equal(kept["tensor"], given["tensor"]) else []
    elif kind == "reduce_scatter":
        record["got"] = {"output": kept["output"]}
        record["changed"] = [
            f"input_list[{i}]"
            for i, t in enumerate(given["input_list"])
            if not torch.equal(kept["input_list"][i], t)
        ]
    else:
        record["got"] = {"tensor": kept["tensor"]}
    return record


def run_cases(kind: str, fn: Callable, cases: list[Case], inputs: list[dict]) -> dict:
    """On each rank: every case in turn, in the same order on every rank, on this rank's own
    `inputs` (one dict per case). Before each case a mark goes to the launcher, so that the
    calls reported after it count for that case."""
    with Provenance(LECTURE) as seen:
        results = []
        for i, (case, given) in enumerate(zip(cases, inputs, strict=True)):
            counted_group.mark(i)
            results.append(_run_case(kind, fn, case, given))
        counted_group.mark(len(cases))  # what comes after the last case belongs to none
    return {"cases": results, "copied": seen.complaint()}
