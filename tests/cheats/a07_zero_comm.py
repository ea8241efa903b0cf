"""Assignment 7's cheats and right answers about what ZeRO-1 communicates, as cell sources
(`tests/cheats/a07_zero.py` lists them).

Each rank is given only its own share of every batch, so right values need messages; but not
all messages are ZeRO's. Before the checks of stages 1 and 2 judged each step's calls from the
launcher's tallies, a rank could all-gather the other ranks' samples (cheaper than any
gradient) and compute the full-batch gradient itself, or all-gather the full gradients: both
gave right values and sharded state, and full marks. Right answers that move other bytes
than the solution's (an all-reduce, one flat buffer, a ring of sends of their own) keep
them."""

from __future__ import annotations

from tests.cheats.a07_zero_stage12 import (
    GATHER_PARAMETERS,
    PARAM_GROUPS,
    ZERO1_INIT,
    ZERO_GRAD,
    zero1,
)

# --- the samples gathered: the full-batch gradient computed on every rank -----------------

# What the three thieves share: step() finds its rank's share of the batch and the model in
# the training loop's frame, gathers every rank's share (`gather_samples`, which each defines)
# and computes the full-batch gradient itself, then steps its shards and all-gathers them.
FULL_BATCH_HERE = '''
import sys


def _up_the_stack():
    """The training loop's model and this rank's share (x, y) of the batch."""
    frame = sys._getframe(2)
    while frame is not None:
        x, y, model = (frame.f_locals.get(k) for k in ("x", "y", "model"))
        if isinstance(model, nn.Module) and isinstance(x, torch.Tensor):
            return model, x, y
        frame = frame.f_back
    raise RuntimeError("no training loop up the stack")
'''

FULL_BATCH_STEP = """
    def step(self):
        model, x, y = _up_the_stack()
        x, y = gather_samples(x), gather_samples(y)
        for p in self.params:
            p.grad = None
        lm_loss(model(x), y).backward()  # the mean over the whole batch
        with torch.no_grad():
            for p, shard in zip(self.params, self.shards, strict=True):
                shard.grad = take_shard(p.grad)
            self.optimizer.step()
            self.gather_parameters()
"""


def full_batch_thief(doc: str, gather_samples: str) -> str:
    return zero1(
        doc,
        ZERO1_INIT,
        PARAM_GROUPS,
        ZERO_GRAD,
        FULL_BATCH_STEP,
        GATHER_PARAMETERS,
        before=FULL_BATCH_HERE + gather_samples,
    )


ZERO1_GATHERS_SAMPLES = full_batch_thief(
    "Every rank's samples all-gathered (token ids, int64); no gradient is communicated.",
    """
def gather_samples(t):
    out = torch.empty((world_size() * len(t), *t.shape[1:]), dtype=t.dtype)
    dist.all_gather_single(out, t.contiguous())
    return out
""",
)

ZERO1_GATHERS_SAMPLES_AS_FLOATS = full_batch_thief(
    "Every rank's samples all-gathered as float64, as if they were parameters.",
    """
def gather_samples(t):
    out = torch.empty((world_size() * len(t), *t.shape[1:]), dtype=torch.float64)
    dist.all_gather_single(out, t.to(torch.float64).contiguous())
    return out.long()
""",
)

# The counted group's inner gloo group reports nothing to the launcher; gloo's all-gather
# on it leaves bytes on the wire, which are not held to the calls where a rank also makes
# built-in collectives. What it cannot hide is the gradient bytes it never received.
ZERO1_GATHERS_SAMPLES_UNREPORTED = full_batch_thief(
    "Every rank's samples all-gathered on the counted group's inner gloo group, unreported.",
    """
def gather_samples(t):
    pieces = [torch.empty_like(t) for _ in range(world_size())]
    dist.group.WORLD._inner.allgather([pieces], [t.contiguous()]).wait()
    return torch.cat(pieces)
""",
)

# --- the whole batch found on the rank --------------------------------------------------------
# Before the checks drew the batches in the checking process, every rank regenerated the
# whole batch from the check's seed (`run.seed`, in its frames; the list of global batches,
# on its heap): this thief took it from there, with one collective, the parameters' gather.

ZERO1_WHOLE_BATCH_IN_SIGHT = zero1(
    """No gradient averaging: step() computes the full-batch gradient here, from the whole
    batch found on the heap or regenerated from the seed up the stack, steps its shards with
    it and all-gathers the parameters (the one collective it makes).""",
    """
    def __init__(self, params, optimizer_cls, **kwargs):
        self.params = list(params)
        self.shards = [nn.Parameter(take_shard(p)) for p in self.params]
        self.optimizer = optimizer_cls(self.shards, **kwargs)
        self.steps = 0
""",
    PARAM_GROUPS,
    ZERO_GRAD,
    """
    def step(self):
        x, y = _whole_batches()[self.steps]
        self.steps += 1
        model, _, _ = _up_the_stack()
        for p in self.params:
            p.grad = None
        lm_loss(model(x), y).backward()
        with torch.no_grad():
            for p, shard in zip(self.params, self.shards, strict=True):
                shard.grad = take_shard(p.grad)
            self.optimizer.step()
            self.gather_parameters()
""",
    GATHER_PARAMETERS,
    before=FULL_BATCH_HERE
    + '''
import gc


def _whole_batches():
    """The global batches: any list of (tokens, targets) batches on the heap, and the batches
    regenerated from the seed of a run found up the stack; the one with the most rows."""
    found = []
    for obj in gc.get_objects():
        if (
            isinstance(obj, list) and obj and isinstance(obj[0], tuple) and len(obj[0]) == 2
            and all(isinstance(t, torch.Tensor) and t.dtype == torch.long for t in obj[0])
            and obj[0][0].dim() == 2 and obj[0][0].shape[1] == SMALL.seq_len
        ):
            found.append(obj)
    frame = sys._getframe(2)
    while frame is not None:
        run = frame.f_locals.get("run")
        if hasattr(run, "seed") and hasattr(run, "batch_size"):
            size, seed = run.batch_size, run.seed
            x, y = data.tokens(4 * size, SMALL.seq_len, SMALL.vocab_size, seed=seed + 1)
            found.append(data.batches(x, y, size, run.steps, seed=seed))
            break
        frame = frame.f_back
    return max(found, key=lambda batches: len(batches[0][0]))
''',
)

# --- the full gradients gathered -----------------------------------------------------------

ZERO1_GATHERS_FULL_GRADIENTS = zero1(
    """Every rank's full gradient all-gathered, averaged here, and this rank's chunk kept:
    right values and sharded state, P - 1 full gradients received per step.""",
    ZERO1_INIT,
    PARAM_GROUPS,
    ZERO_GRAD,
    """
    @torch.no_grad()
    def step(self):
        for p, shard in zip(self.params, self.shards, strict=True):
            every = torch.empty(world_size() * p.numel(), dtype=p.dtype)
            dist.all_gather_single(every, p.grad.reshape(-1).contiguous())
            shard.grad = take_shard(every.view(world_size(), -1).mean(0))
        self.optimizer.step()
        self.gather_parameters()
""",
    GATHER_PARAMETERS,
)

# --- right answers that communicate differently from the solution --------------------------

ZERO1_ALL_REDUCE = zero1(
    """Each gradient all-reduced whole and this rank's chunk kept (twice the bytes of a
    reduce-scatter, as the notebook allows for ZeRO-1).""",
    ZERO1_INIT,
    PARAM_GROUPS,
    ZERO_GRAD,
    """
    @torch.no_grad()
    def step(self):
        for p, shard in zip(self.params, self.shards, strict=True):
            flat = padded(p.grad)
            dist.all_reduce(flat)
            c = shard.numel()
            shard.grad = flat[rank() * c : (rank() + 1) * c] / world_size()
        self.optimizer.step()
        self.gather_parameters()
""",
    GATHER_PARAMETERS,
)

# One flat buffer for the whole model, sharded as one tensor, moved by rings of sends and
# receives of its own: 2(P-1) messages a step, whatever the number of parameters.
ZERO1_FLAT_RING = zero1(
    """The whole model as one flat bucket: its gradient reduce-scattered and its shard
    all-gathered by rings of isend/recv.""",
    """
    def __init__(self, params, optimizer_cls, **kwargs):
        self.params = list(params)
        flat = padded(torch.cat([p.detach().reshape(-1) for p in self.params]))
        c = flat.numel() // world_size()
        self.shard = nn.Parameter(flat[rank() * c : (rank() + 1) * c].clone())
        self.optimizer = optimizer_cls([self.shard], **kwargs)
        self.param_groups = self.optimizer.param_groups

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self):
        flat = padded(torch.cat([p.grad.reshape(-1) for p in self.params]))
        self.shard.grad = ring(flat.chunk(world_size()), add=True)[rank()] / world_size()
        self.optimizer.step()
        chunks = [torch.empty_like(self.shard) for _ in range(world_size())]
        chunks[rank()] = self.shard.detach().clone()
        full, offset = torch.cat(ring(chunks, add=False)), 0
        for p in self.params:
            p.copy_(full[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
""",
    before='''
def ring(chunks, add):
    """P - 1 steps around the ring: with `add`, a reduce-scatter (chunk rank() ends up the
    sum), else an all-gather (every chunk ends up its owner's)."""
    chunks = [c.clone() for c in chunks]
    me, p = rank(), world_size()
    right, left = (me + 1) % p, (me - 1) % p
    for k in range(p - 1):
        shift = k + 1 if add else k  # a reduce-scatter passes on what it just summed
        out, into = (me - shift) % p, (me - shift - 1) % p
        sending = dist.isend(chunks[out].contiguous(), right)
        received = torch.empty_like(chunks[into])
        dist.recv(received, left)
        sending.wait()
        chunks[into] = chunks[into] + received if add else received
    return chunks
''',
)
