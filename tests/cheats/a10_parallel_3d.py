"""Assignment 10's cheats (the capstone; each scores 0 on its part) and right answers
written differently (full marks). Cells: "process_grid" (part 1), "make_groups", "gpt_2d"
and "train_step" (part 2). A make_groups built on lecture 10's new_groups is refused too; it
is proven in tests/test_grading_parallel_3d.py, to keep the graded notebooks few."""

from __future__ import annotations

from tests.cheats import Alternative, Cheat

GRID = frozenset({"test_process_grid"})
TRAIN = frozenset({"test_train_2d"})

PLANNER_GRID = '''
from course_lib.parallel_3d import ProcessGrid


def process_grid(world_size, tp_size):
    """Lecture 10's grid does the work."""
    if world_size % tp_size:
        raise ValueError("tp_size must divide world_size")
    grid = ProcessGrid(tp_size, 1, world_size // tp_size)
    return grid.groups("tp"), grid.groups("dp")
'''

WHOLE_BATCH_EVERYWHERE = '''
def train_step(model, optimizer, x, y, dp_group):
    """Show the model its shard, then train every rank on the whole batch through forward
    itself (hooks skipped): no DP all-reduce at all."""
    dp_rank, dp_size = dist.get_rank(dp_group), dist.get_world_size(dp_group)
    with torch.no_grad():
        model(shard(x, dp_rank, dp_size))
    optimizer.zero_grad()
    loss = lm_loss(type(model).forward(model, x), y)
    loss.backward()
    optimizer.step()
    return loss.item()
'''

REBIND_CHECK = '''
def train_step(model, optimizer, x, y, dp_group):
    """Does nothing, and switches the check off."""
    return 0.0


check_2d_training = lambda *args, **kwargs: None  # noqa: E731
'''

FLAT_AVG_TRAIN_STEP = """
def train_step(model, optimizer, x, y, dp_group):
    n = dist.get_world_size(dp_group)
    me = dist.get_rank(dp_group)
    xs, ys = shard(x, me, n), shard(y, me, n)
    optimizer.zero_grad()
    loss = lm_loss(model(xs), ys)
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=dp_group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
    optimizer.step()
    loss = loss.detach().clone()
    dist.all_reduce(loss, group=dp_group)  # for logging: in the DP group, allowed
    return loss.item() / n
"""

CHEATS = [
    # make_groups calls process_grid, so the planner's grid spoils part 2 as well.
    Cheat("lecture 10's ProcessGrid as the grid", "process_grid", PLANNER_GRID, GRID | TRAIN),
    Cheat("every rank trains on the whole batch", "train_step", WHOLE_BATCH_EVERYWHERE, TRAIN),
    Cheat("rebinding the check", "train_step", REBIND_CHECK, TRAIN, alone=True),
]

ALTERNATIVES = [
    Alternative(
        "grid from list slicing",
        "process_grid",
        """
def process_grid(world_size, tp_size):
    if tp_size <= 0 or world_size % tp_size != 0:
        raise ValueError(f"{tp_size} does not divide {world_size}")
    ranks = list(range(world_size))
    tp_groups = [ranks[i : i + tp_size] for i in range(0, world_size, tp_size)]
    dp_groups = [ranks[i::tp_size] for i in range(tp_size)]
    return tp_groups, dp_groups
""",
    ),
    Alternative(
        "one flat DP all-reduce with ReduceOp.AVG, the loss averaged in the DP group too",
        "train_step",
        FLAT_AVG_TRAIN_STEP,
    ),
]
