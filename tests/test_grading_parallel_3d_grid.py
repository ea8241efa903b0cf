"""The capstone's grid: check_process_grid (Part 1) accepts right layouts and rejects wrong
ones; the TP shards and Part 3's cost formulas agree with course_lib's layers. 2-D training
is in test_grading_parallel_3d.py, Part 4 in test_grading_parallel_3d_zero.py."""

from __future__ import annotations

import pytest
import torch

from course_lib import models
from course_lib.grading import CheckFailed, check_process_grid
from course_lib.grading.parallel_3d import (
    formula,
    gather_dense,
    measure_configuration,
    split_counts,
    tp_shard,
)
from course_lib.grading.parallel_3d_layout import _partners
from tests.adapters import planted, solution
from tests.cheats import a10_parallel_3d as cheats

A10 = solution("parallel_3d")
process_grid, make_groups, GPT2D, train_step = (
    A10.process_grid,
    A10.make_groups,
    A10.GPT2D,
    A10.train_step,
)

# --- wrong grids --------------------------------------------------------------------------


def grid_swapped(world, tp):
    tp_groups, dp_groups = process_grid(world, tp)
    return dp_groups, tp_groups


def grid_strided_tp(world, tp):
    """TP groups strided, DP groups consecutive: 'swapped' only when tp = world / tp."""
    dp = world // tp
    grid = torch.arange(world).view(tp, dp)
    return grid.T.tolist(), grid.tolist()


def grid_no_error(world, tp):
    return [list(range(world))], [[r] for r in range(world)]


def grid_not_implemented(world, tp):
    raise NotImplementedError()


# Right, but lecture 10's ProcessGrid does the work (a cheat).
process_grid_from_planner = planted("parallel_3d", "process_grid", cheats.PLANNER_GRID).process_grid


# --- the grid -----------------------------------------------------------------------------


def test_the_grid_rule_is_picotrons_layout():
    # TP innermost: [dp][tp] grid of ranks, as picotron's process-group manager builds it.
    assert [_partners(8, 2, r) for r in (0, 5)] == [((0, 1), (0, 2, 4, 6)), ((4, 5), (1, 3, 5, 7))]
    assert _partners(4, 4, 2) == ((0, 1, 2, 3), (2,))


def test_process_grid_accepts_a_right_implementation(capsys):
    check_process_grid(process_grid)
    out = capsys.readouterr().out
    assert out.startswith("check_process_grid: passed. Verified ")
    assert "2 sizes that do not divide raise ValueError" in out


@pytest.mark.parametrize(
    "fn, message",
    [
        (grid_swapped, "process_grid(4, 2): the TP and DP groups are swapped"),
        (grid_strided_tp, "process_grid(4, 2): the TP and DP groups are swapped"),
        (grid_no_error, "process_grid(4, 2): TP groups [[0, 1, 2, 3]], expected"),
        (grid_not_implemented, "process_grid(4, 2) raised NotImplementedError"),
    ],
)
def test_process_grid_rejects_wrong_implementations(fn, message):
    with pytest.raises(CheckFailed) as info:
        check_process_grid(fn)
    assert str(info.value).startswith("check_process_grid: ")
    assert message in str(info.value)


def test_process_grid_refuses_the_planners_grid():
    with pytest.raises(CheckFailed) as info:
        check_process_grid(process_grid_from_planner)
    assert "runs course_lib.parallel_3d.ProcessGrid" in str(info.value)


def test_process_grid_names_wrong_tp_groups():
    with pytest.raises(CheckFailed) as info:
        check_process_grid(grid_strided_tp, cases=((8, 2),))
    assert "process_grid(8, 2): TP groups [[0, 4], [1, 5], [2, 6], [3, 7]], expected" in str(
        info.value
    )


def test_process_grid_must_refuse_a_tp_size_that_does_not_divide():
    def no_check(world, tp):
        grid = torch.arange(world - world % tp).view(-1, tp)
        return grid.tolist(), grid.T.tolist()

    with pytest.raises(CheckFailed, match=r"process_grid\(4, 3\) returned .* raise ValueError"):
        check_process_grid(no_check)


# --- shards and formulas, against course_lib's own layers ---------------------------------


def _shards_on_rank(tp):
    tp_group, dp_group = make_groups(tp)
    model = GPT2D(models.TinyGPT(seed=3, dtype=torch.float64), tp_group, dp_group)
    return {n: p.detach() for n, p in model.named_parameters()}


def test_tp_shard_and_gather_dense_agree_with_course_lib_layers():
    from course_lib import launch

    dense = models.TinyGPT(seed=3, dtype=torch.float64).state_dict()
    states = launch(_shards_on_rank, 2, world_size=4, timeout=60)
    for r, state in enumerate(states):
        for name, shard in state.items():
            assert torch.equal(shard, tp_shard(name, dense[name], r % 2, 2)), (r, name)
    gathered = gather_dense(states[:2])
    assert all(torch.equal(gathered[n], dense[n]) for n in states[0])
    assert states[0]["blocks.0.attn.qkv.weight"].shape == (48, 32)  # half of q, k and v


def test_measured_memory_and_traffic_match_the_formulas():
    split, replicated = split_counts()
    assert split + replicated == models.count_parameters(models.TinyGPT())
    for tp in (1, 2, 4):
        m = measure_configuration(make_groups, GPT2D, train_step, tp)
        f = formula(m.dp, m.tp)
        for kind in ("params", "grads", "optimizer_state", "tp_sent", "dp_sent", "total_sent"):
            # CommCounter rounds each call's volume down to whole bytes
            assert abs(getattr(m, kind) - f[kind]) <= 64, (tp, kind, getattr(m, kind), f[kind])
    assert formula(2, 2)["params"] < formula(4, 1)["params"]
