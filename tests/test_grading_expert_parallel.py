"""Assignment 12's checks accept right expert-parallel layers and reject wrong ones, and a
rank holds nothing to copy: its own tokens and experts only, from a secret draw, with the
calls judged by the launcher's tallies. Part 4's check: test_grading_expert_parallel_dedup.py."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist

from course_lib import rank, world_size
from course_lib.costs import ep_bytes
from course_lib.expert_parallel import MoE
from course_lib.grading import (
    CheckFailed,
    check_moe_backward,
    check_moe_forward,
    check_moe_traffic,
)
from course_lib.grading import expert_parallel as ep
from course_lib.grading._harness import new_secret
from course_lib.grading.expert_parallel import (
    Case,
    cases,
    dedup_cases,
    dropped,
    reference,
    routing,
    traffic_budget,
)
from course_lib.grading.expert_parallel_cases import (
    draw,
    expert_ids,
    given,
    inputs,
    layer,
)
from course_lib.grading.expert_parallel_judge import carried
from course_lib.grading.traffic import Sent
from tests.adapters import mutant, planted, solution
from tests.cheats import a12_expert_parallel as cheats

A12 = solution("expert_parallel")
RTOL, ATOL = 1e-12, 1e-12


def expect_failure(check, *fns, message: str, **options) -> CheckFailed:
    with pytest.raises(CheckFailed) as info:
        check(*fns, **options)
    assert message in str(info.value), str(info.value)
    return info.value


# --- the reference and the budget ----------------------------------------------------------


@pytest.mark.parametrize("case", [c for P in (1, 2, 4) for c in cases(P, (0, 1))], ids=str)
def test_reference_is_the_lectures_dense_moe(case):
    """The check's reference, written out token by token, against lecture 12's `MoE` with the
    same weights: output and every gradient (float64, rtol = atol = 1e-12)."""
    moe = MoE(case.d_model, case.d_ff, case.n_experts, case.k, case.capacity_factor)
    router, experts = layer(case)
    moe.router.load_state_dict(router.state_dict())
    for mine, theirs in zip(moe.experts, experts, strict=True):
        mine.load_state_dict(theirs.state_dict())
    x, g = inputs(case)
    x = x.clone().requires_grad_(True)
    out, _ = moe(x)
    out.backward(g)
    want = reference(case)
    torch.testing.assert_close(want["out"], out.detach(), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(want["x_grad"], x.grad, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(want["router_grad"], moe.router.weight.grad, rtol=RTOL, atol=ATOL)
    for e, expert in enumerate(moe.experts):
        for got, ref in zip(want["expert_grads"][e], expert.parameters(), strict=True):
            torch.testing.assert_close(got, ref.grad, rtol=RTOL, atol=ATOL)


def test_the_cases_drop_choices_and_the_no_drop_case_drops_none():
    for P in (1, 2, 4):
        for case in cases(P, (0, 1, 2)):
            if case.capacity_factor < 1:
                assert dropped(case) > 0, case
            else:
                assert dropped(case) == 0, case
        assert any(case.tokens % P for case in cases(P, (0,))) or P == 1


def test_routing_keeps_the_first_tokens_of_each_expert():
    case = cases(2, (0,))[1]
    chosen, _, kept = routing(case)
    for e in range(case.n_experts):
        picks = kept[chosen == e]  # token order
        assert picks.sum() == min(len(picks), 4)  # C = ceil(0.75 * 9 * 2 / 4) = 4
        assert not (picks[1:] & ~picks[:-1]).any(), "a kept choice after a dropped one"


def test_budget_is_twice_the_cost_formula_when_routing_is_even():
    """Every rank sends n rows to each rank, none dropped: the rows part of the budget is
    2 * costs.ep_bytes of the routed tokens (forward and backward)."""
    P, n, E = 4, 3, 8
    case = Case(P, 8, E, 1, 1.0, 0)
    rows = torch.full((P, P), n)
    routed = P * n * case.d_model * 8  # bytes of routed token rows per rank
    slack = (P - 1) * (4 * 64 + 16 * E)
    assert traffic_budget(case, rows) == [int(2 * ep_bytes(routed, P)) + slack] * P


# --- right implementations -----------------------------------------------------------------

SINGLE = planted("expert_parallel", "exchange", cheats.ALL_TO_ALL_SINGLE)
TOKEN_ORDER = planted("expert_parallel", "moe_layer", cheats.TOKEN_ORDER)


@pytest.mark.parametrize(
    "module", [A12, SINGLE, TOKEN_ORDER], ids=["solution", "all_to_all_single", "token-order"]
)
def test_checks_accept_right_implementations(module, capsys):
    check_moe_forward(module.expert_parallel_moe, world_sizes=(1, 2, 4))
    check_moe_backward(module.expert_parallel_moe, module.sync_router_grads, world_sizes=(2, 4))
    check_moe_traffic(module.expert_parallel_moe, module.sync_router_grads, world_sizes=(2, 4))
    assert capsys.readouterr().out.count(": passed.") == 3


# --- wrong implementations -----------------------------------------------------------------

WRONG_RANK = mutant(
    "expert_parallel",
    "moe_layer",
    ("order = torch.argsort(expert * x.shape[0] + token)", "order = torch.argsort(token)"),
).expert_parallel_moe
NO_CAPACITY = mutant(
    "expert_parallel",
    "moe_layer",
    ("place.gather(1, chosen) < capacity", "place.gather(1, chosen) >= 0"),
    ("(capacity - before).clamp(min=0).minimum(counts)", "counts"),
).expert_parallel_moe
LOCAL_QUEUES = mutant(
    "expert_parallel",
    "moe_layer",
    ("before = counts.cumsum(0) - counts", "before = torch.zeros_like(counts)"),
).expert_parallel_moe
NO_GATES = mutant(
    "expert_parallel", "moe_layer", ("gates[token, slot, None] * back", "back")
).expert_parallel_moe
NO_VALUE_ERROR = mutant(
    "expert_parallel", "moe_layer", ("if n_experts % P:", "if False:")
).expert_parallel_moe
DETACHED = mutant(
    "expert_parallel",
    "moe_layer",
    ("ExchangeRows.apply(x[token],", "ExchangeRows.apply(x[token].detach(),"),
).expert_parallel_moe
UNSYNCED = mutant(
    "expert_parallel", "sync_router", ("dist.all_reduce(router.weight.grad)", "pass")
).sync_router_grads


def to_everyone(x, router, experts, k, capacity_factor):
    """Right numbers, but every rank first sends all its tokens to every other rank."""
    P, r = world_size(), rank()
    if router.out_features % P:  # refused as the solution refuses: before any message
        return A12.expert_parallel_moe(x, router, experts, k, capacity_factor)
    sizes = [torch.zeros((), dtype=torch.long) for _ in range(P)]
    dist.all_gather(sizes, torch.tensor(x.shape[0]))
    works, into = [], {}
    for other in range(P):
        if other != r:
            into[other] = torch.empty(int(sizes[other]), x.shape[1], dtype=x.dtype)
            works += [dist.isend(x.detach().contiguous(), other), dist.irecv(into[other], other)]
    for work in works:
        work.wait()
    return A12.expert_parallel_moe(x, router, experts, k, capacity_factor)


def late_refusal(x, router, experts, k, capacity_factor):
    """Right, but when the experts do not split it first all-gathers the token counts."""
    if router.out_features % world_size():
        sizes = [torch.zeros((), dtype=torch.long) for _ in range(world_size())]
        dist.all_gather(sizes, torch.tensor(x.shape[0]))
    return A12.expert_parallel_moe(x, router, experts, k, capacity_factor)


WRONG_FORWARD = [
    ("rows to the wrong ranks", WRONG_RANK, "differs"),
    ("capacity ignored", NO_CAPACITY, "over capacity"),
    ("rank-local queues", LOCAL_QUEUES, "over capacity"),
    ("no gate weights", NO_GATES, "router probability"),
    ("no ValueError", NO_VALUE_ERROR, "expected a ValueError"),
    ("ValueError after a message", late_refusal, "raised the ValueError after communicating"),
]


@pytest.mark.parametrize(
    "fn, message", [w[1:] for w in WRONG_FORWARD], ids=[w[0] for w in WRONG_FORWARD]
)
def test_forward_check_rejects_wrong_implementations(fn, message):
    error = expect_failure(check_moe_forward, fn, message=message, world_sizes=(2,))
    assert error.score == 0
    assert "world size 2" in str(error), "which case failed?"


def test_router_gradients_not_summed_fail_the_backward_check_only():
    check_moe_forward(A12.expert_parallel_moe, world_sizes=(2,))
    error = expect_failure(
        check_moe_backward,
        A12.expert_parallel_moe,
        UNSYNCED,
        message="sync_router_grads must sum",
        world_sizes=(2,),
    )
    assert error.score == 0


def test_a_dispatch_autograd_cannot_go_through_fails_the_backward_check():
    error = expect_failure(
        check_moe_backward, DETACHED, A12.sync_router_grads, message="differs", world_sizes=(2,)
    )
    assert error.score == 0


def test_every_token_to_every_rank_is_right_but_fails_the_traffic_check():
    check_moe_forward(to_everyone, world_sizes=(2,))
    error = expect_failure(
        check_moe_traffic, to_everyone, A12.sync_router_grads, message="bytes", world_sizes=(2,)
    )
    assert error.score == 0 and error.failed == {"dispatch"}


def test_all_gathered_tokens_are_right_but_fail_the_traffic_check():
    fn = planted("expert_parallel", "moe_layer", cheats.ALL_GATHERED)
    check_moe_backward(fn.expert_parallel_moe, fn.sync_router_grads, world_sizes=(2,))
    error = expect_failure(
        check_moe_traffic,
        fn.expert_parallel_moe,
        fn.sync_router_grads,
        message="per-expert numbers only",
        world_sizes=(2,),
    )
    assert error.failed == {"dispatch"}


def test_a_wrong_layer_earns_nothing_for_its_traffic():
    error = expect_failure(
        check_moe_traffic, NO_GATES, A12.sync_router_grads, message="differs", world_sizes=(2,)
    )
    assert error.score == 0 and "result" in error.failed


@pytest.mark.parametrize(
    "cell, source",
    [
        ("moe_layer", cheats.LECTURE_LAYER),
        ("moe_layer", cheats.LECTURE_ROUTING),
        ("exchange", cheats.PASTED_ALL_TO_ALL),
    ],
    ids=["wrapped", "rebound", "pasted"],
)
def test_the_lectures_layer_is_refused(cell, source):
    fn = planted("expert_parallel", cell, source).expert_parallel_moe
    expect_failure(
        check_moe_forward, fn, message="the course's own implementation", world_sizes=(2,)
    )


# --- what a rank holds, and what the verdicts trust -----------------------------------------


def test_the_notebooks_secret_is_the_default_and_a_check_draws_another():
    """`layer`, `inputs` and `kept_rows` (given to the notebook's try cells) build the case with
    secret 0; a check's draw, from `new_secret`, has other weights and tokens."""
    case = dedup_cases(2, (0,))[0]
    x, g = inputs(case)
    torch.testing.assert_close(draw(case, 0)["x"], x, rtol=0, atol=0)
    secret = new_secret()
    assert secret != new_secret()
    other = draw(case, secret)
    assert not torch.equal(other["x"], x) and not torch.equal(other["g"], g)
    assert not torch.equal(other["router"].weight, layer(case)[0].weight)


def test_a_rank_is_given_its_own_tokens_and_experts_only():
    case = cases(4, (0,))[0]
    drawn = draw(case, new_secret())
    for r in range(4):
        x, g, router, experts = given(case, drawn, r)
        torch.testing.assert_close(x, drawn["x"].tensor_split(4)[r], rtol=0, atol=0)
        torch.testing.assert_close(g, drawn["g"].tensor_split(4)[r], rtol=0, atol=0)
        assert [e for e, m in enumerate(drawn["experts"]) if any(m is o for o in experts)] == (
            expert_ids(case, r)
        )


def _inventory(x, router, experts, k, capacity_factor):
    """On a rank: what the process holds besides its own share, reported as the ValueError the
    rank's record keeps: the experts (MLPBlocks) and the float64 tensors, not parameters, with
    more rows than x and as many columns (a whole batch)."""
    import gc

    from course_lib.models import MLPBlock

    blocks = sum(isinstance(o, MLPBlock) for o in gc.get_objects())
    batches = sum(
        isinstance(o, torch.Tensor)
        and not isinstance(o, torch.nn.Parameter)
        and o.dim() == 2
        and o.dtype == x.dtype
        and o.shape[1] == x.shape[1]
        and len(o) > len(x)
        for o in gc.get_objects()
    )
    raise ValueError(f"{blocks} {batches}")


def test_the_ranks_hold_no_other_ranks_tokens_or_experts():
    """A rank's heap holds the experts of its own share and no whole batch (the old ranks built
    the whole layer and batch from the case's seed)."""
    todo = cases(2, (0,))
    runs = ep._run("check", _inventory, None, todo, timeout=60, name="probe")
    for case, _, records, _ in runs:
        per = case.n_experts // 2
        for record in records:
            blocks, batches = map(int, record["raised"].split())
            assert batches == 0, (case, record["raised"])
            # this case's experts, and at most those of the rank's earlier cases (garbage)
            assert per <= blocks <= per * len(todo), (case, record["raised"])


FRAMES = planted("expert_parallel", "moe_layer", cheats.FRAMES_AND_HEAP).expert_parallel_moe
REGENERATED = planted("expert_parallel", "moe_layer", cheats.REGENERATED).expert_parallel_moe
EMPTIED = planted("expert_parallel", "exchange", cheats.COUNTERS_EMPTIED)


@pytest.mark.parametrize("fn", [FRAMES, REGENERATED], ids=["frames and heap", "regenerated"])
def test_the_whole_batch_is_not_on_the_ranks_to_take(fn):
    """Cheats that look for the other ranks' tokens and experts in the process, or rebuild the
    check's case with the given builders: right on the old ranks, which held them all or drew
    them from the case's seed; wrong now."""
    error = expect_failure(check_moe_forward, fn, message="differs", world_sizes=(2,))
    assert error.score == 0
    error = expect_failure(
        check_moe_traffic, fn, A12.sync_router_grads, message="differs", world_sizes=(2,)
    )
    assert error.score == 0


def test_counters_emptied_around_an_all_gather_of_every_row_hide_nothing():
    """Right, but every row all-gathered with the rank's counters emptied around it: the
    launcher's tallies see the all-gather (Part 3; Part 4's bytes: the _dedup tests)."""
    check_moe_backward(EMPTIED.expert_parallel_moe, EMPTIED.sync_router_grads, world_sizes=(2,))
    error = expect_failure(
        check_moe_traffic,
        EMPTIED.expert_parallel_moe,
        EMPTIED.sync_router_grads,
        message="per-expert numbers only",
        world_sizes=(2,),
    )
    assert error.score == 0 and error.failed == {"dispatch"}


def test_sync_router_grads_is_not_counted():
    """Marks between a case's layer and its sync: an all-reduce of the router's whole gradient
    (E x d_model numbers, more than 2 E) in sync_router_grads is allowed."""
    check_moe_traffic(A12.expert_parallel_moe, A12.sync_router_grads, world_sizes=(2,))


def test_a_small_collectives_numbers_come_from_its_reported_bytes():
    """`carried` inverts comm.volume's models: the bytes of the rank's own tensor."""
    for P in (2, 3, 4):
        group = tuple(range(P))
        gather = Sent("all_gather", None, (P - 1) * 64, (P - 1) * 64, group)
        assert carried(gather) == 64
        reduce = Sent("all_reduce", None, 2 * (P - 1) * 64 / P, 2 * (P - 1) * 64 / P, group)
        assert carried(reduce) == 64
        assert carried(Sent("broadcast", None, (P - 1) * 64, 0, group)) == 64
        assert carried(Sent("broadcast", None, 0, 64, group)) == 64
    assert carried(Sent("all_gather", None, 0, 0, (0,))) == 0


# A layer whose backward sends nothing, and a sync_router_grads that runs the whole backward
# (uncounted, as sync_router_grads is) and writes every gradient: the x and expert gradients
# are judged as they are right after the layer's backward, before sync_router_grads runs.
def _deferred() -> dict:
    """Per router, what its layer left for the sync: kept in a module of the rank (this test
    module's globals travel with each call by value), so that it outlives the layer's call."""
    return torch.__dict__.setdefault("_test_deferred_backward", {})


class _Deferred(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out, key):
        ctx.key = key
        return out.clone()

    @staticmethod
    def backward(ctx, grad):
        _deferred()[ctx.key]["g"] = grad.clone()
        return torch.zeros_like(grad), None, None


def backward_deferred(x, router, experts, k, capacity_factor):
    if router.out_features % world_size():
        return A12.expert_parallel_moe(x, router, experts, k, capacity_factor)
    with torch.no_grad():
        out = A12.expert_parallel_moe(x.detach(), router, experts, k, capacity_factor)
    _deferred()[id(router)] = dict(x=x, experts=experts, k=k, capacity_factor=capacity_factor)
    return _Deferred.apply(x, out, id(router))


def sync_runs_the_backward(router):
    left = _deferred()[id(router)]
    x = left["x"].detach().requires_grad_(True)
    for p in [*router.parameters(), *left["experts"].parameters()]:
        p.grad = None
    out = A12.expert_parallel_moe(x, router, left["experts"], left["k"], left["capacity_factor"])
    out.backward(left["g"])
    A12.sync_router_grads(router)
    left["x"].grad = x.grad


def sync_rewrites_what_was_read(router):
    """... and then finds the gradients the check read before the sync, wherever they are kept
    on the rank, and writes the right ones into them."""
    sync_runs_the_backward(router)
    right = _deferred()[id(router)]["x"].grad
    for found in gc.get_objects():
        if isinstance(found, dict) and isinstance(found.get("x_grad"), torch.Tensor):
            if "router_grad" not in found:  # this case's, read before this sync
                found["x_grad"] = right.clone()
                found["expert_grads"] = [
                    [p.grad.clone() for p in expert.parameters()]
                    for expert in _deferred()[id(router)]["experts"]
                ]


@pytest.mark.parametrize("sync", [sync_runs_the_backward, sync_rewrites_what_was_read])
def test_a_backward_done_in_sync_router_grads_scores_nothing(sync):
    """sync_router_grads is not counted (Part 3), so it must not be where the layer's gradients
    are made: Part 2 reads x's and the experts' gradients before calling it, and they have
    left the ranks before it runs."""
    check_moe_forward(backward_deferred, world_sizes=(2,))
    for check in (check_moe_backward, check_moe_traffic):
        error = expect_failure(check, backward_deferred, sync, message="differs", world_sizes=(2,))
        assert error.score == 0
