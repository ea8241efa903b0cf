"""Fewer bits per value: what a 16-bit cast does to a gradient, int8 quantization with one
scale per chunk, the all-reduce that sends only 8-bit payloads (how far it can be off, and its
bytes), and the DDP hooks that send bf16 and int8."""

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

from course_lib.costs import all_gather_bytes, all_reduce_bytes

LEVELS = 127  # int8 values -127..127: symmetric, so 0 is exact and no value is wasted
CHUNK = 256  # elements per scale: 4 scale bytes per 256 value bytes, a 1.6% overhead


# --- 16-bit casts: the same bytes, different ranges ---------------------------------------


def cast_error(tensor: torch.Tensor, dtype: torch.dtype) -> dict[str, float]:
    """What sending `tensor` in `dtype` does to it, measured on the round trip fp32 -> dtype ->
    fp32: the median and largest relative error of the entries that stay finite and nonzero,
    and the fractions of nonzero entries that overflow to inf or underflow to 0."""
    x = tensor.detach().reshape(-1).float()
    back = x.to(dtype).float()
    nonzero = x != 0
    kept = nonzero & back.isfinite() & (back != 0)
    relative = ((back - x).abs() / x.abs())[kept]
    n = max(int(nonzero.sum()), 1)
    return {
        "median": relative.median().item() if relative.numel() else math.nan,
        "max": relative.max().item() if relative.numel() else math.nan,
        "inf": (nonzero & back.isinf()).sum().item() / n,
        "zero": (nonzero & (back == 0)).sum().item() / n,
    }


# --- 8-bit quantization -------------------------------------------------------------------


@dataclass
class Quantized:
    """A tensor as int8 values (padded to whole chunks) and one fp32 scale per chunk."""

    values: torch.Tensor  # int8, numel a multiple of chunk_size
    scales: torch.Tensor  # float32, one per chunk: value * scale approximates the element
    shape: torch.Size
    chunk_size: int

    @property
    def nbytes(self) -> int:
        """Bytes to send this payload: 1 per value and 4 per scale."""
        return self.values.numel() + 4 * self.scales.numel()


def quantize(tensor: torch.Tensor, chunk_size: int | None = CHUNK) -> Quantized:
    """Round `tensor` to int8 with scale max|x| / 127 per chunk (None: one scale for all).

    Rounding to the nearest level errs by at most scale / 2 per element, and a chunk's scale
    follows its own largest element, so one outlier only coarsens its own chunk."""
    flat = tensor.detach().reshape(-1).float()
    n = flat.numel()
    chunk = max(n, 1) if chunk_size is None else chunk_size
    if chunk < 1:
        raise ValueError(f"chunk_size must be >= 1 or None, got {chunk_size}")
    if n % chunk:
        flat = F.pad(flat, (0, -n % chunk))  # zero padding never raises a chunk's max
    chunks = flat.view(-1, chunk)
    scales = chunks.abs().amax(dim=1) / LEVELS
    inverse = torch.where(scales > 0, 1 / scales, 0.0)  # an all-zero chunk gets q = 0
    # |x| * 127 / max|x| <= 127 (+ rounding), so the int8 values need no clamping
    values = (chunks * inverse[:, None]).round_().to(torch.int8)
    return Quantized(values.view(-1), scales, tensor.shape, chunk)


def dequantize(q: Quantized) -> torch.Tensor:
    """The fp32 tensor a `Quantized` payload stands for (values * scales, padding dropped)."""
    # int8 -> fp32 first, then scale in place: a mixed-dtype multiply is far slower on CPU
    chunks = q.values.view(-1, q.chunk_size).float().mul_(q.scales[:, None])
    return chunks.view(-1)[: math.prod(q.shape)].view(q.shape)


def error_bound(q: Quantized) -> torch.Tensor:
    """Per element, the most `dequantize(q)` may differ from the original: its scale / 2."""
    bound = (q.scales / 2).repeat_interleave(q.chunk_size)
    return bound[: math.prod(q.shape)].view(q.shape)


def _pack(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Rows of int8 values and fp32 scales as one uint8 tensor: one message, not two."""
    return torch.cat([values.view(torch.uint8), scales.contiguous().view(torch.uint8)], dim=-1)


def _unpack(packed: torch.Tensor, n_values: int) -> tuple[torch.Tensor, torch.Tensor]:
    values = packed[..., :n_values].view(torch.int8)
    scales = packed[..., n_values:].clone().view(torch.float32)  # a copy: aligned for the view
    return values, scales


def _dequantize_rows(values: torch.Tensor, scales: torch.Tensor, chunk: int) -> torch.Tensor:
    rows = values.shape[0]
    return values.view(rows, -1, chunk).float().mul_(scales.view(rows, -1, 1)).view(rows, -1)


def part_size(numel: int, world_size: int, chunk_size: int = CHUNK) -> int:
    """Elements in each rank's part of a quantized all-reduce: whole chunks, P parts."""
    return math.ceil(numel / (world_size * chunk_size)) * chunk_size


def quantized_all_reduce(tensor: torch.Tensor, chunk_size: int = CHUNK, group=None) -> torch.Tensor:
    """The sum of `tensor` over ranks, sending only int8 values and fp32 scales.

    A reduce-scatter then an all-gather, as in the ring all-reduce: every rank quantizes the
    P parts of its tensor and sends part j to rank j (`all_to_all_single`); rank j sums the
    P dequantized parts in fp32, quantizes the sum and all-gathers it. Each element is
    quantized twice; `quantized_sum_bound` says how far that can move it."""
    p = dist.get_world_size(group)
    flat = tensor.detach().reshape(-1).float()
    part = part_size(flat.numel(), p, chunk_size)
    scales_per_part = part // chunk_size
    # 1. reduce-scatter in 8 bits: row j of `send` is what rank j sums
    if flat.numel() < p * part:
        flat = F.pad(flat, (0, p * part - flat.numel()))
    q = quantize(flat, chunk_size)
    send = _pack(q.values.view(p, part), q.scales.view(p, scales_per_part))
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    values, scales = _unpack(received, part)
    my_sum = _dequantize_rows(values, scales, chunk_size).sum(dim=0)  # fp32 arithmetic
    # 2. all-gather the 8-bit sums
    q_sum = quantize(my_sum, chunk_size)
    mine = _pack(q_sum.values, q_sum.scales)
    gathered = torch.empty(p * mine.numel(), dtype=torch.uint8, device=mine.device)
    dist.all_gather_single(gathered, mine, group=group)
    values, scales = _unpack(gathered.view(p, -1), part)
    total = _dequantize_rows(values, scales, chunk_size).view(-1)[: tensor.numel()]
    return total.view(tensor.shape).to(tensor.dtype)


def quantized_sum_bound(tensors: Sequence[torch.Tensor], chunk_size: int = CHUNK) -> torch.Tensor:
    """Per element, how far `quantized_all_reduce` may be from the exact sum of `tensors`
    (one per rank), computed from the inputs alone.

    Phase 1 errs by at most E1 = sum over ranks of s_r / 2 (each rank's chunk scale s_r);
    phase 2 by s' / 2, where s' = max|sum + phase-1 error| / 127 <= (max|sum| + E1) / 127."""
    p = len(tensors)
    shape = tensors[0].shape
    flats = [t.detach().reshape(-1).float() for t in tensors]
    n = flats[0].numel()
    total = p * part_size(n, p, chunk_size)
    scales = torch.stack([quantize(F.pad(f, (0, total - n)), chunk_size).scales for f in flats])
    phase1 = scales.sum(dim=0) / 2  # per chunk
    exact = F.pad(torch.stack(flats).sum(dim=0), (0, total - n)).view(-1, chunk_size)
    phase2 = (exact.abs().amax(dim=1) + phase1) / LEVELS / 2
    return (phase1 + phase2).repeat_interleave(chunk_size)[:n].view(shape)


def quantized_bytes(numel: int, world_size: int, chunk_size: int = CHUNK) -> int:
    """Bytes one rank sends in `quantized_all_reduce`: (P-1) parts of int8 values and fp32
    scales in each phase, so 2 (P-1)/P N (1 + 4/chunk) for N elements (whole chunks)."""
    part = part_size(numel, world_size, chunk_size)
    # The all-to-all sends P-1 parts of int8 values and scales, the all-gather as many.
    return 2 * all_gather_bytes(part + 4 * part // chunk_size, world_size)


def fp32_all_reduce_bytes(numel: int, world_size: int) -> int:
    """Bytes one rank sends in a ring all-reduce of `numel` fp32 values: 2 (P-1)/P * 4N."""
    return all_reduce_bytes(4 * numel, world_size)


@dataclass
class QuantizeState:
    """State of `quantized_hook`: the chunk size of its scales."""

    chunk_size: int = CHUNK


def bf16_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's `bf16_compress_hook` (cast to bf16, all-reduce, cast back) under another name:
    DDP refuses that name unless it runs on NCCL, while gloo sums bf16 on the CPU as well."""
    return bf16_compress_hook(state, bucket)


def _done(tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(tensor)
    return future


def quantized_hook(
    state: QuantizeState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: average the bucket's gradients with `quantized_all_reduce`."""
    grads = bucket.buffer()
    grads.copy_(quantized_all_reduce(grads, state.chunk_size) / dist.get_world_size())
    return _done(grads)
