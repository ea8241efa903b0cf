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

# What every rank holds is its own (issue 28): the checking process draws the samples and the
# weights and gives each rank only its own, computes the reference itself and counts the
# calls outside the ranks. The three ways at what a rank might otherwise hold:

FRAMES_AND_HEAP = '''
import gc
import sys


def _samples_in_sight():
    """Every (x, y) pair of samples in the callers' frames and on the heap: the other ranks'
    shards, if the check left them where this rank's code runs."""
    found, seen = [], set()

    def take(x, y):
        if (
            isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dim() == 2
            and len(x) == len(y) and x.shape[1] == 8 and id(x) not in seen
        ):
            seen.add(id(x))
            found.append((x, y))

    frame = sys._getframe(2)
    while frame is not None:
        take(frame.f_locals.get("x"), frame.f_locals.get("y"))
        frame = frame.f_back
    for obj in gc.get_objects():
        if isinstance(obj, dict) and "x" in obj and "y" in obj:
            take(obj["x"], obj["y"])
        elif isinstance(obj, tuple) and len(obj) == 2:
            take(*obj)
    return found


def sync_gradients(model, num_samples):
    """The gradient of every sample in sight, computed here; one all-reduce of a zero, for
    show."""
    found = _samples_in_sight()
    x = torch.cat([x for x, _ in found]).to(next(model.parameters()).dtype)
    y = torch.cat([y for _, y in found]).to(x.dtype)
    model.zero_grad()
    (model(x) - y).pow(2).mean().backward()
    dist.all_reduce(torch.zeros(1))
'''

GRADERS_REFERENCE_LOSS = '''
import sys

from course_lib.grading.data_parallel_runs import per_sample_loss


def sync_gradients(model, num_samples):
    """Gather every rank's samples (found up the stack), and let the grader's own loss, the
    one its reference trains with, give the full-batch gradient."""
    frame = sys._getframe(1)
    while "run" not in frame.f_locals:
        frame = frame.f_back
    run, here = frame.f_locals["run"], frame.f_locals
    x, y = (here["x"], here["y"]) if "x" in here else (here["given"]["x"], here["given"]["y"])
    counts = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size())]
    dist.all_gather(counts, torch.tensor([len(x)]))
    most = max(int(c) for c in counts)
    padded = [torch.cat([t, t.new_zeros(most - len(t), *t.shape[1:])]) for t in (x, y)]
    xs = [torch.empty_like(padded[0]) for _ in counts]
    ys = [torch.empty_like(padded[1]) for _ in counts]
    dist.all_gather(xs, padded[0])
    dist.all_gather(ys, padded[1])
    whole_x = torch.cat([t[: int(c)] for t, c in zip(xs, counts)])
    whole_y = torch.cat([t[: int(c)] for t, c in zip(ys, counts)])
    model.zero_grad()
    per_sample_loss(run, model(whole_x), whole_y).mean().backward()
'''

TORCH_DDP_IN_SYNC = '''
def sync_gradients(model, num_samples):
    """Right, but it first wraps the model in PyTorch's DDP once, to be sure the replicas
    agree (its constructor broadcasts rank 0's weights)."""
    if not getattr(model, "replicas_checked", False):
        nn.parallel.DistributedDataParallel(model)
        model.replicas_checked = True
    total = torch.tensor(num_samples)
    dist.all_reduce(total)
    share = num_samples / total.item()
    for p in model.parameters():
        if p.grad is not None:
            p.grad *= share
            dist.all_reduce(p.grad)
'''

SEND_RECV_ONLY = '''
def sync_gradients(model, num_samples):
    """Point-to-point only: every rank sends its count and its weighted gradients to rank 0,
    which sums them, divides by the total and sends the result back."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([num_samples * g.reshape(-1) for g in grads] + [grads[0].new_ones(1)])
    flat[-1] = num_samples
    if rank() == 0:
        for src in range(1, world_size()):
            other = torch.empty_like(flat)
            dist.recv(other, src=src)
            flat += other
        flat[:-1] /= flat[-1].item()
        for dst in range(1, world_size()):
            dist.send(flat, dst=dst)
    else:
        dist.send(flat, dst=0)
        dist.recv(flat, src=0)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
'''

GATHERED_IN_FLOAT64 = '''
def sync_gradients(model, num_samples):
    """Every rank's count and flat gradient by all-gather; the weighted average computed
    locally in float64 and rounded once to the gradients' dtype."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    counts = [torch.zeros(1, dtype=torch.float64) for _ in range(world_size())]
    dist.all_gather(counts, torch.tensor([float(num_samples)], dtype=torch.float64))
    flats = [torch.empty_like(flat) for _ in range(world_size())]
    dist.all_gather(flats, flat)
    total = sum(c.item() for c in counts)
    average = sum(c.item() * f.double() for c, f in zip(counts, flats)) / total
    offset = 0
    for g in grads:
        g.copy_(average[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
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

# The solution's buckets, hooks and finish, for the cheats below that change one thing.
_BUCKETS_BY_THE_RULE = """        cap, self.buckets, size = bucket_cap_mb * 2**20, [[]], 0
        for p in reversed([p for p in module.parameters() if p.requires_grad]):
            nbytes = p.numel() * p.element_size()
            if self.buckets[-1] and size + nbytes > cap:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += nbytes
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
"""

SAME_START_FROM_THE_STACK = (
    '''
import inspect
import sys


def rank0_twin(module):
    """Rank 0's initial model without a message: the seed of its weights, found up the stack,
    and a copy of the model's class (pasted from its source, so not the grader's code)."""
    frame, seed = sys._getframe(2), None
    while frame is not None and seed is None:
        run = frame.f_locals.get("run")
        if isinstance(getattr(run, "seed", None), int):
            seed = run.seed
        elif isinstance(frame.f_locals.get("seed"), int):
            seed = frame.f_locals["seed"]
        frame = frame.f_back
    cls = type(module)
    namespace = dict(vars(sys.modules[cls.__module__]))
    exec(inspect.getsource(cls), namespace)
    return namespace[cls.__name__](seed=seed, dtype=next(module.parameters()).dtype)


class DDP(nn.Module):
    """Right buckets and overlap; no broadcast: rank 0's weights rebuilt from its seed."""

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    def __init__(self, module, bucket_cap_mb=25.0):
        super().__init__()
        self.module = module
        module.load_state_dict(rank0_twin(module).state_dict())
'''
    + _BUCKETS_BY_THE_RULE
    + """
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

HIDDEN_ALL_GATHER = (
    '''
from course_lib import comm


class DDP(nn.Module):
    """Bucket-sized all-reduces of zeros, from the hooks, for show: the buckets and the overlap
    the check wants to see. The real average travels by all-gather after backward, with the
    rank's counters and hooks (comm._active, comm._around) emptied around it."""
'''
    + _BROADCAST
    + _BUCKETS_BY_THE_RULE
    + """
    def _launch(self, i):
        zeros = torch.zeros(sum(p.numel() for p in self.buckets[i]), dtype=self.buckets[i][0].dtype)
        self.in_flight[i] = dist.all_reduce(zeros, async_op=True)

    def finish_gradient_synchronization(self):
        for i in range(len(self.buckets)):
            if i not in self.in_flight:
                self._launch(i)
        for work in self.in_flight.values():
            work.wait()
        hidden = list(comm._active), list(comm._around)
        comm._active.clear()
        comm._around.clear()
        try:
            for p in self.module.parameters():
                if p.grad is not None:
                    gathered = p.grad.new_empty(world_size() * p.shape[0], *p.shape[1:])
                    dist.all_gather_into_tensor(gathered, p.grad.contiguous())
                    p.grad.copy_(gathered.view(world_size(), *p.shape).mean(dim=0))
        finally:
            comm._active.extend(hidden[0])
            comm._around.extend(hidden[1])
        self.missing = [len(b) for b in self.buckets]
        self.in_flight = {}
"""
)

FUTURES = (
    '''
class DDP(nn.Module):
    """The rule's buckets, each all-reduce kept as the Future of its Work, waited for through
    the Future in finish_gradient_synchronization."""
'''
    + _BROADCAST
    + _BUCKETS_BY_THE_RULE
    + """
    def _launch(self, i):
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.buckets[i]]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.in_flight[i] = (dist.all_reduce(flat, async_op=True).get_future(), flat)

    def finish_gradient_synchronization(self):
        for i in range(len(self.buckets)):
            if i not in self.in_flight:
                self._launch(i)
        for i, (future, flat) in self.in_flight.items():
            future.wait()
            for p, piece in zip(self.buckets[i], flat.split([p.numel() for p in self.buckets[i]])):
                if p.grad is not None:
                    p.grad.copy_(piece.view_as(p) / world_size())
        self.missing = [len(b) for b in self.buckets]
        self.in_flight = {}
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

PER_STEP_COUNTERS_EMPTIED = '''
from course_lib import comm


def communicate_less(model, optimizer, batches):
    """Every gradient averaged at every step (the baseline itself, 4x the budget), with the
    rank's byte counters and hooks (comm._active, comm._around) emptied around each
    all-reduce, so that they count nothing."""
    params = list(model.parameters())
    for x, y in batches:
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        hidden = list(comm._active), list(comm._around)
        comm._active.clear()
        comm._around.clear()
        try:
            dist.all_reduce(flat)
        finally:
            comm._active.extend(hidden[0])
            comm._around.extend(hidden[1])
        flat /= world_size()
        for p, part in zip(params, flat.split([p.numel() for p in params]), strict=True):
            p.grad.copy_(part.view_as(p))
        optimizer.step()
'''

PER_STEP_INNER_GROUP = '''
def communicate_less(model, optimizer, batches):
    """Every gradient averaged at every step, on the counted group's inner gloo group, which
    reports nothing: the rank's sockets carry the bytes all the same."""
    params = list(model.parameters())
    inner = dist.group.WORLD._inner
    for x, y in batches:
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        inner.allreduce([flat]).wait()
        flat /= world_size()
        for p, part in zip(params, flat.split([p.numel() for p in params]), strict=True):
            p.grad.copy_(part.view_as(p))
        optimizer.step()
'''

RING_OF_SENDS = '''
def ring_average(flat):
    """A ring all-reduce of isend/irecv, then the division: 2(P-1)/P of the bytes per rank."""
    p, me = world_size(), rank()
    chunks = list(flat.tensor_split(p))
    right, left = (me + 1) % p, (me - 1) % p
    for phase in range(2 * (p - 1)):
        send_i, recv_i = (me - phase) % p, (me - phase - 1) % p
        incoming = torch.empty_like(chunks[recv_i])
        sent = dist.isend(chunks[send_i].clone(), dst=right)
        dist.irecv(incoming, src=left).wait()
        sent.wait()
        if phase < p - 1:
            chunks[recv_i] += incoming
        else:
            chunks[recv_i].copy_(incoming)
    flat /= p


def communicate_less(model, optimizer, batches):
    """Local SGD: the parameters averaged every 4 steps by a ring of sends and receives."""
    params = list(model.parameters())
    for t, (x, y) in enumerate(batches):
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        if (t + 1) % 4 == 0 or t == len(batches) - 1:
            with torch.no_grad():
                flat = torch.cat([p.reshape(-1) for p in params])
                ring_average(flat)
                for p, part in zip(params, flat.split([p.numel() for p in params]), strict=True):
                    p.copy_(part.view_as(p))
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
    # Issue 28: what a rank might hold, count or run that is not its own.
    Cheat(
        "the gradient of every sample found in the frames and on the heap, a zero all-reduced",
        "sync_gradients",
        FRAMES_AND_HEAP,
        PART1,
    ),
    Cheat(
        "samples gathered, the full-batch gradient by the grader's own reference loss",
        "sync_gradients",
        GRADERS_REFERENCE_LOSS,
        PART1,
    ),
    Cheat(
        "right, after wrapping the model in PyTorch's DDP once",
        "sync_gradients",
        TORCH_DDP_IN_SYNC,
        PART1,
    ),
    Cheat(
        "no broadcast: rank 0's weights rebuilt from a seed found up the stack",
        "ddp",
        SAME_START_FROM_THE_STACK,
        PART2,
    ),
    Cheat(
        "zeros all-reduced in buckets for show, the average by an all-gather counted by nothing",
        "ddp",
        HIDDEN_ALL_GATHER,
        PART2,
    ),
    Cheat(
        "per-step all-reduce with the rank's counters emptied around it",
        "communicate_less",
        PER_STEP_COUNTERS_EMPTIED,
        PART3,
    ),
    Cheat(
        "per-step all-reduce on the counted group's inner gloo group",
        "communicate_less",
        PER_STEP_INNER_GROUP,
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
    Alternative("send and recv only, through rank 0", "sync_gradients", SEND_RECV_ONLY),
    Alternative(
        "all-gathered gradients averaged locally in float64", "sync_gradients", GATHERED_IN_FLOAT64
    ),
    Alternative("buckets waited for through their Futures", "ddp", FUTURES),
    Alternative(
        "local SGD every 4 steps, averaged by a ring of isend/irecv",
        "communicate_less",
        RING_OF_SENDS,
    ),
]
