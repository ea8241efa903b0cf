"""The zero-bubble schedule (Qi et al., 2023): backward split into B and W, simulated and run
for real on ranks."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from course_lib.measure.pipeline.runs import LossFn, torch_pipeline_step
from course_lib.memory import SavedTensors
from course_lib.pipeline import FORWARD, Op, StageLog, Task, Timeline
from course_lib.pipeline.p2p import recv_shaped, send_shaped, wait_all
from course_lib.pipeline.timeline import play
from course_lib.runtime import device, rank, world_size

# --- the zero-bubble schedule: backward split in two -------------------------------------------

INPUT_GRAD, WEIGHT_GRAD = "B", "W"  # zero bubble: B (input gradient) and W (weight gradient)


def simulate_zero_bubble(
    n_stages: int,
    m: int,
    forward_s: float = 1.0,
    input_grad_s: float = 1.0,
    weight_grad_s: float = 1.0,
    defer_w: bool = False,
) -> Timeline:
    """A zero-bubble schedule (Qi et al., 2023) on an idealised machine. A backward is two
    passes: B, the gradient with respect to the stage's input, which the previous stage waits
    for, and W, the gradient with respect to its weights, which nobody waits for. Whenever a
    stage is free it runs the first that is ready of: the next B (on the critical path); the
    next F, if fewer than P - s micro-batches hold activations (1F1B's limit); else a W left
    pending, filling time 1F1B leaves idle.

    defer_w=False: a micro-batch holds its activations until its W (1F1B's peak memory).
    defer_w=True: they are freed after B except what W needs (each linear layer's input and
    output gradient), so W's can wait for the end: ZB-H1's bubble, (P-1)(F + B - W), for
    memory that grows with the W's left pending (`pending_w_peak`)."""
    P = n_stages
    done: dict[tuple[str, int, int], float] = {}
    next_f, next_b, w_done = [0] * P, [0] * P, [0] * P
    pending: list[list[int]] = [[] for _ in range(P)]
    free, tasks, clock = [0.0] * P, [], 0.0

    def ready(key: tuple[str, int, int]) -> bool:
        return key in done and done[key] <= clock

    while len(tasks) < 3 * P * m:
        for s in range(P):
            if free[s] > clock:
                continue
            f, b = next_f[s], next_b[s]
            holding = f - (next_b[s] if defer_w else w_done[s])
            if b < m and ready((FORWARD, b, s)) and (s == P - 1 or ready((INPUT_GRAD, b, s + 1))):
                kind, micro, seconds = INPUT_GRAD, b, input_grad_s
                next_b[s] += 1
                pending[s].append(b)
            elif f < m and holding < P - s and (s == 0 or ready((FORWARD, f, s - 1))):
                kind, micro, seconds = FORWARD, f, forward_s
                next_f[s] += 1
            elif pending[s]:
                kind, micro, seconds = WEIGHT_GRAD, pending[s].pop(0), weight_grad_s
                w_done[s] += 1
            else:
                continue
            done[(kind, micro, s)] = free[s] = clock + seconds
            tasks.append(Task(s, kind, micro, 0, clock, clock + seconds))
        clock = min((t for t in (*free, *done.values()) if t > clock), default=clock)
    return Timeline(P, tasks, zero_bubble_name(defer_w))


def zero_bubble_name(defer_w: bool, zb_h1: bool = False) -> str:
    if zb_h1:
        return ZB_H1
    return "zero bubble, " + ("W's deferred" if defer_w else "1F1B's memory")


# --- ZB-H1, the paper's handcrafted schedule ----------------------------------------------------

ZB_H1 = "ZB-H1"


def zb_h1_order(n_stages: int, m: int) -> list[list[Op]]:
    """ZB-H1 (Qi et al., 2023), each stage's F, B and W in order: stage s runs 1F1B's P - s
    forwards before its first B; then for each micro-batch its B, the W owed longest once s W's
    are owed, and the next F; the W's still owed run at the end. Every stage then holds at
    most P micro-batches from F to W, the most 1F1B's first stage holds (its peak memory)."""
    orders = []
    for s in range(n_stages):
        warmup = min(n_stages - s, m)
        order, next_f, next_w = [Op(FORWARD, i) for i in range(warmup)], warmup, 0
        for k in range(m):
            order.append(Op(INPUT_GRAD, k))
            if k >= s:  # stage s owes up to s W's: later stages fill their drain with them
                order.append(Op(WEIGHT_GRAD, next_w))
                next_w += 1
            if next_f < m:
                order.append(Op(FORWARD, next_f))
                next_f += 1
        orders.append(order + [Op(WEIGHT_GRAD, i) for i in range(next_w, m)])
    return orders


def play_split_backward(
    orders: Sequence[Sequence[Op]], times: Sequence[float] = (1.0, 1.0, 1.0), name: str = ""
) -> Timeline:
    """Play each stage's F, B and W ops in the given order on the idealised machine: an op
    starts when the stage is free and what it needs is done (F: the previous stage's F; B: its
    own F and the next stage's B; W: its own B). `times` = (F, B, W)."""
    P, took = len(orders), dict(zip((FORWARD, INPUT_GRAD, WEIGHT_GRAD), times, strict=True))

    def needs(s: int, op: Op) -> tuple[tuple, list[tuple[tuple, float]]]:
        after = {
            FORWARD: [(FORWARD, op.micro, s - 1)] if s > 0 else [],
            INPUT_GRAD: [(FORWARD, op.micro, s)]
            + ([(INPUT_GRAD, op.micro, s + 1)] if s < P - 1 else []),
            WEIGHT_GRAD: [(INPUT_GRAD, op.micro, s)],
        }[op.kind]
        return (op.kind, op.micro, s), [(k, 0.0) for k in after]

    return play(orders, needs, lambda s, op: took[op.kind], name)


def simulate_zb_h1(
    n_stages: int,
    m: int,
    forward_s: float = 1.0,
    input_grad_s: float = 1.0,
    weight_grad_s: float = 1.0,
) -> Timeline:
    """ZB-H1 on the idealised machine: for m >= P its idle time per stage is (P-1)(F + B - W),
    the zero-bubble formula, at 1F1B's peak memory."""
    times = (forward_s, input_grad_s, weight_grad_s)
    return play_split_backward(zb_h1_order(n_stages, m), times, ZB_H1)


def pending_w_peak(timeline: Timeline, stage: int) -> int:
    """Most W's owed at once on `stage`: B done, W not yet (each keeps what W needs)."""
    owed = peak = 0
    for t in sorted((t for t in timeline.tasks if t.stage == stage), key=lambda t: t.start):
        owed += {INPUT_GRAD: 1, WEIGHT_GRAD: -1}.get(t.kind, 0)
        peak = max(peak, owed)
    return peak


def peak_activations(timeline: Timeline, stage: int, freed_by: str = INPUT_GRAD) -> int:
    """Most micro-batches holding activations on `stage` at once: from a forward to the op
    that frees them, the backward (`"B"`, also 1F1B's whole backward) or the W."""
    live = peak = 0
    for t in sorted((t for t in timeline.tasks if t.stage == stage), key=lambda t: t.start):
        live += 1 if t.kind == FORWARD else -1 if t.kind == freed_by else 0
        peak = max(peak, live)
    return peak


def peak_memory(timeline: Timeline, stage: int, w_share: float) -> float:
    """Most activation memory held on `stage` at once, in micro-batches' worth: a micro-batch
    holds all its activations from its F to its B, and `w_share` of them from its B to its W
    (what W needs: each weighted layer's input and output gradient). A backward not split in
    two (1F1B's "B") frees everything."""
    held = peak = 0.0
    for t in sorted((t for t in timeline.tasks if t.stage == stage), key=lambda t: t.start):
        split = any(u.kind == WEIGHT_GRAD for u in timeline.tasks)
        held += {FORWARD: 1.0, INPUT_GRAD: (w_share - 1.0) if split else -1.0}.get(t.kind, 0.0)
        held -= w_share if t.kind == WEIGHT_GRAD else 0.0
        peak = max(peak, held)
    return peak


def what_w_needs(stage: nn.Module, x: torch.Tensor) -> tuple[int, int]:
    """(bytes W needs, bytes autograd saves) for one forward of `stage` on `x`. W needs, for
    every layer with weights (linear, embedding, layer norm), its input and the gradient of
    its output (the output's size); autograd saves every activation backward needs."""
    needed = 0

    def count(module: nn.Module, args: tuple, output: Any) -> None:
        nonlocal needed
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        needed += sum(t.nbytes for t in tensors) + output.nbytes

    weighted = [m for m in stage.modules() if next(m.parameters(recurse=False), None) is not None]
    hooks = [m.register_forward_hook(count) for m in weighted]
    try:
        with SavedTensors(exclude=list(stage.parameters())) as saved:
            out = stage(x)  # held while the output (and its graph) lives
            held = saved.live_bytes
            del out
    finally:
        for h in hooks:
            h.remove()
    return needed, held


# --- the zero-bubble schedule, run for real --------------------------------------------------


def zero_bubble_order(
    n_stages: int,
    m: int,
    defer_w: bool = False,
    times: Sequence[float] = (1.0, 1.0, 1.0),
    zb_h1: bool = False,
) -> list[list[Op]]:
    """Each stage's F, B and W ops in the order `simulate_zero_bubble` ran them with
    `times` = (F, B, W), or ZB-H1's (`zb_h1=True`): the runtime plays the simulator's
    schedule, not one of its own."""
    if zb_h1:
        return zb_h1_order(n_stages, m)
    timeline = simulate_zero_bubble(n_stages, m, *times, defer_w=defer_w)
    tasks = sorted(timeline.tasks, key=lambda t: (t.stage, t.start))
    return [[Op(t.kind, t.micro) for t in tasks if t.stage == s] for s in range(n_stages)]


def zero_bubble_step(
    stage: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    loss_fn: LossFn,
    m: int,
    defer_w: bool = False,
    times: Sequence[float] = (0.0, 0.0, 0.0),
    zb_h1: bool = False,
) -> StageLog:
    """One step of the zero-bubble pipeline on rank r = stage index, in `zero_bubble_order`.

    F: the stage's forward, sent downstream; B: the gradient of the stage's input only, sent
    upstream at once; W: the weights' gradients, later. Each op lasts `times` = (F, B, W)
    seconds beyond its real compute (a sleep after it, as `TimedStage` does; 0: the compute
    only, the order then comes from F = B = W), and its start and end are read on the wall
    clock. zb_h1=True plays ZB-H1's handcrafted order (`defer_w` is then unused).
    """
    P, r = world_size(), rank()
    if x.shape[0] % m:
        raise ValueError(f"a batch of {x.shape[0]} samples does not split into m={m} equal parts")
    order = zero_bubble_order(
        P, m, defer_w, times if all(t > 0 for t in times) else (1, 1, 1), zb_h1
    )
    stage.to(device())
    xs, ys = ([c.to(device(), copy=True) for c in t.chunk(m)] for t in (x, y))
    log = StageLog(r, zero_bubble_name(defer_w, zb_h1))
    params = list(stage.parameters())
    weight_grads = [torch.zeros_like(p) for p in params]
    inputs: dict[int, torch.Tensor] = {}
    outputs: dict[int, torch.Tensor] = {}  # micro-batch -> output, its graph kept until W
    grads_out: dict[int, torch.Tensor | None] = {}  # micro-batch -> gradient W starts from
    pending: list[Any] = []
    total_loss = 0.0
    # W from the graph B kept (retain_graph=True), not by saving each linear layer's input and
    # recomputing: it works for any stage (embedding, layer norm, attention) and is exact. The
    # price: a micro-batch holds all its activations until its W, and W walks the chain of
    # activation gradients again. Both cost real memory and compute (short beside the sleeps).
    with SavedTensors(exclude=params) as saved:
        for op in order[r]:
            i = op.micro
            if op.kind == FORWARD:
                inp = xs[i] if r == 0 else recv_shaped(r - 1)
                start, before = time.perf_counter(), saved.live_bytes
                out = stage(inp.requires_grad_() if r > 0 else inp)
                if r == P - 1:
                    out = loss_fn(out, ys[i]) / m  # mean over micro-batches
                    total_loss += out.item()
                time.sleep(times[0])
                end = time.perf_counter()
                if r < P - 1:
                    pending += send_shaped(out, r + 1)
                log.activation_bytes.append(saved.live_bytes - before)
                inputs[i], outputs[i] = inp, out
                log.peak_in_flight = max(log.peak_in_flight, len(outputs))
            elif op.kind == INPUT_GRAD:
                grad = None if r == P - 1 else recv_shaped(r + 1)
                start, inp = time.perf_counter(), inputs.pop(i)
                if r > 0:  # stage 0's input is data: no gradient to send
                    (grad_in,) = torch.autograd.grad(outputs[i], [inp], grad, retain_graph=True)
                time.sleep(times[1])
                end = time.perf_counter()
                if r > 0:
                    pending += send_shaped(grad_in, r - 1)
                grads_out[i] = grad
            else:  # WEIGHT_GRAD: nobody waits for it
                start = time.perf_counter()
                got = torch.autograd.grad(
                    outputs.pop(i), params, grads_out.pop(i), allow_unused=True
                )
                for total, g in zip(weight_grads, got, strict=True):
                    if g is not None:
                        total += g
                time.sleep(times[2])
                end = time.perf_counter()
            log.tasks.append(Task(r, op.kind, i, 0, start, end))
        log.peak_activation_bytes = saved.peak_bytes
    wait_all(pending)
    for p, g in zip(params, weight_grads, strict=True):
        p.grad = g
    log.loss = total_loss if r == P - 1 else None
    log.grads = [g.detach().clone() for g in weight_grads]
    return log


def measure_zero_bubble(
    make_stage: Callable[[], nn.Module],
    x: torch.Tensor,
    y: torch.Tensor,
    loss_fn: LossFn,
    m: int,
    times: Sequence[float],
) -> dict[str, StageLog]:
    """Run on every rank: torch's 1F1B (backward = B + W in one op), both greedy zero-bubble
    variants and ZB-H1, F, B, W lasting `times` beyond their compute, after warm-up steps that
    open the links and make the first calls."""
    f, b, w = times
    one_f = torch_pipeline_step(make_stage(), x, y, loss_fn, m, "1f1b", f, b + w, warmups=1)
    zero_bubble_step(make_stage(), x, y, loss_fn, m=1)
    return {
        "1f1b": one_f,
        **{
            zero_bubble_name(defer): zero_bubble_step(make_stage(), x, y, loss_fn, m, defer, times)
            for defer in (False, True)
        },
        ZB_H1: zero_bubble_step(make_stage(), x, y, loss_fn, m, times=times, zb_h1=True),
    }
