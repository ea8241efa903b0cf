"""Part 4 of the capstone, check_sharded_adamw: ZeRO-1 inside the DP group of the 2-D grid,
judged by its result, the bytes each rank keeps between steps and the bytes it sends."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from course_lib.grading import CheckFailed, check_sharded_adamw
from course_lib.grading import parallel_3d_zero_judge as judge
from course_lib.grading import parallel_3d_zero_memory as memory
from course_lib.grading import parallel_3d_zero_rank as zero_rank
from course_lib.grading.parallel_3d import (
    comm_budget,
    sharded_adamw_report,
    split_counts,
    state_budget,
)
from course_lib.grading.parallel_3d_zero import rank_sizes, unsharded_state
from tests.adapters import mutant, planted, solution
from tests.cheats import a10_parallel_3d as cheats

A10 = solution("parallel_3d")
make_groups, GPT2D, ShardedAdamW = A10.make_groups, A10.GPT2D, A10.ShardedAdamW

# --- right answers, in three designs --------------------------------------------------------

# Gradients all-reduced, AdamW on views of this rank's chunks, chunks all-gathered (an
# alternative in tests/cheats): 1.5 all-reduces, right at the traffic budget.
AllReduceThenGather = planted(
    "parallel_3d", "sharded_adamw", cheats.ALL_REDUCE_THEN_GATHER
).ShardedAdamW


class WholeParameters:
    """Each parameter is owned by one rank of the DP group (largest first, to the least loaded
    rank): gradients reduced to the owner, torch.optim.AdamW on the owned parameters, each
    parameter broadcast from its owner."""

    def __init__(self, model, dp_group, lr, betas, eps, weight_decay):
        self.params = list(model.parameters())
        self.group = dp_group
        self.d, me = dist.get_world_size(dp_group), dist.get_rank(dp_group)
        load = [0] * self.d
        self.owner = {}
        for i in sorted(range(len(self.params)), key=lambda i: -self.params[i].numel()):
            self.owner[i] = load.index(min(load))
            load[self.owner[i]] += self.params[i].numel()
        mine = [p for i, p in enumerate(self.params) if self.owner[i] == me]
        self.inner = torch.optim.AdamW(
            mine, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False
        )

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self):
        me = dist.get_rank(self.group)
        for i, p in enumerate(self.params):
            owner = dist.get_global_rank(self.group, self.owner[i])
            dist.reduce(p.grad, dst=owner, group=self.group)
            if self.owner[i] == me:
                p.grad /= self.d
            else:
                p.grad = None
        self.inner.step()
        for i, p in enumerate(self.params):
            dist.broadcast(p, src=dist.get_global_rank(self.group, self.owner[i]), group=self.group)


# --- wrong answers -------------------------------------------------------------------------


class Unsharded:
    """Part 2's averaging and a plain AdamW: right parameters, every replica keeps all of the
    state (breaks the memory rule)."""

    def __init__(self, model, dp_group, **adamw):
        self.params, self.group = list(model.parameters()), dp_group
        self.inner = torch.optim.AdamW(self.params, **adamw, foreach=False)

    def zero_grad(self):
        self.inner.zero_grad()

    @torch.no_grad()
    def step(self):
        for p in self.params:
            dist.all_reduce(p.grad, group=self.group)
            p.grad /= dist.get_world_size(self.group)
        self.inner.step()


# The same, with the optimizer parked in a dict at module level: the memory is still seen.
UNSHARDED_HIDDEN = """
_HIDDEN = {}


class ShardedAdamW:
    def __init__(self, model, dp_group, lr, betas, eps, weight_decay):
        self.params, self.group = list(model.parameters()), dp_group
        _HIDDEN["adamw"] = torch.optim.AdamW(
            self.params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False
        )

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self):
        for p in self.params:
            dist.all_reduce(p.grad, group=self.group)
            p.grad /= dist.get_world_size(self.group)
        _HIDDEN["adamw"].step()
"""
UnshardedHidden = planted("parallel_3d", "sharded_adamw", UNSHARDED_HIDDEN).ShardedAdamW

# The state is sharded, but the updated chunks never reach the other ranks: each rank's
# parameters are right only in its own chunk (breaks the result).
NoGather = mutant(
    "parallel_3d",
    "sharded_adamw",
    (
        "dist.all_gather_single(flat, mine, group=self.group)",
        "flat[self.me * chunk : (self.me + 1) * chunk] = mine",
    ),
).ShardedAdamW


class GatheredState(ShardedAdamW):
    """Keeps only its chunk of the moments between steps, but all-gathers the whole moments
    every step and updates the whole parameter locally after an all-reduce of the gradients:
    right, and lean at rest, but it sends the state around (breaks the traffic rule)."""

    @torch.no_grad()
    def step(self):
        self.steps += 1
        for p, (m, v) in zip(self.params, self.moments, strict=True):
            chunk, n = m.numel(), p.numel()
            dist.all_reduce(p.grad, group=self.group)
            grad = p.new_zeros(chunk * self.d)
            grad[:n] = p.grad.reshape(-1) / self.d
            full_m, full_v = p.new_empty(chunk * self.d), p.new_empty(chunk * self.d)
            dist.all_gather_single(full_m, m, group=self.group)
            dist.all_gather_single(full_v, v, group=self.group)
            flat = p.new_zeros(chunk * self.d)
            flat[:n] = p.reshape(-1)
            self.adamw(flat, grad, full_m, full_v)
            p.copy_(flat[:n].view_as(p))
            mine = slice(self.me * chunk, (self.me + 1) * chunk)
            m.copy_(full_m[mine])
            v.copy_(full_v[mine])


# torch's ZeroRedundancyOptimizer (what lecture 7 runs) in the DP group: a cheat.
ZeroRedundancy = planted("parallel_3d", "sharded_adamw", cheats.ZERO_REDUNDANCY).ShardedAdamW


# --- the budgets ------------------------------------------------------------------------------


def test_the_budgets_follow_their_formulas_on_the_ranks_shards():
    """A rank's parameters are its TP shard (N_rep + N_split / t); the budgets are AdamW's two
    float64 moments of a 1/d share plus the largest parameter's, and 1.5 ring all-reduces
    plus d - 1 largest parameters."""
    split, replicated = split_counts()
    for tp in (1, 2, 4):
        sizes = list(rank_sizes(0, tp).values())
        assert sum(sizes) == replicated + split // tp
        assert unsharded_state(sizes) == 16 * sum(sizes)
    sizes = list(rank_sizes(1, 2).values())
    largest = max(sizes)
    assert largest == 2048  # an MLP weight's half: 128 x 32 / 2
    assert sum(sizes) % 2 == 0 and all(n % 2 == 0 for n in sizes)  # chunks without padding
    assert state_budget(sizes, 2) == 16 * (sum(sizes) // 2 + largest)
    assert comm_budget(sizes, 2) == 8 * (3 * sum(sizes) // 2 + largest)
    assert comm_budget(sizes, 1) == 0  # one replica: nothing to send
    # 1.5 ring all-reduces of the parameters, 2 (d-1)/d x 8N each, and d - 1 largest ones
    assert comm_budget(sizes, 2) == 1.5 * 2 * (1 / 2) * 8 * sum(sizes) + 8 * largest
    # uneven: ceil(n / d) elements of each parameter
    assert state_budget([5, 3], 4) == 16 * (2 + 1 + 5)


# --- the check ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [{}, {"tp_size": 1, "seed": 1}, {"world_size": 2, "tp_size": 1, "seed": 2}],
    ids=["2x2", "4x1", "2x1"],
)
def test_check_sharded_adamw_accepts_the_solution(options, capsys):
    check_sharded_adamw(make_groups, GPT2D, ShardedAdamW, **options)
    out = capsys.readouterr().out
    assert out.startswith("check_sharded_adamw: passed. Verified DP x TP"), out
    assert "of the state budget" in out and "of the traffic budget" in out


@pytest.mark.parametrize(
    "impl", [AllReduceThenGather, WholeParameters], ids=["all-reduce-gather", "whole-params"]
)
@pytest.mark.parametrize("options", [{}, {"tp_size": 1, "seed": 1}], ids=["2x2", "4x1"])
def test_check_sharded_adamw_accepts_other_designs(impl, options, capsys):
    check_sharded_adamw(make_groups, GPT2D, impl, steps=2, **options)
    assert capsys.readouterr().out.startswith("check_sharded_adamw: passed.")


@pytest.mark.parametrize(
    "impl, rule, message",
    [
        (Unsharded, "memory", "unsharded AdamW keeps 248,320"),
        (UnshardedHidden, "memory", "unsharded AdamW keeps 248,320"),
        (NoGather, "result", "its TP shard of torch.optim.AdamW on one process"),
        (GatheredState, "communication", "outside the TP all-reduces of forward and backward"),
        (ZeroRedundancy, "provenance", "ZeroRedundancyOptimizer"),
    ],
    ids=["unsharded", "unsharded-hidden", "no-gather", "gathered-state", "zero-redundancy"],
)
def test_check_sharded_adamw_rejects(impl, rule, message):
    with pytest.raises(CheckFailed) as info:
        check_sharded_adamw(make_groups, GPT2D, impl, steps=2)
    text = str(info.value)
    assert text.startswith("check_sharded_adamw: ")
    assert message in text
    if rule in ("memory", "result", "communication"):
        assert f"[{rule}] failed" in text, text
        assert info.value.score == 0


def test_the_report_shows_what_the_check_measures():
    text = sharded_adamw_report(make_groups, GPT2D, ShardedAdamW)
    rows = text.splitlines()[2:]
    assert len(rows) == 4
    for r, row in enumerate(rows):
        rank, error, kept, unsharded, allowed, sent, sent_allowed = row.split()
        assert int(rank) == r and float(error) <= 1e-10
        kept, unsharded = int(kept.replace(",", "")), int(unsharded.replace(",", ""))
        assert kept == unsharded // 2  # the solution keeps exactly its half of the moments
        assert int(sent.replace(",", "")) * 3 == 2 * (
            int(sent_allowed.replace(",", "")) - 8 * 2048
        )  # one reduce-scatter and one all-gather: 2/3 of 1.5 all-reduces


# --- what the check trusts: nothing kept or counted on a rank ----------------------------------


@pytest.mark.parametrize(
    "cheat, rule, message",
    [
        # main's ranks built the model and batches from the check's seed: retrained there
        ("SEED_THIEF", "result", "its TP shard of torch.optim.AdamW on one process"),
        # main counted bytes on the rank (CollectiveLog), blind to a call its hooks missed
        ("COUNTERS_EMPTIED", "communication", "outside the TP all-reduces"),
        # main skipped the storages of a set on the rank, which the rank's code widened
        ("BASELINE_WIDENED", "memory", "unsharded AdamW keeps 248,320"),
    ],
    ids=["seed-thief", "counters-emptied", "baseline-widened"],
)
def test_check_sharded_adamw_trusts_nothing_kept_on_a_rank(cheat, rule, message):
    impl = planted("parallel_3d", "sharded_adamw", getattr(cheats, cheat)).ShardedAdamW
    with pytest.raises(CheckFailed) as info:
        check_sharded_adamw(make_groups, GPT2D, impl, steps=2)
    text = str(info.value)
    assert f"[{rule}] failed" in text and message in text, text
    assert info.value.score == 0


def _entries(steps: int, extra: dict | None = None) -> list[tuple]:
    """A rank's tallies as the check's rank marks them (one 2 x 2 rank: 8 float64 bytes sent
    in each phase, in the TP group [0, 1] or the DP group [0, 2]), with `extra` marks put
    after the mark of the case they name."""
    extra = extra or {}
    scan = memory.PREFIX + json.dumps(
        {"kind": "scan", "step": 0, "allowed": [[1, 80]], "scans": [[[1, 80, "f", [10]]]] * 2}
    )
    out = [("mark", 0), ("mark", memory.PREFIX + '{"kind": "baseline", "keys": [7]}')]
    for c in range(1, zero_rank.cases(steps) + 1):
        out += [("mark", c), *extra.get(c, [])]
        if c < zero_rank.cases(steps) and c > 1:
            group = (0, 1) if (c - 2) % 3 == 1 else (0, 2)
            out.append(("call", "all_reduce", None, 8, 8, group, ("float64",)))
        if c >= 2 and (c - 2) % 3 == 2:
            step = (c - 2) // 3
            out.append(("mark", scan.replace('"step": 0', f'"step": {step}')))
            out.append(("mark", memory.PREFIX + '{"kind": "own", "keys": []}'))
    return out


def test_bytes_kept_and_sent_are_read_from_the_launchers_tallies():
    """The bytes of each step come from the marks and calls the launcher received: the TP
    group's calls in forward and backward are Part 2's; a DP call there counts."""
    (rows,) = judge.per_step("c", [_entries(2)], 4, 2, 2)
    assert [row["sent"] for row in rows] == [16, 16]  # zero_grad's and step()'s, not TP's
    assert [row["kept"] for row in rows] == [0, 0]  # the model's own bytes are allowed
    dp_in_backward = {zero_rank.case(1, "forward and backward"): [
        ("call", "all_reduce", None, 40, 40, (0, 2), ("float64",))
    ]}  # fmt: skip
    (rows,) = judge.per_step("c", [_entries(2, dp_in_backward)], 4, 2, 2)
    assert [row["sent"] for row in rows] == [16, 56]


@pytest.mark.parametrize(
    "forged",
    [
        memory.PREFIX + '{"kind": "baseline", "keys": [1]}',  # a wider baseline
        memory.PREFIX + '{"kind": "own", "keys": [1]}',  # the state among the check's records
        memory.PREFIX + "not json",
    ],
    ids=["baseline", "own", "garbage"],
)
def test_a_memory_observation_not_the_checks_is_tampering(forged):
    """Code on the rank can add marks but not remove the check's: one more observation, in
    any step, fails the part as tampering, so no forged one can widen what is skipped."""
    entries = _entries(2, {zero_rank.case(1, "zero_grad"): [("mark", forged)]})
    with pytest.raises(CheckFailed) as info:
        judge.per_step("c", [entries], 4, 2, 2)
    assert info.value.tampering and "tampering" in str(info.value)


def test_reckon_skips_the_baseline_and_the_checks_records_and_takes_the_smaller_scan():
    base, mine, gone = (
        [1, 800, "torch.float64", [100]],
        [2, 24, "torch.float64", [3]],
        [3, 64, "x", [8]],
    )
    seen = [
        {"kind": "baseline", "keys": [1]},
        {
            "kind": "scan",
            "step": 0,
            "allowed": [[2, 16]],
            "scans": [[base, mine, gone], [base, mine]],
        },
        {"kind": "own", "keys": [2]},
        {"kind": "scan", "step": 1, "allowed": [], "scans": [[base, mine]] * 2},
    ]
    first, second = memory.reckon(seen)
    # storage 2 holds 16 allowed bytes and 8 more; storage 3 was gone by the second scan
    assert first == {"kept": 8, "largest": ["8 bytes (torch.float64, (3,))"]}
    assert second == {"kept": 0, "largest": []}  # then the check's record: skipped
