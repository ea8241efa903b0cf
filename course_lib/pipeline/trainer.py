"""The code of `course_lib.pipeline`, as it was in pipeline.py (split in the next commit)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from course_lib.costs import pp_boundary_bytes
from course_lib.memory import SavedTensors
from course_lib.runtime import device, rank, world_size

SCHEDULES = ("naive", "gpipe", "1f1b", "interleaved")
FORWARD, BACKWARD = "F", "B"

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


# --- 1. schedules: what each stage runs, in which order -------------------------------------


@dataclass(frozen=True)
class Op:
    """One unit of a stage's work: the forward or backward of micro-batch `micro` through
    model chunk `chunk` of the stage (chunks > 0 only in the interleaved schedule)."""

    kind: str  # FORWARD or BACKWARD
    micro: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.micro}" + (f".{self.chunk}" if self.chunk else "")


def _check(n_stages: int, m: int, chunks: int) -> None:
    for name, value in (("P (stages)", n_stages), ("m (micro-batches)", m), ("chunks", chunks)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")


def _one_f_one_b(forwards: list[Op], backwards: list[Op], warmup: int) -> list[Op]:
    """`warmup` forwards, then alternate one forward and one backward, then the backwards
    left over: the order of 1F1B and of its interleaved variant."""
    warmup = min(warmup, len(forwards))
    order = forwards[:warmup]
    for f, b in zip(forwards[warmup:], backwards, strict=False):
        order += [f, b]
    return order + backwards[len(forwards) - warmup :]


def schedule_order(schedule: str, n_stages: int, m: int, chunks: int = 2) -> list[list[Op]]:
    """For each stage, the ops it runs in order under `schedule`.

    naive: one micro-batch at a time through the whole model (forward then backward);
    gpipe: every forward, then every backward; 1f1b: P - s - 1 warm-up forwards on stage s,
    then one forward / one backward; interleaved: 1F1B over `chunks` model chunks per stage
    (Megatron-LM's order; needs m divisible by P).
    """
    _check(n_stages, m, chunks)
    P = n_stages
    if schedule == "naive":
        return [[Op(k, i) for i in range(m) for k in (FORWARD, BACKWARD)] for _ in range(P)]
    if schedule == "gpipe":
        return [
            [Op(FORWARD, i) for i in range(m)] + [Op(BACKWARD, i) for i in range(m)]
            for _ in range(P)
        ]
    if schedule == "1f1b":
        return [
            _one_f_one_b(
                [Op(FORWARD, i) for i in range(m)], [Op(BACKWARD, i) for i in range(m)], P - s - 1
            )
            for s in range(P)
        ]
    if schedule == "interleaved":
        if m % P:
            raise ValueError(f"the interleaved schedule needs m divisible by P: m={m}, P={P}")

        # Groups of P micro-batches go through chunk 0, then the same group through chunk 1...
        def op(kind: str, k: int) -> Op:
            group, chunk = divmod(k // P, chunks)
            chunk = chunk if kind == FORWARD else chunks - 1 - chunk
            return Op(kind, group * P + k % P, chunk)

        total = m * chunks
        orders = []
        for s in range(P):
            warmup = (P - s - 1) * 2 + (chunks - 1) * P
            forwards = [op(FORWARD, k) for k in range(total)]
            backwards = [op(BACKWARD, k) for k in range(total)]
            orders.append(_one_f_one_b(forwards, backwards, warmup))
        return orders
    raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")


# --- 2. timelines: when each op ran, simulated or measured ----------------------------------


@dataclass(frozen=True)
class Task:
    """An op that ran on `stage` from `start` to `end` (seconds)."""

    stage: int
    kind: str
    micro: int
    chunk: int
    start: float
    end: float


@dataclass
class Timeline:
    """Every stage's tasks; the bubble is the idle share of P stages x the makespan."""

    n_stages: int
    tasks: list[Task]
    schedule: str = ""
    measured: bool = False  # True: times are seconds on a real clock; else simulated units

    @property
    def makespan(self) -> float:
        return max(t.end for t in self.tasks) - min(t.start for t in self.tasks)

    def busy(self, stage: int) -> float:
        return sum(t.end - t.start for t in self.tasks if t.stage == stage)

    @property
    def bubble(self) -> float:
        """Share of the P x makespan stage-seconds in which stages were idle."""
        return bubble_fraction(self)

    def peak_in_flight(self, stage: int) -> int:
        """Most micro-batches whose forward ran on `stage` and whose backward had not yet
        (each holds its activations); an interleaved stage counts each chunk's separately."""
        live = peak = 0
        for t in sorted((t for t in self.tasks if t.stage == stage), key=lambda t: t.start):
            live += 1 if t.kind == FORWARD else -1
            peak = max(peak, live)
        return peak

    @classmethod
    def from_logs(cls, logs: Sequence[StageLog], schedule: str = "") -> Timeline:
        """The measured timeline of one step, from every rank's `StageLog`."""
        tasks = [t for log in logs for t in log.tasks]
        origin = min(t.start for t in tasks)
        shifted = [
            Task(t.stage, t.kind, t.micro, t.chunk, t.start - origin, t.end - origin) for t in tasks
        ]
        return cls(len(logs), shifted, schedule or logs[0].schedule, measured=True)


def bubble_fraction(timeline: Timeline) -> float:
    """1 - (time stages were busy) / (P x makespan), from the tasks' start and end times."""
    busy = sum(timeline.busy(s) for s in range(timeline.n_stages))
    return 1.0 - busy / (timeline.n_stages * timeline.makespan)


def _per_stage(value: float | Sequence[float], n_stages: int, name: str) -> list[float]:
    values = [float(value)] * n_stages if isinstance(value, int | float) else list(value)
    if len(values) != n_stages or any(v < 0 for v in values):
        raise ValueError(f"{name} must be one time >= 0 or one per stage ({n_stages}): {value}")
    return values


def simulate(
    n_stages: int,
    m: int,
    schedule: str = "1f1b",
    forward_s: float | Sequence[float] = 1.0,
    backward_s: float | Sequence[float] = 2.0,
    chunks: int = 2,
    comm_s: float = 0.0,
) -> Timeline:
    """Run `schedule_order` on an idealised machine: each stage starts its next op as soon as
    the op it depends on has finished on the neighbouring stage (plus `comm_s`).

    A forward of micro-batch i through virtual stage v needs its forward through v - 1; a
    backward needs the backward through v + 1 (the last virtual stage: its own forward).
    `forward_s` / `backward_s`: one time or one per stage; with interleaving each chunk takes
    1/chunks of it, so a stage does the same work under every schedule.
    """
    orders = schedule_order(schedule, n_stages, m, chunks)
    n_chunks = chunks if schedule == "interleaved" else 1
    fwd = [t / n_chunks for t in _per_stage(forward_s, n_stages, "forward_s")]
    bwd = [t / n_chunks for t in _per_stage(backward_s, n_stages, "backward_s")]
    last_virtual = n_chunks * n_stages - 1
    done: dict[tuple[str, int, int], float] = {}  # (kind, micro, virtual stage) -> end time
    free = [0.0] * n_stages
    position = [0] * n_stages
    tasks: list[Task] = []
    progress = True
    while progress:
        progress = False
        for s in range(n_stages):
            while position[s] < len(orders[s]):
                op = orders[s][position[s]]
                v = op.chunk * n_stages + s  # chunk c of stage s is virtual stage c*P + s
                if op.kind == FORWARD:
                    needs = (FORWARD, op.micro, v - 1) if v > 0 else None
                elif v < last_virtual:
                    needs = (BACKWARD, op.micro, v + 1)
                else:
                    needs = (FORWARD, op.micro, v)
                if needs is not None and needs not in done:
                    break  # waits for a neighbour; another stage moves first
                ready = 0.0 if needs is None else done[needs] + (comm_s if needs[2] != v else 0)
                start = max(free[s], ready)
                end = start + (fwd[s] if op.kind == FORWARD else bwd[s])
                done[(op.kind, op.micro, v)] = free[s] = end
                tasks.append(Task(s, op.kind, op.micro, op.chunk, start, end))
                position[s] += 1
                progress = True
    if any(position[s] < len(orders[s]) for s in range(n_stages)):
        stuck = {
            s: str(orders[s][position[s]]) for s in range(n_stages) if position[s] < len(orders[s])
        }
        raise RuntimeError(f"schedule {schedule!r} deadlocks: stages wait forever at {stuck}")
    return Timeline(n_stages, tasks, schedule)


# --- 3. a real pipeline: one stage per rank, activations and gradients by send/recv ---------

# A tensor travels as a small header (the sender's clock when it was ready, dtype code, number
# of dimensions, the dimensions) and then its data, so a stage need not know its neighbour's
# output shape in advance. Ranks on one machine share `time.perf_counter` (a system-wide
# monotonic clock on Linux and macOS), so the timestamps of all ranks are comparable.
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64]
_MAX_DIMS = 6


def _send(tensor: torch.Tensor, dst: int, ready: float) -> list[Any]:
    """Start sending `tensor` (ready at time `ready`) to rank `dst`; returns the handles to
    wait on, with the buffers they must keep alive until the message has left."""
    if tensor.dim() > _MAX_DIMS:
        raise ValueError(f"can send tensors of at most {_MAX_DIMS} dimensions, got {tensor.dim()}")
    header = torch.zeros(_MAX_DIMS + 3, dtype=torch.float64)
    header[0], header[1], header[2] = ready, _DTYPES.index(tensor.dtype), tensor.dim()
    header[3 : 3 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.float64)
    data = tensor.detach().contiguous()
    return [dist.isend(header, dst), dist.isend(data, dst), header, data]


def _recv(src: int) -> tuple[torch.Tensor, float]:
    """Receive the next tensor rank `src` sends us (blocks until it arrives), and the time
    at which the sender had it ready."""
    header = torch.empty(_MAX_DIMS + 3, dtype=torch.float64)
    dist.recv(header, src)
    shape = [int(d) for d in header[3 : 3 + int(header[2])].tolist()]
    tensor = torch.empty(shape, dtype=_DTYPES[int(header[1])], device=device())
    dist.recv(tensor, src)
    return tensor, float(header[0])


class EmulatedDevice:
    """A rank's stand-in for an accelerator: each op takes a fixed time, real compute included.

    An op starts when its input is ready (the sender's clock, carried by the message) and the
    device is free, and ends `op_s` later: the rank sleeps until then, leaving the cores to
    the other ranks, so 4 ranks on 2 cores act like 4 devices. A rank that wakes up late (the
    OS ran something else) catches up if it is less than one op late; `lateness` records it.
    """

    def __init__(self) -> None:
        self.free_at: float | None = None  # when the last op ended (None: nothing ran yet)
        self.lateness: list[float] = []  # how late the host noticed each op's input

    def start(self, ready: float | None) -> float:
        """When an op whose input was ready at `ready` (None: local, ready now) starts."""
        now = time.perf_counter()
        known = [t for t in (ready, self.free_at) if t is not None]
        start = max(known) if known else now
        self.lateness.append(max(0.0, now - start))
        return start

    def finish(self, start: float, op_s: float) -> float:
        """End the op `op_s` after `start`, or when its compute ended if that was later."""
        end = max(start + op_s, time.perf_counter())
        time.sleep(max(0.0, end - time.perf_counter()))
        self.free_at = end
        return end


@dataclass
class StageLog:
    """What one rank measured during one `pipeline_step`."""

    stage: int
    schedule: str
    tasks: list[Task] = field(default_factory=list)  # perf_counter times of the device's ops
    lateness: list[float] = field(default_factory=list)  # host wake-up delays (seconds)
    peak_in_flight: int = 0  # most micro-batches holding activations at once
    peak_activation_bytes: int = 0  # most bytes autograd held for backward at once
    activation_bytes: list[int] = field(default_factory=list)  # saved per micro-batch forward
    loss: float | None = None  # mean loss over micro-batches (last stage only)
    grads: list[torch.Tensor] = field(default_factory=list)  # this stage's, in parameter order


def pipeline_step(
    stage: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    loss_fn: LossFn,
    m: int,
    schedule: str = "1f1b",
    forward_s: float = 0.0,
    backward_s: float = 0.0,
    optimizer: torch.optim.Optimizer | None = None,
) -> StageLog:
    """One training step of a P-stage pipeline; rank r runs `stage`, the r-th stage.

    The batch `x, y` is cut into `m` equal micro-batches (rank 0 reads x, the last rank y);
    the loss is the mean of the micro-batches' mean losses, so the gradients are those of
    the whole batch. Each forward / backward lasts `forward_s` / `backward_s` seconds on the
    rank's `EmulatedDevice` (0: just the real compute).
    """
    P, r = world_size(), rank()
    if schedule not in ("naive", "gpipe", "1f1b"):
        raise ValueError(f"pipeline_step runs 'naive', 'gpipe' or '1f1b', not {schedule!r}")
    if x.shape[0] % m:
        raise ValueError(f"a batch of {x.shape[0]} samples does not split into m={m} equal parts")
    stage.to(device())  # in place: the caller's stage and its gradients live on the rank's device
    # each micro-batch in storage of its own, as a data loader would hand it over
    xs, ys = ([c.to(device(), copy=True) for c in t.chunk(m)] for t in (x, y))
    log, clock = StageLog(r, schedule), EmulatedDevice()
    inputs: dict[int, torch.Tensor] = {}  # micro-batch -> the input we return a gradient for
    outputs: dict[int, torch.Tensor] = {}  # micro-batch -> output (last stage: its loss)
    pending: list[Any] = []  # sends in flight, waited for at the end
    total_loss = 0.0
    stage.zero_grad(set_to_none=True)
    with SavedTensors(exclude=stage.parameters()) as saved:
        for op in schedule_order(schedule, P, m)[r]:
            i = op.micro
            if op.kind == FORWARD:
                inp, ready = (xs[i], None) if r == 0 else _recv(r - 1)
                start, before = clock.start(ready), saved.live_bytes
                out = stage(inp.requires_grad_() if r > 0 else inp)
                if r == P - 1:
                    out = loss_fn(out, ys[i]) / m  # mean over micro-batches
                    total_loss += out.item()
                end = clock.finish(start, forward_s)
                if r < P - 1:
                    pending += _send(out, r + 1, ready=end)  # the output exists only now
                log.tasks.append(Task(r, FORWARD, i, 0, start, end))
                log.activation_bytes.append(saved.live_bytes - before)
                inputs[i], outputs[i] = inp, out
                log.peak_in_flight = max(log.peak_in_flight, len(outputs))
            else:
                grad, ready = (None, None) if r == P - 1 else _recv(r + 1)
                start = clock.start(ready)
                torch.autograd.backward(outputs.pop(i), grad)  # frees this micro-batch's graph
                end = clock.finish(start, backward_s)
                inp = inputs.pop(i)
                if r > 0:
                    pending += _send(inp.grad, r - 1, ready=end)
                log.tasks.append(Task(r, BACKWARD, i, 0, start, end))
        log.peak_activation_bytes = saved.peak_bytes
    for work in pending:
        if isinstance(work, dist.Work):
            work.wait()
    if optimizer is not None:
        optimizer.step()
    log.loss = total_loss if r == P - 1 else None
    log.lateness = clock.lateness
    log.grads = [
        p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        for p in stage.parameters()
    ]
    return log


# --- 4. cutting a model into stages: dynamic programming over layers and machines ----------


@dataclass(frozen=True)
class Stage:
    """Layers first..last (inclusive, 0-based) replicated on `machines` machines."""

    first: int
    last: int
    machines: int


@dataclass(frozen=True)
class Partition:
    """A cut of the layers into consecutive stages, and the time of its slowest part."""

    time: float
    stages: tuple[Stage, ...]

    @property
    def noam(self) -> int:
        """NUM_OPT_ACTIVE_MINIBATCHES: micro-batches to admit at once to keep every machine
        busy in the steady state, ceil(machines / machines of the input stage)."""
        return math.ceil(sum(s.machines for s in self.stages) / self.stages[0].machines)


def stage_time(
    layer_times: Sequence[float], sync_times: Sequence[float], first: int, last: int, machines: int
) -> float:
    """T(first -> last, m): the stage's compute split over m replicas, or its weight
    synchronisation if that is slower (the two overlap): max(sum T_l, sum W_l) / m."""
    compute = sum(layer_times[first : last + 1])
    sync = sum(sync_times[first : last + 1]) if machines > 1 else 0.0
    return max(compute, sync) / machines


def sync_times(weight_sizes: Sequence[float] | None, n: int, bandwidth: float) -> list[float]:
    # Ring all-reduce of a layer's weights among replicas: about 2 * size / bandwidth.
    sizes = weight_sizes if weight_sizes is not None else [0.0] * n
    if len(sizes) != n:
        raise ValueError(f"weight_sizes has {len(sizes)} entries for {n} layers")
    return [2.0 * w / bandwidth for w in sizes]


def link_times(activation_sizes: Sequence[float], bandwidth: float) -> list[float]:
    # The link after layer i carries its activations forward and their gradients back.
    return [pp_boundary_bytes(a) / bandwidth for a in activation_sizes]


def check_partition_input(layer_times, activation_sizes, n_machines, bandwidth) -> None:
    if not layer_times or len(layer_times) != len(activation_sizes):
        raise ValueError(
            f"need one time and one activation size per layer: got {len(layer_times)} "
            f"times and {len(activation_sizes)} sizes"
        )
    if isinstance(n_machines, bool) or not isinstance(n_machines, int) or n_machines < 1:
        raise ValueError(f"n_machines must be a whole number >= 1, got {n_machines!r}")
    if bandwidth <= 0:
        raise ValueError(f"bandwidth must be > 0, got {bandwidth}")


def optimal_partition(
    layer_times: Sequence[float],
    activation_sizes: Sequence[float],
    n_machines: int,
    bandwidth: float = 1.0,
    weight_sizes: Sequence[float] | None = None,
    replicate: bool = True,
) -> Partition:
    """The cut of layers into stages on exactly `n_machines` that minimises the slowest part
    of the pipeline: a stage, or the link after layer i (2 a_i / bandwidth: activations
    forward, gradients back). PipeDream's recurrence, O(N^2 M^2):

        A(j, m) = min( T(0 -> j, m),
                       min over i < j, 1 <= m' < m of max(A(i, m - m'), 2 C_i, T(i+1 -> j, m')) )

    `replicate=False`: one machine per stage (m' = 1), so at most `n_machines` stages.
    """
    check_partition_input(layer_times, activation_sizes, n_machines, bandwidth)
    n = len(layer_times)
    sync = sync_times(weight_sizes, n, bandwidth)
    comm = link_times(activation_sizes, bandwidth)
    # best[j][k]: (A(j, k), the stages achieving it) for layers 0..j on k machines
    best: list[list[tuple[float, tuple[Stage, ...]]]] = [
        [None] * (n_machines + 1) for _ in range(n)
    ]
    for j in range(n):
        for k in range(1, n_machines + 1):
            k_first = k if replicate else 1
            choice = (stage_time(layer_times, sync, 0, j, k_first), (Stage(0, j, k_first),))
            for i in range(j):
                for k_last in range(1, k if replicate else min(k, 2)):
                    before, stages = best[i][k - k_last]
                    last = stage_time(layer_times, sync, i + 1, j, k_last)
                    slowest = max(before, comm[i], last)
                    if slowest < choice[0]:
                        choice = (slowest, (*stages, Stage(i + 1, j, k_last)))
            best[j][k] = choice
    time_, stages = best[n - 1][n_machines]
    return Partition(time_, stages)


def partition_stages(layers: Sequence[nn.Module], partition: Partition) -> list[nn.Sequential]:
    """The modules of each stage of `partition`, to run with `pipeline_step`."""
    return [nn.Sequential(*layers[s.first : s.last + 1]) for s in partition.stages]
