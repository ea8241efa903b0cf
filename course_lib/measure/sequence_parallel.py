"""What lecture 11 measures: attention's peak memory per rank against the sequence length, the
bytes ring attention and Ulysses send, and the causal work each rank does.

Every function with a rank in its docstring runs inside `launch`; the plots run in the
notebook. Numbers are measured (`PeakMemory`, `CommCounter`, the scores ring attention
computed); the formulas they are held against are in `course_lib.costs`. The checks of the
lecture's exercises (`check_rescale`, `check_merge`, `check_memory_saving`,
`check_busiest_over_idlest`, `check_fewer_bytes_with_one_kv_head`, `check_ring_bytes_per_rank`)
compute their expected values and say why here, out of the notebook's sight.
"""

from __future__ import annotations

import itertools
import math

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
from matplotlib.ticker import NullFormatter

from course_lib import models
from course_lib.comm import CommCounter, WireCounter
from course_lib.costs import ring_attention_bytes
from course_lib.exercises import check_choice, check_function, check_number
from course_lib.memory import PeakMemory, SavedTensors
from course_lib.runtime import rank, world_size
from course_lib.sequence_parallel import (
    SequenceParallelBlock,
    attention,
    merge_block,
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


def plot_peak_bytes(seq_lens, one_process, per_rank: dict[str, list[int]], p: int):
    """Peak bytes against sequence length: one process, and the busiest rank of each method."""
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.loglog(seq_lens, one_process, "o-", color="black", label="one process, whole sequence")
    for name, peaks in per_rank.items():
        ax.loglog(seq_lens, peaks, "o-", label=f"{name}, busiest of {p} ranks")
    ax.set_xticks(seq_lens, [str(n) for n in seq_lens])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("sequence length N (tokens)")
    ax.set_ylabel("peak bytes during attention")
    ax.set_title("Attention's memory: N x N scores, or pieces of them")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    return fig


def plot_causal_work(per_layout: dict[str, list[list[int]]]):
    """Scores computed by each rank at each hop of the ring, one grid per layout
    (`per_layout[layout][rank][hop]`), with each rank's total under its column."""
    fig, axes = plt.subplots(1, len(per_layout), figsize=(3.4 * len(per_layout), 3.6))
    top = max(max(max(hops) for hops in work) for work in per_layout.values())
    for ax, (layout, work) in zip(axes, per_layout.items(), strict=True):
        grid = torch.tensor(work).T  # [hop, rank]
        ax.imshow(grid, cmap="Blues", vmin=0, vmax=top, aspect="auto")
        for hop, r in itertools.product(*map(range, grid.shape)):
            n = int(grid[hop, r])
            shade = "white" if n > top / 2 else "black"  # readable on dark and light cells
            ax.text(r, hop, str(n), ha="center", va="center", fontsize=8, color=shade)
        totals = [f"rank {r}\n{sum(hops)}" for r, hops in enumerate(work)]
        ax.set_xticks(range(len(work)), totals)
        ax.set_yticks(range(grid.shape[0]))
        ax.set_ylabel("hop")
        ax.set_title(f"{layout}: scores per hop")
    fig.suptitle("Causal ring attention: who works at each hop (totals under the ranks)")
    fig.tight_layout()
    return fig


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


# --- the lecture's coded task: the online softmax's merge ------------------------------------


def _joined(merge):
    """`merge(state, scores, v)` with its (max, sum, output) joined into one tensor along the
    last dimension, for `check_function`; None (unanswered) passes through."""

    def joined(state, scores, v):
        out = merge(tuple(t.clone() for t in state), scores, v)
        if out is None or out is ...:
            return out
        if not (isinstance(out, tuple | list) and len(out) == 3):
            raise ValueError("return the three tensors (row_max, row_sum, acc) as a tuple")
        return torch.cat([torch.as_tensor(t, dtype=torch.float64) for t in out], dim=-1)

    return joined


SHAPES = ((3, 4), (4, 2), (3, 4))  # scores of 3 queries x 4 keys, values of width 2


def merge_cases() -> dict[str, tuple]:
    """States and blocks that test a merge: the first block (max -inf), a block that raises
    the max of every query, one that raises no max, and a causal block with masked scores."""
    g = torch.Generator().manual_seed(0)
    scores, v, earlier = (torch.randn(n, generator=g, dtype=torch.float64) for n in SHAPES)
    empty = (torch.full((3, 1), float("-inf")), torch.zeros(3, 1), torch.zeros(3, 2))
    empty = tuple(t.double() for t in empty)  # before any block: max -inf, nothing summed
    seen = merge_block(empty, earlier, v.flip(0))
    masked = scores.masked_fill(torch.ones(3, 4).triu(1).bool(), float("-inf"))
    return {
        "the first block": (empty, scores, v),
        "a block with larger scores": (seen, scores + 4, v),
        "a block with smaller scores": (seen, scores - 4, v),
        "a causal block (some scores -inf)": (seen, masked, v),
    }


def check_rescale(rescale: object) -> bool | None:
    """The factor a running sum is multiplied by when a query's maximum rises from 3 to 5."""
    return check_number(
        rescale,
        math.exp(3.0 - 5.0),
        rtol=1e-3,
        hint="Each term was exp(score - 3); it must become exp(score - 5).",
    )


def check_merge(candidate) -> bool | None:
    """Lecture 11's task: the student's merge(state, scores, v) against `merge_block`, on
    `merge_cases`; the three parts of the state are compared as one tensor."""
    hint = (
        "Per query: the new max is the larger of the old one and the block's largest score; "
        "what was kept is rescaled by exp(old max - new max), then the block's "
        "exp(scores - new max) is added (summed over the keys, or times v)."
    )
    answer = candidate if candidate is ... else _joined(candidate)
    return check_function(answer, _joined(merge_block), merge_cases(), hint=hint)


def check_ring_bytes_per_rank(ring_bytes_per_rank: object) -> bool | None:
    """Bytes one rank sends per attention pass: ring attention, P = 8, N = 32k, h = 4096, 16-bit."""
    return check_number(
        ring_bytes_per_rank,
        ring_attention_bytes(2 * 32 * 1024 * 4096 * 2, 8),
        hint=(
            "K and V of the whole sequence: 2Nh values of 2 bytes; the ring passes (P-1)/P of them."
        ),
    )


SAVINGS = ("2x", "4x", "16x")
IMBALANCES = ("1x", "2x", "4x", "8x")


def _nearest(ratio: float, options: tuple[str, ...]) -> str:
    """The option ("4x") whose factor is nearest to `ratio`, relatively."""
    return min(options, key=lambda option: abs(ratio / int(option[:-1]) - 1))


def check_memory_saving(
    ring_saving: object, ulysses_saving: object, one_process: list[int], busiest: dict
) -> tuple[bool | None, bool | None]:
    """Lecture 11's memory prediction: how many times less than one process the busiest rank
    holds at its peak, at the longest sequence measured (`one_process` and `busiest[method]`
    are peak bytes per length), each answer against the option nearest to the run."""
    ring = check_choice(
        ring_saving,
        _nearest(one_process[-1] / busiest["ring"][-1], SAVINGS),
        SAVINGS,
        why="A ring rank holds (N/P) x (N/P) scores per head: towards P^2 = 16 as N grows.",
    )
    ulysses = check_choice(
        ulysses_saving,
        _nearest(one_process[-1] / busiest["ulysses"][-1], SAVINGS),
        SAVINGS,
        why="Ulysses holds N x N scores, for H/P heads: P times less, however long the sequence.",
    )
    return ring, ulysses


def check_fewer_bytes_with_one_kv_head(answer: object, sent: dict) -> bool | None:
    """Lecture 11's GQA prediction: which method sent fewer bytes with a single K/V head
    (`sent[method]`: bytes per number of K/V heads, the last one 1)."""
    fewer = min(METHODS, key=lambda m: sent[m][-1])
    return check_choice(
        answer,
        fewer,
        tuple(METHODS),
        why="The ring moves only K and V, which shrink with the K/V heads; Ulysses moves q and "
        "the output whole, and every rank needs at least one K/V head.",
    )


def check_busiest_over_idlest(busiest_over_idlest: object, work: dict) -> bool | None:
    """Lecture 11's causal prediction: on contiguous shards, how many times more scores the
    busiest rank computed than the least busy (`work[layout][rank]`: scores per hop)."""
    contiguous = [sum(hops) for hops in work["contiguous"]]
    return check_choice(
        busiest_over_idlest,
        f"{max(contiguous) // min(contiguous)}x",
        IMBALANCES,
        why="Rank r meets r+1 blocks it needs, so the last rank waits on nothing and the first "
        "idles.",
    )
