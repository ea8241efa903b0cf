"""Judging the training of Assignment 3's checks, in the checking process.

The single-process reference (`_Replay`: the whole batches drawn for the ranks, steered by one
rank's gradients), the comparison of every rank's gradients and parameters with it after
every step (`_compare_training`) and of a DDP's state right after construction
(`_compare_initial`), and the hints that say which mistake makes a wrong gradient.
"""

from __future__ import annotations

import torch

from course_lib import compare
from course_lib.grading._harness import fail
from course_lib.grading.data_parallel_cases import Drawn
from course_lib.grading.data_parallel_runs import (
    TOLERANCE,
    DDPRun,
    _grads,
    build_model,
    loss_scale,
    per_sample_loss,
    rank_loss,
)
from course_lib.grading.training import make_optimizer, snapshot

# --- the single-process reference, in the checking process --------------------------------


def _reference(run: DDPRun, drawn: Drawn, prefix: str) -> dict:
    """What every rank is measured against: the whole batches (as the shards drawn for the
    ranks, per step) and the initial model (rank 0's weights), its names prefixed with
    `prefix` (e.g. "module.")."""
    initial = build_model(run, drawn.seeds[0])
    return {
        "shards": drawn.shards,
        "seed": drawn.seeds[0],
        "initial_params": {prefix + n: p.detach() for n, p in initial.named_parameters()},
        "initial_buffers": {prefix + n: b for n, b in initial.named_buffers()},
        "frozen": {prefix + n for n, p in initial.named_parameters() if not p.requires_grad},
        "trainable": [p for p in initial.parameters() if p.requires_grad],
    }


class _Replay:
    """Single-process training on the whole batches, steered by one rank's gradients. Each
    step gives the full-batch gradient at the weights that rank should hold (what its
    gradients are compared with), then applies torch's optimizer to the rank's own gradients
    (what its parameters are compared with). Steering keeps rounding from compounding: AdamW
    turns a gradient of 1e-10 where the whole batch gives exactly 0 into a step of lr / 100,
    after which free-running reference training and a right rank would part ways."""

    def __init__(self, run: DDPRun, prefix: str, seed: int):
        self.run, self.prefix = run, prefix
        self.model = build_model(run, seed)
        self.optimizer = make_optimizer(run.optimizer, self.model.parameters())
        self.steps: list[dict] = []  # per step: weights before, full-batch gradients, shards

    def gradients(self, shards: list[tuple]) -> dict[str, torch.Tensor | None]:
        before = {k: v.clone() for k, v in self.model.state_dict().items()}
        x, y = (torch.cat(parts) for parts in zip(*shards, strict=True))
        self.model.zero_grad(set_to_none=True)
        per_sample_loss(self.run, self.model(x), y).mean().backward()
        grads = {self.prefix + name: g for name, g in _grads(self.model).items()}
        self.steps.append({"before": before, "grads": grads, "shards": shards})
        return grads

    def step(self, grads: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
        for name, p in self.model.named_parameters():
            g = grads.get(self.prefix + name)
            p.grad = g.detach().to(p.dtype).clone() if isinstance(g, torch.Tensor) else None
        self.optimizer.step()
        return {self.prefix + n: p for n, p in snapshot(self.model.named_parameters()).items()}


def _local_grads(kind: str, run: DDPRun, step: dict, name: str) -> list[torch.Tensor]:
    """The gradient of parameter `name` each rank computes from its own shard alone."""
    out = []
    scale = loss_scale([len(x) for x, _ in step["shards"]])
    for x, y in step["shards"]:
        model = build_model(run, 0)
        model.load_state_dict(step["before"])
        rank_loss(kind, run, model(x), y, scale).backward()
        out.append(dict(model.named_parameters())[name].grad)
    return out


# --- comparing training -------------------------------------------------------------------


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Loosely equal: for telling which mistake was made, not for grading."""
    scale = max(1.0, want.abs().max().item())
    return compare.find_mismatch({"t": got}, {"t": want}, rtol=1e-4, atol=1e-5 * scale) is None


def _gradient_hint(kind: str, run: DDPRun, replay: _Replay, s: int, r: int, name: str, got) -> str:
    """Which mistake makes rank r's gradient `got` at step s."""
    step, prefix = replay.steps[s], replay.prefix
    want = step["grads"][name]
    local = _local_grads(kind, run, step, name.removeprefix(prefix))
    sizes = [len(x) for x, _ in step["shards"]]
    ranks, total = len(sizes), sum(sizes)
    candidates = []
    if ranks > 1:
        candidates.append((local[r], "own"))
        if kind == "sync":
            candidates += [
                (sum(local) / ranks, "plain"),
                (sum(local), "sum"),
                (sum(n * g for n, g in zip(sizes, local, strict=True)), "weighted sum"),
            ]
        candidates.append((ranks * want, "times world size"))
    previous = replay.steps[s - 1]["grads"][name] if s > 0 else None
    if previous is not None:
        candidates.append((want + previous, "accumulated"))
    if run.dtype == torch.float64:  # checked last: every other candidate is further away
        candidates.append((want, "float32 rounding"))
    found = next((what for value, what in candidates if _close(got, value)), None)
    return _HINTS[kind][found].format(sizes=sizes, total=total)


_FLOAT32 = (
    "it is right up to float32 rounding, in a float64 run: keep every tensor you compute "
    "with in the gradients' dtype (torch.tensor(2.0) and torch.zeros(n) are float32; pass "
    "dtype=p.grad.dtype), or use Python numbers"
)
_HINTS = {
    "sync": {
        "own": "it is still this rank's own gradient: did you all-reduce every .grad?",
        "plain": (
            "it is the plain average of the ranks' gradients, right for equal shards only; "
            "the shards here hold {sizes} samples: weight rank r's gradient by its "
            "num_samples n_r, the full-batch gradient is sum_r n_r g_r / sum_r n_r"
        ),
        "sum": (
            "it is the sum of the ranks' gradients: weight each by its num_samples and "
            "divide by the total number of samples"
        ),
        "weighted sum": (
            "it is sum_r n_r g_r: divide it by the total number of samples ({total} here), "
            "which every rank must learn from the others"
        ),
        "times world size": (
            "it is world_size times the full-batch gradient: did every rank divide by the "
            "total number of samples (or the world size) after summing?"
        ),
        "accumulated": (
            "it is this step's plus the previous step's gradient: gradients accumulate "
            "across steps; does your code keep state between calls?"
        ),
        "float32 rounding": _FLOAT32,
        None: (
            "after sync_gradients every rank must hold sum_r n_r g_r / sum_r n_r, the "
            "gradient of the mean loss over all ranks' samples ({sizes} this step)"
        ),
    },
    "ddp": {
        "own": (
            "it is still this rank's own gradient: after waiting for a bucket's all-reduce, "
            "are the averaged values written back into each parameter's .grad?"
        ),
        "times world size": (
            "it is world_size times the full-batch gradient: did you divide the "
            "all-reduced sum by the world size, on every rank?"
        ),
        "accumulated": (
            "it is this step's plus the previous step's gradient: gradients accumulate "
            "across steps. The check calls model.zero_grad() before each step; it must "
            "leave every .grad None (or zero), as nn.Module.zero_grad does"
        ),
        "float32 rounding": _FLOAT32,
        None: "after synchronization every rank must hold the average of all ranks' gradients",
    },
}


def _none_hint(kind: str, name: str, frozen: bool, has_grad: bool) -> str:
    if has_grad:
        if frozen:
            return (
                f"{name!r} is frozen (requires_grad=False) but has a gradient: leave frozen "
                "parameters alone"
            )
        return (
            f"{name!r} got no gradient in backward on any rank, but has a .grad after "
            "synchronization; leave .grad None where backward left it None (write averaged "
            "values back only into parameters that have a .grad)"
        )
    what = "after finish_gradient_synchronization" if kind == "ddp" else "after sync_gradients"
    return f"{name!r} has no gradient {what}, but it should have one"


def _step_problem(kind: str, run: DDPRun, ref: dict, s: int, r: int, step: dict, replay: _Replay):
    """What is wrong with rank r's gradients or parameters at step s, or None."""
    rtol, atol = TOLERANCE[run.dtype]
    sync = "finish_gradient_synchronization" if kind == "ddp" else "sync_gradients"
    for name, want in replay.gradients(ref["shards"][s]).items():
        got = step["grads"].get(name)
        if (got is None) != (want is None):
            return _none_hint(kind, name, name in ref["frozen"], got is not None)
        if want is None:
            continue
        problem = compare.find_mismatch({name: got}, {name: want}, rtol=rtol, atol=atol)
        if problem:
            hint = _gradient_hint(kind, run, replay, s, r, name, got)
            if not step["communicated"]:
                hint = "no collective call was seen during the step; " + hint
            return f"the gradient after {sync} differs from the full-batch gradient: " + (
                f"{problem}.\nHint: {hint}"
            )
    problem = compare.find_mismatch(
        step["params"], replay.step(step["grads"]), rtol=rtol, atol=atol
    )
    if problem:
        return (
            f"after optimizer.step(), {problem}.\nHint: the gradients matched the full-batch "
            "ones; does your code change parameters or gradients anywhere else?"
        )
    return None


def _compare_training(check: str, kind: str, run: DDPRun, results: list[dict], ref: dict) -> None:
    """Fail at the first step where a rank differs from the reference (naming the first such
    rank and how many others)."""
    __tracebackhide__ = True
    where = run.describe(len(results))
    prefix = "module." if kind == "ddp" else ""
    replays = [_Replay(run, prefix, ref["seed"]) for _ in results]
    for s in range(run.steps):
        wrong = [
            (r, problem)
            for r, result in enumerate(results)
            if (problem := _step_problem(kind, run, ref, s, r, result["steps"][s], replays[r]))
        ]
        if wrong:
            r, problem = wrong[0]
            also = f" (ranks {', '.join(str(w) for w, _ in wrong[1:])} too)" if wrong[1:] else ""
            fail(check, f"rank {r}, step {s} ({where}){also}: {problem}")


def _compare_initial(check: str, run: DDPRun, results: list[dict], ref: dict) -> None:
    """Right after construction every rank must hold rank 0's parameters and buffers."""
    __tracebackhide__ = True
    expected_names = list(ref["initial_params"])
    where = run.describe(len(results))
    for r, result in enumerate(results):
        initial = result["initial"]
        names = list(initial["params"])
        if sorted(names) != sorted(expected_names):
            fail(
                check,
                f"rank {r}: named_parameters() gives {names}, expected {expected_names}. "
                "Keep the wrapped model as self.module (so names start with 'module.') and "
                "register no parameters of your own",
            )
        for what, got, want in (
            ("parameter", initial["params"], ref["initial_params"]),
            ("buffer", initial["buffers"], ref["initial_buffers"]),
        ):
            problem = compare.find_mismatch(got, want, rtol=0.0, atol=0.0)
            if problem:
                fail(
                    check,
                    f"rank {r} ({where}): right after construction, a {what} differs from "
                    f"rank 0's initial one: {problem}.\nHint: every rank builds its model "
                    "from a different seed here; broadcast rank 0's parameters and buffers "
                    "at construction (with torch.no_grad(): dist.broadcast(tensor, src=0))",
                )
