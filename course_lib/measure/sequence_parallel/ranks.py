"""What lecture 11 runs on its ranks: ring attention and Ulysses against one process, their
peak memory, the bytes they send (with grouped-query attention too), the causal work per hop,
torch's own context parallelism, and tensor parallelism with and without sequence parallelism.

Every function here runs on each rank inside `launch`, except `qkv` and `peak_bytes` with
"one process".
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib import models
from course_lib.comm import CommCounter, WireCounter
from course_lib.memory import PeakMemory, SavedTensors
from course_lib.runtime import rank, world_size
from course_lib.sequence_parallel import (
    SequenceParallelBlock,
    attention,
    ring_attention,
    sequence_positions,
    ulysses_attention,
)
from course_lib.tensor_parallel import ParallelBlock

METHODS = {"ring": ring_attention, "ulysses": ulysses_attention}


def qkv(seq_len: int, heads: int = 4, head_dim: int = 16, batch: int = 1, seed: int = 0):
    """The same q, k, v ([batch, heads, seq_len, head_dim], float64) on every rank."""
    g = torch.Generator().manual_seed(seed)
    shape = (batch, heads, seq_len, head_dim)
    return [torch.randn(shape, dtype=torch.float64, generator=g) for _ in range(3)]


def run_on_my_shard(method: str, seq_len: int, causal: bool = False, layout="contiguous", **kw):
    """On each rank: `method` ("ring" or "ulysses") on this rank's tokens of `qkv(seq_len)`;
    returns (this rank's output, the whole-sequence attention's rows for the same tokens)."""
    q, k, v = qkv(seq_len)
    mine = sequence_positions(seq_len, rank(), world_size(), layout)
    shard = [t[..., mine, :] for t in (q, k, v)]
    if method == "ring":
        out = ring_attention(*shard, mine, causal, **kw)
    else:
        out = ulysses_attention(*shard, causal)
    return out, attention(q, k, v, causal)[..., mine, :]


def largest_error(method: str, seq_len: int, causal: bool, layout: str = "contiguous") -> float:
    """On each rank: the largest |difference| from attention on the whole sequence."""
    out, expected = run_on_my_shard(method, seq_len, causal, layout)
    return (out - expected).abs().max().item() if out.numel() else 0.0


def peak_bytes(method: str, seq_len: int) -> int:
    """On each rank (or alone, for method "one process"): the most bytes attention's forward
    pass held at once, counted by `PeakMemory` (the inputs, made before, not included)."""
    q, k, v = qkv(seq_len)
    if method == "one process":
        with torch.no_grad(), PeakMemory() as memory:
            attention(q, k, v)
        return memory.peak_bytes
    mine = sequence_positions(seq_len, rank(), world_size())
    shard = [t[..., mine, :].contiguous() for t in (q, k, v)]
    with torch.no_grad(), PeakMemory() as memory:
        if method == "ring":
            ring_attention(*shard, mine)
        else:
            ulysses_attention(*shard)
    return memory.peak_bytes


def sweep_peak_bytes(seq_lens: list[int]) -> dict[str, list[int]]:
    """On each rank: `peak_bytes` of ring attention and Ulysses for every length."""
    return {m: [peak_bytes(m, n) for n in seq_lens] for m in METHODS}


def bytes_sent(method: str, seq_len: int) -> int:
    """On each rank: bytes this rank sent for one attention pass (`CommCounter`)."""
    with CommCounter() as counter:
        run_on_my_shard(method, seq_len)
    return counter.bytes_sent


def sweep_gqa_bytes(seq_len: int, heads: int, kv_heads: list[int]) -> dict[str, list[int]]:
    """On each rank: bytes sent (`CommCounter`) for one attention pass of ring attention and
    Ulysses, `heads` query heads, for each number of K/V heads (grouped-query attention: K
    and V are the first `kv_heads` heads of `qkv`'s)."""
    q, k, v = qkv(seq_len, heads)
    mine = sequence_positions(seq_len, rank(), world_size())
    sent: dict[str, list[int]] = {m: [] for m in METHODS}
    for n in kv_heads:
        shard = [t[..., :n, mine, :] if t is not q else t[..., mine, :] for t in (q, k, v)]
        with CommCounter() as counter:
            ring_attention(*shard, mine)
        sent["ring"].append(counter.bytes_sent)
        with CommCounter() as counter:
            ulysses_attention(*shard)
        sent["ulysses"].append(counter.bytes_sent)
    return sent


def causal_work(seq_len: int, layout: str) -> list[int]:
    """On each rank: the scores (per batch and head) causal ring attention computed at each
    hop (hop 0: the rank's own block)."""
    work: list[int] = []
    run_on_my_shard("ring", seq_len, True, layout, work=work)
    return work


def torch_context_parallel(seq_len: int = 64, causal: bool = True) -> str:
    """On each rank: torch's own context parallelism (`context_parallel`, experimental: it
    shards q, k, v along the sequence and reroutes `scaled_dot_product_attention` to its ring
    attention) on `qkv(seq_len)`; the largest difference from one process, or the error torch
    raised, as a line of text."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    q, k, v = (t.float() for t in qkv(seq_len))
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    device = "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
    mesh = init_device_mesh(device, (world_size(),))
    shards = [t.clone().to(device) for t in (q, k, v)]
    try:
        with context_parallel(mesh, buffers=shards, buffer_seq_dims=[2, 2, 2]):
            out = torch.nn.functional.scaled_dot_product_attention(*shards, is_causal=causal)
    except Exception as error:  # report what torch says, on CPU it is not supported
        return f"{type(error).__name__}: {str(error).splitlines()[0]}"
    # Causal, torch balances the work with the zigzag ("head-tail") layout; this comparison
    # has only run where torch refuses (CPU), so check it on the first GPU run.
    layout = "zigzag" if causal else "contiguous"
    mine = expected[..., sequence_positions(seq_len, rank(), world_size(), layout), :]
    return f"largest |torch CP - one process| = {(out.cpu() - mine).abs().max().item():.1e}"


def tp_against_sp(seq_len: int = 64, d_model: int = 64) -> dict[str, dict]:
    """On each rank: one forward and backward of a transformer block under tensor parallelism
    (`ParallelBlock`, every token on every rank) and under tensor + sequence parallelism
    (`SequenceParallelBlock`, this rank's tokens), float64: the bytes each sent (`CommCounter`;
    for the built-in all-reduce, all-gather and reduce-scatter it counts by their ring model),
    the bytes the rank's process really wrote to its sockets meanwhile (`WireCounter`), the
    activation bytes saved for backward (`SavedTensors`), and the largest difference of the
    output from the dense block's."""
    cfg = models.GPTConfig(d_model=d_model, n_heads=4, d_ff=4 * d_model)
    torch.manual_seed(0)
    dense = models.Block(cfg, torch.float64)
    x = torch.randn(
        2, seq_len, d_model, dtype=torch.float64, generator=torch.Generator().manual_seed(1)
    )
    expected = dense(x)
    mine = torch.tensor_split(torch.arange(seq_len), world_size())[rank()]
    runs = {
        "TP": (ParallelBlock(dense), x, slice(None)),
        "TP + SP": (SequenceParallelBlock(dense), x[:, mine], mine),
    }
    out = {}
    for name, (block, inputs, rows) in runs.items():
        with CommCounter() as counter, WireCounter() as wire:
            with SavedTensors(exclude=block.parameters()) as saved:
                y = block(inputs)
            y.sum().backward()
        out[name] = {
            "bytes sent": counter.bytes_sent,
            "on the wire": wire.bytes_written,
            "activations saved": saved.peak_bytes,
            "largest error": (y - expected[:, rows]).abs().max().item(),
        }
    return out
