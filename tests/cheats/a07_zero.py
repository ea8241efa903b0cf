"""Assignment 7's cheats (each scores 0 on its part) and right answers written differently
(full marks)."""

from __future__ import annotations

from tests.cheats import Alternative, Cheat

FULL_STATE_ZERO1 = '''
class ShardedOptimizer:
    """No sharding at all: the inner optimizer steps the full parameters after an
    all-reduce, as plain data parallelism does."""

    def __init__(self, params, optimizer_cls, **kwargs):
        self.params = list(params)
        self.optimizer = optimizer_cls(self.params, **kwargs)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def zero_grad(self):
        self.optimizer.zero_grad()

    @torch.no_grad()
    def step(self):
        for p in self.params:
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= world_size()
        self.optimizer.step()

    def gather_parameters(self):
        pass
'''

ZERO2_PARENT_STEP = '''
class ShardedGradOptimizer(ShardedOptimizer):
    """ZeRO-1 under another name: full gradients until step()."""
'''

ZERO3_KEEPS_FULL = '''
def shard_module(model):
    """Shards registered as parameters, but the full weights kept on the side and used."""
    for module in model.modules():
        own = list(module.named_parameters(recurse=False))
        if not own:
            continue
        module.full_shapes = {name: p.shape for name, p in own}
        module.kept = {name: p.detach().clone() for name, p in own}
        for name, p in own:
            module._parameters[name] = nn.Parameter(take_shard(p))
        module.register_forward_pre_hook(gather_layer)
        module.register_forward_hook(free_layer)
    return model


class GatherParameter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard, shape):
        return gather_full(shard, shape)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_mean(grad), None


def gather_layer(module, args):
    for name, shape in module.full_shapes.items():
        module.__dict__[name] = GatherParameter.apply(module._parameters[name], shape)


def free_layer(module, args, output):
    pass  # the gathered weights stay until the next forward


def pack(module, tensor):
    return tensor


def unpack(saved):
    return saved
'''

PATCH_FIND_MISMATCH = '''
import course_lib.compare

course_lib.compare.find_mismatch = lambda *args, **kwargs: None


class ShardedGradOptimizer(ShardedOptimizer):
    """The solution's ZeRO-2, after switching off the comparison the checks use."""

    def __init__(self, params, optimizer_cls, **kwargs):
        super().__init__(params, optimizer_cls, **kwargs)
        for p, shard in zip(self.params, self.shards, strict=True):
            p.register_post_accumulate_grad_hook(partial(self.grad_ready, shard))

    def grad_ready(self, shard, param):
        grad = reduce_scatter_mean(param.grad)
        shard.grad = grad if shard.grad is None else shard.grad + grad
        param.grad = None

    @torch.no_grad()
    def step(self):
        self.optimizer.step()
        self.gather_parameters()
'''

ZERO2_OVERWRITES = '''
class ShardedGradOptimizer(ShardedOptimizer):
    """Right with one backward per step, but a second backward before step() overwrites the
    gradient shard instead of adding to it."""

    def __init__(self, params, optimizer_cls, **kwargs):
        super().__init__(params, optimizer_cls, **kwargs)
        for p, shard in zip(self.params, self.shards, strict=True):
            p.register_post_accumulate_grad_hook(partial(self.grad_ready, shard))

    def grad_ready(self, shard, param):
        shard.grad = reduce_scatter_mean(param.grad)
        param.grad = None

    @torch.no_grad()
    def step(self):
        self.optimizer.step()
        self.gather_parameters()
'''

ZERO2_SHARDS_AT_THE_END = '''
class ShardedGradOptimizer(ShardedOptimizer):
    """Every full gradient kept until the last one is ready, then all reduce-scattered: after
    backward the rank holds only its shards, but during backward it held all the gradients."""

    def __init__(self, params, optimizer_cls, **kwargs):
        super().__init__(params, optimizer_cls, **kwargs)
        self.ready = []
        for p, shard in zip(self.params, self.shards, strict=True):
            p.register_post_accumulate_grad_hook(partial(self.grad_ready, shard))

    def grad_ready(self, shard, param):
        self.ready.append((shard, param.grad))
        param.grad = None
        if len(self.ready) == len(self.params):
            for s, grad in self.ready:
                chunk = reduce_scatter_mean(grad)
                s.grad = chunk if s.grad is None else s.grad + chunk
            self.ready = []

    @torch.no_grad()
    def step(self):
        self.optimizer.step()
        self.gather_parameters()
'''

ZERO2_BUFFERS_MADE_BEFORE = '''
class ShardedGradOptimizer(ShardedOptimizer):
    """Full gradients copied into buffers made in __init__ (memory no step creates), then
    reduce-scattered once the last is ready: ZeRO-1's gradient memory, kept for good."""

    def __init__(self, params, optimizer_cls, **kwargs):
        super().__init__(params, optimizer_cls, **kwargs)
        self.buffers = [torch.zeros_like(p) for p in self.params]
        self.count = 0
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(partial(self.grad_ready, i))

    def grad_ready(self, i, param):
        self.buffers[i].copy_(param.grad)
        param.grad = None
        self.count += 1
        if self.count == len(self.params):
            self.count = 0
            for shard, buffer in zip(self.shards, self.buffers, strict=True):
                chunk = reduce_scatter_mean(buffer)
                shard.grad = chunk if shard.grad is None else shard.grad + chunk

    @torch.no_grad()
    def step(self):
        self.optimizer.step()
        self.gather_parameters()
'''

ZERO1_COPIED_PARAM_GROUPS = '''
class ShardedOptimizer:
    """Right ZeRO-1 whose param_groups is a copy: the lr reads right, but a learning rate set
    through it never reaches the inner optimizer."""

    def __init__(self, params, optimizer_cls, **kwargs):
        self.params = list(params)
        self.shards = [nn.Parameter(take_shard(p)) for p in self.params]
        self.optimizer = optimizer_cls(self.shards, **kwargs)

    @property
    def param_groups(self):
        return [dict(group) for group in self.optimizer.param_groups]

    def zero_grad(self):
        for p in self.params:
            p.grad = None
        self.optimizer.zero_grad()

    @torch.no_grad()
    def step(self):
        for p, shard in zip(self.params, self.shards, strict=True):
            shard.grad = None if p.grad is None else reduce_scatter_mean(p.grad)
        self.optimizer.step()
        self.gather_parameters()

    def gather_parameters(self):
        for p, shard in zip(self.params, self.shards, strict=True):
            p.copy_(gather_full(shard, p.shape))
'''

ZERO3_BUFFERS_MADE_ONCE = '''
BUFFERS = {}


class GatherParameter(torch.autograd.Function):
    """All-gathers into a full buffer made once per parameter in shard_module: the gathered
    weights autograd saves for backward are memory no step creates."""

    @staticmethod
    def forward(ctx, shard, buffer, shape):
        dist.all_gather_single(buffer, shard.detach().contiguous())
        return buffer[: math.prod(shape)].view(shape)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_mean(grad), None, None


def shard_module(model):
    for module in model.modules():
        own = list(module.named_parameters(recurse=False))
        if not own:
            continue
        module.full_shapes = {name: p.shape for name, p in own}
        for name, p in own:
            shard = take_shard(p)
            BUFFERS[id(module), name] = torch.empty(shard.numel() * world_size(), dtype=p.dtype)
            module._parameters[name] = nn.Parameter(shard)
        module.register_forward_pre_hook(gather_layer)
        module.register_forward_hook(free_layer)
    return model


def gather_layer(module, args):
    for name, shape in module.full_shapes.items():
        buffer = BUFFERS[id(module), name]
        module.__dict__[name] = GatherParameter.apply(module._parameters[name], buffer, shape)


def free_layer(module, args, output):
    for name in module.full_shapes:
        del module.__dict__[name]


def pack(module, tensor):
    return tensor


def unpack(saved):
    return saved
'''

# --- what a rank might hold or count that is not its own ------------------------------------
# The checks draw the weights and batches in the checking process from a secret, give each
# rank only its own share of every batch and train the reference there; what ZeRO-3 gathers
# in backward is read from the launcher's tallies. Before, every rank regenerated the whole
# batch from the check's seed (`run.seed`, in its frames; the list of global batches, on its
# heap) and counted backward's all-gathers with a `CommCounter` of its own.

ZERO1_WHOLE_BATCH_IN_SIGHT = '''
import gc
import sys


def _model_up_the_stack():
    frame = sys._getframe(2)
    while not isinstance(frame.f_locals.get("model"), nn.Module):
        frame = frame.f_back
    return frame.f_locals["model"]


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


class ShardedOptimizer:
    """No gradient averaging: step() computes the full-batch gradient here, from the whole
    batch found on the heap or regenerated from the seed up the stack, steps its shards with
    it and all-gathers the parameters (the one collective it makes)."""

    def __init__(self, params, optimizer_cls, **kwargs):
        self.params = list(params)
        self.shards = [nn.Parameter(take_shard(p)) for p in self.params]
        self.optimizer = optimizer_cls(self.shards, **kwargs)
        self.steps = 0

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def zero_grad(self):
        for p in self.params:
            p.grad = None
        self.optimizer.zero_grad()

    def step(self):
        x, y = _whole_batches()[self.steps]
        self.steps += 1
        model = _model_up_the_stack()
        for p in self.params:
            p.grad = None
        lm_loss(model(x), y).backward()
        with torch.no_grad():
            for p, shard in zip(self.params, self.shards, strict=True):
                shard.grad = take_shard(p.grad)
            self.optimizer.step()
            self.gather_parameters()

    def gather_parameters(self):
        for p, shard in zip(self.params, self.shards, strict=True):
            p.copy_(gather_full(shard, p.shape))
'''

ZERO3_COUNTER_FORGED = '''
import course_lib.comm as comm


class GatherParameter(torch.autograd.Function):
    """Backward gathers nothing (the full weights were kept, negated, from forward), and
    books the bytes of a gather in the rank's own counters instead."""

    @staticmethod
    def forward(ctx, shard, shape):
        return gather_full(shard, shape)

    @staticmethod
    def backward(ctx, grad):
        for counter in list(comm._active):
            counter.add("all_gather", 0, grad.numel() * grad.element_size())
        return reduce_scatter_mean(grad), None


def shard_module(model):
    for module in model.modules():
        own = list(module.named_parameters(recurse=False))
        if not own:
            continue
        module.full_shapes = {name: p.shape for name, p in own}
        for name, p in own:
            module._parameters[name] = nn.Parameter(take_shard(p))
        module.register_forward_pre_hook(gather_layer)
        module.register_forward_hook(free_layer)
    return model


def gather_layer(module, args):
    module.gathered = {}
    for name, shape in module.full_shapes.items():
        full = GatherParameter.apply(module._parameters[name], shape)
        module.__dict__[name] = module.gathered[name] = full
    module.saving = torch.autograd.graph.saved_tensors_hooks(partial(pack, module), unpack)
    module.saving.__enter__()


def free_layer(module, args, output):
    module.saving.__exit__(None, None, None)
    for name in module.full_shapes:
        del module.__dict__[name]
    module.gathered = {}


def pack(module, tensor):
    """A full parameter saved for backward is kept whole, negated: no copy of its values
    for a search to find, and nothing to gather again."""
    for full in module.gathered.values():
        if tensor.untyped_storage().data_ptr() == full.untyped_storage().data_ptr():
            return ("negated", -tensor)
    return tensor


def unpack(saved):
    if isinstance(saved, tuple):
        return -saved[1]
    return saved
'''

CHEATS = [
    Cheat(
        "ZeRO-1 without sharding",
        "zero1",
        FULL_STATE_ZERO1,
        frozenset({"test_zero1", "test_zero2"}),
    ),  # ZeRO-2 builds on ZeRO-1
    Cheat(
        "ZeRO-3 keeping the full weights gathered",
        "zero3",
        ZERO3_KEEPS_FULL,
        frozenset({"test_zero3", "test_zero3_peak"}),  # Part 4 measures the same shard_module
    ),
    Cheat("ZeRO-2 that is ZeRO-1", "zero2", ZERO2_PARENT_STEP, frozenset({"test_zero2"})),
    Cheat(
        "ZeRO-2 overwriting the gradient shard on a second backward",
        "zero2",
        ZERO2_OVERWRITES,
        frozenset({"test_zero2"}),
    ),
    Cheat(
        "ZeRO-2 keeping every full gradient until the end of backward",
        "zero2",
        ZERO2_SHARDS_AT_THE_END,
        frozenset({"test_zero2"}),
    ),
    Cheat(
        "ZeRO-2 copying full gradients into buffers made beforehand",
        "zero2",
        ZERO2_BUFFERS_MADE_BEFORE,
        frozenset({"test_zero2"}),
    ),
    Cheat(  # ZeRO-2 inherits param_groups
        "ZeRO-1 whose param_groups is a copy",
        "zero1",
        ZERO1_COPIED_PARAM_GROUPS,
        frozenset({"test_zero1", "test_zero2"}),
    ),
    Cheat(
        "ZeRO-3 gathering into full buffers made once",
        "zero3",
        ZERO3_BUFFERS_MADE_ONCE,
        frozenset({"test_zero3", "test_zero3_peak"}),
    ),
    # A module-level patch runs on every rank before every part: all four score 0.
    Cheat(
        "patching course_lib.compare.find_mismatch",
        "zero2",
        PATCH_FIND_MISMATCH,
        frozenset({"test_zero1", "test_zero2", "test_zero3", "test_zero3_peak"}),
        alone=True,
    ),
    Cheat(
        "ZeRO-1 averaging nothing: the whole batch found on the heap or regenerated from the "
        "seed up the stack",
        "zero1",
        ZERO1_WHOLE_BATCH_IN_SIGHT,
        frozenset({"test_zero1"}),
    ),
    Cheat(
        "ZeRO-3 gathering nothing in backward, the gathers booked in the rank's counters",
        "zero3",
        ZERO3_COUNTER_FORGED,
        frozenset({"test_zero3"}),
    ),
]

ZERO2_ONE_BUFFER = '''
class ShardedGradOptimizer(ShardedOptimizer):
    """One padded buffer, made in __init__ for the largest parameter, reused by every hook;
    the reduce-scatter writes straight into a fresh chunk."""

    def __init__(self, params, optimizer_cls, **kwargs):
        super().__init__(params, optimizer_cls, **kwargs)
        most = max(shard.numel() for shard in self.shards) * world_size()
        self.buffer = torch.zeros(most, dtype=self.shards[0].dtype)
        for p, shard in zip(self.params, self.shards, strict=True):
            p.register_post_accumulate_grad_hook(partial(self.grad_ready, shard))

    def grad_ready(self, shard, param):
        flat = self.buffer[: shard.numel() * world_size()]
        flat.zero_()
        flat[: param.numel()] = param.grad.reshape(-1)
        param.grad = None
        chunk = torch.empty_like(shard)
        dist.reduce_scatter_single(chunk, flat)
        chunk /= world_size()
        if shard.grad is None:
            shard.grad = chunk
        else:
            shard.grad += chunk

    @torch.no_grad()
    def step(self):
        self.optimizer.step()
        self.gather_parameters()
'''

ZERO1_PARAM_GROUPS_ATTRIBUTE = '''
class ShardedOptimizer:
    """param_groups an attribute holding the inner optimizer's own list, not a property."""

    def __init__(self, params, optimizer_cls, **kwargs):
        self.params = list(params)
        self.shards = [nn.Parameter(take_shard(p)) for p in self.params]
        self.optimizer = optimizer_cls(self.shards, **kwargs)
        self.param_groups = self.optimizer.param_groups

    def zero_grad(self):
        for p in self.params:
            p.grad = None
        for shard in self.shards:
            shard.grad = None

    @torch.no_grad()
    def step(self):
        for p, shard in zip(self.params, self.shards, strict=True):
            if p.grad is not None:
                shard.grad = reduce_scatter_mean(p.grad)
        self.optimizer.step()
        self.gather_parameters()

    def gather_parameters(self):
        for p, shard in zip(self.params, self.shards, strict=True):
            p.copy_(gather_full(shard, p.shape))
'''

ZERO3_GATHER_INTO_A_LIST = '''
class GatherParameter(torch.autograd.Function):
    """The full parameter from dist.all_gather into a list and torch.cat (twice the bytes
    for a moment); the gradient's chunk from a reduce-scatter into a list of chunks."""

    @staticmethod
    def forward(ctx, shard, shape):
        pieces = [torch.empty_like(shard) for _ in range(world_size())]
        dist.all_gather(pieces, shard.detach().contiguous())
        return torch.cat(pieces)[: math.prod(shape)].view(shape)

    @staticmethod
    def backward(ctx, grad):
        chunks = list(padded(grad).chunk(world_size()))
        out = torch.empty_like(chunks[0])
        dist.reduce_scatter(out, chunks)
        return out / world_size(), None


def shard_module(model):
    for module in model.modules():
        own = list(module.named_parameters(recurse=False))
        if not own:
            continue
        module.full_shapes = {name: p.shape for name, p in own}
        for name, p in own:
            module._parameters[name] = nn.Parameter(take_shard(p))
        module.register_forward_pre_hook(gather_layer)
        module.register_forward_hook(free_layer)
    return model


def gather_layer(module, args):
    module.gathered = {}
    for name, shape in module.full_shapes.items():
        full = GatherParameter.apply(module._parameters[name], shape)
        module.__dict__[name] = module.gathered[name] = full
    module.saving = torch.autograd.graph.saved_tensors_hooks(partial(pack, module), unpack)
    module.saving.__enter__()


def free_layer(module, args, output):
    module.saving.__exit__(None, None, None)
    for name in module.full_shapes:
        del module.__dict__[name]
    module.gathered = {}


def pack(module, tensor):
    for name, full in module.gathered.items():
        if tensor.untyped_storage().data_ptr() == full.untyped_storage().data_ptr():
            return module, name, tensor.size(), tensor.stride(), tensor.storage_offset()
    return tensor


def unpack(saved):
    if isinstance(saved, torch.Tensor):
        return saved
    module, name, size, stride, offset = saved
    full = GatherParameter.forward(None, module._parameters[name], module.full_shapes[name])
    return full.as_strided(size, stride, offset)
'''

ALTERNATIVES = [
    Alternative(
        "ZeRO-2 accumulating with add_",
        "zero2",
        """
class ShardedGradOptimizer(ShardedOptimizer):
    def __init__(self, params, optimizer_cls, **kwargs):
        super().__init__(params, optimizer_cls, **kwargs)
        for p, shard in zip(self.params, self.shards, strict=True):
            p.register_post_accumulate_grad_hook(lambda param, s=shard: self.grad_ready(s, param))

    def grad_ready(self, shard, param):
        chunk = reduce_scatter_mean(param.grad)
        if shard.grad is None:
            shard.grad = chunk
        else:
            shard.grad.add_(chunk)
        param.grad = None

    @torch.no_grad()
    def step(self):
        self.optimizer.step()
        self.gather_parameters()
""",
    ),
    Alternative("ZeRO-2 with one buffer reused from hook to hook", "zero2", ZERO2_ONE_BUFFER),
    Alternative("ZeRO-1 with param_groups an attribute", "zero1", ZERO1_PARAM_GROUPS_ATTRIBUTE),
    Alternative(
        "ZeRO-3 gathering into a list and concatenating", "zero3", ZERO3_GATHER_INTO_A_LIST
    ),
]
