"""What training keeps in memory: counted tensor by tensor (lecture 6).

    breakdown = training_memory(model, optimizer)        # weights, gradients, optimizer state
    print(breakdown.table(BYTES_PER_PARAMETER))          # measured bytes/parameter vs formula
    trainer = MixedPrecisionAdamW(model, lr=1e-3)        # bf16 compute, fp32 master + AdamW
    with SavedTensors(exclude=model.parameters()) as saved:
        loss = loss_fn(model(x), y)                      # saved.live_bytes: activations
        loss.backward()                                  # saved.peak_bytes: the high-water mark
    run = measure_chain(chain(36, 64), x, k=6)           # activation checkpointing, k segments
    with CastMemory(model.parameters()) as casts: ...    # the 16-bit weights autocast makes

Bytes are the real bytes of tensor storages, each storage counted once (a view shares its
base's storage), so a number here is what the allocator had to provide, not a formula.
"""

from __future__ import annotations

import math
import statistics
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import checkpoint

from course_lib.costs import BYTES_PER_PARAMETER, activation_memory
from course_lib.models import GPTConfig

GB = 1e9  # memory budgets are quoted in decimal gigabytes, as GPU data sheets do (80 GB)

# --- counting bytes ------------------------------------------------------------------------


def _storage_key(t: torch.Tensor) -> tuple[int, str]:
    storage = t.untyped_storage()
    return storage.data_ptr(), str(storage.device)


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the storages behind `tensors`, each storage counted once (views are free)."""
    seen: dict[tuple[int, str], int] = {}
    for t in tensors:
        seen[_storage_key(t)] = t.untyped_storage().nbytes()
    return sum(seen.values())


@dataclass(frozen=True)
class Row:
    """One category of training memory: its name, the dtypes of its tensors, its bytes."""

    category: str
    dtype: str
    bytes: int


@dataclass
class MemoryBreakdown:
    """Bytes per category of what training keeps, for a model of `n_params` parameters."""

    rows: list[Row]
    n_params: int

    @property
    def total(self) -> int:
        return sum(row.bytes for row in self.rows)

    def bytes_of(self, category: str) -> int:
        """Bytes of one category (0 if training holds none of it)."""
        return sum(row.bytes for row in self.rows if row.category == category)

    def per_parameter(self) -> dict[str, float]:
        """Bytes per parameter of each category."""
        return {row.category: row.bytes / self.n_params for row in self.rows}

    def table(self, formula: Mapping[str, float] | None = None) -> str:
        """A text table: bytes and bytes/parameter per category, next to `formula`'s."""
        header = f"{'category':<24}{'dtype':<18}{'bytes':>12}{'bytes/param':>13}"
        lines = [header + ("" if formula is None else f"{'formula':>9}")]
        for row in self.rows:
            line = f"{row.category:<24}{row.dtype:<18}{row.bytes:>12,}"
            line += f"{row.bytes / self.n_params:>13.3f}"
            if formula is not None:
                line += f"{formula.get(row.category, 0):>9}"
            lines.append(line)
        total = f"{'total':<42}{self.total:>12,}{self.total / self.n_params:>13.3f}"
        if formula is not None:
            total += f"{sum(formula.values()):>9}"
        return "\n".join([*lines, total, f"({self.n_params:,} parameters)"])

    def __str__(self) -> str:
        return self.table()


def training_memory(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> MemoryBreakdown:
    """Count the bytes of `model`'s weights and gradients and of `optimizer`'s parameters,
    gradients and state. A storage already counted in an earlier category is not counted
    again, so an optimizer stepping the model's own parameters adds no "master weights"."""
    seen: set[tuple[int, str]] = set()
    rows: list[Row] = []

    def add(category: str, tensors: Iterable[torch.Tensor]) -> None:
        fresh: dict[tuple[int, str], torch.Tensor] = {}
        for t in tensors:
            key = _storage_key(t)
            if key not in seen:
                fresh[key] = t
        if fresh:
            seen.update(fresh)
            dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in fresh.values()})
            nbytes = storage_bytes(fresh.values())
            rows.append(Row(category, "/".join(dtypes), nbytes))

    params = list(model.parameters())
    add("weights", params)
    add("gradients", [p.grad for p in params if p.grad is not None])
    if optimizer is not None:
        stepped = [p for group in optimizer.param_groups for p in group["params"]]
        add("master weights", stepped)
        add("master gradients", [p.grad for p in stepped if p.grad is not None])
        names = sorted({name for state in optimizer.state.values() for name in state})
        for name in names:
            values = [s[name] for s in optimizer.state.values() if name in s]
            add(f"optimizer: {name}", [v for v in values if isinstance(v, torch.Tensor)])
    return MemoryBreakdown(rows, sum(p.numel() for p in params))


# --- the mixed-precision recipe ------------------------------------------------------------


class MixedPrecisionAdamW:
    """AdamW on an fp32 master copy of a model that computes in bf16.

    The model is cast to bf16 in place (forward, backward and its gradients are bf16); the
    optimizer owns fp32 copies of the parameters. `step()` copies the gradients up to fp32,
    steps the master copy, frees the fp32 gradients and copies the weights back down.
    """

    def __init__(self, model: nn.Module, **adamw_kwargs: float) -> None:
        self.master = [nn.Parameter(p.detach().float().clone()) for p in model.parameters()]
        self.model = model.to(torch.bfloat16)
        self.optimizer = torch.optim.AdamW(self.master, **adamw_kwargs)

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)

    @torch.no_grad()
    def step(self) -> None:
        for master, p in zip(self.master, self.model.parameters(), strict=True):
            master.grad = None if p.grad is None else p.grad.float()
        self.optimizer.step()
        for master, p in zip(self.master, self.model.parameters(), strict=True):
            # The fp32 gradients lived only for this step: at rest they cost nothing.
            master.grad = None
            p.copy_(master)  # rounds to bf16; the master keeps the bits bf16 would lose


def budget(
    n_params: float, bytes_per_parameter: Mapping[str, float] = BYTES_PER_PARAMETER
) -> dict[str, float]:
    """Bytes per category for a model of `n_params` parameters, by the formula."""
    return {category: b * n_params for category, b in bytes_per_parameter.items()}


def budget_table(models: Mapping[str, float], gpu_bytes: float = 80 * GB) -> str:
    """The formula's memory for each named model size, and how many GPUs of `gpu_bytes` it
    needs just to hold weights, gradients and optimizer state (activations come on top)."""
    width = 12
    lines = [f"{'category':<24}" + "".join(f"{name:>{width}}" for name in models)]
    budgets = {name: budget(n) for name, n in models.items()}
    for category in BYTES_PER_PARAMETER:
        cells = "".join(f"{b[category] / GB:>{width - 3},.0f} GB" for b in budgets.values())
        lines.append(f"{category:<24}{cells}")
    totals = {name: sum(b.values()) for name, b in budgets.items()}
    lines.append(
        f"{'total':<24}" + "".join(f"{t / GB:>{width - 3},.0f} GB" for t in totals.values())
    )
    gpus = "".join(f"{math.ceil(t / gpu_bytes):>{width}}" for t in totals.values())
    lines.append(f"{f'GPUs of {gpu_bytes / GB:.0f} GB, at least':<24}{gpus}")
    return "\n".join(lines)


# --- activations: what autograd saves for backward -----------------------------------------


@dataclass(frozen=True)
class SavedRecord:
    """One storage autograd saved: the shape and dtype of the first tensor saved in it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int


class _Packed:
    """What autograd keeps instead of a saved tensor: when autograd drops it, we know."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


@dataclass
class SavedTensors:
    """Context manager counting the bytes of tensors autograd saves for backward.

    `live_bytes` is what is held now (after a forward pass: the activation memory), and
    `peak_bytes` the most held at once; tensors freed during backward leave `live_bytes`.
    Storages of `exclude` (pass the model's parameters: weights are not activations) are not
    counted. Run backward inside the block: recomputation (checkpointing) saves tensors too.
    """

    exclude: Iterable[torch.Tensor] = ()
    live_bytes: int = 0
    peak_bytes: int = 0
    records: list[SavedRecord] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._excluded = {_storage_key(t) for t in self.exclude}
        self._holders: dict[tuple[int, str], int] = {}  # storage -> saved tensors using it
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def __enter__(self) -> SavedTensors:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)

    def _pack(self, t: torch.Tensor) -> object:
        key = _storage_key(t)
        if key in self._excluded:
            return t
        nbytes = t.untyped_storage().nbytes()
        if self._holders.get(key, 0) == 0:  # a storage counts once, however many save it
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            self.records.append(SavedRecord(tuple(t.shape), t.dtype, nbytes))
        self._holders[key] = self._holders.get(key, 0) + 1
        # Detached: a saved output holding its own grad_fn would be a cycle through C++ that no
        # garbage collector sees, keeping a graph that is never backwarded alive for good.
        packed = _Packed(t.detach())
        weakref.finalize(packed, self._release, key, nbytes)
        return packed

    def _release(self, key: tuple[int, str], nbytes: int) -> None:
        self._holders[key] -= 1
        if self._holders[key] == 0:
            del self._holders[key]
            self.live_bytes -= nbytes

    @staticmethod
    def _unpack(packed: object) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Packed) else packed


@dataclass(frozen=True)
class SavedSnapshot:
    """What a `SavedTensors` held at one moment: live and peak bytes, and the records."""

    live_bytes: int
    peak_bytes: int
    records: tuple[SavedRecord, ...]


def saved_by_forward(
    model: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> SavedSnapshot:
    """Forward `inputs` and the loss under `SavedTensors`; its counts while the graph is alive,
    whose `live_bytes` are the activations the backward pass would need. The graph is dropped
    afterwards, and with it the saved tensors."""
    with SavedTensors(exclude=model.parameters()) as saved:
        loss = loss_fn(model(inputs), targets)
    snapshot = SavedSnapshot(saved.live_bytes, saved.peak_bytes, tuple(saved.records))
    del loss
    return snapshot


def square_bytes(saved: SavedTensors | SavedSnapshot, seq: int) -> int:
    """Bytes of saved storages whose tensors end in (seq, seq): attention probabilities and
    causal masks. Pick `seq` unlike the model's other sizes, or other tensors match too."""
    return sum(r.nbytes for r in saved.records if r.shape[-2:] == (seq, seq))


def attention_square_bytes(config: GPTConfig, batch: int, seq: int, element_size: int = 4) -> int:
    """Formula for TinyGPT's seq x seq saved bytes: per block, softmax keeps its output
    (batch x heads x seq x seq) and masked_fill keeps its boolean mask (seq x seq)."""
    per_block = batch * config.n_heads * seq * seq * element_size + seq * seq
    return config.n_layers * per_block


def attention_share(config: GPTConfig, batch: int, seq: int) -> float:
    """Share of the attention scores' as^2b terms in Korthikanti's bytes per layer,
    sbh(34 + 5as/h) (`costs.activation_memory`), for a TinyGPT configuration's h and a: what
    the formula predicts for the seq x seq part that `square_bytes` measures."""
    h, a = config.d_model, config.n_heads
    linear = activation_memory(seq, batch, h, a, recompute_attention=True)
    return 1 - linear / activation_memory(seq, batch, h, a)


# --- everything a block allocates: the high-water mark -------------------------------------


class PeakMemory(TorchDispatchMode):
    """Context manager counting the bytes of every tensor storage created inside the block,
    live (`live_bytes`) and at their most (`peak_bytes`): on the CPU, where torch keeps no
    `max_memory_allocated`, the high-water mark of what the block's own operations allocated.
    Each storage counts once however many views of it exist, and leaves the count when the
    last tensor seen using it is freed. Tensors made before the block are not counted."""

    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._holders: dict[tuple[int, str], int] = {}
        self._known: set[int] = set()  # ids of the live tensors counted

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            # An in-place op returns its input: counted already, or made before the block.
            if isinstance(t, torch.Tensor) and id(t) not in self._known and id(t) not in inputs:
                self._hold(t)
        return out

    def _hold(self, t: torch.Tensor) -> None:
        self._known.add(id(t))
        key, nbytes = _storage_key(t), t.untyped_storage().nbytes()
        if self._holders.get(key, 0) == 0:
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self._holders[key] = self._holders.get(key, 0) + 1
        weakref.finalize(t, self._release, key, nbytes, id(t))

    def _release(self, key: tuple[int, str], nbytes: int, tensor_id: int) -> None:
        self._known.discard(tensor_id)
        self._holders[key] -= 1
        if self._holders[key] == 0:
            del self._holders[key]
            self.live_bytes -= nbytes


class CastMemory(PeakMemory):
    """`PeakMemory` of only the copies of `sources` made in another dtype inside the block:
    the bf16 (or fp16) weights autocast casts from the fp32 parameters, live while autocast
    caches them or autograd keeps them for backward."""

    def __init__(self, sources: Iterable[torch.Tensor]) -> None:
        super().__init__()
        self._sources = {_storage_key(t) for t in sources}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and _storage_key(args[0]) in self._sources:
            self._hold(out)
        return out


# --- activation checkpointing ---------------------------------------------------------------


def chain(n_layers: int, width: int, seed: int = 0) -> nn.Sequential:
    """`n_layers` identical layers Linear(width, width) + ReLU: each saves one activation of
    batch x width values for backward (ReLU's output is the next Linear's input)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(
            *(nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(n_layers))
        )


def segments(layers: nn.Sequential, k: int) -> list[nn.Sequential]:
    """Cut `layers` into `k` contiguous segments of near-equal length."""
    n = len(layers)
    if not 1 <= k <= n:
        raise ValueError(f"cannot cut {n} layers into {k} segments; use 1 <= k <= {n}")
    bounds = [round(i * n / k) for i in range(k + 1)]
    return [layers[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def checkpointed_forward(layers: nn.Sequential, x: torch.Tensor, k: int | None) -> torch.Tensor:
    """Forward through `layers`; with `k` segments, keep only each segment's input and
    recompute the segment's activations during backward (k=None: plain forward)."""
    if k is None:
        return layers(x)
    for segment in segments(layers, k):
        # Reentrant checkpointing recomputes under our saved-tensor hooks, so SavedTensors
        # sees the recomputed activations; the non-reentrant mode hides them in its own hooks.
        x = checkpoint(segment, x, use_reentrant=True)
    return x


@dataclass
class ChainRun:
    """One forward and backward of a chain: saved bytes after forward, peak, gradients."""

    forward_bytes: int
    peak_bytes: int
    grads: list[torch.Tensor]


def _chain_loss(layers: nn.Sequential, x: torch.Tensor, k: int | None) -> torch.Tensor:
    return checkpointed_forward(layers, x, k).square().mean()


def measure_chain(layers: nn.Sequential, x: torch.Tensor, k: int | None = None) -> ChainRun:
    """Forward and backward through `layers` with `k` checkpointed segments (None: none),
    counting saved bytes live after forward and at the peak over forward and backward."""
    layers.zero_grad(set_to_none=True)
    # Reentrant checkpointing needs an input that requires grad, or no gradient flows back.
    x = x.detach().requires_grad_(True)
    with SavedTensors(exclude=layers.parameters()) as saved:
        loss = _chain_loss(layers, x, k)
        forward_bytes = saved.live_bytes
        loss.backward()
    grads = [p.grad.clone() for p in layers.parameters()] + [x.grad.clone()]
    return ChainRun(forward_bytes, saved.peak_bytes, grads)


def time_chain(
    layers: nn.Sequential, x: torch.Tensor, ks: Sequence[int | None], rounds: int = 7
) -> dict[int | None, float]:
    """Median seconds of one forward and backward for each number of segments in `ks`
    (None: no checkpointing). The runs take turns, so a busy moment slows all of them."""
    x = x.detach().requires_grad_(True)
    times: dict[int | None, list[float]] = {k: [] for k in ks}
    for _ in range(rounds):
        for k in ks:
            layers.zero_grad(set_to_none=True)
            start = time.perf_counter()
            _chain_loss(layers, x, k).backward()
            times[k].append(time.perf_counter() - start)
    return {k: statistics.median(t) for k, t in times.items()}


def time_forward(layers: nn.Sequential, x: torch.Tensor, rounds: int = 7) -> float:
    """Median seconds of one plain forward (with autograd recording, as in training)."""
    x = x.detach().requires_grad_(True)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        _chain_loss(layers, x, None)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def checkpoint_units(n_layers: int, k: int) -> float:
    """The formula n/k + k: peak activations, in one layer's activations, with k segments
    (the k segment inputs kept through forward, plus one segment recomputed in backward)."""
    return n_layers / k + k


def divisors(n: int) -> list[int]:
    """The k that cut n layers into equal segments."""
    return [k for k in range(1, n + 1) if n % k == 0]
