"""Assignment 2's checks accept right implementations and reject wrong ones, saying why."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed import broadcast as broadcast_unseen_by_counters

from course_lib import rank, world_size
from course_lib.grading import (
    CheckFailed,
    check_all_gather,
    check_all_reduce,
    check_bidirectional_ring_all_reduce,
    check_broadcast,
    check_reduce,
    check_reduce_scatter,
)
from course_lib.grading.collectives import check_all_reduce_fast
from course_lib.grading.collectives_judge import direction_budget, fast_budget, fast_messages
from course_lib.grading.collectives_ranks import Case
from tests.adapters import planted, solution
from tests.cheats.a02_collectives import (
    BIDIRECTIONAL_PADDED,
    FAST_PAIRED_FOLD,
    FAST_RING_OFF_POWERS,
    LECTURE_HALVING_DOUBLING_WRAPPED,
    LECTURE_RINGS_BOTH_WAYS,
    LECTURE_SCHEDULE_FOLDED,
    RINGS_ONE_AFTER_THE_OTHER,
)

UNEVEN = [(1,), (2,), (7,), (3, 5), ()]  # fewer elements than ranks, not divisible, 0-d
SOLVED = solution("collectives")


def expect_failure(check, fn, message: str, **options) -> str:
    """Run a check that must fail with `message`; return the whole message."""
    with pytest.raises(CheckFailed) as info:
        check(fn, **options)
    text = str(info.value)
    assert message in text, text
    return text


# --- right implementations ----------------------------------------------------------------


def broadcast_tree(tensor, src):
    """Right, another way: a binomial tree, log2(P) rounds, relative to src."""
    p, me = world_size(), (rank() - src) % world_size()
    step = 1
    while step < p:
        if me < step and me + step < p:
            dist.send(tensor, dst=(me + step + src) % p)
        elif step <= me < 2 * step:
            dist.recv(tensor, src=(me - step + src) % p)
        step *= 2


def broadcast_torch(tensor, src):
    dist.broadcast(tensor, src)


def reduce_chain(tensor, dst):
    """Right, another way: partial sums passed along a chain that ends at dst."""
    p, me = world_size(), (rank() - dst) % world_size()  # dst is 0 in this numbering
    if me < p - 1:
        partial = torch.empty_like(tensor)
        dist.recv(partial, src=(me + 1 + dst) % p)
        tensor += partial
    if me > 0:
        dist.send(tensor, dst=(me - 1 + dst) % p)


def reduce_torch(tensor, dst):
    dist.reduce(tensor, dst)


def all_gather_ring(tensor_list, tensor):
    """Right, another way: pass the pieces around a ring with batch_isend_irecv."""
    p, me = world_size(), rank()
    tensor_list[me].copy_(tensor)
    for step in range(p - 1):
        ops = [
            dist.P2POp(dist.isend, tensor_list[(me - step) % p], (me + 1) % p),
            dist.P2POp(dist.irecv, tensor_list[(me - step - 1) % p], (me - 1) % p),
        ]
        for request in dist.batch_isend_irecv(ops):
            request.wait()


def all_gather_torch(tensor_list, tensor):
    dist.all_gather(tensor_list, tensor)


def reduce_scatter_blocking(output, input_list):
    """Right, another way: blocking send/recv in an order that cannot deadlock."""
    p, me = world_size(), rank()
    output.copy_(input_list[me])
    buffer = torch.empty_like(output)
    for shift in range(1, p):
        to, frm = (me + shift) % p, (me - shift) % p
        if me < to:  # the lower rank of each pair sends first
            dist.send(input_list[to], dst=to)
            dist.recv(buffer, src=frm)
        else:
            dist.recv(buffer, src=frm)
            dist.send(input_list[to], dst=to)
        output += buffer


def reduce_scatter_torch(output, input_list):
    dist.reduce_scatter(output, input_list)


def all_reduce_torch(tensor):
    dist.all_reduce(tensor)


def one_way_ring(tensor):
    """Lecture 2's ring, one way, with P2POp / batch_isend_irecv and uneven split points: a
    right all-reduce, but Part 6's bytes all go to rank + 1."""
    p, me = world_size(), rank()
    flat = tensor.reshape(-1)
    bounds = [len(flat) * i // p for i in range(p + 1)]
    chunks = [flat[bounds[i] : bounds[i + 1]] for i in range(p)]
    right, left = (me + 1) % p, (me - 1) % p
    for step in range(2 * (p - 1)):
        reducing = step < p - 1
        outgoing = chunks[(me - step) % p]
        incoming = chunks[(me - step - 1) % p]
        buffer = torch.empty_like(incoming) if reducing else incoming
        ops = [dist.P2POp(dist.isend, outgoing, right), dist.P2POp(dist.irecv, buffer, left)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        if reducing:
            incoming += buffer


RING = "bidirectional_ring_all_reduce"
# Right, other ways: zero-padded chunks of ceil(N/(2P)) elements, so all chunks are equal; and
# the two rings one after the other, which Part 6 accepts (it does not judge time).
ring_padded = getattr(planted("collectives", RING, BIDIRECTIONAL_PADDED), RING)
IN_TURN = planted("collectives", RING, RINGS_ONE_AFTER_THE_OTHER)
rings_in_turn = getattr(IN_TURN, RING)
# A cheat: the lecture's ring, called once each way.
ring_lecture_both_ways = getattr(planted("collectives", RING, LECTURE_RINGS_BOTH_WAYS), RING)


def ring_prebound_far_peer(tensor):
    """Right sums, but rank 0's messages go to a rank that is not its neighbour, through
    names bound before the check wraps torch.distributed."""
    from torch.distributed import recv as early_recv
    from torch.distributed import send as early_send

    p, me = world_size(), rank()
    if p < 4:
        return SOLVED.bidirectional_ring_all_reduce(tensor)
    total = tensor.clone()
    for peer in range(p):  # everyone to everyone: not a ring
        if peer != me:
            if me < peer:
                early_send(tensor, peer)
                other = torch.empty_like(tensor)
                early_recv(other, peer)
            else:
                other = torch.empty_like(tensor)
                early_recv(other, peer)
                early_send(tensor, peer)
            total += other
    tensor.copy_(total)


@pytest.mark.parametrize(
    "check, fn",
    [
        (check_broadcast, SOLVED.broadcast),
        (check_broadcast, broadcast_tree),
        (check_reduce, SOLVED.reduce),
        (check_reduce, reduce_chain),
        (check_all_gather, SOLVED.all_gather),
        (check_all_gather, all_gather_ring),
        (check_reduce_scatter, SOLVED.reduce_scatter),
        (check_reduce_scatter, reduce_scatter_blocking),
        (check_all_reduce, SOLVED.all_reduce_naive),
        (check_all_reduce, SOLVED.bidirectional_ring_all_reduce),
        (check_all_reduce, one_way_ring),
    ],
    ids=lambda x: getattr(x, "__name__", ""),
)
def test_checks_accept_right_implementations(check, fn):
    check(fn, shapes=UNEVEN)


@pytest.mark.parametrize(
    "fn",
    [SOLVED.bidirectional_ring_all_reduce, ring_padded, rings_in_turn],
    ids=["solution", "padded", "in_turn"],
)
def test_ring_check_accepts_right_rings(fn):
    check_bidirectional_ring_all_reduce(fn, shapes=UNEVEN, seeds=[0, 1])


def test_ring_check_accepts_the_solution_on_8_ranks():
    check_bidirectional_ring_all_reduce(
        SOLVED.bidirectional_ring_all_reduce, world_sizes=[8], shapes=[(5,), (13,), (40,)]
    )


def test_ring_budget_each_way_by_hand():
    # 2(P-1) chunks of ceil(N/(2P)) elements: 7 float32 on 3 ranks, 4 chunks of 2; 12 int64
    # on 4 ranks, 6 chunks of 2; 1 element on 5 ranks, 8 chunks of 1 (the padded answer's).
    assert direction_budget(Case(3, (7,), torch.float32, 0)) == 4 * 2 * 4
    assert direction_budget(Case(4, (3, 4), torch.int64, 0)) == 6 * 2 * 8
    assert direction_budget(Case(5, (), torch.float64, 0)) == 8 * 1 * 8
    assert direction_budget(Case(1, (7,), torch.float32, 0)) == 0


TORCH_VERSIONS = [
    (check_broadcast, broadcast_torch, "dist.broadcast"),
    (check_reduce, reduce_torch, "dist.reduce"),
    (check_all_gather, all_gather_torch, "dist.all_gather"),
    (check_reduce_scatter, reduce_scatter_torch, "dist.reduce_scatter"),
    (check_all_reduce, all_reduce_torch, "dist.all_reduce"),
]


@pytest.mark.parametrize("check, fn, called", TORCH_VERSIONS)
def test_torch_own_collectives_match_the_reference_when_allowed(check, fn, called):
    # The comparison itself accepts torch's results (tolerances, every rank, every dtype)...
    check(fn, shapes=UNEVEN, point_to_point_only=False)
    # ...but the assignment forbids them.
    text = expect_failure(check, fn, "use send/recv only", world_sizes=[2])
    assert f"rank 0 called {called}" in text


# --- wrong implementations ----------------------------------------------------------------


def ring_reduce_scatter(chunks, hop=1):
    """The reduce-scatter half of a ring, in place in `chunks`: P - 1 steps, each sending a
    chunk `hop` ranks to the right and adding the one received from `hop` ranks to the left
    (only hop = 1 is a ring)."""
    p, me = world_size(), rank()
    for step in range(p - 1):
        incoming = chunks[(me - step - 1) % p]
        buffer = torch.empty_like(incoming)
        request = dist.isend(chunks[(me - step) % p], (me + hop) % p)
        dist.recv(buffer, (me - hop) % p)
        request.wait()
        incoming += buffer


def ring_drops_tail(tensor):
    """Chunks of N // P elements: the last N % P elements are never reduced."""
    p, me = world_size(), rank()
    flat = tensor.view(-1)
    size = len(flat) // p
    chunks = [flat[i * size : (i + 1) * size] for i in range(p)]
    ring_reduce_scatter(chunks)
    for step in range(p - 1):
        request = dist.isend(chunks[(me + 1 - step) % p], (me + 1) % p)
        dist.recv(chunks[(me - step) % p], (me - 1) % p)
        request.wait()


def ring_wrong_neighbour(tensor):
    """Sends two ranks to the right: on 4 ranks, two separate rings of two."""
    ring_reduce_scatter(torch.tensor_split(tensor.view(-1), world_size()), hop=2)


def ring_whole_tensor(tensor):
    """Right sum, wrong cost: each step passes a whole tensor to the right."""
    p, me = world_size(), rank()
    passing, total = tensor.clone(), tensor.clone()
    for _ in range(p - 1):
        buffer = torch.empty_like(tensor)
        request = dist.isend(passing, (me + 1) % p)
        dist.recv(buffer, (me - 1) % p)
        request.wait()
        total += buffer
        passing = buffer
    tensor.copy_(total)


def reduce_without_own(tensor, dst):
    """dst sums what it receives into a fresh zero tensor and forgets its own."""
    if rank() == dst:
        total, buffer = torch.zeros_like(tensor), torch.empty_like(tensor)
        for peer in range(world_size()):
            if peer != dst:
                dist.recv(buffer, peer)
                total += buffer
        tensor.copy_(total)
    else:
        dist.send(tensor, dst)


def naive_only_on_rank_0(tensor):
    SOLVED.reduce(tensor, 0)


def all_reduce_returns_new_tensor(tensor):
    """Computes the right sum, but in a new tensor: the caller's tensor is unchanged."""
    total = tensor.clone()
    SOLVED.reduce(total, 0)
    SOLVED.broadcast(total, 0)
    return total


def all_reduce_via_mean(tensor):
    """Averages (as for gradients), then scales back: int64 loses the remainder."""
    SOLVED.reduce(tensor, 0)
    if rank() == 0:
        tensor.copy_(tensor / world_size())
    SOLVED.broadcast(tensor, 0)
    tensor.mul_(world_size())


def broadcast_from_zero(tensor, src):
    SOLVED.broadcast(tensor, 0)


def broadcast_never_sent(tensor, src):
    """src forgets to send: every other rank waits in recv forever."""
    if rank() != src:
        dist.recv(tensor, src)


def broadcast_unseen(tensor, src):
    """torch's broadcast through a name bound at import: the grading ranks' process group
    sees it all the same."""
    broadcast_unseen_by_counters(tensor, src)


def broadcast_not_implemented(tensor, src):
    raise NotImplementedError()


def all_gather_no_wait(tensor_list, tensor):
    """Reads nothing wrong by luck at best: the irecv requests are never waited for."""
    me = rank()
    sends = [dist.isend(tensor, peer) for peer in range(world_size()) if peer != me]
    for peer in range(world_size()):
        if peer != me:
            dist.irecv(tensor_list[peer], peer)
    tensor_list[me].copy_(tensor)
    for request in sends:
        request.wait()


def all_gather_rebinds(tensor_list, tensor):
    """Puts the input tensor itself into the list instead of copying it."""
    SOLVED.all_gather(tensor_list, tensor)
    tensor_list[rank()] = tensor


def all_gather_forgets_own(tensor_list, tensor):
    me = rank()
    sends = [dist.isend(tensor, peer) for peer in range(world_size()) if peer != me]
    for peer in range(world_size()):
        if peer != me:
            dist.recv(tensor_list[peer], peer)
    for request in sends:
        request.wait()


def reduce_scatter_into_input(output, input_list):
    """Accumulates into its own input_list entry, which torch leaves unchanged."""
    me = rank()
    sends = [dist.isend(input_list[peer], peer) for peer in range(world_size()) if peer != me]
    buffer = torch.empty_like(output)
    for peer in range(world_size()):
        if peer != me:
            dist.recv(buffer, peer)
            input_list[me] += buffer
    output.copy_(input_list[me])
    for request in sends:
        request.wait()


def reduce_scatter_rebinds_output(output, input_list):
    total = input_list[rank()].clone()
    SOLVED.reduce_scatter(total, input_list)
    output = total  # noqa: F841 (the mistake under test: only the local name changes)


def ring_in_float64(tensor):
    """Sums a float64 copy "for precision": int64 values above 2**53 get rounded."""
    work = tensor.double()
    SOLVED.bidirectional_ring_all_reduce(work)
    tensor.copy_(work)


WRONG = [
    (
        check_all_reduce,
        ring_drops_tail,
        {"shapes": [(7,)]},
        "Only the last 1 element(s) are wrong: with N = 7 not divisible by P = 2",
    ),
    (check_reduce, reduce_without_own, {}, "did rank 0 also add its own?"),
    (check_all_reduce, naive_only_on_rank_0, {}, "did only rank 0 get it?"),
    (check_all_reduce, all_reduce_returns_new_tensor, {}, "it returned a new tensor instead"),
    (check_all_reduce, all_reduce_via_mean, {}, "int64 sums must be exact"),
    (check_broadcast, broadcast_from_zero, {}, "but src was 1: use the src argument"),
    (check_broadcast, broadcast_unseen, {}, "called dist.broadcast; use send/recv only"),
    (check_broadcast, broadcast_not_implemented, {}, "raised NotImplementedError on rank "),
    (check_all_gather, all_gather_no_wait, {}, "never called wait() on the request"),
    (check_all_gather, all_gather_rebinds, {}, "tensor_list[0] was replaced by another"),
    (check_all_gather, all_gather_forgets_own, {}, "copy its own tensor into tensor_list[0]"),
    (check_reduce_scatter, reduce_scatter_into_input, {}, "changed its input input_list[0]"),
    (check_reduce_scatter, reduce_scatter_rebinds_output, {}, "did not change output on rank"),
]


@pytest.mark.parametrize(
    "check, fn, options, message", WRONG, ids=[fn.__name__ for _, fn, _, _ in WRONG]
)
def test_checks_reject_wrong_implementations(check, fn, options, message):
    text = expect_failure(check, fn, message, **options)
    assert text.startswith(check.__name__ + ": "), text
    assert "world size" in text, "the message should say which case failed"


def test_failure_names_the_rank_and_the_elements():
    text = expect_failure(check_all_reduce, ring_drops_tail, "rank 0", shapes=[(7,)])
    assert "world size 2, float32, shape (7,)" in text
    assert "flat indices 6" in text and "max abs error" in text


def test_int64_mistake_is_found_only_in_int64():
    check_all_reduce(all_reduce_via_mean, dtypes=[torch.float32, torch.float64])
    text = expect_failure(check_all_reduce, all_reduce_via_mean, "int64", dtypes=[torch.int64])
    assert "it must match exactly" in text


def test_float_buffer_breaks_large_int64_sums():
    expect_failure(
        check_all_reduce, ring_in_float64, "int64 sums must be exact", dtypes=[torch.int64]
    )


def test_ring_check_rejects_a_wrong_neighbour():
    text = expect_failure(
        check_bidirectional_ring_all_reduce,
        ring_wrong_neighbour,
        "talks only to its neighbours, here ranks [1, 3]",
        world_sizes=[4],
        shapes=[(8,)],  # equal chunks, so the wrong pairs still exchange matching sizes
    )
    assert text.startswith("check_bidirectional_ring_all_reduce: ")


def test_ring_check_rejects_a_ring_over_the_byte_budget():
    check_all_reduce(ring_whole_tensor)  # the sum is right: only the ring check rejects it
    text = expect_failure(
        check_bidirectional_ring_all_reduce,
        ring_whole_tensor,
        "rank 0 sent all its bytes one way, 56 to rank + 1 (rank 1) and none to rank - 1",
    )
    # The first case over the budget: 3 ranks, 7 float32 (28 bytes), passed on twice.
    assert "world size 3, float32, shape (7,)" in text
    assert "2(P-1) chunks of ceil(N/(2P)) elements, 32 bytes each way" in text


def test_the_one_way_ring_earns_half_and_is_told_to_send_half_the_other_way():
    check_all_reduce(one_way_ring, world_sizes=[3, 4, 5])  # the sum is right
    with pytest.raises(CheckFailed) as info:
        check_bidirectional_ring_all_reduce(one_way_ring, shapes=[(12,), (2, 17)])
    assert info.value.failed == {"bytes"} and info.value.score == 0.5
    text = str(info.value)
    # 3 ranks, 12 float32: 4 chunks of 4 to rank + 1, where one way may carry 4 chunks of 2
    assert (
        "world size 3, float32, shape (12,), seed 0: rank 0 sent all its bytes one way, 64 " in text
    )
    assert "send the second half around the ring the other way" in text


def swap_twice(tensor):
    """Right sums on 2 ranks: the whole tensor swapped and added, then swapped again to make
    sure. The second swap is twice the bytes two rings on the one link need."""
    other = 1 - rank()
    theirs = torch.empty_like(tensor)
    request = dist.isend(tensor.clone(), other)
    dist.recv(theirs, other)
    request.wait()
    tensor += theirs
    request = dist.isend(tensor.clone(), other)
    dist.recv(theirs, other)
    request.wait()


def test_on_2_ranks_the_ring_check_holds_the_sum_of_both_ways():
    check_all_reduce(swap_twice, world_sizes=[2])  # the sum is right
    with pytest.raises(CheckFailed) as info:
        check_bidirectional_ring_all_reduce(swap_twice, world_sizes=[2], shapes=[(7,)])
    assert info.value.failed == {"bytes"}
    # 7 float32 twice, 56 bytes, where each way may carry 2 chunks of ceil(7/4) = 2 elements
    assert (
        "rank 0 sent 56 bytes in all; one ring all-reduce of half the tensor (N = 7 elements, "
        "28 bytes) sends at most 2(P-1) chunks of ceil(N/(2P)) elements, 16 bytes each way, 32 "
        "bytes for the two (on 2 ranks both rings run between the same two ranks)"
    ) in str(info.value)


def ring_lopsided(tensor):
    """Both ways, but a third of the tensor one way and two thirds the other."""
    flat = tensor.view(-1)
    third = flat.numel() // 3
    IN_TURN._one_way(flat[:third], -1)
    IN_TURN._one_way(flat[third:], +1)


def test_ring_check_holds_each_way_to_half():
    check_all_reduce(ring_lopsided, world_sizes=[3, 4])  # the sum is right
    with pytest.raises(CheckFailed) as info:
        check_bidirectional_ring_all_reduce(ring_lopsided, world_sizes=[4], shapes=[(48,)])
    assert info.value.failed == {"bytes"}
    # 4 ranks, 32 of 48 float32 to rank + 1: 6 chunks of 8, where one way may carry 6 of 6
    assert "rank 0 sent 192 bytes to rank + 1 (rank 1); one ring all-reduce of half" in str(
        info.value
    )


def all_reduce_direct(tensor):
    """Bandwidth-optimal but no ring: reduce-scatter and all-gather by direct messages."""
    p, me = world_size(), rank()
    chunks = torch.tensor_split(tensor.view(-1), p)
    others = [r for r in range(p) if r != me]
    incoming = {r: torch.empty_like(chunks[me]) for r in others}
    requests = [dist.isend(chunks[r], r) for r in others]
    requests += [dist.irecv(incoming[r], r) for r in others]
    for request in requests:
        request.wait()
    mine = chunks[me]  # a view: adding to it in place adds into tensor
    for r in others:
        mine += incoming[r]
    requests = [dist.isend(chunks[me], r) for r in others]
    requests += [dist.irecv(chunks[r], r) for r in others]
    for request in requests:
        request.wait()


def test_a_passing_check_says_what_it_verified(capsys):
    check_bidirectional_ring_all_reduce(
        SOLVED.bidirectional_ring_all_reduce, world_sizes=[3], shapes=[(7,)],
        dtypes=[torch.float32],
    )  # fmt: skip
    out = capsys.readouterr().out
    # 3 ranks, halves of 4 and 3 float32 in chunks of 2, 1, 1 and 1, 1, 1: each ring passes
    # each chunk 2(P-1) = 4 times in all, 4 * 4 + 4 * 3 = 28 elements.
    assert out.startswith(
        "check_bidirectional_ring_all_reduce: passed. Verified 1 case(s) on 3 rank(s): "
        "every rank's result matches torch.distributed.all_reduce"
    )
    assert "; 112 bytes sent in all;" in out
    # the busiest way: 8 elements less the chunks of its place and the next, 6 of 4 * 2
    assert "(closest to the limit: 24 of 32 bytes one way)" in out


def test_a_failing_check_lists_several_failing_cases():
    text = expect_failure(
        check_all_reduce, ring_drops_tail, "[result] failed in 8 case(s):", world_sizes=[2, 4],
        shapes=[(7,), (3, 3)], dtypes=[torch.float32, torch.int64],
    )  # fmt: skip
    assert text.count("\n  - ") == 3 and "... and 5 more" in text


def test_a_ring_that_passes_whole_tensors_earns_half():
    with pytest.raises(CheckFailed) as info:
        check_bidirectional_ring_all_reduce(ring_whole_tensor, world_sizes=[3, 4])
    assert info.value.failed == {"bytes"} and info.value.score == 0.5
    assert "Partial credit: neighbours passed (50%), bytes failed (50%)" in str(info.value)


def test_direct_reduce_scatter_and_all_gather_earns_half():
    check_all_reduce(all_reduce_direct, world_sizes=[3, 4], shapes=UNEVEN)  # a right sum
    with pytest.raises(CheckFailed) as info:
        check_bidirectional_ring_all_reduce(all_reduce_direct, world_sizes=[4])
    assert info.value.failed == {"neighbours"} and info.value.score == 0.5


def test_ring_check_rejects_the_naive_all_reduce():
    # Right sums, but rank 0 talks to every rank and sends (P-1) N.
    text = expect_failure(
        check_bidirectional_ring_all_reduce, SOLVED.all_reduce_naive,
        "talks only to its neighbours", world_sizes=[4],
    )  # fmt: skip
    assert "[neighbours] failed" in text and "[bytes] failed" in text
    assert "No points for this part" not in text  # the result was right: it is not the gate


def test_deadlock_fails_within_the_timeout_with_stacks():
    start = time.monotonic()
    text = expect_failure(
        check_broadcast, broadcast_never_sent, "did not finish within 3 s", world_sizes=[3],
        timeout=3,
    )  # fmt: skip
    assert time.monotonic() - start < 15
    assert "--- rank 1 ---" in text and "broadcast_never_sent" in text


def test_failing_case_is_named_in_a_raising_rank_traceback():
    text = expect_failure(check_broadcast, broadcast_not_implemented, "while checking: world size")
    assert "NotImplementedError" in text


def test_bad_argument_is_a_clear_error():
    expect_failure(check_broadcast, "broadcast", "expected your function, got str")


def test_the_lectures_ring_is_refused_even_run_once_each_way():
    expect_failure(
        check_bidirectional_ring_all_reduce,
        ring_lecture_both_ways,
        "runs course_lib.collectives._ring",
        world_sizes=(3,),
    )


def test_peers_are_seen_on_every_route():
    expect_failure(
        check_bidirectional_ring_all_reduce,
        ring_prebound_far_peer,
        "rank 0 called dist.send with rank 2",
        world_sizes=(4,),
        dtypes=(torch.float64,),
    )


# --- Part 7: all_reduce_fast, halving-doubling's bounds on any number of ranks -------------

FAST_SHAPES = [(1,), (7,), (3, 5), ()]  # fewer elements than ranks, not divisible, 0-d
FAST = "all_reduce_fast"

# Right, another way: Rabenseifner's fold in pairs, partners 1, 2, 4 apart, padded chunks.
fast_paired_fold = getattr(planted("collectives", FAST, FAST_PAIRED_FOLD), FAST)
# Cheats: the lecture's halving-doubling, called; a fold around the lecture's schedule; the
# ring where P is not a power of two.
fast_lecture_wrapped = getattr(planted("collectives", FAST, LECTURE_HALVING_DOUBLING_WRAPPED), FAST)
fast_lecture_schedule = getattr(planted("collectives", FAST, LECTURE_SCHEDULE_FOLDED), FAST)
fast_ring_off_powers = getattr(planted("collectives", FAST, FAST_RING_OFF_POWERS), FAST)


def butterfly(tensor):
    """Right sums in log2 P messages, but each carries the whole tensor: too many bytes."""
    p, me = world_size(), rank()
    incoming = torch.empty_like(tensor)
    distance = 1
    while distance < p:
        request = dist.isend(tensor.clone(), me ^ distance)
        dist.recv(incoming, me ^ distance)
        request.wait()
        tensor += incoming
        distance *= 2


def butterfly_folded(tensor):
    """The butterfly on Q ranks with the others folded in and out: right sums, messages within
    the limit, but whole tensors in every round."""
    p, me = world_size(), rank()
    q = 1 << (p.bit_length() - 1)
    if me >= q:
        dist.send(tensor, me - q)
        dist.recv(tensor, me - q)
        return
    if me + q < p:
        theirs = torch.empty_like(tensor)
        dist.recv(theirs, me + q)
        tensor += theirs
    incoming, distance = torch.empty_like(tensor), 1
    while distance < q:
        request = dist.isend(tensor.clone(), me ^ distance)
        dist.recv(incoming, me ^ distance)
        request.wait()
        tensor += incoming
        distance *= 2
    if me + q < p:
        dist.send(tensor, me + q)


def test_fast_message_bound_is_halving_doublings_plus_the_fold():
    # 2 log2 Q from costs.all_reduce_seconds' latencies for halving-doubling on Q ranks (not
    # written again here), and 2 more where P > Q: one message in, one back.
    assert [fast_messages(p) for p in (1, 2, 3, 4, 5, 6, 7, 8, 9, 16)] == [
        0, 2, 4, 4, 6, 6, 6, 6, 8, 8
    ]  # fmt: skip


def test_fast_byte_bound_by_hand():
    # 2(Q-1) chunks of ceil(N/Q) elements, and N more where P > Q
    assert fast_budget(Case(4, (7,), torch.float32, 0)) == 6 * 2 * 4  # Q = 4, as before
    assert fast_budget(Case(8, (7,), torch.float32, 0)) == 14 * 1 * 4
    assert fast_budget(Case(6, (7,), torch.float32, 0)) == (6 * 2 + 7) * 4  # Q = 4
    assert fast_budget(Case(3, (3, 5), torch.int64, 0)) == (2 * 8 + 15) * 8  # Q = 2
    assert fast_budget(Case(5, (), torch.float64, 0)) == (6 * 1 + 1) * 8
    assert fast_budget(Case(1, (7,), torch.float32, 0)) == 0


@pytest.mark.parametrize(
    "fn", [SOLVED.all_reduce_fast, fast_paired_fold], ids=["solution", "paired_fold"]
)
def test_fast_check_accepts_right_answers(fn, capsys):
    start = time.perf_counter()
    check_all_reduce_fast(fn, shapes=FAST_SHAPES, seeds=[0, 1])
    seconds = time.perf_counter() - start
    out = capsys.readouterr().out
    assert out.startswith(
        "check_all_reduce_fast: passed. Verified 144 case(s) on 2, 3, 4, 5, 6, 8 rank(s)"
    )
    assert "closest to the limit: 6 of 6)" in out  # 8 ranks: every rank sends 2 log2 8
    print(f"check_all_reduce_fast: {seconds:.1f} s")


def test_fast_check_accepts_both_folds_on_7_ranks():
    for fn in (SOLVED.all_reduce_fast, fast_paired_fold):
        check_all_reduce_fast(fn, world_sizes=[7], shapes=[(9,), (2, 3)], dtypes=[torch.int64])


def test_fast_check_refuses_the_ring_for_its_messages_on_8_ranks():
    check_all_reduce(one_way_ring, world_sizes=[8])  # the sum is right
    text = expect_failure(
        check_all_reduce_fast,
        one_way_ring,
        "rank 0 sent 14 messages (sends and isends, empty ones included); at most "
        "2 log2 P = 6 are allowed on 8 ranks",
        world_sizes=[8],
        dtypes=[torch.float32],
    )
    assert "[messages] failed" in text and "[bytes]" not in text  # the ring's bytes are fine


def test_fast_check_refuses_the_ring_where_p_is_not_a_power_of_two():
    check_all_reduce(fast_ring_off_powers, world_sizes=[2, 3, 4, 5, 6])  # the sum is right
    check_all_reduce_fast(fast_ring_off_powers, world_sizes=[2, 3, 4])  # within the bounds
    text = expect_failure(
        check_all_reduce_fast,
        fast_ring_off_powers,
        "rank 0 sent 8 messages (sends and isends, empty ones included); at most "
        "2 floor(log2 P) + 2 = 6 (P = 5, Q = 4) are allowed on 5 ranks",
        dtypes=[torch.float32],
    )
    assert "No points" not in text and "Partial credit" not in text  # all or nothing


def test_fast_check_refuses_the_butterfly_for_its_bytes():
    check_all_reduce(butterfly, world_sizes=[2, 4, 8])  # the sum is right
    text = expect_failure(
        check_all_reduce_fast,
        butterfly,
        # 4 ranks, 7 float32 (28 bytes): the whole tensor twice, budget 6 chunks of 2 elements
        "world size 4, float32, shape (7,), seed 0: rank 0 sent 56 bytes",
        world_sizes=[2, 4],
    )
    assert "2(P-1) chunks of ceil(N/P) elements, 48 bytes" in text
    assert "[bytes] failed" in text and "[messages]" not in text  # log2 P messages are fine


def test_fast_check_refuses_a_folded_butterfly_for_its_bytes():
    check_all_reduce(butterfly_folded, world_sizes=[3, 5, 6])  # the sum is right
    text = expect_failure(
        check_all_reduce_fast,
        butterfly_folded,
        # 6 ranks, Q = 4, 7 float32: two whole tensors and the one handed back, 84 bytes,
        # where 6 chunks of 2 elements and the 7 handed back make 76
        "world size 6, float32, shape (7,), seed 0: rank 0 sent 84 bytes",
        world_sizes=[6],
    )
    assert "with Q = 4, the largest power of two <= P, plus N for the fold: 76 bytes" in text
    assert "[bytes] failed" in text and "[messages]" not in text


def test_fast_check_refuses_the_naive_all_reduce():
    text = expect_failure(
        check_all_reduce_fast,
        SOLVED.all_reduce_naive,
        "rank 0 sent 7 messages",  # the root, on 8 ranks
        world_sizes=[2, 4, 8],
        dtypes=[torch.int64],
    )
    # The root sends (P-1) N: on 4 ranks, 7 int64 three times, over 6 chunks of 2 elements.
    assert "world size 4, int64, shape (7,), seed 0: rank 0 sent 168 bytes" in text
    assert "at most 2(P-1) chunks of ceil(N/P) elements, 96 bytes" in text
    assert "No points" not in text and "Partial credit" not in text  # all or nothing


def test_fast_check_refuses_the_lectures_halving_doubling_even_wrapped():
    expect_failure(
        check_all_reduce_fast,
        fast_lecture_wrapped,
        "runs course_lib.collectives.halving_doubling_all_reduce",
        world_sizes=[2],
    )


def test_fast_check_refuses_a_fold_around_the_lectures_schedule():
    expect_failure(
        check_all_reduce_fast,
        fast_lecture_schedule,
        "runs course_lib.collectives.halving_doubling_rounds",
        world_sizes=[3],
    )


def test_fast_check_needs_ranks():
    with pytest.raises(ValueError, match="world sizes >= 1"):
        check_all_reduce_fast(SOLVED.all_reduce_fast, world_sizes=[0])
