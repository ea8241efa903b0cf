"""Assignment 11's checks accept right ring and Ulysses attentions and reject wrong ones."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from course_lib import rank, world_size
from course_lib.costs import ring_attention_bytes
from course_lib.grading import (
    CheckFailed,
    check_balanced_attention,
    check_ring_attention,
    check_ring_traffic,
    check_ulysses_attention,
)
from course_lib.grading.sequence_parallel import (
    BALANCE,
    WORK,
    Case,
    WorkMeter,
    causal_attention_flops,
    lengths,
    reference,
    ring_budget,
)
from tests.adapters import mutant, planted, solution
from tests.cheats import a11_sequence_parallel as cheats

A11 = solution("sequence_parallel")
LOGSUMEXP = planted("sequence_parallel", "ring_attention", cheats.RING_LOGSUMEXP)
ULYSSES_P2P = planted("sequence_parallel", "ulysses_attention", cheats.ULYSSES_P2P)


def expect_failure(check, fn, message: str, **options) -> CheckFailed:
    with pytest.raises(CheckFailed) as info:
        check(fn, **options)
    assert message in str(info.value), str(info.value)
    return info.value


# --- the reference and the budget ----------------------------------------------------------


def test_reference_is_torch_attention_on_the_whole_sequence():
    """The check's reference against torch's own attention (float64, to 1e-12)."""
    from course_lib.grading.sequence_parallel_ranks import inputs

    for causal in (False, True):
        case = Case(3, 2, 11, 4, causal, 0)
        q, k, v = inputs(case)
        torch_out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        torch.testing.assert_close(reference(case), torch_out, rtol=1e-12, atol=1e-12)


def test_shards_are_tensor_split_and_the_budget_is_the_cost_formula_when_even():
    assert lengths(Case(4, 2, 14, 4, False, 0)) == [4, 4, 3, 3]
    even = Case(4, 2, 12, 4, False, 0)
    kv_bytes = 2 * 2 * 12 * 4 * 8
    slack = 3 * (8 * 3 + 64)
    assert ring_budget(even) == ring_attention_bytes(kv_bytes, 4) + slack


# --- right implementations -----------------------------------------------------------------


@pytest.mark.parametrize("module", [A11, LOGSUMEXP], ids=["solution", "logsumexp-leftwards"])
def test_ring_checks_accept_right_implementations(module, capsys):
    check_ring_attention(module.ring_attention, world_sizes=(1, 2, 3, 4))
    check_ring_attention(module.ring_attention, causal=True, world_sizes=(1, 2, 3, 4))
    check_ring_traffic(module.ring_attention, world_sizes=(2, 3, 4))
    assert capsys.readouterr().out.count(": passed.") == 3


@pytest.mark.parametrize("module", [A11, ULYSSES_P2P], ids=["solution", "isend-irecv-sdpa"])
def test_ulysses_check_accepts_right_implementations(module):
    check_ulysses_attention(module.ulysses_attention, world_sizes=(1, 2, 3, 4))


# --- wrong implementations -----------------------------------------------------------------

OFF_BY_ONE = mutant(
    "sequence_parallel",
    "ring_attention",
    ("source = (r - step) % P", "source = (r - step - 1) % P"),
).ring_attention
NO_RESCALE = mutant(
    "sequence_parallel",
    "ring_attention",
    ("row_sum = row_sum * rescale + ", "row_sum = row_sum + "),
    ("acc = acc * rescale + ", "acc = acc + "),
).ring_attention
LOCAL_MASK = mutant(
    "sequence_parallel",
    "ring_attention",
    ("if not (causal and source > r):", "if True:"),
    ("if causal and source == r:", "if causal:"),
).ring_attention
MISSING_LAST_BLOCK = mutant(
    "sequence_parallel", "ring_attention", ("for step in range(P):", "for step in range(P - 1):")
).ring_attention
NO_VALUE_ERROR = mutant(
    "sequence_parallel", "ulysses_attention", ("if heads % P:", "if False:")
).ulysses_attention


def ring_to_everyone(q, k, v, causal=False):
    """Right numbers, but every rank sends its K/V straight to every other rank."""
    P, r = world_size(), rank()
    blocks = {r: (k, v)}
    sizes = {}
    works = []
    for other in range(P):
        if other != r:
            size = torch.empty(1, dtype=torch.long)
            works += [dist.isend(torch.tensor([k.shape[1]]), other), dist.irecv(size, other)]
            sizes[other] = size
    for work in works:
        work.wait()
    works = []
    for other, size in sizes.items():
        into = torch.empty(2, k.shape[0], int(size), k.shape[2], dtype=k.dtype)
        works += [dist.isend(torch.stack([k, v]), other), dist.irecv(into, other)]
        blocks[other] = into
    for work in works:
        work.wait()
    whole_k = torch.cat([blocks[s][0] for s in range(P)], dim=1)
    whole_v = torch.cat([blocks[s][1] for s in range(P)], dim=1)
    start = sum(int(sizes.get(s, torch.tensor([q.shape[1]]))) for s in range(r))
    scores = q @ whole_k.transpose(-2, -1) / q.shape[-1] ** 0.5
    if causal:
        positions = torch.arange(start, start + q.shape[1])
        hidden = torch.arange(whole_k.shape[1])[None, :] > positions[:, None]
        scores = scores.masked_fill(hidden, float("-inf"))
    return torch.softmax(scores, dim=-1) @ whole_v


def ring_gather_then_attend(q, k, v, causal=False):
    """Right numbers and a ring's messages, but every block is kept and joined: the whole
    sequence's K and V on every rank, then attention over all of it."""
    P, r = world_size(), rank()
    right, left = (r + 1) % P, (r - 1) % P
    blocks, current = {r: (k, v)}, (k, v)
    for step in range(1, P):
        n_in = torch.empty(1, dtype=torch.long)
        for work in [
            dist.isend(torch.tensor([current[0].shape[1]]), right),
            dist.irecv(n_in, left),
        ]:
            work.wait()
        into = torch.empty(2, k.shape[0], int(n_in), k.shape[2], dtype=k.dtype)
        for work in [dist.isend(torch.stack(current), right), dist.irecv(into, left)]:
            work.wait()
        current = (into[0], into[1])
        blocks[(r - step) % P] = current
    whole_k = torch.cat([blocks[s][0] for s in range(P)], dim=1)
    whole_v = torch.cat([blocks[s][1] for s in range(P)], dim=1)
    start = sum(blocks[s][0].shape[1] for s in range(r))
    scores = q @ whole_k.transpose(-2, -1) / q.shape[-1] ** 0.5
    if causal:
        positions = torch.arange(start, start + q.shape[1])
        hidden = torch.arange(whole_k.shape[1])[None, :] > positions[:, None]
        scores = scores.masked_fill(hidden, float("-inf"))
    return torch.softmax(scores, dim=-1) @ whole_v


def ulysses_all_gathered(q, k, v, causal=False):
    """Right numbers and the ValueError, but all-gathers the whole q, k, v instead of swapping
    shards for heads."""
    P, r = world_size(), rank()
    if q.shape[0] % P:
        raise ValueError("heads must divide")
    whole = []
    for x in (q, k, v):
        parts = [torch.empty_like(x) for _ in range(P)]
        dist.all_gather(parts, x.contiguous())
        whole.append(torch.cat(parts, dim=1))
    scores = whole[0] @ whole[1].transpose(-2, -1) / q.shape[-1] ** 0.5
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), -torch.inf)
    out = torch.softmax(scores, dim=-1) @ whole[2]
    return out.tensor_split(P, dim=1)[r]


CAUSAL_ONLY = {"causal": True}
WRONG_RING = [
    ("off-by-one block order", check_ring_attention, OFF_BY_ONE, CAUSAL_ONLY, "differs"),
    ("missing softmax rescale", check_ring_attention, NO_RESCALE, {}, "rescale"),
    ("causal mask per block", check_ring_attention, LOCAL_MASK, CAUSAL_ONLY, "diagonal block"),
    ("a block never seen", check_ring_attention, MISSING_LAST_BLOCK, {}, "differs"),
    # On 3 ranks every rank is a neighbour: 4 tell a ring from sending to everyone.
    ("K/V to every rank", check_ring_traffic, ring_to_everyone, {"world_sizes": (4,)}, "rank 2"),
    ("whole K/V kept", check_ring_traffic, ring_gather_then_attend, {}, "made a tensor of"),
]


@pytest.mark.parametrize(
    "check, fn, options, message", [w[1:] for w in WRONG_RING], ids=[w[0] for w in WRONG_RING]
)
def test_ring_checks_reject_wrong_implementations(check, fn, options, message):
    options = {"world_sizes": (3,), **options}
    error = expect_failure(check, fn, message, **options)
    assert error.score == 0
    assert f"world size {options['world_sizes'][0]}" in str(error), "which case failed?"


def test_block_order_matters_only_under_the_mask():
    check_ring_attention(OFF_BY_ONE, world_sizes=(3,))


def test_all_gathered_kv_is_right_but_fails_the_traffic_check():
    sdpa = planted("sequence_parallel", "ring_attention", cheats.SDPA_ALL_GATHERED).ring_attention
    check_ring_attention(sdpa, causal=True, world_sizes=(3,))
    error = expect_failure(check_ring_traffic, sdpa, "called dist.all_gather", world_sizes=(3,))
    assert error.score == 0 and error.failed == {"ring"}


def test_ulysses_without_its_value_error_scores_nothing():
    error = expect_failure(
        check_ulysses_attention, NO_VALUE_ERROR, "expected a ValueError", world_sizes=(2,)
    )
    assert error.score == 0


def test_ulysses_all_gathered_earns_half():
    error = expect_failure(
        check_ulysses_attention, ulysses_all_gathered, "dist.all_gather", world_sizes=(2,)
    )
    assert error.failed == {"all-to-all"} and error.score == 0.5


@pytest.mark.parametrize(
    "check, source",
    [
        (check_ring_traffic, cheats.LECTURE_RING),
        (check_ring_attention, cheats.PASTED_MERGE),
    ],
    ids=["wrapped", "pasted"],
)
def test_the_lectures_ring_is_refused(check, source):
    fn = planted("sequence_parallel", "ring_attention", source).ring_attention
    expect_failure(check, fn, "the course's own implementation", world_sizes=(2,))


def test_the_lectures_ulysses_is_refused():
    fn = planted("sequence_parallel", "ulysses_attention", cheats.LECTURE_ULYSSES)
    expect_failure(check_ulysses_attention, fn.ulysses_attention, "lecture", world_sizes=(2,))


# --- Part 5: causal attention, balanced ----------------------------------------------------

STRIPED = planted("sequence_parallel", "balanced_attention", cheats.STRIPED_ROWS)


def balanced(module):
    return module.layout, module.balanced_causal_attention


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
        with WorkMeter() as meter:
            product()
        assert meter.work == flops, name
    with WorkMeter() as meter:
        torch.softmax(a, dim=-1)
        a.transpose(-2, -1)
        torch.empty_like(a)
        _ = torch.arange(10) > 3
    assert meter.work == a.numel()


def test_fused_attention_costs_its_whole_rectangle():
    q, k, v = (torch.randn(2, 6, 4, dtype=torch.float64) for _ in range(3))
    with WorkMeter() as meter:
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert meter.work >= 2 * (2 * 2 * 6 * 6 * 4)  # both products, every score


def test_the_causal_minimum_is_torchs_flop_count_of_the_visible_pairs():
    """causal_attention_flops against torch's FlopCounterMode on attention row by row, each
    query against exactly the keys it sees."""
    from torch.utils.flop_counter import FlopCounterMode

    heads, tokens, d = 2, 9, 4
    q, k, v = (torch.randn(heads, tokens, d, dtype=torch.float64) for _ in range(3))
    with FlopCounterMode(display=False) as counter:
        for i in range(tokens):
            scores = q[:, i : i + 1] @ k[:, : i + 1].transpose(-2, -1)
            torch.softmax(scores, dim=-1) @ v[:, : i + 1]
    assert counter.get_total_flops() == causal_attention_flops(tokens, heads, d)


@pytest.mark.parametrize("module", [A11, STRIPED], ids=["zigzag-solution", "striped-rows"])
def test_balanced_check_accepts_right_layouts(module, capsys):
    check_balanced_attention(*balanced(module), world_sizes=(2, 3, 4))
    out = capsys.readouterr().out
    assert out.startswith("check_balanced_attention: passed."), out
    assert f"(allowed {BALANCE:g})" in out and f"(allowed {WORK:g})" in out


CONTIGUOUS = planted("sequence_parallel", "balanced_attention", cheats.CONTIGUOUS_RING)
# zigzag shards, but every query against every key, then the mask: right, twice the work
FULL_SCORES = mutant(
    "sequence_parallel", "balanced_attention", ("seen = int(pos[-1]) + 1", "seen = n * P")
)
# the mask by positions inside a chunk instead of the sequence's
LOCAL_MASK_5 = mutant(
    "sequence_parallel",
    "balanced_attention",
    ("> pos[:, None]", "> torch.arange(len(pos))[:, None]"),
)
# the scores computed in numpy: out of the meter's sight
NUMPY_SCORES = mutant(
    "sequence_parallel",
    "balanced_attention",
    (
        "scores = q[:, rows] @ whole_k[:, :seen].transpose(-2, -1)",
        "scores = torch.from_numpy(q[:, rows].numpy() @ "
        "whole_k[:, :seen].transpose(-2, -1).numpy())",
    ),
)
# the same scores, with the meter taken off torch's dispatch stack meanwhile
METER_OFF = mutant(
    "sequence_parallel",
    "balanced_attention",
    (
        "scores = q[:, rows] @ whole_k[:, :seen].transpose(-2, -1)",
        "with __import__('torch').utils._python_dispatch._disable_current_modes():\n"
        "            scores = q[:, rows] @ whole_k[:, :seen].transpose(-2, -1)\n"
        "        scores = scores",
    ),
)


def everyone_holds_chunk_zero(tokens, world_size):
    """Not a partition: every rank the first tokens."""
    return [torch.arange(tokens // world_size) for _ in range(world_size)]


WRONG_BALANCE = [
    ("contiguous shards: unbalanced", balanced(CONTIGUOUS), "balance", "x the ranks' mean"),
    ("every score, then the mask", balanced(FULL_SCORES), "work", "x the causal minimum"),
    ("mask by chunk positions", balanced(LOCAL_MASK_5), "result", "differs"),
    ("scores in numpy", balanced(NUMPY_SCORES), "result", "Tensor.numpy()"),
    ("meter switched off", balanced(METER_OFF), "result", "work meter"),
    (
        "not a partition",
        (everyone_holds_chunk_zero, A11.balanced_causal_attention),
        "result",
        "not a partition",
    ),
]


@pytest.mark.parametrize(
    "fns, prop, message", [w[1:] for w in WRONG_BALANCE], ids=[w[0] for w in WRONG_BALANCE]
)
def test_balanced_check_rejects(fns, prop, message):
    with pytest.raises(CheckFailed) as info:
        check_balanced_attention(*fns, world_sizes=(2,))
    error = info.value
    assert message in str(error), str(error)
    assert error.score == 0 and prop in error.failed, (error.failed, str(error))


def test_unbalanced_fails_on_every_world_size():
    """Contiguous shards: the last rank's share grows with P (2P/(P+1) of the mean)."""
    for P in (2, 3, 4):
        with pytest.raises(CheckFailed, match=f"world size {P}"):
            check_balanced_attention(*balanced(CONTIGUOUS), world_sizes=(P,))


def test_the_lectures_balanced_attention_is_refused():
    module = planted("sequence_parallel", "balanced_attention", cheats.LECTURE_BALANCED)
    with pytest.raises(CheckFailed, match="the course's own implementation") as info:
        check_balanced_attention(*balanced(module), world_sizes=(2,))
    assert info.value.score == 0
