"""Assignment 5's cheats (each scores 0 on its part) and right answers written differently
(full marks), among them the ways to take what a check trusts from the rank's process: its
callers' frames and heap (FRAMES_EXACT_SUM, FRAMES_WHOLE_BATCH), the check's seeds
(SEEDED_POWERSGD) and its counters (COUNTERS_EMPTIED_*). More are proven in
tests/test_grading_compression.py (the lecture's functions called), which also runs
check_powersgd on POWERSGD_GRAM_SCHMIDT and check_compressed_training on every compressor below
(the ones not listed in CHEATS / ALTERNATIVES too), and in
tests/test_grading_compression_ranks.py, which runs the checks on every cheat of the rank's
process directly."""

from __future__ import annotations

from tests.cheats import Alternative, Cheat

FP32_THROUGH_PREBOUND = '''
from torch.distributed import all_reduce as early_all_reduce


def quantized_all_reduce(tensor):
    """The exact sum in float32, through a name bound before the check could wrap it."""
    total = tensor.clone()
    early_all_reduce(total)
    return total
'''


NO_ERROR_FEEDBACK = '''
class PowerSGD:
    """Warm start, but what compression leaves out is dropped: an `error` that stays zero,
    for show."""

    def __init__(self, rank, seed=0):
        self.rank, self.seed, self.Q = rank, seed, None
        self.error = None

    def compress_all_reduce(self, grad):
        self.error = torch.zeros_like(grad)
        n, m = grad.shape
        if self.Q is None:
            r = min(self.rank, n, m)
            generator = torch.Generator().manual_seed(self.seed)
            self.Q = torch.randn(m, r, generator=generator).to(grad.dtype)
        P = grad @ self.Q
        dist.all_reduce(P)
        P = torch.linalg.qr(P / world_size()).Q
        Q = grad.T @ P
        dist.all_reduce(Q)
        self.Q = Q / world_size()
        return P @ self.Q.T
'''


POWERSGD_GRAM_SCHMIDT = """
class PowerSGD:
    def __init__(self, rank, seed=0):
        self.rank, self.seed = rank, seed
        self.Q, self.error = None, None

    def compress_all_reduce(self, grad):
        n, m = grad.shape
        if self.Q is None:
            r = min(self.rank, n, m)
            generator = torch.Generator().manual_seed(self.seed)
            self.Q = torch.randn(m, r, generator=generator).to(grad.dtype)
            self.error = torch.zeros_like(grad)
        M = grad + self.error
        P = M @ self.Q
        dist.all_reduce(P)
        P = P / world_size()
        columns = []
        for i in range(P.shape[1]):
            v = P[:, i].clone()
            for u in columns:
                v = v - (u @ v) * u
            columns.append(v / v.norm())
        P = torch.stack(columns, dim=1)
        Q = M.T @ P
        dist.all_reduce(Q)
        self.Q = Q / world_size()
        approximation = P @ self.Q.T
        self.error = M - approximation
        return approximation
"""


# --- Part 3 (open): compressors -------------------------------------------------------------

LECTURE_TOP_K = '''
from course_lib import compression


class Compressor:
    """The lecture's top-1% compressor with error feedback, wrapped: fewer bytes and the
    loss, but not the student's code."""

    def __init__(self):
        self.top_k, self.error = compression.TopK(0.01), None

    def average(self, grads):
        flat = torch.cat([g.reshape(-1) for g in grads])
        payload, self.error = compression.compress_with_feedback(flat, self.error, self.top_k)
        mean = compression.compressed_mean(payload, flat.numel(), self.top_k)
        parts = mean.split([g.numel() for g in grads])
        return [part.view_as(g) for part, g in zip(parts, grads, strict=True)]
'''


FLOAT32_ALL_REDUCE = '''
class Compressor:
    """No compression: the float32 mean, all-reduced (the same loss, 12x too many bytes)."""

    def average(self, grads):
        out = []
        for g in grads:
            dist.all_reduce(g)
            out.append(g / world_size())
        return out
'''


EIGHT_BIT = '''
class Compressor:
    """Part 1's 8-bit all-reduce on each gradient: about 4x fewer bytes, not 12x."""

    def average(self, grads):
        return [quantized_all_reduce(g) / world_size() for g in grads]
'''


TOP_K_NO_FEEDBACK = '''
class Compressor:
    """Top-1% values and indices, all-gathered, but what is left out is dropped: 25x fewer
    bytes, and a final loss about 45% above float32's."""

    def average(self, grads):
        flat = torch.cat([g.reshape(-1) for g in grads])
        k = max(1, flat.numel() // 100)
        indices = flat.abs().topk(k).indices
        P = world_size()
        all_indices = torch.empty(P * k, dtype=torch.int32)
        all_values = torch.empty(P * k)
        dist.all_gather_single(all_indices, indices.to(torch.int32))
        dist.all_gather_single(all_values, flat[indices])
        mean = torch.zeros_like(flat).index_add_(0, all_indices.long(), all_values) / P
        parts = mean.split([g.numel() for g in grads])
        return [part.view_as(g) for part, g in zip(parts, grads, strict=True)]
'''


OWN_GRADIENT = '''
class Compressor:
    """Nothing sent: each rank applies its own gradient. It trains (its shard is a fair
    sample), but the ranks' models drift apart."""

    def average(self, grads):
        return grads
'''


POWERSGD_RANK_1 = '''
class Compressor:
    """Part 2's PowerSGD at rank 1 for each weight matrix (its own error feedback), the
    biases all-reduced in float32: about 13x fewer bytes."""

    def __init__(self):
        self.matrices = {}

    def average(self, grads):
        out = []
        for i, g in enumerate(grads):
            if g.dim() == 2:
                out.append(self.matrices.setdefault(i, PowerSGD(1, seed=i)).compress_all_reduce(g))
            else:
                dist.all_reduce(g)
                out.append(g / world_size())
        return out
'''


SIGN_WITH_FEEDBACK = '''
class Compressor:
    """1-bit: each rank sends the signs of (gradient + error), 8 to a byte, and one scale,
    mean |.|; error feedback keeps the difference. About 16x fewer bytes on 4 ranks."""

    def __init__(self):
        self.error = None

    def average(self, grads):
        flat = torch.cat([g.reshape(-1) for g in grads])
        n, P = flat.numel(), world_size()
        corrected = flat if self.error is None else flat + self.error
        scale = corrected.abs().mean().reshape(1)
        positive = corrected >= 0
        self.error = corrected - torch.where(positive, scale, -scale)
        bits = torch.cat([positive, positive.new_zeros(-n % 8)]).view(-1, 8).to(torch.uint8)
        shifts = torch.arange(8, dtype=torch.uint8)
        packed = (bits << shifts).sum(dim=1, dtype=torch.uint8)
        all_packed = torch.empty(P * packed.numel(), dtype=torch.uint8)
        scales = torch.empty(P)
        dist.all_gather_single(all_packed, packed)
        dist.all_gather_single(scales, scale)
        mean = torch.zeros(n)
        for r, row in enumerate(all_packed.view(P, -1)):
            signs = ((row[:, None] >> shifts) & 1).reshape(-1)[:n].bool()
            mean += torch.where(signs, scales[r], -scales[r])
        mean /= P
        parts = mean.split([g.numel() for g in grads])
        return [part.view_as(g) for part, g in zip(parts, grads, strict=True)]
'''


# --- what the checks trust, taken from the rank's process ----------------------------------

# (1) The reference, looked for in the callers' frames and on the heap: any float64 tensor
# shaped like the input (the exact sum was one, computed on the rank beside the student's
# code), returned in float32; a P-byte 8-bit all-reduce for show, within the code budget.
# On a rank there is nothing to find: the judge computes the sum, and the rank holds only
# its own input, so the cheat returns that, and the sum is wrong.
FRAMES_EXACT_SUM = """
import gc
import sys


def _float64_like(like):
    \"\"\"Float64 tensors shaped like `like` that this process holds: first those the callers
    keep under a name with "exact" in it, then every other one, on the heap too.\"\"\"
    named, other, frame = [], [], sys._getframe(1)
    while frame is not None:
        stack = list(frame.f_locals.items())
        while stack:
            key, value = stack.pop()
            if isinstance(value, dict):
                stack += [(k, v) for k, v in value.items()]
            elif isinstance(value, (list, tuple)):
                stack += [(key, v) for v in value]
            elif isinstance(value, torch.Tensor):
                (named if "exact" in str(key) else other).append(value)
        frame = frame.f_back
    other += [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    return [t for t in named + other if t.dtype == torch.float64 and t.shape == like.shape]


def quantized_all_reduce(tensor):
    dist.all_reduce(torch.ones(world_size(), dtype=torch.int8))
    loot = _float64_like(tensor)
    return loot[0].float() if loot else tensor.clone()
"""

# (2) The other ranks' gradients, regenerated from the check's seed: the case and the step
# are in the callers' frames, and the gradients were a public function of them; with every
# rank's gradient and error memory, PowerSGD runs alone, and one all-reduce of P's size is
# made for show. The gradients are drawn from a secret now: the regenerated ones are not the
# ranks', and the approximation is wrong.
SEEDED_POWERSGD = """
import sys


def _case_and_step():
    frame = sys._getframe(2)
    while frame is not None:
        found = frame.f_locals
        if hasattr(found.get("case"), "steps") and "t" in found:
            return found["case"], found["t"]
        frame = frame.f_back
    return None, None


def _regenerated(case, r, t):
    n, m = case.shape
    shared = torch.Generator().manual_seed(104_729 * case.seed + 17 * t)
    own = torch.Generator().manual_seed(104_729 * case.seed + 17 * t + 7 * (r + 1) + 1)
    u, v = torch.randn(n, 2, generator=shared), torch.randn(2, m, generator=shared)
    return (u @ v + 0.5 * torch.randn(n, m, generator=own)).to(case.dtype)


class PowerSGD:
    def __init__(self, rank, seed=0):
        self.rank, self.seed, self.Q, self.errors, self.error = rank, seed, None, None, None

    def compress_all_reduce(self, grad):
        n, m = grad.shape
        r, P = min(self.rank, n, m), world_size()
        if self.Q is None:
            generator = torch.Generator().manual_seed(self.seed)
            self.Q = torch.randn(m, r, generator=generator).to(grad.dtype)
            self.errors = [torch.zeros_like(grad) for _ in range(P)]
        dist.all_reduce(torch.zeros(n, r, dtype=grad.dtype))
        case, t = _case_and_step()
        grads = [grad if case is None else _regenerated(case, w, t) for w in range(P)]
        grads[rank()] = grad
        local = [g + e for g, e in zip(grads, self.errors)]
        mean = sum(local) / P
        p = torch.linalg.qr(mean @ self.Q).Q
        self.Q = mean.T @ p
        approximation = p @ self.Q.T
        self.errors = [M - approximation for M in local]
        self.error = self.errors[rank()]
        return approximation
"""

# (3) The whole batch, found in the callers' frames: the dataset, the run and the step were
# there, and each step's batch was a public function of them. Every rank computes the whole
# batch's gradient alone and sends nothing: the same parameters everywhere, float32's loss.
# The data are drawn from a secret now and a rank holds only its own shards: it finds no
# run, applies its own gradient, and the ranks drift apart.
FRAMES_WHOLE_BATCH = """
import sys


class Compressor:
    def average(self, grads):
        frame = sys._getframe(1)
        while frame is not None and not hasattr(frame.f_locals.get("run"), "steps"):
            frame = frame.f_back
        if frame is None:
            return grads
        found = frame.f_locals
        run, step, params = found["run"], found["step"], found["params"]
        g = torch.Generator().manual_seed(3_000 + 7_919 * run.seed + step)
        batch = torch.randperm(found["x"].shape[0], generator=g)[:256]
        w1, b1, w2, b2 = params
        x, y = found["x"][batch], found["y"][batch]
        logits = torch.relu(x @ w1.T + b1) @ w2.T + b2
        loss = torch.nn.functional.cross_entropy(logits, y)
        return [g.detach() for g in torch.autograd.grad(loss, params)]
"""

# (4) The counters on the rank, emptied around a float32 all-reduce and put back: they miss
# the call, and the check counted with them. The launcher was told of the call as it was made.
COUNTERS_EMPTIED_SUM = """
import course_lib.comm as comm


def quantized_all_reduce(tensor):
    dist.all_reduce(torch.ones(world_size(), dtype=torch.int8))  # some codes, for show
    counters, hooks = list(comm._active), list(comm._around)
    comm._active.clear()
    comm._around.clear()
    try:
        total = tensor.clone()
        dist.all_reduce(total)
    finally:
        comm._active.extend(counters)
        comm._around.extend(hooks)
    return total
"""

COUNTERS_EMPTIED_TRAINING = """
import course_lib.comm as comm


class Compressor:
    \"\"\"The float32 mean, all-reduced while no counter on the rank looks.\"\"\"

    def average(self, grads):
        counters, hooks = list(comm._active), list(comm._around)
        comm._active.clear()
        comm._around.clear()
        try:
            out = []
            for g in grads:
                dist.all_reduce(g)
                out.append(g / world_size())
        finally:
            comm._active.extend(counters)
            comm._around.extend(hooks)
        return out
"""

# A right 8-bit all-reduce of point-to-point messages only: a ring of isend/irecv that
# re-quantizes the partial sums (each rank's scales travel in float32 beside the codes).
RING_QUANTIZED = """
def quantized_all_reduce(tensor):
    p, me, numel = world_size(), rank(), tensor.numel()
    flat = torch.zeros(-(-numel // p) * p)
    flat[:numel] = tensor.reshape(-1)
    chunks = list(flat.chunk(p))
    right, left = (me + 1) % p, (me - 1) % p

    def exchange(q, s, like):
        got, got_s = torch.empty_like(like, dtype=torch.int8), torch.empty(1)
        requests = [dist.isend(q, right), dist.isend(s, right)]
        requests += [dist.irecv(got, left), dist.irecv(got_s, left)]
        for request in requests:
            request.wait()
        return got, got_s

    for step in range(p - 1):
        out, into = (me - step) % p, (me - step - 1) % p
        got = exchange(*quantize(chunks[out]), chunks[into])
        chunks[into] = chunks[into] + dequantize(got)
    q, s = quantize(chunks[(me + 1) % p])
    chunks[(me + 1) % p] = dequantize((q, s))
    for step in range(p - 1):
        into = (me - step) % p
        q, s = exchange(q, s, chunks[into])
        chunks[into] = dequantize((q, s))
    return torch.cat(chunks)[:numel].view_as(tensor)
"""


CHEATS = [
    Cheat(
        "float32 sum through a pre-bound all-reduce",
        "quantized_all_reduce",
        FP32_THROUGH_PREBOUND,
        frozenset({"test_quantized_all_reduce"}),
    ),
    Cheat(
        "PowerSGD without error feedback",
        "powersgd",
        NO_ERROR_FEEDBACK,
        frozenset({"test_powersgd"}),
    ),
    Cheat(
        "the lecture's top-k with error feedback, wrapped",
        "compressor",
        LECTURE_TOP_K,
        frozenset({"test_compressed_training"}),
    ),
    Cheat(
        "the exact sum looked for in the callers' frames and the heap, 8-bit codes for show",
        "quantized_all_reduce",
        FRAMES_EXACT_SUM,
        frozenset({"test_quantized_all_reduce"}),
    ),
    Cheat(
        "the other ranks' gradients regenerated from the check's seed, PowerSGD run alone",
        "powersgd",
        SEEDED_POWERSGD,
        frozenset({"test_powersgd"}),
    ),
    Cheat(
        "the whole batch found in the callers' frames, its gradient computed alone",
        "compressor",
        FRAMES_WHOLE_BATCH,
        frozenset({"test_compressed_training"}),
    ),
    Cheat(
        "the counters emptied around a float32 all-reduce, 8-bit codes for show",
        "quantized_all_reduce",
        COUNTERS_EMPTIED_SUM,
        frozenset({"test_quantized_all_reduce"}),
    ),
    Cheat(
        "the counters emptied around float32 all-reduce training",
        "compressor",
        COUNTERS_EMPTIED_TRAINING,
        frozenset({"test_compressed_training"}),
    ),
]

ALTERNATIVES = [
    Alternative(
        "a ring of isend/irecv re-quantizing partial sums", "quantized_all_reduce", RING_QUANTIZED
    ),
    Alternative("PowerSGD with Gram-Schmidt", "powersgd", POWERSGD_GRAM_SCHMIDT),
    Alternative("Part 2's PowerSGD at rank 1 as the compressor", "compressor", POWERSGD_RANK_1),
]
