"""Checks for Assignment 3, data-parallel training.

    check_sync_gradients(sync_gradients)   the full-batch gradient from shards of uneven sizes
    check_ddp(DDP)                         a DDP wrapper: broadcast, gradient buckets, overlap

Both train seeded models for a few steps of SGD and of AdamW with every global batch split
across the ranks in shards of random, uneven sizes, and compare every rank's gradients, after
every step, with single-process training on the whole batch, and its parameters with what
torch's optimizer makes of those gradients (`_Replay`).

Each rank draws its own samples at random (`secrets`) while the check runs and sends them back
with its results; the reference is trained on them in the checking process. No rank can know
another rank's samples, so communication is the only way to the full-batch gradient: an
answer that recomputes the gradient of data every rank could regenerate gets nothing.

Part 1: rank r's loss is the mean over its own n_r samples, and `sync_gradients(model, n_r)`
must leave the full-batch gradient sum_r n_r g_r / sum_r n_r. The lecture's
`allreduce_gradients` takes the plain average, right for equal shards only; an answer that
calls or copies the lecture's code is refused (`Provenance`).

Part 2: the DDP averages plainly, as torch's does, so rank r's loss is weighted instead:
sum over its shard * world_size / batch size, whose plain average over the ranks is the
full-batch mean. Ranks start from different weights (a different seed per rank): only a
broadcast at construction makes them match. `ProbeModel` has what trips implementations up:
parameters of uneven sizes, a frozen one, one that never gets a gradient, and a buffer; a
parameter that gets no gradient keeps .grad None, as with torch's DDP and
find_unused_parameters=True. Communication is recorded on every route (`AllReduceLog`) and
judged as three properties: the result (which gates the others), the buckets and the overlap
(`DDP_WEIGHTS`).
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course_lib import comm, compare, data
from course_lib.grading._harness import RESULT, CheckFailed, Verdict, fail, run_on_ranks
from course_lib.grading.provenance import Provenance
from course_lib.grading.training import make_optimizer, snapshot
from course_lib.launch import LaunchTimeout
from course_lib.models import MLP, TinyGPT
from course_lib.runtime import rank, world_size

MB = 2**20  # bytes in one "MB" of bucket_cap_mb, as in torch's DDP
INIT_SEED_STRIDE = 1000  # check_ddp builds rank r's model with seed + 1000 * r
# (rtol, atol) per dtype; fp32 rounding between split and whole batches is ~1e-7 (measured on
# the course's models), fp64 ~1e-14.
TOLERANCE = {torch.float32: (1e-5, 1e-6), torch.float64: (1e-10, 1e-10)}
# Default caps, in elements: below the largest parameter. ProbeModel's 60 makes the rule's
# layout differ from forward order, from 1 MB = 10^6 bytes and from closing a bucket when
# it reaches the cap (one of its buckets fills the cap exactly).
BUCKET_ELEMENTS = {"probe": 60, "mlp": 300, "gpt": 2048}
# check_ddp's points: half for the buckets, half for the overlap, neither unless the result
# (training, broadcast, every gradient all-reduced once) is right.
DDP_WEIGHTS = {RESULT: 0.0, "buckets": 0.5, "overlap": 0.5}

# What a student receives that would answer these parts: the lecture's data-parallel
# helpers, this module's bucket rule (it ships with course_lib), and torch's DDP. (Not the
# lecture's `_unflatten_into`: its five lines are what anyone writes to copy slices back.)
LECTURE_DP = tuple(
    f"course_lib.data_parallel.{name}"
    for name in (
        "allreduce_gradients",
        "flat_gradients",
        "gradients",
        "train_data_parallel",
        "host_step",
    )
)
FORBIDDEN = {
    "sync": LECTURE_DP,
    "ddp": (
        *LECTURE_DP,
        "course_lib.grading.data_parallel.buckets",
        "course_lib.grading.data_parallel.bucket_layout",
        "torch.nn.parallel.DistributedDataParallel",
    ),
}


# --- the check's own model ----------------------------------------------------------------


class ProbeModel(nn.Module):
    """8 -> 24 -> 12 -> 4 with uneven parameter sizes, a frozen gain, a buffer, and a layer
    (`unused`) whose weight never gets a gradient and shares a bucket with `inp.bias`."""

    def __init__(self, seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.gain = nn.Parameter(torch.rand(24, dtype=dtype) + 0.5, requires_grad=False)
            self.inp = nn.Linear(8, 24, dtype=dtype)
            self.unused = nn.Linear(6, 6, bias=False, dtype=dtype)  # never called
            self.mid = nn.Linear(24, 12, dtype=dtype)
            self.out = nn.Linear(12, 4, dtype=dtype)
            self.register_buffer("shift", 0.1 * torch.randn(24, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x) + self.shift) * self.gain
        return self.out(torch.relu(self.mid(h)))


# --- recording all-reduce calls -----------------------------------------------------------


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
class AllReduceLog:
    """Records every all-reduce made while the block runs, and every wait for one.

        with AllReduceLog() as log:
            loss.backward()
        log.calls   # [AllReduceCall(time=..., nbytes=..., async_op=True, phase=""), ...]

    Built on `course_lib.comm`'s around hooks: on grading ranks, whose process group reports
    every call, that is every route (`dist.all_reduce`, a name bound earlier, the group
    object, DDP's C++ reducer); elsewhere, the calls made as `dist.all_reduce(...)`. `waits`
    holds the phase of every `wait()` on a Work or a Future made from Python (a synchronous
    all-reduce waits too), `others` the (op, phase) of every other collective. Set `phase` to
    label what follows ("backward", ...)."""

    calls: list[AllReduceCall] = field(default_factory=list)
    waits: list[str] = field(default_factory=list)
    others: list[tuple[str, str]] = field(default_factory=list)
    phase: str = ""

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
        comm.remove_around_hook(self._hook)


# --- models, data and losses shared by the ranks and the reference ------------------------


@dataclass(frozen=True)
class Run:
    """One training run: which model, optimizer, precision and batches."""

    model: str = "mlp"  # "mlp", "probe" or "gpt"
    optimizer: str = "sgd"  # "sgd" or "adamw"
    seed: int = 0
    dtype: torch.dtype = torch.float32
    steps: int = 3
    batch_size: int = 16
    bucket_cap_mb: float | None = None

    def batch(self, step: int, ranks: int) -> int:
        """Samples in the global batch of `step`: batch_size, but a quarter fewer at the last
        step (as the last batch of an epoch often is), and never fewer than the ranks."""
        if step < self.steps - 1:
            return self.batch_size
        return max(ranks, 3 * self.batch_size // 4)

    def describe(self, ranks: int) -> str:
        name = {"sgd": "SGD", "adamw": "AdamW"}[self.optimizer]
        dtype = str(self.dtype).removeprefix("torch.")
        last = self.batch(self.steps - 1, ranks)
        batches = f"batches of {self.batch_size}" + (
            f" (the last {last})" if last != self.batch_size else ""
        )
        return (
            f"{self.model} model, {name}, {dtype}, seed {self.seed}, {batches} on {ranks} "
            f"rank{'s' if ranks > 1 else ''}"
        )

    def cap_mb(self) -> float:
        """bucket_cap_mb, or by default a cap smaller than the model's largest parameter."""
        if self.bucket_cap_mb is not None:
            return self.bucket_cap_mb
        element_size = torch.empty(0, dtype=self.dtype).element_size()
        return BUCKET_ELEMENTS[self.model] * element_size / MB


def build_model(run: Run, seed: int) -> nn.Module:
    if run.model == "mlp":
        return MLP((8, 32, 32, 4), seed=seed, dtype=run.dtype)
    if run.model == "probe":
        return ProbeModel(seed=seed, dtype=run.dtype)
    if run.model == "gpt":
        return TinyGPT(seed=seed, dtype=run.dtype)
    raise ValueError(f"unknown model {run.model!r}: use 'mlp', 'probe' or 'gpt'")


def shard_sizes(run: Run, ranks: int, step: int) -> list[int]:
    """How many of the `run.batch(step, ranks)` samples each rank holds at `step`: a random
    split (the same on every rank and in the reference), every rank at least one, usually
    uneven."""
    total = run.batch(step, ranks)
    g = torch.Generator().manual_seed(1_000_003 * run.seed + 1009 * step + ranks)
    cuts = (torch.randperm(total - 1, generator=g)[: ranks - 1] + 1).sort().values
    edges = [0, *cuts.tolist(), total]
    return [b - a for a, b in itertools.pairwise(edges)]


def draw_shard(run: Run, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`n` samples nobody else can predict: a fresh secret seed on every call."""
    seed = secrets.randbits(62)
    if run.model == "gpt":
        return data.tokens(n, seed=seed)
    return data.regression(n, seed=seed, dtype=run.dtype)


def per_sample_loss(run: Run, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """One loss per sample: mean squared error, or mean next-token cross-entropy."""
    if run.model == "gpt":
        tokens = F.cross_entropy(output.flatten(0, 1), target.flatten(), reduction="none")
        return tokens.view(target.shape).mean(dim=1)
    return (output - target).pow(2).mean(dim=1)


def rank_loss(kind: str, run: Run, output, target, sizes: list[int]) -> torch.Tensor:
    """This rank's loss when the ranks hold `sizes` samples. Part 1 ("sync"): the mean over
    its shard (sync_gradients weights it). Part 2 ("ddp"): the shard's sum * world_size /
    batch size, whose plain average over the ranks is the full-batch mean for any split."""
    losses = per_sample_loss(run, output, target)
    if kind == "sync":
        return losses.mean()
    return losses.sum() * (len(sizes) / sum(sizes))


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return snapshot((name, p.grad) for name, p in model.named_parameters())


# --- what runs on each rank ---------------------------------------------------------------


def _train_on_rank(impl: Callable, kind: str, runs: list[Run]) -> dict:
    """Every run with the student's code, watched for the course's own implementations."""
    with Provenance(FORBIDDEN[kind]) as seen:
        results = [_train_one(impl, kind, run) for run in runs]
    return {"runs": results, "copied": seen.complaint()}


def _train_one(impl: Callable, kind: str, run: Run) -> dict:
    """Train `run` on this rank with the student's code; record this rank's samples, its
    gradients after synchronization, its parameters after each step, and its communication."""
    ranks, me = world_size(), rank()
    ready: list[float] = []  # when each gradient of this step was accumulated
    if kind == "ddp":
        module = build_model(run, run.seed + INIT_SEED_STRIDE * me)
        _watch_gradients(module, ready)  # before the student's hooks: ours run first
        model = impl(module, bucket_cap_mb=run.cap_mb())
        initial = {
            "params": snapshot(model.named_parameters()),
            "buffers": snapshot(model.named_buffers()),
        }
    else:
        model, initial = build_model(run, run.seed), None
    # torch.optim refuses an empty parameter list; a wrapper that hides the model's
    # parameters trains nothing here, and the comparison says what is missing.
    params = list(model.parameters())
    optimizer = make_optimizer(run.optimizer, params) if params else None
    steps = []
    with AllReduceLog() as log:
        for s in range(run.steps):
            sizes = shard_sizes(run, ranks, s)
            x, y = draw_shard(run, sizes[me])
            model.zero_grad()  # the model's own: a DDP may change what it does
            marks = (len(log.calls), len(log.waits), len(log.others))
            ready.clear()
            log.phase = "forward"
            loss = rank_loss(kind, run, model(x), y, sizes)
            log.phase = "backward"
            loss.backward()
            no_grad = sum(p.grad is None for p in params if p.requires_grad)
            log.phase = "sync"
            if kind == "ddp":
                model.finish_gradient_synchronization()
            else:
                impl(model, sizes[me])
            log.phase = "step"
            grads = _grads(model)
            if optimizer is not None:
                optimizer.step()
            last_gradient = max(ready, default=float("inf"))
            steps.append(
                {
                    "x": x,
                    "y": y,
                    "grads": grads,
                    "params": snapshot(model.named_parameters()),
                    "calls": [
                        {
                            "nbytes": c.nbytes,
                            "async": c.async_op,
                            "phase": c.phase,
                            "early": c.time < last_gradient,
                        }
                        for c in log.calls[marks[0] :]
                    ],
                    "waits": log.waits[marks[1] :],
                    "others": [op for op, _ in log.others[marks[2] :]],
                    "no_grad": no_grad,
                }
            )
    return {"initial": initial, "steps": steps}


def _watch_gradients(module: nn.Module, ready: list[float]) -> None:
    for p in module.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda _p: ready.append(time.perf_counter()))


# --- the single-process reference, in the checking process --------------------------------


def _shards(check: str, run: Run, results: list[dict], s: int) -> list[tuple]:
    """Step s's samples as the ranks report them, checked for shape (they come from a rank
    that ran the student's code)."""
    shards = []
    for r, (result, n) in enumerate(zip(results, shard_sizes(run, len(results), s), strict=True)):
        x, y = result["steps"][s]["x"], result["steps"][s]["y"]
        if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)) or (
            len(x) != n or len(y) != n
        ):
            fail(check, f"rank {r}, step {s}: the samples it reports are not the {n} it drew")
        shards.append((x, y))
    return shards


def _reference(check: str, run: Run, results: list[dict], prefix: str) -> dict:
    """What every rank is measured against: the whole batches the ranks drew (as shards, per
    step) and the initial model, its names prefixed with `prefix` (e.g. "module.")."""
    initial = build_model(run, run.seed)
    return {
        "shards": [_shards(check, run, results, s) for s in range(run.steps)],
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

    def __init__(self, run: Run, prefix: str):
        self.run, self.prefix = run, prefix
        self.model = build_model(run, run.seed)
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


def _local_grads(kind: str, run: Run, step: dict, name: str) -> list[torch.Tensor]:
    """The gradient of parameter `name` each rank computes from its own shard alone."""
    out = []
    sizes = [len(x) for x, _ in step["shards"]]
    for x, y in step["shards"]:
        model = build_model(run, run.seed)
        model.load_state_dict(step["before"])
        rank_loss(kind, run, model(x), y, sizes).backward()
        out.append(dict(model.named_parameters())[name].grad)
    return out


# --- comparing training -------------------------------------------------------------------


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Loosely equal: for telling which mistake was made, not for grading."""
    scale = max(1.0, want.abs().max().item())
    return compare.find_mismatch({"t": got}, {"t": want}, rtol=1e-4, atol=1e-5 * scale) is None


def _gradient_hint(kind: str, run: Run, replay: _Replay, s: int, r: int, name: str, got) -> str:
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


def _step_problem(kind: str, run: Run, ref: dict, s: int, r: int, step: dict, replay: _Replay):
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
            if not step["calls"] and not step["others"]:
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


def _compare_training(check: str, kind: str, run: Run, results: list[dict], ref: dict) -> None:
    """Fail at the first step where a rank differs from the reference (naming the first such
    rank and how many others)."""
    __tracebackhide__ = True
    where = run.describe(len(results))
    prefix = "module." if kind == "ddp" else ""
    replays = [_Replay(run, prefix) for _ in results]
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


def _compare_initial(check: str, run: Run, results: list[dict], ref: dict) -> None:
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


# --- communication (check_ddp) ------------------------------------------------------------


def buckets(parameters: list[nn.Parameter], cap_bytes: float) -> list[list]:
    """The assignment's rule: trainable parameters in reverse order of registration; start a
    new bucket when the next parameter would take the bucket over `cap_bytes` (so a bucket
    may fill the cap exactly, and a parameter larger than the cap gets one of its own)."""
    out: list[list] = [[]]
    size = 0
    for p in reversed([p for p in parameters if p.requires_grad]):
        nbytes = p.numel() * p.element_size()
        if out[-1] and size + nbytes > cap_bytes:
            out.append([])
            size = 0
        out[-1].append(p)
        size += nbytes
    return [bucket for bucket in out if bucket]


def _each_step(check: str, run: Run, results: list[dict], judge: Callable, prop: str) -> None:
    """Fail at the first (step, rank) where `judge(step)` returns a problem."""
    __tracebackhide__ = True
    where = run.describe(len(results))
    for s in range(run.steps):
        for r, result in enumerate(results):
            problem = judge(result["steps"][s])
            if problem:
                fail(check, f"rank {r}, step {s} ({where}): {problem}", prop=prop)


def _traffic_problem(trainable_bytes: int):
    """Part of the result: each step, every trainable gradient is all-reduced exactly once
    and nothing else is communicated. (So fake all-reduces cannot stand in for real ones.)"""

    def judge(step: dict) -> str | None:
        others = sorted({op for op in step["others"] if op != "barrier"})
        if others:
            return (
                f"the step used {', '.join(others)}: average the gradients with "
                "dist.all_reduce only, one call per bucket"
            )
        if not step["calls"]:
            return (
                "no all-reduce was seen during the step: launch each bucket's all-reduce "
                "with dist.all_reduce(flat, async_op=True)"
            )
        carried = sum(c["nbytes"] for c in step["calls"])
        if carried != trainable_bytes:
            return (
                f"the all-reduces carried {carried} bytes; the gradients of the trainable "
                f"parameters are {trainable_bytes} bytes: all-reduce each exactly once per "
                "step (frozen parameters never)"
            )
        return None

    return judge


def _bucket_problem(run: Run):
    """The buckets property: each step's all-reduce sizes are the rule's buckets' (in any
    order, so the order inside a bucket and the order of sending are free)."""
    module = build_model(run, run.seed)
    names = {id(p): "module." + n for n, p in module.named_parameters()}
    cap = run.cap_mb()
    expected = buckets(list(module.parameters()), cap * MB)
    sizes = sorted(sum(p.numel() * p.element_size() for p in b) for b in expected)
    layout = "; ".join(f"[{', '.join(names[id(p)] for p in b)}]" for b in expected)

    def judge(step: dict) -> str | None:
        got = sorted(c["nbytes"] for c in step["calls"])
        if got == sizes:
            return None
        return (
            f"all-reduces of {got} bytes; with bucket_cap_mb={cap:.6g} ({cap * MB:g} "
            f"bytes) the rule gives {len(expected)} buckets of {sizes} bytes: {layout}. "
            "Take the trainable parameters last registered first, and start a new bucket "
            "only when the next parameter would take it over the cap (1 MB = 2**20 bytes)"
        )

    return judge, len(expected)


def _overlap_problem(n_buckets: int):
    """The overlap property: backward never waits for an all-reduce; only buckets holding a
    parameter without gradient are left for after backward; and with several buckets, one
    starts while backward still has gradients to compute."""

    def judge(step: dict) -> str | None:
        calls = step["calls"]
        in_backward = [c for c in calls if c["phase"] == "backward"]
        if "backward" in step["waits"] or any(not c["async"] for c in in_backward):
            return (
                "backward waited for an all-reduce (a dist.all_reduce without "
                "async_op=True, or a wait(), in a gradient hook): launch it with "
                "async_op=True and wait only in finish_gradient_synchronization"
            )
        late = len(calls) - len(in_backward)
        if late > step["no_grad"]:
            return (
                f"{late} of {len(calls)} all-reduces were launched after backward; only a "
                "bucket holding a parameter that got no gradient "
                f"({step['no_grad']} this step) may be left to "
                "finish_gradient_synchronization. Launch each bucket's all-reduce from the "
                "hook (register_post_accumulate_grad_hook) that completes it"
            )
        if n_buckets > 1 and not any(c["early"] for c in calls):
            return (
                f"with {n_buckets} buckets, no all-reduce started before backward had computed "
                "its last gradient: launch each bucket as soon as its own gradients are "
                "ready, so that communication overlaps the rest of backward"
            )
        return None

    return judge


def _judge_communication(check: str, run: Run, results: list[dict], ref, verdict) -> None:
    """check_ddp's communication, one verdict case per property."""
    trainable_bytes = sum(p.numel() * p.element_size() for p in ref["trainable"])
    bucket_judge, n_buckets = _bucket_problem(run)
    for judge, prop in (
        (_traffic_problem(trainable_bytes), RESULT),
        (bucket_judge, "buckets"),
        (_overlap_problem(n_buckets), "overlap"),
    ):
        with verdict.case():
            _each_step(check, run, results, judge, prop)


# --- the checks ---------------------------------------------------------------------------


def _run(check: str, impl: Callable, kind: str, runs: list[Run], ranks: int, timeout: float):
    __tracebackhide__ = True
    what = "your sync_gradients" if kind == "sync" else "your DDP"
    try:
        return run_on_ranks(
            check, _train_on_rank, impl, kind, runs, world_size=ranks, timeout=timeout, what=what
        )
    except CheckFailed as error:
        probed = any(run.model == "probe" for run in runs)
        if not (isinstance(error.__context__, LaunchTimeout) and kind == "ddp" and probed):
            raise
        raise CheckFailed(
            f"{error}\n\nHint: ProbeModel's parameter 'unused.weight' never gets a gradient, "
            "so its hook never fires: finish_gradient_synchronization must send a bucket that is "
            "still incomplete itself instead of waiting for it. Also check that every rank "
            "makes the same all-reduce calls in the same order."
        ) from None


def _judge(check: str, kind: str, runs: list[Run], results: list[dict], verdict: Verdict):
    """Every run's training (and for DDP its communication), each a case of the verdict."""
    copied = next((result["copied"] for result in results if result["copied"]), None)
    if copied:
        with verdict.case():
            fail(check, copied)
        return
    prefix = "module." if kind == "ddp" else ""
    for i, run in enumerate(runs):
        per_rank = [result["runs"][i] for result in results]
        ref = None
        with verdict.case():
            ref = _reference(check, run, per_rank, prefix)
        if ref is None:
            continue
        with verdict.case():
            if kind == "ddp":
                _compare_initial(check, run, per_rank, ref)
            _compare_training(check, kind, run, per_rank, ref)
        if kind == "ddp" and len(per_rank) > 1:  # one rank may rightly skip communicating
            _judge_communication(check, run, per_rank, ref, verdict)


def _runs(models, optimizers, **fields) -> list[Run]:
    return [Run(model=m, optimizer=o, **fields) for m in models for o in optimizers]


def _validate(ranks: int, batch_size: int, dtype: torch.dtype, runs: list[Run]) -> None:
    """Refuse bad arguments before any rank starts."""
    for run in runs:
        if run.model not in BUCKET_ELEMENTS:
            raise ValueError(f"unknown model {run.model!r}: use 'mlp', 'probe' or 'gpt'")
        if run.optimizer not in ("sgd", "adamw"):
            raise ValueError(f"unknown optimizer {run.optimizer!r}: use 'sgd' or 'adamw'")
    if not runs:
        raise ValueError("give at least one model and one optimizer")
    if not 1 <= ranks <= 8:
        raise ValueError(f"world_size must be 1..8, got {ranks}")
    if batch_size < ranks:
        raise ValueError(f"batch_size={batch_size} leaves some of {ranks} ranks without data")
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")


def _what_ran(runs: list[Run], ranks: int) -> str:
    first = runs[0]
    rtol, atol = TOLERANCE[first.dtype]
    models = "/".join(dict.fromkeys(run.model for run in runs))
    optimizers = "/".join(dict.fromkeys(run.optimizer for run in runs))
    return (
        f"{len(runs)} training run(s) ({models} x {optimizers}, "
        f"{str(first.dtype).removeprefix('torch.')}, seed {first.seed}) of {first.steps} steps "
        f"on {ranks} rank(s), shards of random sizes (step 0: "
        f"{shard_sizes(first, ranks, 0)}): every rank's gradients (rtol={rtol:g}, "
        f"atol={atol:g}) after every step match single-process training, and its parameters "
        "are what the optimizer makes of them"
    )


def check_sync_gradients(
    sync_gradients: Callable[[nn.Module, int], None],
    *,
    world_size: int = 4,
    seed: int = 0,
    steps: int = 3,
    batch_size: int = 16,
    dtype: torch.dtype = torch.float32,
    models: tuple[str, ...] = ("mlp", "probe"),
    optimizers: tuple[str, ...] = ("sgd", "adamw"),
    timeout: float = 30.0,
) -> None:
    """`sync_gradients(model, num_samples)`, called on every rank after backward of the mean
    loss over its own `num_samples` samples, leaves in every .grad the full-batch gradient
    sum_r n_r g_r / sum_r n_r (parameters without .grad are skipped). Every rank's gradients
    and parameters must match single-process training after each step."""
    __tracebackhide__ = True
    check = "check_sync_gradients"
    runs = _runs(models, optimizers, seed=seed, dtype=dtype, steps=steps, batch_size=batch_size)
    _validate(world_size, batch_size, dtype, runs)
    verdict = Verdict(check)
    results = None
    with verdict.case():
        results = _run(check, sync_gradients, "sync", runs, world_size, timeout)
    if results is not None:
        _judge(check, "sync", runs, results, verdict)
    verdict.conclude(_what_ran(runs, world_size))


def check_ddp(
    ddp_class: Callable[..., nn.Module],
    *,
    world_size: int = 4,
    seed: int = 0,
    steps: int = 3,
    batch_size: int = 16,
    dtype: torch.dtype = torch.float32,
    models: tuple[str, ...] = ("probe", "mlp"),
    optimizers: tuple[str, ...] = ("sgd", "adamw"),
    bucket_cap_mb: float | None = None,
    timeout: float = 30.0,
) -> None:
    """`ddp_class(module, bucket_cap_mb=...)` wraps a model as torch's DDP does (parameters
    named "module.<name>", rank 0's weights broadcast at construction); its gradient hooks
    launch one async all-reduce per bucket during backward, and
    `finish_gradient_synchronization()` waits and leaves averaged gradients in .grad.
    Partial credit (`DDP_WEIGHTS`): the buckets and the overlap, each only with a right result."""
    __tracebackhide__ = True
    check = "check_ddp"
    runs = _runs(
        models,
        optimizers,
        seed=seed,
        dtype=dtype,
        steps=steps,
        batch_size=batch_size,
        bucket_cap_mb=bucket_cap_mb,
    )
    _validate(world_size, batch_size, dtype, runs)
    verdict = Verdict(check, DDP_WEIGHTS)
    results = None
    with verdict.case():
        results = _run(check, ddp_class, "ddp", runs, world_size, timeout)
    if results is not None:
        _judge(check, "ddp", runs, results, verdict)
    verified = _what_ran(runs, world_size) + "; rank 0's weights broadcast at construction"
    if world_size > 1:
        verified += (
            "; each step one all-reduce per bucket of the rule's layout, every trainable "
            "gradient exactly once, launched during backward without waiting"
        )
    verdict.conclude(verified)


def bucket_layout(module: nn.Module, bucket_cap_mb: float) -> list[list[str]]:
    """Names of the parameters in each bucket, by the assignment's rule (for a notebook)."""
    names = {id(p): n for n, p in module.named_parameters()}
    groups = buckets(list(module.parameters()), bucket_cap_mb * MB)
    return [[names[id(p)] for p in bucket] for bucket in groups]


__all__ = [
    "DDP_WEIGHTS",
    "AllReduceCall",
    "AllReduceLog",
    "ProbeModel",
    "Run",
    "bucket_layout",
    "buckets",
    "check_ddp",
    "check_sync_gradients",
    "shard_sizes",
]
