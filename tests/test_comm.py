"""CommCounter: exact bytes for point-to-point, the documented model for collectives."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from course_lib import CommCounter, WireCounter, WorkerPool, launch, rank, world_size
from course_lib.comm import COLLECTIVE_MODEL
from course_lib.costs import all_to_all_bytes


def pass_to_next(numel, dtype):
    """Each rank sends one tensor to the next rank and receives one from the previous."""
    p, r = world_size(), rank()
    out = torch.ones(numel, dtype=dtype)
    into = torch.empty(numel, dtype=dtype)
    with CommCounter() as c:
        if r % 2 == 0:
            dist.send(out, (r + 1) % p)
            dist.recv(into, (r - 1) % p)
        else:
            dist.recv(into, (r - 1) % p)
            dist.send(out, (r + 1) % p)
    return c.bytes_sent, c.bytes_received, dict(c.calls)


@pytest.mark.parametrize(
    "numel, dtype", [(10, torch.float32), (7, torch.float64), (3, torch.int64)]
)
def test_point_to_point_is_counted_exactly(pool4, numel, dtype):
    nbytes = numel * torch.tensor([], dtype=dtype).element_size()
    for sent, received, calls in pool4.launch(pass_to_next, numel, dtype):
        assert (sent, received) == (nbytes, nbytes)
        assert calls == {"send": 1, "recv": 1}


def batched_exchange():
    p, r = world_size(), rank()
    out, into = torch.ones(5), torch.empty(5)
    with CommCounter() as c:
        ops = [dist.P2POp(dist.isend, out, (r + 1) % p), dist.P2POp(dist.irecv, into, (r - 1) % p)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return c.bytes_sent, c.bytes_received, into.tolist()


def test_batched_point_to_point_is_counted_once_per_op(pool4):
    for sent, received, values in pool4.launch(batched_exchange):
        assert (sent, received) == (20, 20)
        assert values == [1.0] * 5


def collective_volumes(numel):
    """Bytes counted for each built-in collective on a float32 tensor of `numel` elements."""
    t = torch.ones(numel)
    p, shard = world_size(), torch.ones(numel // world_size())
    results = {}
    calls = {
        "all_reduce": lambda: dist.all_reduce(t),
        "all_gather_single": lambda: dist.all_gather_single(torch.empty(numel), shard),
        "reduce_scatter_single": lambda: dist.reduce_scatter_single(torch.empty(numel // p), t),
        # deprecated, and implemented by calling all_gather_single: must count once, not twice
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(torch.empty(numel), shard),
        "all_gather": lambda: dist.all_gather([torch.empty_like(shard) for _ in range(p)], shard),
        "broadcast": lambda: dist.broadcast(t, src=p - 1),
        "reduce": lambda: dist.reduce(t, dst=p - 1),
        "barrier": lambda: dist.barrier(),
    }
    for op, call in calls.items():
        with CommCounter() as c:
            call()
        results[op] = (c.bytes_sent, c.bytes_received)
    return results


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_collectives_follow_the_ring_and_tree_formulas(world_size):
    numel = 1024
    n = 4 * numel  # bytes of the full float32 tensor
    ring = 2 * (world_size - 1) * n // world_size
    for r, volumes in enumerate(launch(collective_volumes, numel, world_size=world_size)):
        assert volumes["all_reduce"] == (ring, ring), "all-reduce: 2(P-1)/P * N"
        shard_part = (world_size - 1) * n // world_size
        assert volumes["all_gather_single"] == (shard_part, shard_part)
        assert volumes["reduce_scatter_single"] == (shard_part, shard_part)
        assert volumes["all_gather_into_tensor"] == (shard_part, shard_part)
        assert volumes["all_gather"] == (shard_part, shard_part)
        assert volumes["barrier"] == (0, 0)
        if world_size > 1:
            root = r == world_size - 1
            assert volumes["broadcast"] == (((world_size - 1) * n, 0) if root else (0, n))
            assert volumes["reduce"] == ((0, (world_size - 1) * n) if root else (n, 0))


def nested_and_outside():
    t = torch.ones(100)
    dist.all_reduce(t)  # before any counter: not counted anywhere
    with CommCounter() as outer:
        dist.all_reduce(t)
        with CommCounter() as inner:
            dist.all_reduce(t)
    dist.all_reduce(t)  # after: not counted
    restored = not hasattr(dist.all_reduce, "__wrapped_by_course_lib__")
    return outer.bytes_sent, inner.bytes_sent, restored, outer.summary()


def uneven_all_to_all(through_group: bool):
    """all_to_all_single where rank r sends r + j + 1 rows of 3 float32 to rank j, called as
    users do (dist.all_to_all_single) or on the process group itself (as torch's own code
    does; on grading ranks `CountedGroup` reports it). Counted and true (sent, received)."""
    p, r = world_size(), rank()
    send = [r + j + 1 for j in range(p)]
    receive = [j + r + 1 for j in range(p)]
    x, out = torch.zeros(sum(send), 3), torch.empty(sum(receive), 3)
    with CommCounter() as counter:
        if through_group:
            group = dist.distributed_c10d._get_default_group()
            group.alltoall_base(out, x, receive, send, dist.AllToAllOptions()).wait()
        else:
            dist.all_to_all_single(out, x, receive, send)
    true = (12 * (sum(send) - send[r]), 12 * (sum(receive) - receive[r]))
    return (counter.bytes_sent, counter.bytes_received), true, all_to_all_bytes(x.nbytes, p)


@pytest.mark.parametrize("untrusted", [False, True], ids=["gloo", "counted group"])
def test_uneven_all_to_all_single_is_counted_by_its_splits(untrusted):
    with WorkerPool(3, "gloo", untrusted=untrusted) as pool:
        results = pool.launch(uneven_all_to_all, untrusted, timeout=60)
    for r, (counted, true, _) in enumerate(results):
        assert counted == true, f"rank {r}: counted {counted}, sent and received {true}"
    assert any(true[0] != even for _, true, even in results), "the splits must be uneven"


def test_counters_nest_and_only_count_inside(pool4):
    per_call = 2 * 3 * 400 // 4
    for outer, inner, restored, summary in pool4.launch(nested_and_outside):
        assert (outer, inner) == (2 * per_call, per_call)
        assert restored, "torch.distributed was not put back after the last counter closed"
        assert "all_reduce" in summary and "total" in summary


def leave_counter_open():
    CommCounter().__enter__()
    return hasattr(dist.all_reduce, "__wrapped_by_course_lib__")


def is_patched():
    return hasattr(dist.all_reduce, "__wrapped_by_course_lib__")


def test_a_counter_left_open_does_not_leak_into_the_next_call(pool4):
    assert pool4.launch(leave_counter_open) == [True] * 4
    assert pool4.launch(is_patched) == [False] * 4


def test_every_modelled_collective_exists_in_torch():
    for op in COLLECTIVE_MODEL:
        assert callable(getattr(dist, op))


# --- WireCounter: what the operating system saw written ------------------------------------


def wire_all_reduce(numel: int) -> tuple[int, int]:
    t = torch.ones(numel)
    dist.all_reduce(t)  # gloo's first call sets up its connections: keep that out
    with CommCounter() as counted, WireCounter() as wire:
        dist.all_reduce(t)
    return counted.bytes_sent, wire.bytes_written


@pytest.mark.parametrize("world_size", [2, 4])
def test_wire_counter_sees_what_gloo_writes_to_its_sockets(world_size):
    numel = 250_000  # 1 MB: headers (tens of bytes a message) are noise beside it
    for counted, written in launch(wire_all_reduce, numel, world_size=world_size, timeout=60):
        # gloo's all-reduce on CPU is a ring: it writes the textbook volume, plus headers
        assert counted <= written <= counted + 4096


def wire_point_to_point(nbytes: int) -> int:
    t = torch.zeros(nbytes, dtype=torch.uint8)
    if rank() == 0:
        dist.send(t, dst=1)  # the first send also sets up the connection
    else:
        dist.recv(t, src=0)
    dist.barrier()
    with WireCounter() as wire:
        if rank() == 0:
            dist.send(t, dst=1)
        else:
            dist.recv(t, src=0)
    return wire.bytes_written


def test_wire_counter_counts_the_sender_not_the_receiver():
    sender, receiver = launch(wire_point_to_point, 1_000_000, world_size=2, timeout=60)
    assert 1_000_000 <= sender <= 1_000_000 + 4096
    assert receiver <= 4096  # receiving writes nothing but an acknowledgement, if that
