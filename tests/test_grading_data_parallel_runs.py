"""Assignment 3's runs: the check's model and bucket rule, what the checking process draws and
gives each rank, the cases the ranks mark, the bytes read back from the tallies, and the
AllReduceLog the notebook plots with."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch import nn

from course_lib.comm_log import AllReduceLog
from course_lib.costs import all_reduce_bytes
from course_lib.grading._harness import grading_pool
from course_lib.grading.data_parallel import (
    DDPRun,
    ProbeModel,
    bucket_layout,
    buckets,
    shard_sizes,
)
from course_lib.grading.data_parallel_cases import cases, draw, given
from course_lib.grading.data_parallel_communication import tensor_bytes
from course_lib.grading.data_parallel_runs import BUCKET_ELEMENTS, MB
from course_lib.grading.traffic import Sent
from tests.test_grading_data_parallel_communication import rule_buckets, torch_rule_buckets

# --- shards, draws and cases --------------------------------------------------------------


def test_the_default_shards_are_uneven_and_change_every_step():
    for ranks, batch in ((4, 16), (3, 10), (2, 16)):
        run = DDPRun(batch_size=batch)
        splits = [shard_sizes(run, ranks, s) for s in range(3)]
        assert [sum(sizes) for sizes in splits] == [batch, batch, 3 * batch // 4]
        assert all(min(sizes) >= 1 and len(set(sizes)) > 1 for sizes in splits), splits
        assert len({tuple(sizes) for sizes in splits}) == 3, splits
    assert shard_sizes(DDPRun(batch_size=4, steps=1), 4, 0) == [1, 1, 1, 1]


def test_each_rank_gets_only_its_own_samples_and_weights_drawn_from_a_new_secret():
    runs = [DDPRun(model="probe", steps=2)]
    first, second = draw(runs, 4), draw(runs, 4)
    x1, x2 = first[0].shards[0][0][0], second[0].shards[0][0][0]
    assert x1.shape == (shard_sizes(runs[0], 4, 0)[0], 8) and not torch.equal(x1, x2)
    assert len(set(first[0].seeds)) == 4 and first[0].seeds != second[0].seeds
    # ProbeModel's 'unused' layer never gets a gradient, its 'gain' is frozen.
    assert first[0].gradients == len(list(ProbeModel().parameters())) - 2
    for kind in ("sync", "ddp"):
        per_rank = given(kind, runs, first, 4)
        for r, (mine,) in enumerate(per_rank):
            shards = [step[r] for step in first[0].shards]
            assert all(a["x"] is x for a, (x, _) in zip(mine["steps"], shards, strict=True))
            # Part 1: everyone starts from rank 0's weights; Part 2: each from its own.
            assert mine["seed"] == first[0].seeds[r if kind == "ddp" else 0]
            assert set(mine) == {"seed", "steps"} and set(mine["steps"][0]) == {"x", "y", "scale"}
    # Part 2's cases: construction, then per step forward, backward before and after each of
    # the 6 gradients, and the synchronization.
    labels = cases("ddp", runs, first)
    assert len(labels) == 1 + 2 * (1 + 7 + 1) and labels[0][0] == "construction"
    assert len(cases("sync", runs, first)) == 2


# --- the bucket rule and the probe model --------------------------------------------------


def _sizes(groups):
    return Counter(sum(p.numel() * p.element_size() for p in b) for b in groups)


def test_probe_model_has_what_the_ddp_check_needs():
    model = ProbeModel()
    sizes = [p.numel() for p in model.parameters()]
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert frozen == ["gain"] and len(set(sizes)) >= 6  # uneven sizes
    model(torch.randn(3, 8)).sum().backward()
    assert model.unused.weight.grad is None and model.gain.grad is None
    assert model.inp.weight.grad is not None and len(list(model.buffers())) == 1
    cap = BUCKET_ELEMENTS["probe"] * 4  # bytes, float32
    layout = bucket_layout(model, cap / MB)
    assert layout == [
        ["out.bias", "out.weight"],
        ["mid.bias"],
        ["mid.weight"],
        ["unused.weight", "inp.bias"],  # 240 bytes: fills the cap exactly
        ["inp.weight"],
    ]


def test_the_default_probe_cap_tells_every_other_bucket_rule_apart():
    """The visible test catches the rules the notebook excludes: forward order, 1 MB =
    10^6 bytes, a new bucket at the cap (>=) and torch's close-once-reached rule."""
    params = list(ProbeModel().parameters())
    cap = BUCKET_ELEMENTS["probe"] * 4
    right = _sizes(buckets(params, cap))
    assert right == _sizes(rule_buckets(params, cap))
    variants = {
        "forward": _sizes(rule_buckets(params, cap, order="forward")),
        "1e6": _sizes(rule_buckets(params, cap * 10**6 / MB)),
        ">=": _sizes(rule_buckets(params, cap, new_at=lambda size, cap: size >= cap)),
        "torch": _sizes(torch_rule_buckets(params, cap)),
    }
    assert all(v != right for v in variants.values()), variants


# --- the launcher's tallies -----------------------------------------------------------------


@pytest.mark.parametrize("ranks", range(2, 9))
def test_an_all_reduce_s_tensor_bytes_are_read_back_from_what_it_sends(ranks):
    group = tuple(range(ranks))
    for nbytes in range(0, 4097, 4):
        sent = all_reduce_bytes(nbytes, ranks)
        assert tensor_bytes(Sent("all_reduce", None, sent, sent, group)) == nbytes


# --- AllReduceLog -------------------------------------------------------------------------


def _every_route_logged():
    from torch.distributed import all_reduce

    with AllReduceLog() as log:
        log.phase = "a"
        all_reduce(torch.ones(3))  # a name bound before the log: synchronous
        log.phase = "b"
        dist.group.WORLD.allreduce([torch.ones(5)]).wait()  # the group object
        log.phase = "c"
        dist.all_reduce(torch.ones(2, dtype=torch.float64), async_op=True).wait()
        dist.broadcast(torch.ones(1), src=0)
        model = nn.parallel.DistributedDataParallel(nn.Linear(2, 2))  # C++ reducer
        model(torch.ones(1, 2)).sum().backward()
    restored = dist.Work.wait is log._saved[0][1]
    calls = [[c.nbytes, c.async_op, c.phase] for c in log.calls]
    others = [list(other) for other in log.others]
    return {"calls": calls, "waits": log.waits, "others": others, "restored": restored}


def test_all_reduce_log_sees_every_route_and_every_wait_on_grading_ranks():
    result = grading_pool(2).launch(_every_route_logged, timeout=60)[0]
    # The pre-bound all_reduce is seen at the process group, which hands torch's function a
    # Work to wait for: it looks async there, but its wait is logged.
    assert result["calls"][:3] == [[12, True, "a"], [20, True, "b"], [16, True, "c"]]
    assert len(result["calls"]) >= 4  # and DDP's bucket, reduced from C++
    assert result["waits"][:3] == ["a", "b", "c"]
    assert ["broadcast", "c"] in result["others"]
    assert result["restored"]
