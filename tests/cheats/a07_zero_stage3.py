"""Assignment 7's ZeRO-3 cheats and right answers written differently, as cell sources
(`tests/cheats/a07_zero.py` lists them). Most share the solution's way of hooking layers,
written once here: what differs is how a parameter is gathered and what backward saves."""

from __future__ import annotations

# Each parameter replaced by its shard; a layer's full parameters gathered before its forward
# (`gather_layer`) and freed after it (`free_layer`).
SHARD_MODULE = """
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
"""

# The solution's layer hooks: the gathered parameters go through `pack` when backward saves
# them, and are dropped once the layer has run.
SAVING_HOOKS = """
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
"""

# Backward keeps what forward saved (the solution's `pack` and `unpack` names, doing nothing).
SAVED_AS_IS = """
def pack(module, tensor):
    return tensor


def unpack(saved):
    return saved
"""

ZERO3_KEEPS_FULL = (
    '''
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
'''
    + SAVED_AS_IS
)

ZERO3_BUFFERS_MADE_ONCE = (
    '''
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
'''
    + SAVED_AS_IS
)

# What ZeRO-3 gathers in backward is read from the launcher's tallies; before, it was read
# from a `CommCounter` on the rank, which this cheat books a gather in without making one.
ZERO3_COUNTER_FORGED = (
    '''
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
'''
    + SHARD_MODULE
    + SAVING_HOOKS
    + '''
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
)

ZERO3_GATHER_INTO_A_LIST = (
    '''
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
'''
    + SHARD_MODULE
    + SAVING_HOOKS
    + """
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
"""
)
