"""Assignment 9's cheats (each scores 0 on its part) and right answers written differently
(full marks). More are proven in tests/test_grading_tensor_parallel.py (a column layer
gathering from a full copy, a row layer that all-gathers instead of all-reducing, the lecture's
layers, a loss that changes its logits in place, a row layer that hides an all-gather from the
rank's counters: its result is right, so it keeps half), to keep the graded notebooks few.

Counting cheats: the checks once counted each rank's calls and bytes on the rank itself
(`course_lib.comm.CommCounter`), where the student's code can empty or forge the counters.
They now read the calls each rank's process group reported to the launcher while they
happened, and the kernel's count of the bytes on each rank's sockets: emptying the counters
hides nothing, and calls made around the counted group leave bytes no reported call accounts
for."""

from __future__ import annotations

from tests.adapters import answer_cells
from tests.cheats import Alternative, Cheat


def _edited(cell: str, old: str, new: str) -> str:
    """The solution's answer cell with one piece replaced (and its solution markers gone)."""
    source = answer_cells("tensor_parallel")[cell]
    if source.count(old) != 1:
        raise ValueError(f"{old!r} occurs {source.count(old)} times in cell {cell!r}")
    lines = source.replace(old, new).splitlines()
    return "\n".join(
        line
        for line in lines
        if "### BEGIN SOLUTION" not in line and "### END SOLUTION" not in line
    )


# One edit: the loss shifts the targets to this rank's columns in place. Its numbers are
# right; the caller's targets are not what they were.
LOSS_SHIFTS_TARGETS = _edited(
    "vocab_loss",
    "column = (targets - first).clamp(0, width - 1)",
    "targets -= first\n    column = targets.clamp(0, width - 1)",
)


# No messages: the whole logits, wherever a frame of the check holds them, through
# F.cross_entropy (this rank's block kept in autograd). The checking process draws the
# logits and sends each rank only its block, so no frame on a rank holds the others'.
LOSS_FROM_THE_CALLERS_FRAME = """
import inspect


def vocab_parallel_cross_entropy(local_logits, targets):
    n, width = local_logits.shape
    first = rank() * width
    whole = None
    for frame in inspect.stack():
        for value in frame.frame.f_locals.values():
            if isinstance(value, torch.Tensor) and value.shape == (n, width * world_size()):
                whole = value.detach()
    if whole is None:  # no frame holds them: this rank's block alone
        return F.cross_entropy(local_logits, (targets - first).clamp(0, width - 1))
    logits = torch.cat([whole[:, :first], local_logits, whole[:, first + width :]], dim=1)
    return F.cross_entropy(logits, targets)
"""


# The whole logits gathered, with the rank's counters (and the hooks of the rank's byte
# meters) emptied around the all-gather: the counters on the rank saw no bytes at all.
LOSS_COUNTERS_EMPTIED = """
import course_lib.comm as comm


def vocab_parallel_cross_entropy(local_logits, targets):
    counters, hooks = list(comm._active), list(comm._around)
    comm._active.clear()
    comm._around.clear()
    try:
        pieces = [torch.empty_like(local_logits) for _ in range(world_size())]
        dist.all_gather(pieces, local_logits.detach())
    finally:
        comm._active.extend(counters)
        comm._around.extend(hooks)
    pieces[rank()] = local_logits  # this rank's own block stays in autograd
    return F.cross_entropy(torch.cat(pieces, dim=1), targets)
"""

# ... and gathered on the counted group's inner gloo group, which no counter on the rank and
# no report to the launcher sees: only the kernel's count of the socket bytes does.
LOSS_INNER_GROUP = """
def vocab_parallel_cross_entropy(local_logits, targets):
    pieces = [torch.empty_like(local_logits) for _ in range(world_size())]
    if world_size() > 1:
        inner = dist.group.WORLD._inner
        inner.allgather([pieces], [local_logits.detach()]).wait()
    pieces[rank()] = local_logits  # this rank's own block stays in autograd
    return F.cross_entropy(torch.cat(pieces, dim=1), targets)
"""

# Megatron's MLP with its two all-reduces made on the inner gloo group, and the rank's
# counters told they were ordinary ones: right numbers, and the calls a counter on the rank
# reports are Megatron's.
MLP_INNER_GROUP_FORGED = """
import course_lib.comm as comm


def _hidden_all_reduce(t):
    t = t.clone()
    if world_size() > 1:
        dist.group.WORLD._inner.allreduce([t]).wait()
    for counter in comm._active:  # what a counter on the rank would have seen
        counter.add("all_reduce", 0, 0)
    return t


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _hidden_all_reduce(grad)


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _hidden_all_reduce(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class ParallelMLP(nn.Module):
    def __init__(self, block):
        super().__init__()
        P, r = world_size(), rank()
        d_model, d_ff = block.fc.in_features, block.fc.out_features
        rows = slice(r * d_ff // P, (r + 1) * d_ff // P)
        dtype = block.fc.weight.dtype
        self.fc = nn.Linear(d_model, d_ff // P, dtype=dtype)
        self.proj = nn.Linear(d_ff // P, d_model, dtype=dtype)
        with torch.no_grad():
            self.fc.weight.copy_(block.fc.weight[rows])
            self.fc.bias.copy_(block.fc.bias[rows])
            self.proj.weight.copy_(block.proj.weight[:, rows])
            self.proj.bias.copy_(block.proj.bias)

    def forward(self, x):
        hidden = F.gelu(self.fc(_Copy.apply(x)))
        return _Reduce.apply(F.linear(hidden, self.proj.weight)) + self.proj.bias
"""


# Megatron's MLP whose shards are views of the dense block's tensors, not copies: it saves
# memory, and the dense block changes whenever the shards do.
MLP_SHARD_VIEWS = """
class ParallelMLP(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.fc = ColumnParallelLinear(block.fc)
        self.proj = RowParallelLinear(block.proj)
        rows = my_block(block.fc.out_features)
        self.fc.weight = nn.Parameter(block.fc.weight.detach()[rows])
        self.fc.bias = nn.Parameter(block.fc.bias.detach()[rows])
        self.proj.weight = nn.Parameter(block.proj.weight.detach()[:, rows])

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))
"""


# Part 3 written another way: fresh nn.Linear layers filled with copy_ (no Part 1 or 2
# layer), the all-reduces called through the autograd functions directly.
MLP_COPIED_INTO_LINEARS = """
class ParallelMLP(nn.Module):
    def __init__(self, block):
        super().__init__()
        P, r = world_size(), rank()
        d_model, d_ff = block.fc.in_features, block.fc.out_features
        rows = slice(r * d_ff // P, (r + 1) * d_ff // P)
        dtype = block.fc.weight.dtype
        self.fc = nn.Linear(d_model, d_ff // P, dtype=dtype)
        self.proj = nn.Linear(d_ff // P, d_model, dtype=dtype)
        with torch.no_grad():
            self.fc.weight.copy_(block.fc.weight[rows])
            self.fc.bias.copy_(block.fc.bias[rows])
            self.proj.weight.copy_(block.proj.weight[:, rows])
            self.proj.bias.copy_(block.proj.bias)

    def forward(self, x):
        hidden = F.gelu(self.fc(CopyToParallel.apply(x)))
        return ReduceFromParallel.apply(F.linear(hidden, self.proj.weight)) + self.proj.bias
"""

MLP_FULL_COPY = '''
class ParallelMLP(nn.Module):
    """The dense MLP, kept whole, computes the output; the shards get Megatron's local
    gradients through a path whose value is zero; all-reduces of zeros look like Megatron's."""

    def __init__(self, block):
        super().__init__()
        self.fc = ColumnParallelLinear(block.fc)
        self.proj = RowParallelLinear(block.proj)
        self.dense = [block]  # in a list: not registered, not a parameter

    def forward(self, x):
        fc, proj = self.fc, self.proj
        local = F.linear(F.gelu(F.linear(x.detach(), fc.weight, fc.bias)), proj.weight)
        local = local + proj.bias
        dummy = CopyToParallel.apply(torch.zeros_like(x, requires_grad=True))
        out = self.dense[0](x + dummy)
        out = out + ReduceFromParallel.apply(torch.zeros_like(out)).detach()
        return out + (local - local.detach())
'''


LECTURE_ATTENTION = '''
import course_lib.tensor_parallel as tp_lecture


class ParallelSelfAttention(nn.Module):
    """The lecture's layer, handed over as this one."""

    def __new__(cls, attn):
        return tp_lecture.ParallelSelfAttention(attn)
'''


LECTURE_LOSS = '''
import course_lib.tensor_parallel as tp_lecture


def vocab_parallel_cross_entropy(local_logits, targets):
    """The lecture's per-token loss, averaged."""
    return tp_lecture.vocab_parallel_cross_entropy(local_logits, targets).mean()
'''


# Part 5 in another design: one all-gather of each rank's (log-sum-exp of its block, target
# logit or 0) per token, then the whole log-sum-exp computed locally; plain autograd.
LOSS_ONE_ALL_GATHER = """
def vocab_parallel_cross_entropy(local_logits, targets):
    n, width = local_logits.shape
    first = rank() * width
    biggest = local_logits.detach().max(dim=-1).values  # this rank's own maximum only
    block_lse = biggest + (local_logits - biggest[:, None]).exp().sum(dim=-1).log()
    owned = (targets >= first) & (targets < first + width)
    index = torch.where(owned, targets - first, 0)
    target = torch.where(owned, local_logits.gather(1, index[:, None]).squeeze(1), 0.0)
    stats = torch.stack([block_lse.detach(), target.detach()], dim=1)  # (n, 2)
    everyone = torch.empty(world_size() * n, 2, dtype=stats.dtype)
    dist.all_gather_into_tensor(everyone, stats)
    everyone = everyone.view(world_size(), n, 2)
    lse = torch.logsumexp(everyone[..., 0], dim=0)
    # d lse / d block_lse = exp(block_lse - lse): the value from all ranks, the gradient of
    # this rank's own terms.
    weight = (block_lse.detach() - lse).exp()
    per_token = lse + weight * (block_lse - block_lse.detach())
    per_token = per_token - everyone[..., 1].sum(dim=0) - (target - target.detach())
    return per_token.mean()
"""


# Part 5 with in-place arithmetic on tensors of its own (a copy of the targets, the maximum):
# the arguments stay as they were.
LOSS_IN_PLACE_ON_COPIES = """
def vocab_parallel_cross_entropy(local_logits, targets):
    n, width = local_logits.shape
    first = rank() * width
    top = local_logits.detach().amax(dim=1)
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    z = local_logits - top[:, None]
    column = targets.clone()
    column -= first
    owned = (column >= 0) & (column < width)
    column.clamp_(0, width - 1)
    picked = z.gather(1, column[:, None]).squeeze(1) * owned
    stats = torch.stack([z.exp().sum(dim=1), picked])
    total = stats.detach().clone()
    dist.all_reduce(total)
    stats = stats + (total - stats.detach())
    return (stats[0].log() - stats[1]).mean()
"""


CHEATS = [
    Cheat(
        "the loss shifts the targets in place",
        "vocab_loss",
        LOSS_SHIFTS_TARGETS,
        frozenset({"test_vocab_loss"}),
    ),
    Cheat(
        "no messages: the whole logits from the check's frames",
        "vocab_loss",
        LOSS_FROM_THE_CALLERS_FRAME,
        frozenset({"test_vocab_loss"}),
    ),
    Cheat(
        "MLP shards as views of the dense block (no copies)",
        "parallel_mlp",
        MLP_SHARD_VIEWS,
        frozenset({"test_parallel_mlp"}),
    ),
    Cheat(
        "MLP computed from a full copy",
        "parallel_mlp",
        MLP_FULL_COPY,
        frozenset({"test_parallel_mlp"}),
    ),
    Cheat(
        "the lecture's attention layer",
        "parallel_attention",
        LECTURE_ATTENTION,
        frozenset({"test_parallel_attention"}),
    ),
    Cheat(
        "the whole logits gathered, the rank's counters emptied around it",
        "vocab_loss",
        LOSS_COUNTERS_EMPTIED,
        frozenset({"test_vocab_loss"}),
    ),
    Cheat(
        "the whole logits gathered on the counted group's inner group",
        "vocab_loss",
        LOSS_INNER_GROUP,
        frozenset({"test_vocab_loss"}),
    ),
    Cheat(
        "MLP all-reduces on the inner group, the rank's counters forged",
        "parallel_mlp",
        MLP_INNER_GROUP_FORGED,
        frozenset({"test_parallel_mlp"}),
    ),
    Cheat(
        "the lecture's vocabulary-parallel loss, averaged",
        "vocab_loss",
        LECTURE_LOSS,
        frozenset({"test_vocab_loss"}),
    ),
]

ALTERNATIVES = [
    Alternative("loss with in-place arithmetic on copies", "vocab_loss", LOSS_IN_PLACE_ON_COPIES),
    Alternative("MLP copied into fresh linear layers", "parallel_mlp", MLP_COPIED_INTO_LINEARS),
    Alternative(
        "loss from one all-gather of per-rank statistics", "vocab_loss", LOSS_ONE_ALL_GATHER
    ),
    Alternative(
        "row-parallel with its own autograd function and torch.matmul",
        "row_parallel",
        """
class _SumOverRanks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, partial):
        total = partial.clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad


class RowParallelLinear(nn.Module):
    def __init__(self, linear):
        super().__init__()
        n, P, r = linear.in_features, world_size(), rank()
        start, stop = r * n // P, (r + 1) * n // P
        self.weight = nn.Parameter(linear.weight.detach()[:, start:stop].clone())
        self.bias = None
        if linear.bias is not None:
            self.bias = nn.Parameter(linear.bias.detach().clone())

    def forward(self, x):
        y = _SumOverRanks.apply(torch.matmul(x, self.weight.t()))
        if self.bias is not None:
            y = y + self.bias
        return y
""",
    ),
]
