"""Assignment 7's ZeRO-1 and ZeRO-2 cheats and right answers written differently, as cell
sources (`tests/cheats/a07_zero.py` lists them). The methods the solution's classes share
are written once here; each source is the solution with the methods it changes."""

from __future__ import annotations

# --- the solution's methods ----------------------------------------------------------------

ZERO1_INIT = """
    def __init__(self, params, optimizer_cls, **kwargs):
        self.params = list(params)
        self.shards = [nn.Parameter(take_shard(p)) for p in self.params]
        self.optimizer = optimizer_cls(self.shards, **kwargs)
"""

PARAM_GROUPS = """
    @property
    def param_groups(self):
        return self.optimizer.param_groups
"""

ZERO_GRAD = """
    def zero_grad(self):
        for p in self.params:
            p.grad = None
        self.optimizer.zero_grad()
"""

GATHER_PARAMETERS = """
    def gather_parameters(self):
        for p, shard in zip(self.params, self.shards, strict=True):
            p.copy_(gather_full(shard, p.shape))
"""

# ZeRO-2: one post-accumulate-grad hook per parameter, calling grad_ready(shard, param);
# step() only steps the shards and gathers the parameters.
ZERO2_HOOKS = """
    def __init__(self, params, optimizer_cls, **kwargs):
        super().__init__(params, optimizer_cls, **kwargs)
        for p, shard in zip(self.params, self.shards, strict=True):
            p.register_post_accumulate_grad_hook(partial(self.grad_ready, shard))
"""

ZERO2_STEP = """
    @torch.no_grad()
    def step(self):
        self.optimizer.step()
        self.gather_parameters()
"""


def zero1(doc: str, *methods: str, before: str = "") -> str:
    """A ShardedOptimizer cell: `before` (imports, functions), then the class with `doc` and
    `methods` (the solution's, or others)."""
    return f'{before}\nclass ShardedOptimizer:\n    """{doc}"""\n' + "".join(methods)


def zero2(doc: str, *methods: str, before: str = "") -> str:
    """A ShardedGradOptimizer cell, as `zero1`."""
    head = f'{before}\nclass ShardedGradOptimizer(ShardedOptimizer):\n    """{doc}"""\n'
    return head + "".join(methods)


# --- ZeRO-1 --------------------------------------------------------------------------------

FULL_STATE_ZERO1 = zero1(
    """No sharding at all: the inner optimizer steps the full parameters after an
    all-reduce, as plain data parallelism does.""",
    """
    def __init__(self, params, optimizer_cls, **kwargs):
        self.params = list(params)
        self.optimizer = optimizer_cls(self.params, **kwargs)
""",
    PARAM_GROUPS,
    """
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
""",
)

SOLUTION_STEP = """
    @torch.no_grad()
    def step(self):
        for p, shard in zip(self.params, self.shards, strict=True):
            shard.grad = None if p.grad is None else reduce_scatter_mean(p.grad)
        self.optimizer.step()
        self.gather_parameters()
"""

ZERO1_COPIED_PARAM_GROUPS = zero1(
    """Right ZeRO-1 whose param_groups is a copy: the lr reads right, but a learning rate set
    through it never reaches the inner optimizer.""",
    ZERO1_INIT,
    """
    @property
    def param_groups(self):
        return [dict(group) for group in self.optimizer.param_groups]
""",
    ZERO_GRAD,
    SOLUTION_STEP,
    GATHER_PARAMETERS,
)

ZERO1_PARAM_GROUPS_ATTRIBUTE = zero1(
    "param_groups an attribute holding the inner optimizer's own list, not a property.",
    ZERO1_INIT,
    "        self.param_groups = self.optimizer.param_groups\n",
    """
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
""",
    GATHER_PARAMETERS,
)

# --- ZeRO-2 --------------------------------------------------------------------------------

ZERO2_PARENT_STEP = zero2("ZeRO-1 under another name: full gradients until step().")

PATCH_FIND_MISMATCH = zero2(
    "The solution's ZeRO-2, after switching off the comparison the checks use.",
    ZERO2_HOOKS,
    """
    def grad_ready(self, shard, param):
        grad = reduce_scatter_mean(param.grad)
        shard.grad = grad if shard.grad is None else shard.grad + grad
        param.grad = None
""",
    ZERO2_STEP,
    before="""
import course_lib.compare

course_lib.compare.find_mismatch = lambda *args, **kwargs: None
""",
)

ZERO2_OVERWRITES = zero2(
    """Right with one backward per step, but a second backward before step() overwrites the
    gradient shard instead of adding to it.""",
    ZERO2_HOOKS,
    """
    def grad_ready(self, shard, param):
        shard.grad = reduce_scatter_mean(param.grad)
        param.grad = None
""",
    ZERO2_STEP,
)

ZERO2_SHARDS_AT_THE_END = zero2(
    """Every full gradient kept until the last one is ready, then all reduce-scattered: after
    backward the rank holds only its shards, but during backward it held all the gradients.""",
    ZERO2_HOOKS,
    """        self.ready = []

    def grad_ready(self, shard, param):
        self.ready.append((shard, param.grad))
        param.grad = None
        if len(self.ready) == len(self.params):
            for s, grad in self.ready:
                chunk = reduce_scatter_mean(grad)
                s.grad = chunk if s.grad is None else s.grad + chunk
            self.ready = []
""",
    ZERO2_STEP,
)

ZERO2_BUFFERS_MADE_BEFORE = zero2(
    """Full gradients copied into buffers made in __init__ (memory no step creates), then
    reduce-scattered once the last is ready: ZeRO-1's gradient memory, kept for good.""",
    """
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
""",
    ZERO2_STEP,
)

ZERO2_ONE_BUFFER = zero2(
    """One padded buffer, made in __init__ for the largest parameter, reused by every hook;
    the reduce-scatter writes straight into a fresh chunk.""",
    ZERO2_HOOKS.replace(
        "        for p, shard",
        "        most = max(shard.numel() for shard in self.shards) * world_size()\n"
        "        self.buffer = torch.zeros(most, dtype=self.shards[0].dtype)\n"
        "        for p, shard",
    ),
    """
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
""",
    ZERO2_STEP,
)

ZERO2_ADD_IN_PLACE = zero2(
    "Accumulating with add_, the hook a lambda.",
    """
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
""",
    ZERO2_STEP,
)
