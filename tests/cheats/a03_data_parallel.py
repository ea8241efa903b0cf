"""Assignment 3's cheats (each scores 0 on its part) and right answers written differently
(full marks). Cells: "sync_gradients" (part 1), "ddp" (part 2) and "communicate_less" (part 3,
open)."""

from __future__ import annotations

from tests.cheats import Alternative, Cheat

PART1 = frozenset({"test_sync_gradients"})
PART2 = frozenset({"test_ddp"})
PART3 = frozenset({"test_communicate_less"})

# --- part 1 -------------------------------------------------------------------------------

WHOLE_BATCH_ON_EVERY_RANK = '''
import sys


def sync_gradients(model, num_samples):
    """No communication: recompute the gradient from the samples found up the stack, as if
    every rank had the whole batch. (Each rank draws its own samples: it has only those.)"""
    frame = sys._getframe(1)
    while frame is not None and not {"x", "y"} <= set(frame.f_locals):
        frame = frame.f_back
    x, y = frame.f_locals["x"], frame.f_locals["y"]
    model.zero_grad()
    (model(x) - y).pow(2).mean().backward()
'''

LECTURE_HELPER_WRAPPED = '''
from course_lib.data_parallel import allreduce_gradients


def sync_gradients(model, num_samples):
    """Weight by the shard's share, then let the lecture's allreduce_gradients average."""
    total = torch.tensor(num_samples)
    dist.all_reduce(total)
    for p in model.parameters():
        if p.grad is not None:
            p.grad *= num_samples * world_size() / total.item()
    allreduce_gradients(model)
'''

ONE_FLAT_ALL_REDUCE = '''
from torch.distributed import all_reduce


def sync_gradients(model, num_samples):
    """One all-reduce, through a name bound at import, of the weighted gradients with the
    count appended; then divide by the total."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([num_samples * g.reshape(-1) for g in grads] + [grads[0].new_ones(1)])
    flat[-1] = num_samples
    all_reduce(flat)
    flat /= flat[-1].item()
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
'''

GATHERED_COUNTS = '''
def sync_gradients(model, num_samples):
    """All-gather the counts; sum the weighted gradients through the process-group object."""
    counts = torch.zeros(world_size(), dtype=torch.int64)
    dist.all_gather_into_tensor(counts, torch.tensor([num_samples]))
    share = num_samples / counts.sum().item()
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(share)
            dist.group.WORLD.allreduce([p.grad]).wait()
'''

LECTURE_CODE_PASTED = '''
def sync_gradients(model, num_samples):
    """Weight by the shard's share, then the lecture's allreduce_gradients and its helpers,
    pasted in with new names."""
    total = torch.tensor(num_samples)
    dist.all_reduce(total)
    for p in model.parameters():
        if p.grad is not None:
            p.grad *= num_samples * world_size() / total.item()
    average(model)


def grads_of(model):
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return [p.grad for p in model.parameters()]


def flat_grads(model):
    return torch.cat([g.reshape(-1) for g in grads_of(model)])


def average(model):
    grads = flat_grads(model)
    dist.all_reduce(grads)  # sum over ranks
    grads /= world_size()
    offset = 0
    with torch.no_grad():
        for t in grads_of(model):
            t.copy_(grads[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
'''

# --- part 2 -------------------------------------------------------------------------------

_BROADCAST = """
    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    def __init__(self, module, bucket_cap_mb=25.0):
        super().__init__()
        self.module = module
        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                dist.broadcast(t, src=0)
"""

ONE_ALL_REDUCE_AFTER_BACKWARD = f'''
class DDP(nn.Module):
    """No buckets, no overlap: one all-reduce of every gradient after backward."""
{_BROADCAST}
    def finish_gradient_synchronization(self):
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= world_size()
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
'''

FAKE_BUCKETS = f'''
class DDP(nn.Module):
    """Bucket-sized all-reduces of zeros, async, early in backward for show; the real
    average one parameter at a time afterwards."""
{_BROADCAST}
        trainable = [p for p in module.parameters() if p.requires_grad]
        self.sizes, size = [], 0
        for p in reversed(trainable):
            nbytes = p.numel() * p.element_size()
            if not self.sizes or size + nbytes > bucket_cap_mb * 2**20:
                self.sizes.append(0)
                size = 0
            self.sizes[-1] += p.numel()
            size += nbytes
        self.works = []
        trainable[-1].register_post_accumulate_grad_hook(self._show)  # backward's first

    def _show(self, param):
        for n in self.sizes:
            self.works.append(dist.all_reduce(torch.zeros(n, dtype=param.dtype), async_op=True))

    def finish_gradient_synchronization(self):
        for work in self.works:
            work.wait()
        self.works = []
        for p in self.module.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= world_size()
'''

TORCH_DDP = '''
class DDP(nn.parallel.DistributedDataParallel):
    """PyTorch's own DDP behind the assignment's interface."""

    def __init__(self, module, bucket_cap_mb=25.0):
        super().__init__(module, bucket_cap_mb=bucket_cap_mb, find_unused_parameters=True)

    def finish_gradient_synchronization(self):
        pass
'''

GRADERS_BUCKET_RULE = (
    '''
from course_lib.grading.data_parallel import buckets


class DDP(nn.Module):
    """Right, but its buckets come from the grader's own rule, which ships with course_lib."""
'''
    + _BROADCAST
    + """        self.buckets = buckets(list(module.parameters()), bucket_cap_mb * 2**20)
        self.bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self.missing = [len(b) for b in self.buckets]
        self.in_flight = {}
        for b in self.buckets:
            for p in b:
                p.register_post_accumulate_grad_hook(self._grad_ready)

    def _grad_ready(self, param):
        i = self.bucket_of[id(param)]
        self.missing[i] -= 1
        if self.missing[i] == 0:
            self._launch(i)

    def _launch(self, i):
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.buckets[i]]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.in_flight[i] = (dist.all_reduce(flat, async_op=True), flat)

    def finish_gradient_synchronization(self):
        for i in range(len(self.buckets)):
            if i not in self.in_flight:
                self._launch(i)
        for i, (work, flat) in self.in_flight.items():
            work.wait()
            flat /= world_size()
            offset = 0
            for p in self.buckets[i]:
                if p.grad is not None:
                    p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        self.missing = [len(b) for b in self.buckets]
        self.in_flight = {}
"""
)

OTHER_STYLE = (
    '''
from torch.distributed import all_reduce


class DDP(nn.Module):
    """The rule's buckets, each a preallocated buffer laid out first-registered first,
    averaged with ReduceOp.AVG through a name bound at import; readiness kept as sets, and
    incomplete buckets sent last one first."""
'''
    + _BROADCAST
    + """        self.buckets, room = [], 0
        for p in reversed([p for p in module.parameters() if p.requires_grad]):
            nbytes = p.numel() * p.element_size()
            if not self.buckets or nbytes > room:
                self.buckets.append([])
                room = bucket_cap_mb * 2**20
            self.buckets[-1].insert(0, p)
            room -= nbytes
        self.buffers = [torch.cat([p.detach().reshape(-1) for p in b]) for b in self.buckets]
        self.waiting = [set(map(id, b)) for b in self.buckets]
        self.works = [None] * len(self.buckets)
        for i, bucket in enumerate(self.buckets):
            for p in bucket:
                p.register_post_accumulate_grad_hook(lambda p, i=i: self._ready(i, p))

    def _ready(self, i, p):
        self.waiting[i].discard(id(p))
        if not self.waiting[i]:
            self._send(i)

    def _send(self, i):
        offset = 0
        for p in self.buckets[i]:
            view = self.buffers[i][offset : offset + p.numel()]
            view.copy_(p.grad.reshape(-1) if p.grad is not None else torch.zeros_like(view))
            offset += p.numel()
        self.works[i] = all_reduce(self.buffers[i], op=dist.ReduceOp.AVG, async_op=True)

    def finish_gradient_synchronization(self):
        for i in reversed(range(len(self.buckets))):
            if self.works[i] is None:
                self._send(i)
        for i, bucket in enumerate(self.buckets):
            self.works[i].wait()
            offset = 0
            for p in bucket:
                if p.grad is not None:
                    p.grad.view(-1).copy_(self.buffers[i][offset : offset + p.numel()])
                offset += p.numel()
        self.works = [None] * len(self.buckets)
        self.waiting = [set(map(id, b)) for b in self.buckets]
"""
)

GROUP_OBJECT = (
    '''
class DDP(nn.Module):
    """The rule's buckets, launched through the process-group object (which returns a Work
    at once) in a hook per parameter that counts down."""
'''
    + _BROADCAST
    + """        cap, self.buckets, size = bucket_cap_mb * 2**20, [[]], 0
        for p in reversed([p for p in module.parameters() if p.requires_grad]):
            nbytes = p.numel() * p.element_size()
            if self.buckets[-1] and size + nbytes > cap:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += nbytes
        self.left = [len(b) for b in self.buckets]
        self.sent = {}
        for i, bucket in enumerate(self.buckets):
            for p in bucket:
                p.register_post_accumulate_grad_hook(lambda p, i=i: self._count_down(i))

    def _count_down(self, i):
        self.left[i] -= 1
        if self.left[i] == 0:
            self._send(i)

    def _send(self, i):
        flat = torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
             for p in self.buckets[i]]
        )
        self.sent[i] = (dist.group.WORLD.allreduce([flat]), flat)

    def finish_gradient_synchronization(self):
        for i in range(len(self.buckets)):
            if i not in self.sent:
                self._send(i)
        for i, (work, flat) in self.sent.items():
            work.wait()
            flat /= world_size()
            for p, piece in zip(self.buckets[i], flat.split([p.numel() for p in self.buckets[i]])):
                if p.grad is not None:
                    p.grad.copy_(piece.view_as(p))
        self.left = [len(b) for b in self.buckets]
        self.sent = {}
"""
)

# --- part 3 -------------------------------------------------------------------------------

LECTURE_AVERAGING_EVERY_4 = '''
from course_lib.data_parallel import average_parameters


def communicate_less(model, optimizer, batches):
    """Local SGD every 4 steps, averaged by the lecture's average_parameters."""
    for t, (x, y) in enumerate(batches):
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        if (t + 1) % 4 == 0 or t == len(batches) - 1:
            average_parameters(model)
'''

AVERAGE_ONCE_AT_THE_END = '''
def communicate_less(model, optimizer, batches):
    """Train alone, then average the parameters once: a few bytes, equal ranks, but the
    models drifted apart on their own regions and their average fits none."""
    for x, y in batches:
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    with torch.no_grad():
        for p in model.parameters():
            dist.all_reduce(p)
            p /= world_size()
'''

HALF_PRECISION_EVERY_2 = '''
def communicate_less(model, optimizer, batches):
    """Local SGD every 2 steps, the parameters averaged in float16: half the bytes per
    average, so twice as many averages fit in the budget."""
    params = list(model.parameters())
    for t, (x, y) in enumerate(batches):
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        if t % 2 == 1 or t == len(batches) - 1:
            with torch.no_grad():
                flat = torch.cat([p.reshape(-1) for p in params]).half()
                dist.all_reduce(flat)
                flat = flat.float() / world_size()
                for p, part in zip(params, flat.split([p.numel() for p in params]), strict=True):
                    p.copy_(part.view_as(p))
'''

WARM_UP_THEN_EVERY_8 = '''
def communicate_less(model, optimizer, batches):
    """Local SGD with a warm-up: parameters averaged after each of the first 4 steps, then
    every 8, one all-reduce per parameter."""
    for t, (x, y) in enumerate(batches):
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        if t < 4 or (t + 1) % 8 == 0 or t == len(batches) - 1:
            with torch.no_grad():
                for p in model.parameters():
                    dist.all_reduce(p)
                    p /= world_size()
'''

CHEATS = [
    Cheat(
        "every rank recomputes from its own samples, no communication",
        "sync_gradients",
        WHOLE_BATCH_ON_EVERY_RANK,
        PART1,
    ),
    Cheat(
        "the lecture's allreduce_gradients, after weighting",
        "sync_gradients",
        LECTURE_HELPER_WRAPPED,
        PART1,
    ),
    Cheat(
        "one all-reduce after backward: no buckets, no overlap",
        "ddp",
        ONE_ALL_REDUCE_AFTER_BACKWARD,
        PART2,
    ),
    Cheat(
        "bucket-sized all-reduces of zeros for show, the real average after backward",
        "ddp",
        FAKE_BUCKETS,
        PART2,
    ),
    Cheat("PyTorch's DistributedDataParallel behind the interface", "ddp", TORCH_DDP, PART2),
    Cheat(
        "the lecture's code pasted under new names", "sync_gradients", LECTURE_CODE_PASTED, PART1
    ),
    Cheat("buckets from the grader's own rule", "ddp", GRADERS_BUCKET_RULE, PART2),
    Cheat(
        "local SGD through the lecture's average_parameters",
        "communicate_less",
        LECTURE_AVERAGING_EVERY_4,
        PART3,
    ),
    Cheat(
        "parameters averaged only once, at the end",
        "communicate_less",
        AVERAGE_ONCE_AT_THE_END,
        PART3,
    ),
]

ALTERNATIVES = [
    Alternative(
        "one flat all-reduce with the count appended, through a pre-bound name",
        "sync_gradients",
        ONE_FLAT_ALL_REDUCE,
    ),
    Alternative(
        "counts by all-gather, sums through the group object", "sync_gradients", GATHERED_COUNTS
    ),
    Alternative(
        "preallocated buffers in another order, ReduceOp.AVG, pre-bound all_reduce",
        "ddp",
        OTHER_STYLE,
    ),
    Alternative("buckets launched through the process-group object", "ddp", GROUP_OBJECT),
    Alternative(
        "parameters averaged every 2 steps in float16", "communicate_less", HALF_PRECISION_EVERY_2
    ),
    Alternative(
        "local SGD every 8 steps after 4 steps of warm-up", "communicate_less", WARM_UP_THEN_EVERY_8
    ),
]
