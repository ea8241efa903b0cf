"""Compressed gradient communication, measured (lecture 5).

    q = quantize(grad, chunk_size=256)              # int8 values + one fp32 scale per chunk
    dequantize(q)                                   # within scale / 2 of grad, element by element
    quantized_all_reduce(grad)                      # the sum over ranks, sending only 8-bit data
    compress_with_feedback(grad, error, TopK(0.01)) # error feedback: keep what was not sent
    EFMomentumSGD(params, lr=0.1, momentum=0.9)     # momentum on the decompressed average
    run = train_compressed("powersgd", batches, sizes=...)  # course_lib.measure.compression

Every method here is a DDP communication hook (`build_ddp`, with the training loop in
`course_lib.measure.compression`), so one loop runs them all and counts the same things: the
loss, the bytes sent (`CommCounter`) and the wall-clock time of every step, optionally on an
emulated slow network (`SlowNetwork`).

- "fp32": torch's `allreduce_hook`, the uncompressed reference (a ring all-reduce).
- "fp16", "bf16": torch's `fp16_compress_hook` and `bf16_compress_hook` (`bf16_hook`), the
  same all-reduce of gradients cast to 16 bits (`cast_error` measures what each cast does).
- "int8": `quantized_hook`, an all-reduce whose payloads are 8-bit (fp32 arithmetic).
- "topk", "sign" and their "+ef" versions: `feedback_hook`, all-gathers of top-k or 1-bit
  compressed gradients, with or without error feedback.
- "dgc": deep gradient compression's top-k with momentum correction (`dgc_hook`).
- "vote": signSGD with majority vote (`majority_vote_hook`): 1-bit signs all-gathered, the
  sign of their sum applied (with `SGD`, a step of lr times +-1 per entry).
- "powersgd": torch's `powerSGD_hook` with `PowerSGDState(use_error_feedback=True,
  warm_start=True)`, the production reference (Assignment 5 builds PowerSGD from scratch).
"""

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

from course_lib.costs import all_gather_bytes, all_reduce_bytes, alpha_beta_time, collective_steps

LEVELS = 127  # int8 values -127..127: symmetric, so 0 is exact and no value is wasted
CHUNK = 256  # elements per scale: 4 scale bytes per 256 value bytes, a 1.6% overhead
ONE_BUCKET_MB = 1024  # DDP bucket size larger than any model here
METHODS = (
    "fp32",
    "fp16",
    "bf16",
    "int8",
    "topk",
    "topk+ef",
    "dgc",
    "sign",
    "sign+ef",
    "vote",
    "powersgd",
)


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


# --- top-k and 1-bit compressors, error feedback -----------------------------------------


@dataclass
class TopK:
    """Keep the `fraction` of entries largest in magnitude; send their values and indices."""

    fraction: float

    def k(self, numel: int) -> int:
        return max(1, round(self.fraction * numel))

    def compress(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 payload: k values, then their k indices as int32 bit patterns."""
        indices = x.abs().topk(self.k(x.numel())).indices
        bits = indices.to(torch.int32).view(torch.float32)  # same 4 bytes, reinterpreted
        return torch.cat([x[indices], bits])

    def decompress(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        values, bits = payload.view(2, -1)
        dense = torch.zeros(numel, dtype=payload.dtype, device=payload.device)
        return dense.index_put_((bits.view(torch.int32).long(),), values)

    def payload_bytes(self, numel: int) -> int:
        return 8 * self.k(numel)


@dataclass
class Sign:
    """1-bit compression: sign(x) times the mean |x|, the signs packed 8 to a byte."""

    def compress(self, x: torch.Tensor) -> torch.Tensor:
        """uint8 payload: the fp32 scale as 4 bytes, then ceil(N / 8) bytes of signs."""
        scale = x.abs().mean().reshape(1)
        bits = F.pad(x >= 0, (0, -x.numel() % 8)).view(-1, 8).to(torch.uint8)
        packed = (bits << torch.arange(8, dtype=torch.uint8, device=x.device)).sum(
            dim=1, dtype=torch.uint8
        )
        return torch.cat([scale.view(torch.uint8), packed])

    def decompress(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        scale = payload[:4].clone().view(torch.float32)  # a copy: aligned for the view
        shifts = torch.arange(8, dtype=torch.uint8, device=payload.device)
        bits = (payload[4:, None] >> shifts) & 1
        signs = bits.view(-1)[:numel].float() * 2 - 1
        return signs * scale

    def payload_bytes(self, numel: int) -> int:
        return 4 + math.ceil(numel / 8)


Compressor = TopK | Sign


def compress_with_feedback(
    grad: torch.Tensor, error: torch.Tensor | None, compressor: Compressor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One error-feedback step: compress delta = grad + error; return (payload, new error).

    The new error is delta - C(delta): what compression dropped this step is added back to
    the next step's gradient instead of being lost."""
    delta = grad if error is None else grad + error
    payload = compressor.compress(delta)
    return payload, delta - compressor.decompress(payload, delta.numel())


@dataclass
class FeedbackState:
    """State of `feedback_hook`: the compressor, and each bucket's error memory."""

    compressor: Compressor
    error_feedback: bool = True
    errors: dict[int, torch.Tensor] = field(default_factory=dict)


def gather_payloads(payload: torch.Tensor) -> torch.Tensor:
    """All-gather every rank's payload (all the same size): one row per rank."""
    p = dist.get_world_size()
    gathered = torch.empty(p * payload.numel(), dtype=payload.dtype, device=payload.device)
    dist.all_gather_single(gathered, payload)
    return gathered.view(p, -1)


def compressed_mean(payload: torch.Tensor, numel: int, compressor: Compressor) -> torch.Tensor:
    """All-gather every rank's payload; return the mean of the decompressed payloads."""
    rows = gather_payloads(payload)
    return sum(compressor.decompress(row, numel) for row in rows) / len(rows)


def feedback_hook(
    state: FeedbackState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: compressed gradients, all-gathered and averaged, with or without
    error feedback (`state.error_feedback`)."""
    grads = bucket.buffer()
    error = state.errors.get(bucket.index()) if state.error_feedback else None
    payload, new_error = compress_with_feedback(grads, error, state.compressor)
    if state.error_feedback:
        state.errors[bucket.index()] = new_error
    grads.copy_(compressed_mean(payload, grads.numel(), state.compressor))
    return _done(grads)


def majority_vote_hook(_state: None, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook for signSGD with majority vote (Bernstein et al., 2018): every rank sends
    the signs of its gradient (1 bit each), and every rank applies the sign of their sum, the
    majority's direction, +1, -1 or 0 on a tie (one bit cannot say 0: a zero entry votes +1).
    No error feedback: the vote is the update."""
    grads, sign = bucket.buffer(), Sign()
    rows = gather_payloads(sign.compress(grads))
    votes = sum(sign.decompress(row, grads.numel()).sign() for row in rows)
    grads.copy_(votes.sign())
    return _done(grads)


@dataclass
class DGCState:
    """State of `dgc_hook`: the top-k compressor, the momentum, and per bucket the local
    velocity u and the accumulated update v that waits to be sent."""

    compressor: TopK
    momentum: float = 0.9
    velocity: dict[int, torch.Tensor] = field(default_factory=dict)
    accumulated: dict[int, torch.Tensor] = field(default_factory=dict)


def dgc_hook(state: DGCState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook for deep gradient compression (Lin et al., 2018) with momentum
    correction: momentum runs on each rank *before* compression (u = m u + g), the velocity
    accumulates locally (v = v + u), the top-k of v is sent, and what was sent is cleared from
    both u and v (momentum factor masking), so a stale velocity does not push it again. Use
    it with plain SGD: the momentum is already in the update. (The paper's warm-up of the
    sparsity and its gradient clipping are left out.)"""
    grads, i = bucket.buffer(), bucket.index()
    u = state.velocity.setdefault(i, torch.zeros_like(grads))
    v = state.accumulated.setdefault(i, torch.zeros_like(grads))
    u.mul_(state.momentum).add_(grads)
    v.add_(u)
    payload = state.compressor.compress(v)
    sent = payload.view(2, -1)[1].view(torch.int32).long()  # the indices TopK sent
    u[sent], v[sent] = 0.0, 0.0
    grads.copy_(compressed_mean(payload, grads.numel(), state.compressor))
    return _done(grads)


class EFMomentumSGD(torch.optim.Optimizer):
    """SGD with momentum as error-feedback compression applies it (PowerSGD's paper,
    algorithm 2): on the decompressed average Delta' every rank received, m = lambda m + Delta'
    and x = x - lr (Delta' + m). The momentum sees only the aggregate, identical on all ranks,
    so the copies stay equal, and the error memory keeps only what compression dropped."""

    def __init__(self, params, lr: float, momentum: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum})

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("momentum", torch.zeros_like(p))
                m.mul_(group["momentum"]).add_(p.grad)
                p.sub_(group["lr"] * (p.grad + m))


# --- PowerSGD: the compression ratio and torch's hook --------------------------------------


def powersgd_ratio(n: int, m: int, r: int) -> float:
    """How much smaller PowerSGD's P (n x r) and Q (m x r) are than an n x m matrix."""
    return n * m / ((n + m) * r)


def powersgd_elements(shapes: Iterable[torch.Size], r: int, min_rate: float = 2.0) -> dict:
    """Elements torch's powerSGD_hook all-reduces per step for parameters of `shapes`:
    P (n r per matrix), Q (m r per matrix) and the uncompressed rest (vectors, and matrices
    too small to gain `min_rate`), following the hook's own rule."""
    counts = {"P": 0, "Q": 0, "uncompressed": 0}
    for shape in shapes:
        n = shape[0]
        m = math.prod(shape[1:]) if len(shape) > 1 else 1
        r_used = min(n, m, r)
        if len(shape) > 1 and (n + m) * r_used * min_rate < n * m:
            counts["P"] += n * r_used
            counts["Q"] += m * r_used
        else:
            counts["uncompressed"] += n * m
    return counts


def powersgd_bytes(shapes: Iterable[torch.Size], r: int, world_size: int) -> int:
    """Bytes one rank sends per PowerSGD step: three fp32 ring all-reduces (the uncompressed
    tensors, then the Ps, then the Qs), each counted as 2 (P-1)/P * its bytes."""
    counts = powersgd_elements(shapes, r)
    return sum(fp32_all_reduce_bytes(c, world_size) for c in counts.values())


# --- the formulas for every method, per step ------------------------------------------------


def bytes_per_step(
    method: str,
    shapes: Sequence[torch.Size],
    world_size: int,
    *,
    chunk_size: int = CHUNK,
    topk_fraction: float = 0.01,
    powersgd_rank: int = 4,
) -> int:
    """Bytes one rank sends per step under `method` for parameters of `shapes` in one DDP
    bucket (PowerSGD: once compression has started)."""
    numel = sum(math.prod(shape) for shape in shapes)
    if method == "fp32":
        return fp32_all_reduce_bytes(numel, world_size)
    if method in ("fp16", "bf16"):
        return all_reduce_bytes(2 * numel, world_size)
    if method == "int8":
        return quantized_bytes(numel, world_size, chunk_size)
    if method.startswith("topk") or method == "dgc":
        return all_gather_bytes(TopK(topk_fraction).payload_bytes(numel), world_size)
    if method.startswith("sign") or method == "vote":
        return all_gather_bytes(Sign().payload_bytes(numel), world_size)
    if method == "powersgd":
        return powersgd_bytes(shapes, powersgd_rank, world_size)
    raise ValueError(f"unknown method {method!r}; use one of {', '.join(METHODS)}")


def latency_steps(method: str, world_size: int) -> int:
    """Messages one after another per step: a ring all-reduce takes 2(P-1), an all-gather or
    an all-to-all P-1; PowerSGD runs three all-reduces, int8 an all-to-all and an all-gather."""
    collectives = {
        "fp32": ("all_reduce",),
        "fp16": ("all_reduce",),
        "bf16": ("all_reduce",),
        "int8": ("all_to_all", "all_gather"),
        "powersgd": ("all_reduce",) * 3,
    }
    return sum(collective_steps(op, world_size) for op in collectives.get(method, ("all_gather",)))


def comm_seconds(
    method: str,
    shapes: Sequence[torch.Size],
    world_size: int,
    bandwidth: float,
    latency: float,
    **options,
) -> float:
    """Network time per step, alpha-beta model: latency_steps * latency + bytes / bandwidth."""
    sent = bytes_per_step(method, shapes, world_size, **options)
    return alpha_beta_time(sent, latency, bandwidth, messages=latency_steps(method, world_size))
