"""Checks for Assignment 2, data-parallel training.

    check_sync_gradients(sync_gradients)   average every .grad over the ranks after backward
    check_ddp(DDP)                         a DDP wrapper: broadcast, gradient buckets, overlap

Both train seeded models for a few steps of SGD and of AdamW with the global batch split
across the ranks (`course_lib.data.shard`), and compare every rank's gradients and parameters,
after every step, with single-process training on the whole batch.

Loss weighting: rank r's loss is sum(per-sample losses of its shard) * world_size / batch_size.
Averaging these over the ranks gives exactly the full-batch mean loss even when the shards
differ in size (10 samples on 4 ranks: 3, 3, 2, 2), so the student's averaging is checked
with even and uneven splits alike. (Averaging per-rank *means* is only right for even shards.)

For check_ddp, ranks start from different weights (a different seed per rank), so only a
broadcast at construction can make them match, and `ProbeModel` has what trips
implementations up: parameters of uneven sizes, a frozen one, one that never gets a gradient,
and a buffer. Gradient synchronization must behave as torch's DistributedDataParallel with
find_unused_parameters=True does: a parameter no rank used, or a frozen one, keeps .grad None.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.nn.functional as F
from torch import nn

from course_lib import compare, data
from course_lib.grading._harness import CheckFailed, fail, run_on_ranks
from course_lib.launch import LaunchTimeout
from course_lib.models import MLP, TinyGPT
from course_lib.runtime import rank, world_size

MB = 2**20  # bytes in one "MB" of bucket_cap_mb, as in torch's DDP
INIT_SEED_STRIDE = 1000  # check_ddp builds rank r's model with seed + 1000 * r
# (rtol, atol) per dtype and optimizer; fp32 rounding between split and whole batches is
# ~1e-7 (NOTES.md), fp64 ~1e-14. Gradients use the SGD tolerance.
TOLERANCE = {
    (torch.float32, "sgd"): (1e-5, 1e-6),
    (torch.float32, "adamw"): (1e-5, 1e-5),
    (torch.float64, "sgd"): (1e-10, 1e-10),
    (torch.float64, "adamw"): (1e-10, 1e-10),
}
BUCKET_ELEMENTS = {"probe": 100, "mlp": 300, "gpt": 2048}  # default caps, below the largest


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
            self.unused = nn.Linear(6, 1, bias=False, dtype=dtype)  # never called
            self.mid = nn.Linear(24, 12, dtype=dtype)
            self.out = nn.Linear(12, 4, dtype=dtype)
            self.register_buffer("shift", 0.1 * torch.randn(24, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x) + self.shift) * self.gain
        return self.out(torch.relu(self.mid(h)))


# --- recording all-reduce calls -----------------------------------------------------------


@dataclass
class AllReduceCall:
    """One dist.all_reduce call: when (perf_counter seconds), how big, and whether async."""

    time: float
    numel: int
    nbytes: int
    async_op: bool


@dataclass
class AllReduceLog:
    """Records every `dist.all_reduce` call made while the block runs.

        with AllReduceLog() as log:
            loss.backward()
        log.calls   # [AllReduceCall(time=..., numel=..., nbytes=..., async_op=True), ...]

    Like CommCounter, it sees calls made through `dist.all_reduce` from Python only."""

    calls: list[AllReduceCall] = field(default_factory=list)

    def __enter__(self) -> AllReduceLog:
        self._saved = (dist.all_reduce, c10d.all_reduce)
        original = dist.all_reduce

        def logged(tensor, *args, **kwargs):
            async_op = bool(kwargs.get("async_op", args[2] if len(args) > 2 else False))
            nbytes = tensor.numel() * tensor.element_size()
            self.calls.append(AllReduceCall(time.perf_counter(), tensor.numel(), nbytes, async_op))
            return original(tensor, *args, **kwargs)

        dist.all_reduce = c10d.all_reduce = logged
        return self

    def __exit__(self, *exc_info: object) -> None:
        dist.all_reduce, c10d.all_reduce = self._saved


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

    def describe(self, ranks: int) -> str:
        name = {"sgd": "SGD", "adamw": "AdamW"}[self.optimizer]
        dtype = str(self.dtype).removeprefix("torch.")
        return (
            f"{self.model} model, {name}, {dtype}, seed {self.seed}, batch of "
            f"{self.batch_size} on {ranks} rank{'s' if ranks > 1 else ''}"
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


def global_batches(run: Run) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same `run.steps` global batches on every rank and in the reference."""
    if run.model == "gpt":
        x, y = data.tokens(4 * run.batch_size, seed=run.seed + 1)
    else:
        x, y = data.regression(4 * run.batch_size, seed=run.seed + 1, dtype=run.dtype)
    return data.batches(x, y, run.batch_size, run.steps, seed=run.seed)


def per_sample_loss(run: Run, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """One loss per sample: mean squared error, or mean next-token cross-entropy."""
    if run.model == "gpt":
        tokens = F.cross_entropy(output.flatten(0, 1), target.flatten(), reduction="none")
        return tokens.view(target.shape).mean(dim=1)
    return (output - target).pow(2).mean(dim=1)


def shard_loss(run: Run, output: torch.Tensor, target: torch.Tensor, ranks: int) -> torch.Tensor:
    """This rank's loss, weighted so that its average over the ranks is the full-batch mean
    even for uneven shards: sum over the shard * world_size / batch_size."""
    return per_sample_loss(run, output, target).sum() * (ranks / run.batch_size)


SGD_LR = 0.1
ADAMW = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}


def make_optimizer(name: str, parameters) -> torch.optim.Optimizer:
    """torch.optim's SGD or AdamW, the same on the ranks and in the single-process reference.
    Weight decay moves a parameter that wrongly gets a (zero) gradient, so that mistake
    shows; parameters without .grad are skipped."""
    if name == "sgd":
        return torch.optim.SGD(parameters, lr=SGD_LR)
    if name == "adamw":
        return torch.optim.AdamW(parameters, **ADAMW, foreach=False)
    raise ValueError(f"unknown optimizer {name!r}: use 'sgd' or 'adamw'")


def _snapshot(named) -> dict[str, torch.Tensor | None]:
    return {name: None if t is None else t.detach().clone() for name, t in named}


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return _snapshot((name, p.grad) for name, p in model.named_parameters())


# --- what runs on each rank ---------------------------------------------------------------


def _train_on_rank(impl: Callable, kind: str, runs: list[Run]) -> list[dict]:
    return [_train_one(impl, kind, run) for run in runs]


def _train_one(impl: Callable, kind: str, run: Run) -> dict:
    """Train `run` on this rank with the student's code; record gradients after
    synchronization, parameters after each step, and the all-reduce calls of each step."""
    ranks, me = world_size(), rank()
    if kind == "ddp":
        module = build_model(run, run.seed + INIT_SEED_STRIDE * me)
        model = impl(module, bucket_cap_mb=run.cap_mb())
        initial = {
            "params": _snapshot(model.named_parameters()),
            "buffers": _snapshot(model.named_buffers()),
            "is_torch_ddp": isinstance(model, nn.parallel.DistributedDataParallel),
        }
    else:
        model, initial = build_model(run, run.seed), None
    # torch.optim refuses an empty parameter list; a wrapper that hides the model's
    # parameters trains nothing here, and the comparison says what is missing.
    params = list(model.parameters())
    optimizer = make_optimizer(run.optimizer, params) if params else None
    steps = []
    with AllReduceLog() as log:
        for x, y in global_batches(run):
            x, y = data.shard(x, me, ranks), data.shard(y, me, ranks)
            seen: list[int] = []
            if x.is_floating_point():
                # The input's gradient is the last thing backward computes: how many
                # all-reduces were already under way at that moment?
                x = x.clone().requires_grad_(True)
                x.register_hook(lambda grad, seen=seen: seen.append(len(log.calls)))
            if optimizer is not None:
                optimizer.zero_grad()
            first = len(log.calls)
            shard_loss(run, model(x), y, ranks).backward()
            in_backward = len(log.calls) - first
            if kind == "ddp":
                model.finish_gradient_synchronization()
            else:
                impl(model)
            grads = _grads(model)
            if optimizer is not None:
                optimizer.step()
            calls = log.calls[first:]
            steps.append(
                {
                    "grads": grads,
                    "params": _snapshot(model.named_parameters()),
                    "calls": [(c.async_op, c.numel) for c in calls],
                    "in_backward": in_backward,
                    "before_input_grad": seen[0] - first if seen else None,
                }
            )
    return {"initial": initial, "steps": steps}


# --- the single-process reference, in the checking process --------------------------------


def _reference(run: Run, prefix: str) -> dict:
    """Plain training on the whole batch: parameters before each step, gradients, and
    parameters after each step, named with `prefix` (e.g. "module.")."""
    model = build_model(run, run.seed)
    optimizer = make_optimizer(run.optimizer, model.parameters())
    steps = []
    for x, y in global_batches(run):
        before = model.state_dict()
        before = {k: v.clone() for k, v in before.items()}
        optimizer.zero_grad()
        per_sample_loss(run, model(x), y).mean().backward()
        grads = {prefix + name: g for name, g in _grads(model).items()}
        optimizer.step()
        params = {prefix + name: p for name, p in _snapshot(model.named_parameters()).items()}
        steps.append({"before": before, "grads": grads, "params": params, "batch": (x, y)})
    initial = build_model(run, run.seed)
    return {
        "initial_params": {prefix + n: p.detach() for n, p in initial.named_parameters()},
        "initial_buffers": {prefix + n: b for n, b in initial.named_buffers()},
        "steps": steps,
        "frozen": {prefix + n for n, p in initial.named_parameters() if not p.requires_grad},
    }


def _local_grad(run: Run, step: dict, name: str, prefix: str, r: int, ranks: int) -> torch.Tensor:
    """The gradient rank r computes from its own shard alone, before any synchronization."""
    model = build_model(run, run.seed)
    model.load_state_dict(step["before"])
    x, y = (data.shard(t, r, ranks) for t in step["batch"])
    shard_loss(run, model(x), y, ranks).backward()
    return dict(model.named_parameters())[name.removeprefix(prefix)].grad


# --- comparing ----------------------------------------------------------------------------


def _close(got: torch.Tensor, want: torch.Tensor, scale: float) -> bool:
    """Loosely equal: for telling which mistake was made, not for grading."""
    return compare.find_mismatch({"t": got}, {"t": want}, rtol=1e-4, atol=1e-5 * scale) is None


def _gradient_hint(kind: str, got, want, local, ranks: int) -> str:
    scale = max(1.0, want.abs().max().item())
    if ranks > 1 and _close(got, ranks * want, scale):
        return (
            f"it is {ranks} (the world size) times the full-batch gradient: did you divide "
            "the all-reduced sum by the world size, on every rank?"
        )
    if ranks > 1 and local is not None and _close(got, local, scale):
        if kind == "sync":
            return "it is still this rank's own gradient: did you all-reduce every .grad?"
        return (
            "it is still this rank's own gradient: after waiting for a bucket's all-reduce, "
            "are the averaged values written back into each parameter's .grad?"
        )
    return "after synchronization every rank must hold the average of all ranks' gradients"


def _none_hint(kind: str, name: str, frozen: bool, has_grad: bool) -> str:
    if has_grad:
        if frozen:
            return (
                f"{name!r} is frozen (requires_grad=False) but has a gradient: leave frozen "
                "parameters out of the buckets"
            )
        return (
            f"{name!r} got no gradient in backward on any rank, but has a .grad after "
            "synchronization; as torch's DDP does, leave .grad None where backward left it "
            "None (write averaged values back only into parameters that have a .grad)"
        )
    what = "after finish_gradient_synchronization" if kind == "ddp" else "after sync_gradients"
    return f"{name!r} has no gradient {what}, but it should have one"


def _compare_training(check: str, kind: str, run: Run, results: list[dict]) -> None:
    """Fail at the first rank, step and parameter that differs from the reference."""
    __tracebackhide__ = True
    ranks = len(results)
    prefix = "module." if kind == "ddp" else ""
    ref = _reference(run, prefix)
    rtol, atol = TOLERANCE[(run.dtype, run.optimizer)]
    grad_rtol, grad_atol = TOLERANCE[(run.dtype, "sgd")]
    where = run.describe(ranks)
    if kind == "ddp":
        _compare_initial(check, ref, results, where)
    sync = "finish_gradient_synchronization" if kind == "ddp" else "sync_gradients"
    for s, ref_step in enumerate(ref["steps"]):
        for r, result in enumerate(results):
            step = result["steps"][s]
            at = f"rank {r}, step {s} ({where})"
            for name, want in ref_step["grads"].items():
                got = step["grads"].get(name)
                if (got is None) != (want is None):
                    frozen = name in ref["frozen"]
                    fail(check, f"{at}: {_none_hint(kind, name, frozen, got is not None)}")
                if want is None:
                    continue
                problem = compare.find_mismatch(
                    {name: got}, {name: want}, rtol=grad_rtol, atol=grad_atol
                )
                if problem:
                    if not any(each["calls"] for each in result["steps"]):
                        hint = (
                            "no dist.all_reduce call was seen: call it as dist.all_reduce "
                            "(import torch.distributed as dist)"
                        )
                    else:
                        local = _local_grad(run, ref_step, name, prefix, r, ranks)
                        hint = _gradient_hint(kind, got, want, local, ranks)
                    fail(
                        check,
                        f"{at}: the gradient after {sync} differs from the full-batch "
                        f"gradient: {problem}.\nHint: {hint}",
                    )
            problem = compare.find_mismatch(
                step["params"], ref_step["params"], rtol=rtol, atol=atol
            )
            if problem:
                fail(
                    check,
                    f"{at}: after optimizer.step(), {problem}.\nHint: the gradients matched "
                    "the full-batch ones; does your code change parameters or gradients "
                    "anywhere else?",
                )


def _compare_initial(check: str, ref: dict, results: list[dict], where: str) -> None:
    """Right after construction every rank must hold rank 0's parameters and buffers."""
    __tracebackhide__ = True
    expected_names = list(ref["initial_params"])
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
        for kind, got, want in (
            ("parameter", initial["params"], ref["initial_params"]),
            ("buffer", initial["buffers"], ref["initial_buffers"]),
        ):
            problem = compare.find_mismatch(got, want, rtol=0.0, atol=0.0)
            if problem:
                fail(
                    check,
                    f"rank {r} ({where}): right after construction, a {kind} differs from "
                    f"rank 0's initial one: {problem}.\nHint: every rank builds its model "
                    "from a different seed here; broadcast rank 0's parameters and buffers "
                    "at construction (dist.broadcast(tensor, src=0))",
                )


# --- communication (check_ddp) ------------------------------------------------------------


def buckets(parameters: list[nn.Parameter], cap_bytes: float, close_at_cap: bool) -> list[list]:
    """Trainable parameters in reverse order of registration, grouped into buckets.

    close_at_cap=False (the assignment's rule): start a new bucket when the next parameter
    would take the bucket over the cap (a parameter larger than the cap gets one of its own).
    close_at_cap=True (torch's DDP rule): add the parameter, close the bucket once it
    reaches the cap."""
    out: list[list] = [[]]
    size = 0
    for p in reversed([p for p in parameters if p.requires_grad]):
        nbytes = p.numel() * p.element_size()
        if not close_at_cap and out[-1] and size + nbytes > cap_bytes:
            out.append([])
            size = 0
        out[-1].append(p)
        size += nbytes
        if close_at_cap and size >= cap_bytes:
            out.append([])
            size = 0
    return [bucket for bucket in out if bucket]


def _check_communication(check: str, run: Run, results: list[dict]) -> None:
    """All-reduces are async, follow the bucketing, and start before backward ends."""
    __tracebackhide__ = True
    ranks = len(results)
    module = build_model(run, run.seed)
    names = {id(p): "module." + n for n, p in module.named_parameters()}
    params = list(module.parameters())
    cap = run.cap_mb()
    accepted = {
        len(buckets(params, cap * unit, close_at_cap))
        for unit in (MB, 10**6)
        for close_at_cap in (False, True)
    }
    expected = buckets(params, cap * MB, close_at_cap=False)
    layout = "; ".join(f"[{', '.join(names[id(p)] for p in b)}]" for b in expected)
    trainable = [p for p in params if p.requires_grad]
    where = run.describe(ranks)
    for r, result in enumerate(results):
        for s, step in enumerate(result["steps"]):
            at = f"rank {r}, step {s} ({where})"
            calls = step["calls"]
            if not calls:
                torch_ddp = result["initial"]["is_torch_ddp"]
                fail(
                    check,
                    f"{at}: no dist.all_reduce call was seen during the step. Launch each "
                    "bucket's all-reduce from Python with dist.all_reduce(flat, "
                    "async_op=True)"
                    + (
                        "; torch's DistributedDataParallel reduces from C++, which this "
                        "check cannot see, so it cannot show the overlap asked for here"
                        if torch_ddp
                        else ""
                    ),
                )
            numel = sum(n for _, n in calls)
            total = sum(p.numel() for p in trainable)
            if numel != total:
                fail(
                    check,
                    f"{at}: the all-reduces carried {numel} elements; the trainable "
                    f"parameters have {total} (each exactly once; frozen parameters never)",
                )
            if len(calls) not in accepted:
                per_param = " (one per parameter)" if len(calls) == len(trainable) else ""
                fail(
                    check,
                    f"{at}: {len(calls)} all-reduce calls{per_param}; with bucket_cap_mb="
                    f"{cap:.6g} ({cap * MB:.0f} bytes) the trainable parameters, last "
                    f"registered first, form {len(expected)} buckets: {layout}. "
                    "Expected one all-reduce per bucket",
                )
            backward_calls = calls[: step["in_backward"]]
            synchronous = [i for i, (is_async, _) in enumerate(backward_calls) if not is_async]
            if synchronous:
                fail(
                    check,
                    f"{at}: all-reduce call {synchronous[0]} was made during backward without "
                    "async_op=True, so backward waited for it; launch it with "
                    "dist.all_reduce(..., async_op=True) and wait in "
                    "finish_gradient_synchronization",
                )
            if len(expected) > 1 and step["before_input_grad"] == 0:
                fail(
                    check,
                    f"{at}: no all-reduce had started when backward computed the input's "
                    f"gradient (the last thing it computes), although there are "
                    f"{len(expected)} buckets. Launch a bucket's all-reduce from a gradient "
                    "hook (register_post_accumulate_grad_hook) as soon as all its gradients "
                    "are ready, so communication overlaps the rest of backward",
                )


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
    if any(run.model == "gpt" and run.optimizer == "adamw" for run in runs):
        raise ValueError(
            "check TinyGPT with optimizers=('sgd',): its key biases get a gradient that is "
            "zero up to rounding, and AdamW's normalization blows that noise up to the "
            "learning rate, so no tolerance separates right from wrong there"
        )


def check_sync_gradients(
    sync_gradients: Callable[[nn.Module], None],
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
    """`sync_gradients(model)`, called after backward on every rank, leaves in every
    parameter's .grad the average over the ranks (parameters without .grad are skipped).
    Every rank's gradients and parameters must match single-process training after each step."""
    __tracebackhide__ = True
    check = "check_sync_gradients"
    runs = _runs(models, optimizers, seed=seed, dtype=dtype, steps=steps, batch_size=batch_size)
    _validate(world_size, batch_size, dtype, runs)
    results = _run(check, sync_gradients, "sync", runs, world_size, timeout)
    for i, run in enumerate(runs):
        _compare_training(check, "sync", run, [per_rank[i] for per_rank in results])


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
    launch one async all-reduce per full bucket during backward, and
    `finish_gradient_synchronization()` waits and leaves averaged gradients in .grad.
    Checked against single-process training, and for the bucketing and the overlap."""
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
    results = _run(check, ddp_class, "ddp", runs, world_size, timeout)
    for i, run in enumerate(runs):
        _compare_training(check, "ddp", run, [per_rank[i] for per_rank in results])
    if world_size > 1:  # one rank may rightly skip communicating
        for i, run in enumerate(runs):
            _check_communication(check, run, [per_rank[i] for per_rank in results])


def bucket_layout(module: nn.Module, bucket_cap_mb: float) -> list[list[str]]:
    """Names of the parameters in each bucket, by the assignment's rule (for a notebook)."""
    names = {id(p): n for n, p in module.named_parameters()}
    groups = buckets(list(module.parameters()), bucket_cap_mb * MB, close_at_cap=False)
    return [[names[id(p)] for p in bucket] for bucket in groups]


__all__ = [
    "AllReduceCall",
    "AllReduceLog",
    "ProbeModel",
    "Run",
    "bucket_layout",
    "buckets",
    "check_ddp",
    "check_sync_gradients",
]
