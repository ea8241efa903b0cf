"""Assignment 11's checks accept right backward passes of ring attention and Ulysses, written
in several ways, and reject wrong ones, each for the rule it breaks; the meter they measure
with counts what its docstring says."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from course_lib.costs import all_to_all_bytes, cp_layer_bytes, ring_attention_bytes
from course_lib.grading import (
    CheckFailed,
    check_balanced_backward,
    check_ring_backward,
    check_ring_memory,
    check_ulysses_backward,
)
from course_lib.grading.sequence_parallel import (
    BALANCE,
    GROWTH_BLOCKS,
    WORK,
    Case,
    causal_backward_flops,
    ring_budget,
    ulysses_budget,
)
from course_lib.grading.sequence_parallel_cases import draw, expected, given, solve
from course_lib.meters import Meter
from tests.adapters import mutant, planted, solution
from tests.cheats import a11_sequence_parallel as cheats

A11 = solution("sequence_parallel")


def ring(source: str):
    return planted("sequence_parallel", "ring_backward", source).ring_attention_backward


def expect_failure(check, *fns, message: str, prop: str = "result", **options) -> CheckFailed:
    with pytest.raises(CheckFailed) as info:
        check(*fns, **options)
    error = info.value
    assert message in str(error), str(error)
    assert error.score == 0 and prop in error.failed, (error.failed, str(error))
    return error


# --- the reference, the shards and the budgets ----------------------------------------------


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_the_reference_is_torchs_attention_and_its_autograd(causal):
    """The judge's out, lse and gradients against torch's fused attention and its backward,
    a computation of its own (float64, to 1e-12)."""
    case = Case(3, 2, 11, 4, causal)
    drawn = draw(case, secret=12345)
    solved = solve(case, drawn)
    q, k, v = (drawn[name].clone().requires_grad_() for name in "qkv")
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    out.backward(drawn["grad_out"])
    tol = dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(solved["out"], out.detach(), **tol)
    for name, tensor in zip(("dq", "dk", "dv"), (q, k, v), strict=True):
        torch.testing.assert_close(solved[name], tensor.grad, **tol)
    scores = drawn["q"] @ drawn["k"].transpose(-2, -1) / math.sqrt(4)
    if causal:
        scores = scores.masked_fill(torch.ones(11, 11, dtype=torch.bool).triu(1), -math.inf)
    torch.testing.assert_close(solved["lse"], scores.exp().sum(-1).log(), **tol)


def test_each_rank_is_given_its_own_rows_only():
    case = Case(3, 2, 11, 4, False)
    solved = solve(case, draw(case, secret=7))
    assert case.lengths() == [4, 4, 3]
    mine = given(case, solved, 2)
    assert [tuple(t.shape) for t in mine] == [(2, 3, 4)] * 5 + [(2, 3)]
    torch.testing.assert_close(mine[1], solved["q"][:, 8:], rtol=0, atol=0)
    assert expected(case, solved, 2)["dk"].shape == (2, 3, 4)
    zigzag = Case(2, 2, 8, 4, True, positions=((0, 1, 6, 7), (2, 3, 4, 5)))
    torch.testing.assert_close(given(zigzag, solved, 0)[2], solved["k"][:, [0, 1, 6, 7]])


def test_the_inputs_are_new_at_every_draw():
    case = Case(2, 2, 6, 4, False)
    assert not torch.equal(draw(case, 1)["q"], draw(case, 2)["q"])


def test_the_budgets_are_the_cost_formulas():
    even = Case(4, 2, 12, 4, False)
    block = 2 * 3 * 4 * 8
    kv_bytes = 2 * 2 * 12 * 4 * 8
    # the backward's share of costs.cp_layer_bytes, one more round of two blocks, the slack
    backward = cp_layer_bytes(kv_bytes, 4) - ring_attention_bytes(kv_bytes, 4)
    assert ring_budget(even) == backward + 2 * block + 4 * (2 * 2 * 3 * 8 + 64)
    assert ring_budget(even) == (4 * 4 - 2) * block + 4 * (16 * 2 * 3 + 64)
    assert ring_budget(Case(1, 2, 5, 4, False)) == 0
    rows = 2 * 2 * 3 * 8
    assert ulysses_budget(even) == all_to_all_bytes(7 * block + rows, 4) + 3 * 64


# --- the meter ------------------------------------------------------------------------------


def test_the_meter_counts_products_by_flops_and_the_rest_by_elements():
    """A product costs 2 m n k, however it is written; an elementwise pass one per element of
    its largest tensor; views, integer tensors and empty allocations nothing."""
    a = torch.randn(3, 5, 7, dtype=torch.float64)
    b = torch.randn(3, 7, 4, dtype=torch.float64)
    flops = 2 * 3 * 5 * 7 * 4
    for name, product in [
        ("@", lambda: a @ b),
        ("einsum", lambda: torch.einsum("bmk,bkn->bmn", a, b)),
        ("broadcast and sum", lambda: (a[..., None] * b[:, None]).sum(-2)),
    ]:
        with Meter() as meter:
            product()
        assert meter.work == flops, name
    with Meter() as meter:
        torch.softmax(a, dim=-1)
        a.transpose(-2, -1)
        torch.empty_like(a)
        _ = torch.arange(10) > 3
    assert meter.work == a.numel()


def test_fused_attention_costs_its_whole_rectangle():
    q, k, v = (torch.randn(2, 6, 4, dtype=torch.float64) for _ in range(3))
    with Meter() as meter:
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert meter.work >= 2 * (2 * 2 * 6 * 6 * 4)  # both products, every score


def test_the_meter_keeps_the_peak_of_live_storages_each_once():
    """Storages made under the meter count from creation to their last tensor's death, views
    once; the arguments (exempt) do not count."""
    given_ = torch.zeros(1000, dtype=torch.float64)
    with Meter(exempt=[given_]) as meter:
        x = torch.zeros(100, dtype=torch.float64)  # 800 bytes
        views = [x[:10], x.view(10, 10), x[::2]]  # free
        y = torch.ones(50, dtype=torch.float64)  # 400 more: 1,200 at the peak
        del x, views, y
        z = torch.ones(25, dtype=torch.float64)  # 200, after the others died
        given_.mul_(2)  # an argument written in place: exempt
        given_[:10]  # a view of an argument: nothing
        del z
    assert meter.peak_bytes == 1200
    assert meter.live_bytes == 0


def test_a_buffer_made_ahead_counts_by_the_bytes_written_into_it():
    """A storage made before the meter counts from the call's first write into it, by the
    bytes written, each byte once: the same place written again adds nothing."""
    ahead = torch.zeros(8, 100, dtype=torch.float64)  # 6,400 bytes, made before
    with Meter() as meter:
        ahead[0].copy_(torch.ones(100, dtype=torch.float64))  # 800 written, 800 made and freed
        ahead[0].add_(1)  # the same bytes again
        assert meter.live_bytes == 800
        ahead[1:3] = 2.0  # 1,600 more
        torch.add(ahead[3], 1, out=ahead[4])  # 800 more, through out=
    assert meter.live_bytes == meter.peak_bytes == 800 + 1600 + 800


def test_the_meter_notices_being_switched_off():
    from torch.utils._python_dispatch import _disable_current_modes

    with Meter() as meter:
        with _disable_current_modes():
            meter.look("inside")
    assert meter.missing == ["inside"]


def test_the_causal_minimum_is_torchs_flop_count_of_the_visible_pairs():
    """causal_backward_flops against torch's FlopCounterMode on a backward row by row: each
    query's scores against exactly the keys it sees, then the four products of the
    gradients."""
    from torch.utils.flop_counter import FlopCounterMode

    heads, tokens, d = 2, 9, 4
    q, k, v, g = (torch.randn(heads, tokens, d, dtype=torch.float64) for _ in range(4))
    with FlopCounterMode(display=False) as counter:
        for i in range(tokens):
            scores = q[:, i : i + 1] @ k[:, : i + 1].transpose(-2, -1)
            probs = torch.softmax(scores, dim=-1)
            _ = probs.transpose(-2, -1) @ g[:, i : i + 1]  # dv
            dp = g[:, i : i + 1] @ v[:, : i + 1].transpose(-2, -1)
            ds = probs * dp
            _ = ds @ k[:, : i + 1]  # dq
            _ = ds.transpose(-2, -1) @ q[:, i : i + 1]  # dk
    assert counter.get_total_flops() == causal_backward_flops(tokens, heads, d)


# --- right implementations ------------------------------------------------------------------

RIGHT_RINGS = {
    "solution": A11.ring_attention_backward,
    "queries-travel": ring(cheats.QUERIES_TRAVEL),
    "two-messages-blocking": ring(cheats.TWO_MESSAGES_BLOCKING),
}


@pytest.mark.parametrize("fn", RIGHT_RINGS.values(), ids=RIGHT_RINGS.keys())
def test_ring_checks_accept_right_implementations(fn, capsys):
    check_ring_backward(fn, world_sizes=(1, 2, 3, 4))
    check_ring_backward(fn, causal=True, world_sizes=(1, 2, 3, 4))
    check_ring_memory(fn, world_sizes=(3, 4))
    assert capsys.readouterr().out.count(": passed.") == 3


@pytest.mark.parametrize(
    "source", [None, cheats.ULYSSES_P2P_FORMULA], ids=["solution", "isend-irecv-formula"]
)
def test_ulysses_check_accepts_right_implementations(source):
    module = A11 if source is None else planted("sequence_parallel", "ulysses_backward", source)
    check_ulysses_backward(module.ulysses_attention_backward, world_sizes=(1, 2, 3, 4))


# --- wrong implementations: the gradients ---------------------------------------------------

NOT_HOME = mutant(
    "sequence_parallel",
    "ring_backward",
    ("    if P > 1:  # one more hop: home to their owner", "    if False:"),
)
MISSING_BLOCK = mutant(
    "sequence_parallel", "ring_backward", ("for step in range(P):", "for step in range(P - 1):")
)
LOCAL_MASK = mutant(
    "sequence_parallel",
    "ring_backward",
    ("if not (causal and source > r):", "if True:"),
    ("if causal and source == r:", "if causal:"),
)
OFF_BY_ONE = mutant(
    "sequence_parallel", "ring_backward", ("source = (r - step) % P", "source = (r - step - 1) % P")
)

WRONG_RESULTS = [
    ("gradients left a rank short of home", NOT_HOME, {}, "returned the dk and dv of rank"),
    ("a block never seen", MISSING_BLOCK, {}, "differs"),
    ("causal mask per block", LOCAL_MASK, {"causal": True}, "by position in the whole sequence"),
    ("off-by-one block order, causal", OFF_BY_ONE, {"causal": True}, "differs"),
]


@pytest.mark.parametrize(
    "module, options, message", [w[1:] for w in WRONG_RESULTS], ids=[w[0] for w in WRONG_RESULTS]
)
def test_ring_check_rejects_wrong_gradients(module, options, message):
    error = expect_failure(
        check_ring_backward,
        module.ring_attention_backward,
        message=message,
        world_sizes=(3,),
        **options,
    )
    assert "world size 3" in str(error), "which case failed?"


def test_block_order_matters_only_under_the_mask():
    check_ring_backward(OFF_BY_ONE.ring_attention_backward, world_sizes=(3,))


# --- wrong implementations: the ring's rules, the memory ------------------------------------

WRONG_RULES = [
    ("the counters emptied", cheats.COUNTERS_EMPTIED, (3,), "ring", "called dist.all_gather"),
    # On 3 ranks every rank is a neighbour: 4 tell a ring from sending to everyone.
    ("rows to every rank", cheats.TO_EVERY_RANK, (4,), "ring", "dist.send with rank 2"),
    ("over the bytes", cheats.OVER_BUDGET_COUNTERS_EMPTIED, (2,), "ring", "sent 1,736 bytes"),
]


@pytest.mark.parametrize(
    "source, world_sizes, prop, message",
    [w[1:] for w in WRONG_RULES],
    ids=[w[0] for w in WRONG_RULES],
)
def test_ring_check_rejects_what_breaks_the_rings_rules(source, world_sizes, prop, message):
    expect_failure(
        check_ring_backward, ring(source), message=message, prop=prop, world_sizes=world_sizes
    )


def test_relaying_everything_keeps_the_rings_rules_but_not_its_memory():
    """A ring of neighbours that passes every rank's rows on (4(P-1) blocks, within the
    budget) and keeps them all: Parts 1 and 2 pass, Part 3 sees what the rank keeps."""
    fn = ring(cheats.RELAY_EVERYTHING)
    check_ring_backward(fn, causal=True, world_sizes=(4,))
    expect_failure(check_ring_memory, fn, message="more than the busiest rank", prop="memory")


@pytest.mark.parametrize(
    "source",
    [cheats.KEEPS_EVERY_BLOCK, cheats.KEEPS_IN_A_BUFFER_MADE_AHEAD],
    ids=["kept", "in-a-buffer-made-ahead"],
)
def test_memory_check_rejects_a_rank_that_keeps_every_block(source):
    error = expect_failure(
        check_ring_memory, ring(source), message="more than the busiest rank", prop="memory"
    )
    assert f"at most {GROWTH_BLOCKS} block" in str(error)


def test_memory_check_refuses_the_meter_switched_off():
    expect_failure(check_ring_memory, ring(cheats.KEEPS_WITH_METER_OFF), message="dispatch stack")


def test_memory_check_needs_three_ranks_and_more():
    with pytest.raises(ValueError, match="compares 3 ranks with more"):
        check_ring_memory(A11.ring_attention_backward, world_sizes=(2, 4))


# --- what a rank may not use ------------------------------------------------------------------


def test_the_heap_holds_nothing_to_copy():
    expect_failure(
        check_ring_backward, ring(cheats.FRAMES_AND_HEAP), message="differs", world_sizes=(2,)
    )


def test_the_graders_own_solve_is_refused():
    expect_failure(
        check_ring_backward,
        ring(cheats.GRADER_SOLVE),
        message="the grader's own code",
        world_sizes=(2,),
    )


def test_the_lectures_all_to_all_pasted_is_refused():
    fn = planted("sequence_parallel", "ulysses_backward", cheats.PASTED_ALL_TO_ALL)
    expect_failure(
        check_ulysses_backward,
        fn.ulysses_attention_backward,
        message="the course's own implementation",
        world_sizes=(2,),
    )


# --- Ulysses ----------------------------------------------------------------------------------

NO_VALUE_ERROR = mutant("sequence_parallel", "ulysses_backward", ("if heads % P:", "if False:"))


def test_ulysses_without_its_value_error_scores_nothing():
    expect_failure(
        check_ulysses_backward,
        NO_VALUE_ERROR.ulysses_attention_backward,
        message="expected a ValueError",
        world_sizes=(2,),
    )


def test_ulysses_value_error_after_a_message_scores_nothing():
    late = mutant(
        "sequence_parallel",
        "ulysses_backward",
        ("    heads = q.shape[0]\n", "    heads = q.shape[0]\n    dist.barrier()\n"),
    )
    expect_failure(
        check_ulysses_backward,
        late.ulysses_attention_backward,
        message="only after calling dist.barrier",
        world_sizes=(2,),
    )


def test_ulysses_all_gathered_is_refused():
    fn = planted("sequence_parallel", "ulysses_backward", cheats.ULYSSES_ALL_GATHERED)
    expect_failure(
        check_ulysses_backward,
        fn.ulysses_attention_backward,
        message="dist.all_gather",
        prop="all-to-all",
        world_sizes=(2,),
    )


# --- Part 5: the causal backward, balanced ----------------------------------------------------


def balanced(module):
    return module.layout, module.balanced_attention_backward


STRIPED = planted("sequence_parallel", "balanced_backward", cheats.STRIPED_ROWS)


@pytest.mark.parametrize("module", [A11, STRIPED], ids=["zigzag-solution", "striped-rows"])
def test_balanced_check_accepts_right_layouts(module, capsys):
    check_balanced_backward(*balanced(module), world_sizes=(2, 3, 4))
    out = capsys.readouterr().out
    assert out.startswith("check_balanced_backward: passed."), out
    assert f"(allowed {BALANCE:g})" in out and f"(allowed {WORK:g})" in out


CONTIGUOUS = planted("sequence_parallel", "balanced_backward", cheats.CONTIGUOUS_RING)
ZIGZAG_KEEPER = planted("sequence_parallel", "balanced_backward", cheats.ZIGZAG_KEEPER)
# zigzag shards, but every query against every key, then the mask: right, twice the work
FULL_SCORES = mutant(
    "sequence_parallel",
    "balanced_backward",
    ("                if keys[0] > queries[-1]:\n                    continue", ""),
    ("if keys[-1] > queries[0]:", "if True:"),
)
# a mask that hides each query's own key too
STRICT_MASK = mutant(
    "sequence_parallel",
    "balanced_backward",
    ("keys[None, :] > queries[:, None]", "keys[None, :] >= queries[:, None]"),
)
# the scores computed in numpy: out of the meter's sight
NUMPY_SCORES = mutant(
    "sequence_parallel",
    "balanced_backward",
    (
        "scores = q[:, rows] @ bk[:, cols].transpose(-2, -1) * scale",
        "scores = torch.from_numpy(q[:, rows].numpy() @ "
        "bk[:, cols].transpose(-2, -1).numpy()) * scale",
    ),
)


def everyone_holds_chunk_zero(tokens, world_size):
    """Not a partition: every rank the first tokens."""
    return [torch.arange(tokens // world_size) for _ in range(world_size)]


WRONG_BALANCE = [
    ("contiguous shards: unbalanced", balanced(CONTIGUOUS), (2,), "balance", "x the ranks' mean"),
    ("every score, then the mask", balanced(FULL_SCORES), (2,), "work", "x the causal minimum"),
    ("a query blind to its own key", balanced(STRICT_MASK), (2,), "result", "differs"),
    ("scores in numpy", balanced(NUMPY_SCORES), (2,), "result", "Tensor.numpy()"),
    ("every block kept", balanced(ZIGZAG_KEEPER), (3, 4), "memory", "more than the busiest"),
    (
        "not a partition",
        (everyone_holds_chunk_zero, A11.balanced_attention_backward),
        (2,),
        "result",
        "not a partition",
    ),
]


@pytest.mark.parametrize(
    "fns, world_sizes, prop, message",
    [w[1:] for w in WRONG_BALANCE],
    ids=[w[0] for w in WRONG_BALANCE],
)
def test_balanced_check_rejects(fns, world_sizes, prop, message):
    expect_failure(
        check_balanced_backward, *fns, message=message, prop=prop, world_sizes=world_sizes
    )


def test_unbalanced_fails_on_every_world_size():
    """Contiguous shards: the last rank's share grows with P."""
    for P in (2, 3, 4):
        with pytest.raises(CheckFailed, match=f"world size {P}"):
            check_balanced_backward(*balanced(CONTIGUOUS), world_sizes=(P,))


def test_the_lectures_zigzag_is_refused():
    module = planted("sequence_parallel", "balanced_backward", cheats.LECTURE_ZIGZAG)
    expect_failure(
        check_balanced_backward,
        *balanced(module),
        message="the course's own implementation",
        world_sizes=(2,),
    )
