"""What a rank of check_sharded_adamw (grading/parallel_3d_zero.py) keeps between steps:
observed on the rank, reckoned in the checking process.

Only the rank can see its own memory, so the scans run there: every storage behind a tensor
the garbage collector can reach (and behind their .grad), as Assignment 7's scans do. But
nothing a scan finds is left on the rank to be read later, where the rank's code could widen
the check's baseline or slip its state among the check's own records: each observation is
sent to the launcher as it is made, as a mark between the tallied calls (`counted_group.mark`),
and the judge reckons the bytes kept from what the launcher received. Code on the rank can
add marks, never take one back, and the check's marks have fixed places (`read_observations`):
any other is tampering.

    baseline(alive)          on the rank, before ShardedAdamW(...): the storages alive then
    scan(model, step)        on the rank, after step(): two scans, and the model's own bytes
    own(tensors)             on the rank: the storages of the check's own records
    observation(label)       in the checking process: a mark's observation, or None
    reckon(observations)     in the checking process: bytes kept after each step, and the
                             largest storages

Memory kept outside torch (a numpy array) is not seen: the notebook forbids it in words, as
Assignment 7 does.
"""

from __future__ import annotations

import gc
import json
import time
import warnings
from collections import Counter
from collections.abc import Iterable

import torch

from course_lib import _worker

PREFIX = "memory "  # the marks that carry an observation; every other mark is a case number
RESCAN_AFTER = 0.05  # seconds between the two scans of a step
SHOWN = 3  # largest storages named in a verdict


# --- on the rank --------------------------------------------------------------------------------


def reachable() -> list[torch.Tensor]:
    """Every tensor the garbage collector knows on this rank, and their .grad. Objects a call
    froze to hide them from this scan are unfrozen first (see `_worker._freeze`)."""
    if _worker.frozen_by_a_call():
        gc.unfreeze()
    gc.collect()
    # isinstance() on torch's deprecated aliases warns, and so does .grad of a non-leaf
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
        grads = [t.grad for t in tensors if t.grad is not None]
    return tensors + grads


def _storage(t: torch.Tensor) -> tuple[int, int]:
    """(key, bytes) of the storage behind `t`; a tensor without one of its own (a wrapper
    subclass, say) counts as its elements, under its own id."""
    try:
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        return id(t), t.numel() * t.element_size()


def _label(kind: str, **payload: object) -> str:
    return PREFIX + json.dumps({"kind": kind, **payload})


def baseline(alive: Iterable[torch.Tensor]) -> str:
    """The storages alive before ShardedAdamW(...) was called (the check holds `alive` until
    the end, so that no new storage can take their place)."""
    return _label("baseline", keys=sorted({_storage(t)[0] for t in alive}))


def own(tensors: Iterable[torch.Tensor]) -> str:
    """The storages of the check's own records (held until the end, like the baseline)."""
    return _label("own", keys=sorted({_storage(t)[0] for t in tensors}))


def _found() -> list[list]:
    """[key, bytes, dtype, shape] of every storage alive on this rank."""
    found = {}
    for t in reachable():
        key, nbytes = _storage(t)
        if nbytes:
            found[key] = [key, nbytes, str(t.dtype), list(t.shape)]
    return list(found.values())


def scan(model: torch.nn.Module, step: int) -> str:
    """After step `step`: the bytes of the model's parameters and gradients in each storage
    (allowed), and two scans of every storage alive, some time apart. A buffer a collective
    is done with can stay alive a moment after wait() returns, most likely until gloo's
    thread lets it go (seen: 256 bytes more on one step in about 150, under load): what the
    code keeps is alive in both scans, and the judge takes the smaller total."""
    allowed: Counter = Counter()
    for p in model.parameters():
        for t in (p, p.grad):
            if t is not None:
                key, _ = _storage(t)
                allowed[key] += t.numel() * t.element_size()
    scans = []
    for n in range(2):
        time.sleep(RESCAN_AFTER if n else 0)
        scans.append(_found())
    return _label("scan", step=step, allowed=sorted(allowed.items()), scans=scans)


# --- in the checking process ------------------------------------------------------------------


def observation(label: object) -> dict | None:
    """The observation a mark carries, None for a case mark; a mark that claims to be an
    observation but is not one raises ValueError."""
    if not (isinstance(label, str) and label.startswith(PREFIX)):
        return None
    found = json.loads(label.removeprefix(PREFIX))
    if not isinstance(found, dict) or found.get("kind") not in ("baseline", "own", "scan"):
        raise ValueError(f"not an observation: {label[:80]!r}")
    return found


def reckon(observations: list[dict]) -> list[dict]:
    """Per step, from one rank's observations in order (a baseline, then per step a scan and
    the check's records of it): "kept", the bytes of storages alive in both scans that were
    neither in the baseline nor the check's own, less the parameters' and gradients' bytes
    in them (the smaller of the two scans' totals); "largest", those storages, described."""
    skip, steps = set(), []
    for seen in observations:
        if seen["kind"] != "scan":
            skip |= set(seen["keys"])  # the baseline, and the check's records
            continue
        allowed = dict(seen["allowed"])
        totals = []
        for found in seen["scans"]:
            extra = {
                key: (nbytes - allowed.get(key, 0), dtype, shape)
                for key, nbytes, dtype, shape in found
                if key not in skip and nbytes > allowed.get(key, 0)
            }
            totals.append((sum(e[0] for e in extra.values()), extra))
        kept, extra = min(totals, key=lambda total: total[0])
        largest = sorted(extra.values(), key=lambda e: e[0], reverse=True)[:SHOWN]
        shown = [f"{n:,} bytes ({dtype}, {tuple(shape)})" for n, dtype, shape in largest]
        steps.append({"kept": kept, "largest": shown})
    return steps
