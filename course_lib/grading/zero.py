"""Checks for Assignment 7, ZeRO stages 1-3.

    check_zero1(ShardedOptimizer)      optimizer state sharded; parameters all-gathered after step
    check_zero2(ShardedGradOptimizer)  gradients reduce-scattered during backward as well
    check_zero3(shard_module)          parameters sharded, gathered per layer just in time

The sharding rule, the same for every stage (as in FSDP): each parameter is flattened and
padded with zeros to a multiple of P; rank r owns the r-th of P equal chunks, which holds
c = ceil(numel / P) elements (`chunk_range`).

Each check trains `TinyGPT(SMALL)` (tensor sizes not divisible by 2, 3 or 4, so shards are
uneven) for a few AdamW steps in float64, with every global batch split across the ranks and
each rank's loss the mean over its own share, and compares every rank after every step with
`torch.optim.AdamW` on one process on the whole batch: parameters, and where visible the
gradient shards and the optimizer state, to `TOLERANCE`. Memory is measured on every rank:
the bytes of optimizer state (stage 1), of gradients after backward (stage 2) and of the
tensors the model holds at rest (stage 3) may not exceed `shard_bytes`: per tensor, at most
one element more than numel / P (c elements), summed over the tensors. Bytes are counted per
storage, so a view that keeps a whole tensor alive counts as the whole tensor.
"""

from __future__ import annotations

import functools
import gc
import math
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from course_lib import _worker, compare, data
from course_lib.comm import CommCounter
from course_lib.grading._harness import Verdict, fail, run_on_ranks
from course_lib.grading.training import ADAMW, make_optimizer, snapshot
from course_lib.launch import launch
from course_lib.models import GPTConfig, TinyGPT, lm_loss
from course_lib.runtime import rank, world_size

# Every tensor of this model has a size that 2, 3 or 4 do not all divide (d_model 22,
# d_ff 37, vocab 29, 7 positions), so shards come out uneven.
SMALL = GPTConfig(vocab_size=29, seq_len=7, d_model=22, n_heads=2, n_layers=2, d_ff=37)
# float64 rounding between a split and a whole batch is ~1e-17 in the gradients and ~1e-14
# after a few AdamW steps (measured); 1e-10 leaves room and still catches any real mistake.
TOLERANCE = {"rtol": 1e-10, "atol": 1e-10}
GRAD_TOLERANCE = {"rtol": 1e-10, "atol": 1e-12}
STATE_NAMES = ("exp_avg", "exp_avg_sq")
# What ZeRO-2 may keep from backward beyond its gradient shards: one parameter's full size (a
# buffer reused from hook to hook) and a few small tensors (a loss, a count).
KEPT_SLACK = 1024


# --- the sharding rule ----------------------------------------------------------------------


def chunk_range(numel: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, stop) of the flattened elements rank `rank` owns; chunks hold
    ceil(numel / world_size) elements, the last one(s) fewer (padding makes up the rest)."""
    chunk = shard_numel(numel, world_size)
    return min(rank * chunk, numel), min((rank + 1) * chunk, numel)


def shard_numel(numel: int, world_size: int) -> int:
    """Elements of one padded shard: ceil(numel / world_size)."""
    return math.ceil(numel / world_size)


def shard_bytes(model: nn.Module, world_size: int, values_per_element: int = 1) -> int:
    """The most bytes one rank may hold: ceil(numel / P) elements of each parameter, times
    `values_per_element` (2 for AdamW's state), summed over the parameters."""
    return sum(
        shard_numel(p.numel(), world_size) * p.element_size() * values_per_element
        for p in model.parameters()
    )


def chunk_of(full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank `rank`'s padded shard of `full`, as the sharding rule defines it (a copy)."""
    chunk = shard_numel(full.numel(), world_size)
    flat = torch.zeros(chunk * world_size, dtype=full.dtype)
    flat[: full.numel()] = full.detach().reshape(-1)
    return flat[rank * chunk : (rank + 1) * chunk].clone()


# --- measuring memory ---------------------------------------------------------------------


def _storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (a view counts as its whole base)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes():
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def optimizers_in(obj: object, depth: int = 4) -> list:
    """Every optimizer reachable from `obj` through attributes, lists and dicts: anything
    with a `state` dict and a `param_groups` list (torch.optim's optimizers, for one)."""
    found: dict[int, object] = {}

    def visit(item: object, level: int) -> None:
        if level < 0 or isinstance(item, torch.Tensor | nn.Module | str | int | float):
            return
        if isinstance(getattr(item, "state", None), dict) and isinstance(
            getattr(item, "param_groups", None), list
        ):
            found.setdefault(id(item), item)
        if isinstance(item, dict):
            children = list(item.values())
        elif isinstance(item, list | tuple | set):
            children = list(item)
        elif hasattr(item, "__dict__"):
            children = list(vars(item).values())
        else:
            return
        for child in children:
            visit(child, level - 1)

    visit(obj, depth)
    return list(found.values())


def optimizer_state_bytes(optimizer: object) -> int:
    """Bytes of optimizer state (exp_avg, ...; not the 0-d step counters) in every
    optimizer reachable from `optimizer`."""
    tensors = [
        value
        for inner in optimizers_in(optimizer)
        for per_param in inner.state.values()
        for value in per_param.values()
        if isinstance(value, torch.Tensor) and value.dim() > 0
    ]
    return _storage_bytes(tensors)


def _stepped_tensors(optimizer: object) -> list[torch.Tensor]:
    return [
        p for inner in optimizers_in(optimizer) for g in inner.param_groups for p in g["params"]
    ]


def gradient_bytes(model: nn.Module, optimizer: object) -> int:
    """Bytes of the .grad of the model's parameters and of every tensor an optimizer
    reachable from `optimizer` steps (the gradient shards)."""
    tensors = [*model.parameters(), *_stepped_tensors(optimizer)]
    return _storage_bytes(t.grad for t in tensors if t.grad is not None)


def held_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor the model's modules hold: parameters, buffers and tensor attributes
    (also inside lists and dicts), by name."""
    out: dict[str, torch.Tensor] = {}
    for prefix, module in model.named_modules():
        items = [*module._parameters.items(), *module._buffers.items()]
        for key, value in vars(module).items():
            if key in ("_parameters", "_buffers", "_modules"):
                continue  # counted above (or modules, visited on their own)
            if isinstance(value, torch.Tensor):
                items.append((key, value))
            elif isinstance(value, list | tuple):
                items += [(f"{key}[{i}]", v) for i, v in enumerate(value)]
            elif isinstance(value, dict):
                items += [(f"{key}[{k!r}]", v) for k, v in value.items()]
        for key, value in items:
            if isinstance(value, torch.Tensor):
                out[f"{prefix}.{key}" if prefix else key] = value
    return out


def reachable_tensors() -> list[torch.Tensor]:
    """Every tensor the garbage collector knows in this process, after a collection (garbage
    not yet collected is not kept), except what the fork server froze before this worker
    started (`_worker.FROZEN_OBJECTS`): objects frozen since, by code calling gc.freeze() to
    hide them from this scan, are unfrozen first."""
    if _worker.frozen_by_a_call():
        gc.unfreeze()
    gc.collect()
    with warnings.catch_warnings():  # isinstance() on torch's deprecated aliases warns
        warnings.simplefilter("ignore", FutureWarning)
        return [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]


def live_tensor_bytes() -> int:
    """Bytes of the distinct storages behind every tensor Python can reach in this process,
    and behind their .grad: wherever a tensor is kept (an attribute, a closure, a module-level
    dict), the garbage collector knows it. (A gradient autograd holds only in C++, such as a
    parameter's .grad never read from Python, is `gradient_bytes`' to count.)"""
    tensors = reachable_tensors()
    grads = [t.grad for t in tensors if t.requires_grad and t.grad is not None]
    return _storage_bytes([*tensors, *grads])


def storages_elsewhere(
    model: nn.Module, optimizer: torch.optim.Optimizer, records: object = ()
) -> list[torch.Tensor]:
    """Every float64 storage Python can reach on this rank, flat, except those of the model's
    parameters, their gradients, the optimizer's state and the check's own `records` (nested
    dicts and lists): where a full parameter kept privately (an attribute, a dict, a closure)
    would be. Its values are compared with the full parameters in the checking process
    (`_judge_private_copies`)."""
    own = {t.untyped_storage().data_ptr() for t in _tensors_in(records)}
    own |= {p.untyped_storage().data_ptr() for p in model.parameters()}
    own |= {p.grad.untyped_storage().data_ptr() for p in model.parameters() if p.grad is not None}
    own |= {
        t.untyped_storage().data_ptr()
        for state in optimizer.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor)
    }
    found: dict[int, torch.Tensor] = {}
    for t in reachable_tensors():
        if t.dtype != torch.float64 or t.device.type != "cpu" or t.is_sparse:
            continue
        storage = t.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if ptr in own or ptr in found or not nbytes or nbytes % t.element_size():
            continue
        found[ptr] = torch.empty(0, dtype=torch.float64).set_(storage).clone()
    return list(found.values())


def _tensors_in(records: object) -> list[torch.Tensor]:
    if isinstance(records, torch.Tensor):
        return [records]
    if isinstance(records, dict):
        records = list(records.values())
    if isinstance(records, (list, tuple)):
        return [t for item in records for t in _tensors_in(item)]
    return []


def held_bytes(model: nn.Module) -> int:
    """Bytes of the distinct storages behind `held_tensors(model)`."""
    return _storage_bytes(held_tensors(model).values())


# --- one training run ---------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """Which model, data and steps a check trains."""

    seed: int = 0
    steps: int = 3
    batch_size: int = 12

    def describe(self, ranks: int) -> str:
        return (
            f"TinyGPT(SMALL), AdamW, float64, seed {self.seed}, batches of {self.batch_size} "
            f"sequences split over {ranks} rank{'s' if ranks > 1 else ''}"
        )


def build_model(run: Run) -> TinyGPT:
    return TinyGPT(SMALL, seed=run.seed, dtype=torch.float64)


def global_batches(run: Run) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same global batches on every rank and in the reference."""
    x, y = data.tokens(4 * run.batch_size, SMALL.seq_len, SMALL.vocab_size, seed=run.seed + 1)
    return data.batches(x, y, run.batch_size, run.steps, seed=run.seed)


def _visible_shards(optimizer: object, model: nn.Module, ranks: int) -> list | None:
    """The tensors an optimizer steps, if they are exactly the model's shards in order
    (one 1-D tensor of ceil(numel / P) elements per parameter); else None."""
    sizes = [shard_numel(p.numel(), ranks) for p in model.parameters()]
    for inner in optimizers_in(optimizer):
        stepped = [p for g in inner.param_groups for p in g["params"]]
        if [tuple(p.shape) for p in stepped] == [(n,) for n in sizes]:
            return [(inner, p) for p in stepped]
    return None


def _state_values(shards: list | None) -> list | None:
    if shards is None:
        return None
    out = []
    for inner, p in shards:
        state = inner.state.get(p, {})
        out.append({k: state[k].detach().clone() for k in STATE_NAMES if k in state})
    return out


def _train_stage12(impl: Callable, stage: int, run: Run) -> dict:
    """On each rank: train with the student's optimizer; record what the check compares."""
    ranks, me = world_size(), rank()
    model = build_model(run)
    # optimizer_cls is torch.optim.AdamW itself: on the CPU it runs its single-tensor code
    # (foreach=False), as the reference does.
    optimizer = impl(model.parameters(), torch.optim.AdamW, **ADAMW)
    groups = getattr(optimizer, "param_groups", None)
    lr = groups[0].get("lr") if isinstance(groups, list) and groups else None
    steps = []
    for x, y in global_batches(run):
        x, y = data.shard(x, me, ranks), data.shard(y, me, ranks)
        optimizer.zero_grad()
        before = live_tensor_bytes() if stage == 2 else 0
        lm_loss(model(x), y).backward()
        record = {"grad_bytes": gradient_bytes(model, optimizer)}
        if stage == 2:  # what backward left alive, wherever the student's code keeps it
            record["kept_bytes"] = live_tensor_bytes() - before
        shards = _visible_shards(optimizer, model, ranks)
        if stage == 2 and shards is not None:
            record["grad_shards"] = [None if p.grad is None else p.grad.clone() for _, p in shards]
        optimizer.step()
        record["params"] = snapshot(model.named_parameters())
        record["state_bytes"] = optimizer_state_bytes(optimizer)
        record["state"] = _state_values(_visible_shards(optimizer, model, ranks))
        steps.append(record)
    return {"lr": lr, "steps": steps}


def _train_stage3(shard_module: Callable, run: Run) -> dict:
    """On each rank: shard the model with the student's shard_module, train it with AdamW
    on the shards, and record shards, gradients, bytes held and what was gathered when."""
    ranks, me = world_size(), rank()
    model = build_model(run)
    model = shard_module(model) or model
    names = [name for name, _ in model.named_parameters()]
    result = {"names": names, "initial": snapshot(model.named_parameters()), "steps": []}
    if any(p.dim() != 1 for p in model.parameters()):
        return result  # the check explains what a shard should look like
    optimizer = make_optimizer("adamw", model.parameters())
    for x, y in global_batches(run):
        x, y = data.shard(x, me, ranks), data.shard(y, me, ranks)
        optimizer.zero_grad()
        logits = model(x)
        after_forward = held_bytes(model)
        holders = {n: _storage_bytes([t]) for n, t in held_tensors(model).items()}
        # The check's own records are not the student's: without `records`, each scan would
        # also copy every earlier record, and the scans would grow step after step.
        elsewhere = storages_elsewhere(model, optimizer, records=result)
        with CommCounter() as backward_traffic:
            lm_loss(logits, y).backward()
        del logits
        grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
        result["steps"].append(
            {
                "held_after_forward": after_forward,
                "holders": holders,
                "elsewhere_after_forward": elsewhere,
                "elsewhere_after_step": storages_elsewhere(
                    model, optimizer, records=[result, elsewhere, grads]
                ),
                "held_after_step": held_bytes(model),
                "gathered_in_backward": _gathered_bytes(backward_traffic),
                "grads": grads,
                "shards": snapshot(model.named_parameters()),
            }
        )
    return result


def _gathered_bytes(counter: CommCounter) -> int:
    ops = ("all_gather", "all_gather_into_tensor", "all_gather_single", "broadcast")
    return sum(counter.by_op.get(op, [0, 0])[1] for op in ops)


# --- the single-process reference, in the checking process --------------------------------


@functools.lru_cache(maxsize=8)
def reference(run: Run, loss_scale: float = 1.0) -> dict:
    """torch.optim.AdamW on one process on the whole batch: per step the gradients,
    parameters and optimizer state (named); `loss_scale` > 1 trains on summed gradients
    instead of averaged ones (for telling that mistake apart)."""
    model = build_model(run)
    optimizer = make_optimizer("adamw", model.parameters())
    steps = []
    for x, y in global_batches(run):
        optimizer.zero_grad()
        (loss_scale * lm_loss(model(x), y)).backward()
        grads = snapshot((n, p.grad) for n, p in model.named_parameters())
        optimizer.step()
        state = {
            n: {k: optimizer.state[p][k].clone() for k in STATE_NAMES}
            for n, p in model.named_parameters()
        }
        steps.append({"grads": grads, "params": snapshot(model.named_parameters()), "state": state})
    return {"initial": snapshot(build_model(run).named_parameters()), "steps": steps}


# --- comparing ------------------------------------------------------------------------------


def _mismatch(got: dict, want: dict, tolerance: dict = TOLERANCE) -> str | None:
    return compare.find_mismatch(got, want, **tolerance)


def _parameter_hint(run: Run, results: list[dict], r: int, s: int, ranks: int) -> str:
    """Why rank r's parameters after step s are wrong, as far as the check can tell."""
    got = results[r]["steps"][s]["params"]
    for other in range(ranks):
        theirs = results[other]["steps"][s]["params"]
        problem = _mismatch(got, theirs)
        if problem:
            return (
                f"the ranks hold different parameters (rank {r} against rank {other}: "
                f"{problem}). After stepping its own shard, every rank must receive the "
                "other ranks' updated shards (all-gather or broadcast) so that all ranks "
                "hold the same full model"
            )
    if ranks > 1 and _mismatch(got, reference(run, ranks)["steps"][s]["params"]) is None:
        return (
            f"your parameters are what training with gradients {ranks} (the world size) "
            "times too large gives: average the gradients (divide the sum by world_size())"
        )
    initial = reference(run)["initial"]
    want = reference(run)["steps"][s]["params"]
    for name, value in got.items():
        bad = (value - want[name]).abs() > TOLERANCE["atol"] + TOLERANCE["rtol"] * want[name].abs()
        never_moved = bad & (value == initial[name])
        if never_moved.any():
            index = int(never_moved.flatten().nonzero()[0])
            return (
                f"element {index} of {name!r} (numel {value.numel()}) was never updated: no "
                f"rank stepped it. Check the shard boundaries: with P = {ranks} each rank "
                f"owns ceil(numel / P) = {shard_numel(value.numel(), ranks)} elements, and "
                "together the shards must cover every element exactly once"
            )
    return (
        "is every gradient averaged over the ranks before the step, and does each rank step "
        "exactly its own elements (shard boundaries: ceil(numel / P) elements per rank)?"
    )


def _compare_parameters(check: str, run: Run, results: list[dict], ref: dict) -> None:
    __tracebackhide__ = True
    ranks = len(results)
    where = run.describe(ranks)
    for s, ref_step in enumerate(ref["steps"]):
        for r, result in enumerate(results):
            problem = _mismatch(result["steps"][s]["params"], ref_step["params"])
            if problem:
                hint = _parameter_hint(run, results, r, s, ranks)
                fail(
                    check,
                    f"rank {r}, after step {s} ({where}): {problem} (compared with "
                    f"torch.optim.AdamW on one process).\nHint: {hint}",
                )


def _compare_state(check: str, r: int, s: int, ranks: int, got: list, ref_step: dict) -> None:
    """Rank r's AdamW state, where visible, must be its chunk of the reference state."""
    __tracebackhide__ = True
    for name, values in zip(ref_step["state"], got, strict=True):
        for key in STATE_NAMES:
            if key not in values:
                continue
            label = f"{key} of {name}"
            expected = chunk_of(ref_step["state"][name][key], r, ranks)
            problem = _mismatch({label: values[key]}, {label: expected})
            if problem:
                fail(
                    check,
                    f"rank {r}, after step {s}: the optimizer state of rank {r}'s shard "
                    f"differs from the same elements of torch.optim.AdamW's state: {problem}."
                    "\nHint: is the gradient averaged over the ranks before the step, and is "
                    "rank r's shard the r-th chunk of the flattened, zero-padded parameter?",
                )


def _check_bytes(
    check: str, what: str, per_rank: list[int], allowed: int, full: int, where: str, hint: str
) -> None:
    """Each rank at most `allowed` bytes; all ranks together at least `full` (else the
    check cannot see where the tensors are)."""
    __tracebackhide__ = True
    ranks = len(per_rank)
    for r, nbytes in enumerate(per_rank):
        if nbytes > allowed:
            fail(
                check,
                f"rank {r} ({where}) holds {nbytes:,} bytes of {what}; at most {allowed:,} "
                f"are allowed: ceil(numel / {ranks}) elements of each parameter"
                + (
                    f" (for the full model: {full:,} bytes, / {ranks} = {full // ranks:,})"
                    if full
                    else ""
                )
                + ".\n"
                f"Hint: {hint}",
            )
    if full and sum(per_rank) < full:
        fail(
            check,
            f"the ranks together hold only {sum(per_rank):,} bytes of {what} where the check "
            f"looks, less than the full model's {full:,} ({where}).\nHint: {hint}",
        )


def _check_bytes_every_step(
    check: str,
    what: str,
    results: list[dict],
    key: str,
    allowed: int,
    full: int,
    where: str,
    hint: str,
) -> None:
    """`_check_bytes` on the bytes each rank recorded under `key` at every step; `where` may
    name the step as {s}."""
    __tracebackhide__ = True
    for s in range(len(results[0]["steps"])):
        per_rank = [result["steps"][s][key] for result in results]
        _check_bytes(check, what, per_rank, allowed, full, where.format(s=s), hint)


def _check_param_groups(check: str, results: list[dict]) -> None:
    __tracebackhide__ = True
    lr = results[0]["lr"]
    if lr != ADAMW["lr"]:
        fail(
            check,
            f"optimizer.param_groups[0]['lr'] is {lr!r}, expected {ADAMW['lr']} (the lr "
            "given to the constructor): a drop-in optimizer shows its settings in "
            "param_groups, as torch's do (learning-rate schedulers change them there)",
        )


# --- the checks -----------------------------------------------------------------------------


def _validate(ranks: int, run: Run) -> None:
    if not 1 <= ranks <= 8:
        raise ValueError(f"world_size must be 1..8, got {ranks}")
    if run.batch_size % ranks or run.batch_size < ranks:
        raise ValueError(
            f"batch_size={run.batch_size} must be a multiple of world_size={ranks}, so each "
            "rank's mean loss averages to the full-batch mean"
        )
    if not 1 <= run.steps <= 20:
        raise ValueError(f"steps must be 1..20, got {run.steps}")


def _check_stage12(check: str, impl: Callable, stage: int, ranks: int, run: Run, timeout: float):
    """Each property a case of its own, over every step: a failing check lists each
    property's first problem."""
    __tracebackhide__ = True
    _validate(ranks, run)
    name = "ShardedOptimizer" if stage == 1 else "ShardedGradOptimizer"
    results = run_on_ranks(
        check, _train_stage12, impl, stage, run, world_size=ranks, timeout=timeout,
        what=f"your {name}",
    )  # fmt: skip
    ref = reference(run)
    model = build_model(run)
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    where = run.describe(ranks)
    steps = range(len(ref["steps"]))
    verdict = Verdict(check)
    with verdict.case():
        _check_param_groups(check, results)
    with verdict.case():
        _compare_parameters(check, run, results, ref)
    with verdict.case():
        for s, ref_step in enumerate(ref["steps"]):
            for r, result in enumerate(results):
                state = result["steps"][s]["state"]
                if state is not None:
                    _compare_state(check, r, s, ranks, state, ref_step)
    state_allowed = shard_bytes(model, ranks, values_per_element=2)
    with verdict.case():
        _check_bytes_every_step(
            check,
            "optimizer state",
            results,
            "state_bytes",
            state_allowed,
            shard_bytes(model, 1, values_per_element=2),
            "after step {s}, " + where,
            "each rank keeps AdamW state (exp_avg, exp_avg_sq) only for its own shards: "
            "create optimizer_cls with this rank's shard tensors (clones, not views of the "
            "full parameters), never with the full parameters",
        )
    grad_allowed = shard_bytes(model, ranks)
    kept_allowed = grad_allowed + largest + KEPT_SLACK
    if stage == 2:
        with verdict.case():
            _check_bytes_every_step(
                check,
                "gradients (measured after backward)",
                results,
                "grad_bytes",
                grad_allowed,
                shard_bytes(model, 1),
                "step {s}, " + where,
                "as soon as a parameter's gradient is ready (a post-accumulate-grad hook), "
                "reduce-scatter it into this rank's shard's .grad and free the full "
                "gradient (param.grad = None)",
            )
        with verdict.case():
            _check_bytes_every_step(
                check,
                "tensors kept from backward (every tensor alive after backward that was "
                "not before it, wherever it is kept; one parameter's full size is allowed "
                "on top)",
                results,
                "kept_bytes",
                kept_allowed,
                0,  # no lower bound: a delta (a shard's .grad may reuse its memory)
                "step {s}, " + where,
                "reduce-scatter each gradient in its hook and keep only the chunk: a full "
                "gradient kept anywhere until step() is what ZeRO-2 removes",
            )
        with verdict.case():
            for s, ref_step in enumerate(ref["steps"]):
                _compare_grad_shards(check, results, s, ref_step, ranks, f"after step {s}, {where}")

    def most(key: str) -> int:
        return max(result["steps"][s][key] for result in results for s in steps)

    verified = (
        f"{len(steps)} steps ({where}): every rank's parameters after every step match "
        f"torch.optim.AdamW on one process (rtol {TOLERANCE['rtol']:g}, atol "
        f"{TOLERANCE['atol']:g}), param_groups holds the lr, and a rank's optimizer state "
        f"took at most {most('state_bytes'):,} of the {state_allowed:,} bytes of its shards"
    )
    if stage == 2:
        verified += (
            f"; after backward, gradients at most {most('grad_bytes'):,} of "
            f"{grad_allowed:,} bytes per rank and tensors kept from backward at most "
            f"{most('kept_bytes'):,} of {kept_allowed:,}, the gradient shards right"
        )
    verdict.conclude(verified)


def _compare_grad_shards(check: str, results, s: int, ref_step: dict, ranks: int, at: str):
    __tracebackhide__ = True
    for r, result in enumerate(results):
        shards = result["steps"][s].get("grad_shards")
        if shards is None:
            continue
        for (name, full), got in zip(ref_step["grads"].items(), shards, strict=True):
            want = chunk_of(full, r, ranks)
            if got is None:
                fail(
                    check,
                    f"rank {r}, step {s}: the shard of {name!r} has no .grad after backward."
                    "\nHint: reduce-scatter each gradient during backward (a "
                    "post-accumulate-grad hook), not in step()",
                )
            label = f"gradient shard of {name}"
            problem = _mismatch({label: got}, {label: want}, GRAD_TOLERANCE)
            if problem:
                summed = _mismatch({label: got}, {label: ranks * want}, GRAD_TOLERANCE) is None
                hint = (
                    f"it is {ranks} (the world size) times the average: divide the "
                    "reduce-scattered sum by world_size()"
                    if ranks > 1 and summed
                    else "after backward, rank r's shard .grad must hold the r-th chunk of "
                    "the gradient averaged over the ranks"
                )
                fail(
                    check,
                    f"rank {r}, {at.replace('after', 'in')}: {problem} (against the "
                    f"same elements of the full-batch gradient).\nHint: {hint}",
                )


def check_zero1(
    sharded_optimizer: Callable,
    *,
    world_size: int = 4,
    seed: int = 0,
    steps: int = 3,
    batch_size: int = 12,
    timeout: float = 60.0,
) -> None:
    """ZeRO-1. `sharded_optimizer(params, optimizer_cls, **kwargs)` is used as a torch
    optimizer (`zero_grad()`, `step()`, `param_groups`) after a plain backward on each rank's
    share of the batch. Its step averages the gradients over the ranks, steps each rank's
    shards with optimizer_cls, and leaves the full updated parameters on every rank.
    Checked: parameters on every rank after every step; optimizer state bytes per rank."""
    __tracebackhide__ = True
    run = Run(seed=seed, steps=steps, batch_size=batch_size)
    _check_stage12("check_zero1", sharded_optimizer, 1, world_size, run, timeout)


def check_zero2(
    sharded_grad_optimizer: Callable,
    *,
    world_size: int = 4,
    seed: int = 0,
    steps: int = 3,
    batch_size: int = 12,
    timeout: float = 60.0,
) -> None:
    """ZeRO-2. As check_zero1, and after backward each rank holds gradients only for its own
    shards: checked are the gradient shards' values (where the optimizer's tensors are
    the shards) and the gradient bytes per rank."""
    __tracebackhide__ = True
    run = Run(seed=seed, steps=steps, batch_size=batch_size)
    _check_stage12("check_zero2", sharded_grad_optimizer, 2, world_size, run, timeout)


def check_zero3(
    shard_module: Callable[[nn.Module], nn.Module | None],
    *,
    world_size: int = 4,
    seed: int = 0,
    steps: int = 3,
    batch_size: int = 12,
    timeout: float = 60.0,
) -> None:
    """ZeRO-3. `shard_module(model)` replaces each parameter by this rank's 1-D shard (same
    names) and adds hooks that all-gather a layer's full parameters just before its forward
    and again for its backward, free them after, and leave in each shard's .grad its chunk of
    the gradient averaged over the ranks. The check trains it with AdamW on the shards.
    Checked: shards, gradient shards and optimizer state against single-process AdamW; the
    bytes the model holds after forward and after each step; all-gathers during backward."""
    __tracebackhide__ = True
    check = "check_zero3"
    run = Run(seed=seed, steps=steps, batch_size=batch_size)
    _validate(world_size, run)
    ranks = world_size
    results = run_on_ranks(
        check, _train_stage3, shard_module, run, world_size=ranks, timeout=timeout,
        what="your shard_module",
    )  # fmt: skip
    ref = reference(run)
    model = build_model(run)
    where = run.describe(ranks)
    steps = range(len(ref["steps"]))
    verdict = Verdict(check)
    with verdict.case():
        _compare_initial_shards(check, ref["initial"], results, ranks, where)
    verdict.settle()  # the rest compares shards of these names and shapes
    with verdict.case():
        for s, ref_step in enumerate(ref["steps"]):
            for r, result in enumerate(results):
                _compare_stage3_step(
                    check, r, result["steps"][s], ref_step, ranks, f"step {s}, {where}"
                )
    allowed = shard_bytes(model, ranks)
    for moment, key, hint in (
        (
            "after forward",
            "held_after_forward",
            "free each layer's gathered parameters in a forward hook once the layer has run "
            "(the ranks held: {holders}). A shard must be a copy (.clone()): a view keeps the "
            "full tensor alive",
        ),
        ("after the step", "held_after_step", "between steps the model may hold only its shards"),
    ):
        with verdict.case():
            for s in steps:
                _check_bytes(
                    check,
                    f"parameters (held by the model {moment})",
                    [result["steps"][s][key] for result in results],
                    allowed,
                    shard_bytes(model, 1),
                    f"step {s}, {where}",
                    hint.format(holders=_largest(results[0]["steps"][s]["holders"])),
                )
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    with verdict.case():
        for s in steps:
            for r in range(ranks):
                _judge_private_copies(check, results, r, s, model, largest, where)
    linear_weights = sum(
        shard_numel(m.weight.numel(), ranks) * m.weight.element_size()
        for m in model.modules()
        if isinstance(m, nn.Linear)
    )
    needed = (ranks - 1) * linear_weights
    with verdict.case():
        for s in steps:
            for r, result in enumerate(results):
                gathered = result["steps"][s]["gathered_in_backward"]
                if ranks > 1 and gathered < needed:
                    fail(
                        check,
                        f"rank {r}, step {s}, {where}: during backward it all-gathered "
                        f"{gathered:,} bytes of parameters; computing the input gradients "
                        "needs every Linear layer's full weight again: at least "
                        f"{needed:,} bytes for {ranks} ranks.\nHint: autograd keeps the "
                        "tensors forward saved until backward, so full weights saved in "
                        "forward stay in memory; save the shard instead and gather again "
                        "when backward needs the weight "
                        "(torch.autograd.graph.saved_tensors_hooks)",
                    )
    held = max(
        result["steps"][s][key]
        for result in results
        for s in steps
        for key in ("held_after_forward", "held_after_step")
    )
    verdict.conclude(
        f"{len(steps)} steps ({where}): every rank's gradient shards and shards after every "
        "step match torch.optim.AdamW on one process; the model held at most "
        f"{held:,} of the {allowed:,} bytes of its shards after forward and after each "
        "step"
        + (", and each rank all-gathered the Linear weights again in backward" if ranks > 1 else "")
    )


def _full_parameters(results: list[dict], model: nn.Module, s: int) -> dict[str, torch.Tensor]:
    """The full parameters (flat) every rank gathers in step s's forward: the ranks' shards
    after the previous step (or right after sharding), put together."""
    out = {}
    for name, p in model.named_parameters():
        shards = [
            (result["steps"][s - 1]["shards"] if s else result["initial"])[name]
            for result in results
        ]
        out[name] = torch.cat([t.reshape(-1) for t in shards])[: p.numel()]
    return out


def _contains(flat: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether `values` appears in `flat` as a run of consecutive elements."""
    n = values.numel()
    if flat.numel() < n:
        return False
    starts = (flat[: flat.numel() - n + 1] == values[0]).nonzero().flatten().tolist()
    return any(torch.equal(flat[i : i + n], values) for i in starts)


def _judge_private_copies(check, results, r: int, s: int, model, largest: int, where: str):
    """No full parameter kept outside the model's shards, beyond one parameter's size (room
    for one reused gathering buffer)."""
    __tracebackhide__ = True
    ranks = len(results)
    full = _full_parameters(results, model, s)
    for moment in ("forward", "step"):
        kept = {
            name: values.numel() * values.element_size()
            for name, values in full.items()
            if shard_numel(values.numel(), ranks) < values.numel()
            and any(
                _contains(t, values) for t in results[r]["steps"][s][f"elsewhere_after_{moment}"]
            )
        }
        if sum(kept.values()) > largest:
            names = ", ".join(repr(n) for n in list(kept)[:4]) + (" ..." if len(kept) > 4 else "")
            fail(
                check,
                f"rank {r}, step {s}, {where}: after {moment}, full copies of {len(kept)} "
                f"parameters ({names}; {sum(kept.values()):,} bytes) are alive outside the "
                "model's shards, in tensors Python can reach (an attribute, a dict, a "
                f"closure); at most one parameter's size ({largest:,} bytes) may be.\nHint: "
                "ZeRO-3 keeps only the shards between a layer's forward and its backward: "
                "drop every reference to the gathered parameters once the layer has run, and "
                "gather again in backward",
            )


def _compare_stage3_step(check: str, r: int, step: dict, ref_step: dict, ranks: int, at: str):
    """Rank r's gradient shards after backward, then its shards after the step."""
    __tracebackhide__ = True
    for name, full in ref_step["grads"].items():
        got, want = step["grads"][name], chunk_of(full, r, ranks)
        label = f"gradient shard of {name}"
        if got is None:
            fail(
                check,
                f"rank {r}, {at}: the shard of {name!r} has no .grad after backward."
                "\nHint: the backward of your all-gather should reduce-scatter the "
                "full gradient into the shard (an autograd.Function's backward)",
            )
        problem = _mismatch({label: got}, {label: want}, GRAD_TOLERANCE)
        if problem:
            summed = (
                ranks > 1 and _mismatch({label: got}, {label: ranks * want}, GRAD_TOLERANCE) is None
            )
            hint = (
                f"it is {ranks} (the world size) times the average: divide the "
                "reduce-scattered sum by world_size()"
                if summed
                else "in backward, reduce-scatter each full gradient (padded like "
                "the parameter) so that rank r's shard .grad holds the r-th chunk of "
                "the average over the ranks"
            )
            fail(check, f"rank {r}, {at}: {problem}.\nHint: {hint}")
    want = {n: chunk_of(p, r, ranks) for n, p in ref_step["params"].items()}
    problem = _mismatch(step["shards"], want)
    if problem:
        fail(
            check,
            f"rank {r}, after {at}: {problem} (against the same elements of "
            "torch.optim.AdamW's parameters on one process).\nHint: the gradient "
            "shards were right; does your code change the shards anywhere else?",
        )


def _largest(holders: dict[str, int], n: int = 3) -> str:
    top = sorted(holders.items(), key=lambda item: -item[1])[:n]
    return ", ".join(f"{name} {nbytes:,} bytes" for name, nbytes in top)


def _compare_initial_shards(check: str, initial: dict, results: list, ranks: int, where: str):
    __tracebackhide__ = True
    for r, result in enumerate(results):
        if result["names"] != list(initial):
            fail(
                check,
                f"rank {r}: after shard_module, named_parameters() gives {result['names']}; "
                f"expected the same names as before, {list(initial)}",
            )
        for name, full in initial.items():
            got = result["initial"][name]
            c = shard_numel(full.numel(), ranks)
            if tuple(got.shape) != (c,):
                fail(
                    check,
                    f"rank {r}: after shard_module, {name!r} has shape {tuple(got.shape)}; "
                    f"expected a 1-D shard of ceil({full.numel()} / {ranks}) = {c} elements "
                    "(the flattened parameter, zero-padded to a multiple of the world size, "
                    "cut into equal chunks)",
                )
            problem = _mismatch(
                {name: got}, {name: chunk_of(full, r, ranks)}, {"rtol": 0, "atol": 0}
            )
            if problem:
                fail(
                    check,
                    f"rank {r}, right after shard_module ({where}): {problem}.\nHint: rank r's "
                    "shard is elements [r*c, (r+1)*c) of the flattened parameter padded with "
                    "zeros, c = ceil(numel / world_size)",
                )


# --- for the notebook: measured bytes per rank --------------------------------------------


def _measure_on_rank(impl: Callable, stage: int, run: Run) -> dict[str, int]:
    """One step of training with a stage's implementation; this rank's bytes of
    parameters, gradients (after backward) and optimizer state (after the step)."""
    ranks, me = world_size(), rank()
    model = build_model(run)
    if stage == 3:
        model = impl(model) or model
        optimizer = make_optimizer("adamw", model.parameters())
    elif stage == 0:
        optimizer = make_optimizer("adamw", model.parameters())
    else:
        optimizer = impl(model.parameters(), torch.optim.AdamW, **ADAMW)
    x, y = global_batches(run)[0]
    x, y = data.shard(x, me, ranks), data.shard(y, me, ranks)
    optimizer.zero_grad()
    lm_loss(model(x), y).backward()
    grads = gradient_bytes(model, optimizer)
    optimizer.step()
    return {
        "parameters": held_bytes(model),
        "gradients": grads,
        "optimizer state": optimizer_state_bytes(optimizer),
    }


def measure_memory(
    impl: Callable | None, stage: int, world_size: int, seed: int = 0, timeout: float = 60.0
) -> list[dict[str, int]]:
    """Per-rank bytes of parameters (at rest), gradients (after backward) and optimizer
    state for one training step of `TinyGPT(SMALL)` in float64 on `world_size` ranks.
    stage 0 is plain data parallelism without communication (impl None): the baseline."""
    return launch(_measure_on_rank, impl, stage, Run(seed=seed, steps=1), world_size=world_size,
                  timeout=timeout)  # fmt: skip


__all__ = [
    "ADAMW",
    "SMALL",
    "check_zero1",
    "check_zero2",
    "check_zero3",
    "chunk_of",
    "gradient_bytes",
    "held_bytes",
    "measure_memory",
    "optimizer_state_bytes",
    "reference",
    "shard_bytes",
    "shard_numel",
    "chunk_range",
]
