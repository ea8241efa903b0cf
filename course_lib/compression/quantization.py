"""Fewer bits per value: what a 16-bit cast does to a gradient, torch's own 8-bit quantization
with one scale per chunk (`int8_chunks`: torch's observer picks the scales, torch's
`quantize_per_channel` rounds), the DDP hooks that send bf16 and int8, and the bytes of two
8-bit all-reduces: the all-gather one `int8_hook` runs, and the two-phase one of Assignment 5
(by its formula only: building it is the assignment)."""

import math
from dataclasses import dataclass

import torch
import torch.ao.quantization.fx._decomposed  # noqa: F401  registers torch.ops.quantized_decomposed
import torch.distributed as dist
import torch.nn.functional as F
from torch.ao.quantization import PerChannelMinMaxObserver
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

from course_lib.costs import all_gather_bytes, all_reduce_bytes

LEVELS = 127  # int8 codes -127..127: symmetric, so 0 is exact and no code is wasted
CHUNK = 256  # elements per scale: 4 scale bytes per 256 code bytes, a 1.6% overhead
# torch's quantize and dequantize on plain int8 tensors, as PyTorch's export-based quantization
# lowers to them (torch.quantize_per_channel's qint8 tensors are deprecated from torch 2.13 on)
TORCH_INT8 = torch.ops.quantized_decomposed


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


# --- torch's 8-bit quantization, a scale per chunk -----------------------------------------


@dataclass
class Int8Chunks:
    """A tensor as torch's per-channel int8 quantization holds it, one channel per chunk: rows
    of int8 codes (zero padding to whole rows) and one fp32 scale per row (zero points 0)."""

    codes: torch.Tensor  # int8, (chunks, chunk_size)
    scales: torch.Tensor  # float32, (chunks,): code * scale approximates the element
    shape: torch.Size

    @property
    def nbytes(self) -> int:
        """Bytes to send this payload: 1 per code and 4 per scale."""
        return self.codes.numel() + 4 * self.scales.numel()

    def restored(self) -> torch.Tensor:
        """The fp32 tensor the codes stand for (torch's dequantize_per_channel), unpadded."""
        # zero points None: they are 0 (symmetric), and an int64 tensor of zeros would make
        # torch compute codes - 0 in int64, taking three times as long
        rows = TORCH_INT8.dequantize_per_channel(
            self.codes, self.scales, None, 0, -LEVELS, LEVELS, torch.int8
        )
        return rows.reshape(-1)[: math.prod(self.shape)].view(self.shape)

    def error_bound(self) -> torch.Tensor:
        """Per element, the most `restored()` may differ from the original: its scale / 2."""
        bound = (self.scales / 2).repeat_interleave(self.codes.shape[1])
        return bound[: math.prod(self.shape)].view(self.shape)


def int8_chunks(tensor: torch.Tensor, chunk_size: int | None = CHUNK) -> Int8Chunks:
    """torch's symmetric 8-bit quantization of `tensor`, one scale per chunk of `chunk_size`
    elements (None: one scale for all): torch's `PerChannelMinMaxObserver` picks each scale,
    max|x| / 127 (never below float32's eps, so an all-zero chunk divides by no zero), and
    torch's `quantize_per_channel` rounds every element to the nearest code."""
    flat = tensor.detach().reshape(-1).float()
    chunk = max(flat.numel(), 1) if chunk_size is None else chunk_size
    if chunk < 1:
        raise ValueError(f"chunk_size must be >= 1 or None, got {chunk_size}")
    rows = F.pad(flat, (0, -flat.numel() % chunk)).view(-1, chunk)  # zeros raise no max
    observer = PerChannelMinMaxObserver(
        ch_axis=0,
        dtype=torch.qint8,
        qscheme=torch.per_channel_symmetric,
        quant_min=-LEVELS,
        quant_max=LEVELS,
    )
    observer(rows)
    scales, zero_points = observer.calculate_qparams()
    codes = TORCH_INT8.quantize_per_channel(
        rows, scales, zero_points, 0, -LEVELS, LEVELS, torch.int8
    )
    return Int8Chunks(codes, scales.float(), tensor.shape)


# --- the bytes of two 8-bit all-reduces ------------------------------------------------------


def int8_allgather_bytes(numel: int, world_size: int, chunk_size: int = CHUNK) -> int:
    """Bytes one rank sends in `int8_hook`: all its codes (whole chunks) and fp32 scales to
    each of the P-1 others, (P-1) N (1 + 4/c): fewer than a fp32 ring's 2 (P-1)/P 4N only
    while P < 8."""
    chunks = math.ceil(numel / chunk_size)
    return all_gather_bytes(chunks * (chunk_size + 4), world_size)


def int8_two_phase_bytes(numel: int, world_size: int, chunk_size: int = CHUNK) -> int:
    """Bytes one rank sends in an 8-bit all-reduce built as a reduce-scatter then an all-gather
    (Assignment 5's design; a formula, nothing here runs it): in each phase P-1 parts of N/P
    codes (whole chunks) and their fp32 scales, so 2 (P-1)/P N (1 + 4/c) in all."""
    part = math.ceil(numel / (world_size * chunk_size)) * chunk_size
    return 2 * all_gather_bytes(part + 4 * part // chunk_size, world_size)


def fp32_all_reduce_bytes(numel: int, world_size: int) -> int:
    """Bytes one rank sends in a ring all-reduce of `numel` fp32 values: 2 (P-1)/P * 4N."""
    return all_reduce_bytes(4 * numel, world_size)


# --- the DDP hooks -------------------------------------------------------------------------


def bf16_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's `bf16_compress_hook` (cast to bf16, all-reduce, cast back) under another name:
    DDP refuses that name unless it runs on NCCL, while gloo sums bf16 on the CPU as well."""
    return bf16_compress_hook(state, bucket)


def _done(tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(tensor)
    return future


@dataclass
class QuantizeState:
    """State of `int8_hook`: the chunk size of its scales."""

    chunk_size: int = CHUNK


def int8_hook(state: QuantizeState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the mean of the bucket over the ranks, sending 8-bit codes, by the design
    of torch's `quantization_perchannel_hook`: every rank quantizes its whole bucket, all-gathers
    the scales, then the codes, and dequantizes and sums all P payloads in fp32 (torch's hook
    sends uint8 codes with a zero point per chunk; symmetric int8 codes need none).

    torch's own hook fails on gloo (torch 2.13): it reads each all-gather's future as NCCL
    fills it, a list of lists, where gloo gives the flat list. Hence this synchronous copy of
    its algorithm, on `int8_chunks`; every rank sums the same payloads in the same order, so
    the mean is the same on every rank, bit for bit."""
    grads = bucket.buffer()
    mine = int8_chunks(grads, state.chunk_size)
    p = dist.get_world_size()
    scales = [torch.empty_like(mine.scales) for _ in range(p)]
    dist.all_gather(scales, mine.scales)
    codes = [torch.empty_like(mine.codes) for _ in range(p)]
    dist.all_gather(codes, mine.codes)
    payloads = [Int8Chunks(c, s, grads.shape) for c, s in zip(codes, scales, strict=True)]
    grads.copy_(sum(payload.restored() for payload in payloads) / p)
    return _done(grads)
