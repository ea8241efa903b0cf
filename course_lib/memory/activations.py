"""Activations: what autograd saves for backward (`SavedTensors`, `saved_by_forward`), the
attention scores' share of it, and everything a block allocates, its high-water mark
(`PeakMemory`; `CastMemory`, the 16-bit weights autocast makes)."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from course_lib.costs import activation_memory
from course_lib.memory.counting import storage_key
from course_lib.models import GPTConfig


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
        self._excluded = {storage_key(t) for t in self.exclude}
        self._holders: dict[tuple[int, str], int] = {}  # storage -> saved tensors using it
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def __enter__(self) -> SavedTensors:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)

    def _pack(self, t: torch.Tensor) -> object:
        key = storage_key(t)
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
        key, nbytes = storage_key(t), t.untyped_storage().nbytes()
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
        self._sources = {storage_key(t) for t in sources}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and storage_key(args[0]) in self._sources:
            self._hold(out)
        return out
