"""What lecture 3 measures beyond the data-parallel loop itself: the two tools DDP is built
from (section 3: the order gradients become ready, an all-reduce that overlaps compute; the
table of DDP's overlap, `overlap_table`),
large batches (section 5: steps to a target loss against the batch size, the gradient noise
scale) and fewer all-reduces (section 6: local SGD's loss against the bytes it sends); and
the checks of its exercises, which compute their expected values (and say why) off the page:
section 2's (`check_ring_bytes_limit`, `check_redundancy`) and the predictions checked against
the runs (`check_first_ready`, `check_rank0_grows_by`, `check_steps_fall_from_256_to_1024`,
`check_no_sync_sends`).

Data parallelism over P ranks with B/P samples each is, step for step, single-process
training with batch B (lecture 3, section 2 shows the parameters equal to rounding). So the
optimisation questions of large batches (which learning rate, whether to warm up, when more
ranks stop saving steps) are measured here in one process, on a small seeded problem: an MLP
classifying points around four centres that overlap, so that mini-batch gradients are noisy.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from course_lib import data, launch, models, rank
from course_lib.costs import MIXED_ADAMW, zero_bytes
from course_lib.exercises import check_choice, check_number, nearest_option, together

SIZES = (8, 32, 4)  # the classifier: 8 inputs, 32 hidden units, 4 classes


def large_batch_task(n: int = 4096, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The data set every run trains on: overlapping classes, so gradients are noisy."""
    return data.classification(n, dim=SIZES[0], classes=SIZES[-1], spread=2.0, seed=seed)


def warmup_factor(step: int, warmup: int) -> float:
    """Linear warm-up: the learning rate grows from lr/warmup to lr over the first `warmup`
    steps (step counts from 1), then stays."""
    return min(1.0, step / warmup) if warmup else 1.0


def steps_to_loss(
    batch_size: int,
    lr: float,
    target: float,
    warmup: int = 0,
    max_steps: int = 1500,
    every: int = 5,
    seed: int = 0,
) -> int | None:
    """SGD with mini-batches of `batch_size` drawn with replacement: the first step (checked
    every `every` steps) at which the loss on the whole data set is <= target, or None when
    it never gets there in `max_steps` or diverges."""
    x, y = large_batch_task()
    model = models.MLP(SIZES)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    for step in range(1, max_steps + 1):
        for group in optimizer.param_groups:
            group["lr"] = lr * warmup_factor(step, warmup)
        idx = torch.randint(len(x), (batch_size,), generator=g)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x[idx]), y[idx])
        if not math.isfinite(loss.item()) or loss.item() > 20:  # diverged: stop paying
            return None
        loss.backward()
        optimizer.step()
        if step % every == 0:
            with torch.no_grad():
                if F.cross_entropy(model(x), y).item() <= target:
                    return step
    return None


def large_batch_sweep(
    grid: dict[int, Sequence[float]], target: float, warmup: int = 0
) -> dict[int, dict[float, int | None]]:
    """steps_to_loss for each batch size and each of its learning rates: {B: {lr: steps}}."""
    return {b: {lr: steps_to_loss(b, lr, target, warmup) for lr in lrs} for b, lrs in grid.items()}


def best_steps(results: dict[int, dict[float, int | None]]) -> dict[int, tuple[float, int]]:
    """For each batch size, the learning rate that reached the target in fewest steps."""
    best = {}
    for b, by_lr in results.items():
        reached = [(steps, lr) for lr, steps in by_lr.items() if steps is not None]
        if reached:
            steps, lr = min(reached)
            best[b] = (lr, steps)
    return best


def fit_critical_batch(best: dict[int, tuple[float, int]]) -> tuple[float, float]:
    """Least-squares fit of steps = S_min (1 + B_crit / B) to the measured best steps per
    batch (McCandlish et al., 2018): S_min is the fewest steps any batch can take, B_crit
    the batch at which training takes twice that. Returns (S_min, B_crit)."""
    sizes = torch.tensor(sorted(best), dtype=torch.float64)
    steps = torch.tensor([best[int(b)][1] for b in sizes], dtype=torch.float64)
    # steps = a + c / B is linear in (a, c): a = S_min, c = S_min * B_crit.
    design = torch.stack([torch.ones_like(sizes), 1 / sizes], dim=1)
    a, c = torch.linalg.lstsq(design, steps.unsqueeze(1)).solution.squeeze(1).tolist()
    return a, c / a


def per_example_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One row per example: the flattened gradient of that example's loss (torch.func)."""
    params = {name: p.detach() for name, p in model.named_parameters()}

    def loss_of_one(p, xi, yi):
        logits = functional_call(model, p, (xi.unsqueeze(0),))
        return F.cross_entropy(logits, yi.unsqueeze(0))

    grads = vmap(grad(loss_of_one), in_dims=(None, 0, 0))(params, x, y)
    return torch.cat([g.flatten(1) for g in grads.values()], dim=1)


def gradient_noise_scale(per_example: torch.Tensor) -> float:
    """The gradient noise scale B_simple = tr(Sigma) / |G|^2 (McCandlish et al., 2018) from
    one row of gradient per example: Sigma is the covariance of one example's gradient, G
    their mean. Batches much smaller than B_simple are dominated by noise (doubling B nearly
    halves the steps); much larger ones waste samples (the steps hardly fall)."""
    mean = per_example.mean(dim=0)
    trace = per_example.var(dim=0).sum()  # sum of per-coordinate variances = tr(Sigma)
    return (trace / mean.square().sum()).item()


def model_at_loss(loss: float, lr: float = 0.4, batch_size: int = 64) -> nn.Module:
    """The classifier trained until its loss on the whole data set falls to `loss`: the point
    of training where the noise scale is measured."""
    x, y = large_batch_task()
    model = models.MLP(SIZES)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(0)
    for _ in range(10_000):
        with torch.no_grad():
            if F.cross_entropy(model(x), y).item() <= loss:
                return model
        idx = torch.randint(len(x), (batch_size,), generator=g)
        optimizer.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        optimizer.step()
    raise RuntimeError(f"the classifier did not reach loss {loss}; pick a larger one")


def plot_steps_against_batch(
    best: dict[int, tuple[float, int]], b_noise: float | None = None, ax=None
) -> plt.Axes:
    """Measured steps to the target against batch size (log-log), with the line of perfect
    scaling (steps halve when B doubles) through the smallest batch, and B_simple marked."""
    ax = ax or plt.subplots(figsize=(6, 4))[1]
    sizes = sorted(best)
    steps = [best[b][1] for b in sizes]
    ax.loglog(sizes, steps, "o-", label="measured (best learning rate per batch)")
    ax.loglog(
        sizes, [steps[0] * sizes[0] / b for b in sizes], "k--", label="perfect: steps x B fixed"
    )
    for b, s in zip(sizes, steps, strict=True):
        ax.annotate(f"lr {best[b][0]:g}", (b, s), textcoords="offset points", xytext=(5, 5))
    if b_noise:
        ax.axvline(
            b_noise, color="tab:red", ls=":", label=f"measured $B_{{simple}}$ = {b_noise:.0f}"
        )
    ax.set(xlabel="global batch size B", ylabel="steps to reach the target loss")
    ax.legend()
    return ax


def plot_loss_against_bytes(
    results: dict[float, dict[int, tuple[float, int]]], ax=None
) -> plt.Axes:
    """Local SGD: final loss against bytes each rank wrote, one line per learning rate, one
    point per averaging period. `results` is {lr: {every: (loss, bytes)}}."""
    ax = ax or plt.subplots(figsize=(6, 4))[1]
    for lr, by_every in results.items():
        periods = sorted(by_every)
        ax.semilogx([by_every[h][1] for h in periods], [by_every[h][0] for h in periods], "o-",
                    label=f"lr {lr:g}")  # fmt: skip
        for h in periods:
            ax.annotate(f"every {h}", by_every[h][::-1], textcoords="offset points", xytext=(4, 4))
    ax.set(xlabel="bytes each rank wrote (measured, WireCounter)", ylabel="final loss, all data")
    ax.legend()
    return ax


# --- DDP's two tools (lecture 3, section 3): gradient-ready hooks and asynchronous collectives


def gradient_ready_order(sizes: tuple[int, ...] = (8, 32, 32, 4)) -> list[str]:
    """Names of an MLP's parameters in the order one backward pass finishes their gradients,
    seen by `register_post_accumulate_grad_hook` (what DDP's buckets wait for)."""
    model = models.MLP(sizes)
    order: list[str] = []
    for name, param in model.named_parameters():
        # Autograd calls the hook once param.grad holds this backward's gradient.
        param.register_post_accumulate_grad_hook(lambda _p, name=name: order.append(name))
    x, y = data.regression(16, in_dim=sizes[0], out_dim=sizes[-1])
    F.mse_loss(model(x), y).backward()
    return order


def _try_all_reduce_while_computing(fn) -> tuple[list[float], object]:
    tensor = torch.full((4,), float(rank() + 1))
    result = fn(tensor, lambda: "computed")
    return tensor.tolist(), result


def check_all_reduce_while_computing(fn, world_size: int = 2) -> bool | None:
    """The lecture's exercise check: on `world_size` ranks, fn(tensor, compute) must return
    compute()'s result with `tensor` already summed over the ranks (waited for)."""
    runs = launch(_try_all_reduce_while_computing, fn, world_size=world_size)
    if all(result is None or result is ... for _, result in runs):
        print("Not answered yet: your function returned nothing; return compute()'s result.")
        return None
    total = float(sum(range(1, world_size + 1)))
    for r, (tensor, result) in enumerate(runs):
        if result != "computed":
            print(f"✗ Not yet: rank {r} returned {result!r}, not what compute() returned.")
            return False
        if tensor != [total] * 4:
            print(f"✗ Not yet: on return, rank {r}'s tensor is not the sum; did you wait()?")
            return False
    print("✓ Right: every rank computed while its all-reduce ran, and waited for the sum.")
    return True


def median_ms(seconds: Sequence[float], skip: int = 2) -> float:
    """The median of a run's step times in milliseconds, its first `skip` steps left out (step 0
    sets up connections, step 1 is when DDP rebuilds its buckets)."""
    return 1000 * statistics.median(seconds[skip:])


def overlap_table(runs: dict[str, list]) -> None:
    """Print lecture 3's table of DDP's overlap: for each run (name: every rank's log of
    `train_data_parallel`), rank 0's median step, backward and all-reduce after backward; then
    the times the no-overlap and best-overlap sums predict from the loop's parts, and how much
    faster 4 MB buckets measured."""
    print(f"{'':<28}{'step':>9}{'backward':>10}{'all-reduce after':>18}")
    for name, logs in runs.items():
        log = logs[0]
        step, backward, sync = (median_ms(t) for t in (log.step_s, log.backward_s, log.sync_s))
        print(f"{name:<28}{step:>7.1f}ms{backward:>8.1f}ms{sync:>16.1f}ms")
    loop = runs["all-reduce after backward"][0]
    forward = median_ms([e.end - e.start for e in loop.events if e.kind == "forward"])
    backward, comm = median_ms(loop.backward_s), median_ms(loop.sync_s)
    parts = f"T_fwd = {forward:.1f} ms, T_bwd = {backward:.1f} ms, T_comm = {comm:.1f} ms"
    print(f"\nfrom our loop: {parts}")
    print(f"no overlap:   T_fwd + T_bwd + T_comm      = {forward + backward + comm:.1f} ms")
    print(f"best overlap: T_fwd + max(T_bwd, T_comm) = {forward + max(backward, comm):.1f} ms")
    bucketed = median_ms(runs["DDP, 4 MB buckets"][0].step_s)
    for name in ("all-reduce after backward", "DDP, one 1000 MB bucket"):
        ratio = median_ms(runs[name][0].step_s) / bucketed
        print(f"measured: DDP with 4 MB buckets is {ratio:.2f}x as fast per step as {name}")


def time_overlap(overlap: bool, floats: int = 4_000_000, steps: int = 5) -> float:
    """Median seconds of `steps` rounds of one all-reduce of `floats` values and a fixed
    amount of matrix multiplication, one after the other or overlapped (async_op=True)."""
    tensor, a = torch.ones(floats), torch.randn(400, 400)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        work = dist.all_reduce(tensor, async_op=True) if overlap else dist.all_reduce(tensor)
        for _ in range(20):
            a = torch.tanh(a @ a)  # the "backward" that runs while the bytes travel
        if overlap:
            work.wait()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# --- section 2's exercises, checked off the page ----------------------------------------------


def check_ring_bytes_limit(limit_in_units_of_M: object) -> bool | None:
    """Lecture 3: what a ring all-reduce's bytes per rank over M tend to as P grows."""
    return check_number(limit_in_units_of_M, 2.0, rtol=0.01, hint="What does (P-1)/P tend to?")


def check_redundancy(redundant_bytes: object, zero3_bytes_per_gpu: object) -> bool | None:
    """Lecture 3: 7B parameters' AdamW state on 64 GPUs: the bytes beyond one copy, ZeRO-3's."""
    per_copy = sum(zero_bytes("ddp", 7e9, 64, MIXED_ADAMW).values())
    return together(
        # 0.5%: 64 copies instead of 63 is 1.6% off, and must not pass
        check_number(
            redundant_bytes,
            63 * per_copy,
            rtol=0.005,
            unit="bytes",
            hint="One copy is 16 bytes x 7e9.",
        ),
        check_number(
            zero3_bytes_per_gpu,
            sum(zero_bytes("zero3", 7e9, 64, MIXED_ADAMW).values()),
            unit="bytes",
            hint="Every kind of state is divided by P.",
        ),
    )


# --- the predictions, checked against what the runs measured ----------------------------------

READY = ("layers.0.weight", "layers.4.bias", "all at the same moment")


def check_first_ready(first_ready: object, order: list[str]) -> bool | None:
    """Which parameter's gradient was ready first in backward (`order`, from
    `gradient_ready_order`)."""
    return check_choice(
        first_ready,
        order[0],
        READY,
        why="Backward runs from the loss back to the input: the last layer's gradients come first.",
    )


GROWTH = {"0 ms": 1.0, "12.5 ms": 12.5, "50 ms": 50.0, "200 ms": 200.0}


def check_rank0_grows_by(rank0_grows_by: object, normal: list, slowed: list) -> bool | None:
    """How much rank 0's median step grew with rank 2 slowed (`normal[r].step_s` and
    `slowed[r].step_s`: rank r's step seconds), against the option nearest the run."""
    grew = median_ms(slowed[0].step_s) - median_ms(normal[0].step_s)
    return check_choice(
        rank0_grows_by,
        nearest_option(max(grew, 1.0), GROWTH),  # "0 ms" as 1 ms: a log scale has no zero
        list(GROWTH),
        why=f"Rank 0 grew by {grew:.1f} ms: its all-reduce waits for rank 2's gradient every step.",
    )


FALLS = {"about 4x": 4.0, "about 3x": 3.0, "less than 2x": 1.4}


def check_steps_fall_from_256_to_1024(
    steps_fall_from_256_to_1024: object, best: dict[int, tuple[float, int]]
) -> bool | None:
    """How many times fewer steps batch 1024 needed than 256 to reach the target loss, each at
    its best learning rate (`best[B]`: (lr, steps), from `best_steps`)."""
    ratio = best[256][1] / best[1024][1]
    return check_choice(
        steps_fall_from_256_to_1024,
        nearest_option(ratio, FALLS),
        list(FALLS),
        why=f"Measured: {best[256][1]} -> {best[1024][1]} steps, {ratio:.1f}x fewer for 4x the "
        "batch.",
    )


SHARES = {"the same": 1.0, "about half": 0.5, "about a quarter": 0.25}


def check_no_sync_sends(no_sync_sends: object, accumulated: dict, k: int) -> bool | None:
    """The share of the bytes rank 0 wrote per step of `k` accumulated micro-batches with
    `no_sync` against without (`accumulated[no_sync][rank]`: (state, bytes written))."""
    share = accumulated[True][0][1] / accumulated[False][0][1]
    return check_choice(
        no_sync_sends,
        nearest_option(share, SHARES),
        list(SHARES),
        why=f"Measured: {share:.2f} of the bytes. Only the last of the {k} backwards all-reduces.",
    )
