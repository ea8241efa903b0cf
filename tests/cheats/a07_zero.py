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
    # A module-level patch runs on every rank before every part: all four score 0.
    Cheat(
        "patching course_lib.compare.find_mismatch",
        "zero2",
        PATCH_FIND_MISMATCH,
        frozenset({"test_zero1", "test_zero2", "test_zero3", "test_zero3_peak"}),
        alone=True,
    ),
]

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
]
