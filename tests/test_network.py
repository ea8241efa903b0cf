"""The emulated network: transfers take latency + bytes / bandwidth within 20%, data intact.

Timings are end-of-call minus the sender's (or, for a collective, the last rank's) start, read
from the machine's shared clock. Emulated times are tens of milliseconds, far above what the
same transfer takes on loopback, and each is the median of a few repetitions, so a 20% band
holds on a busy 2-core machine.
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch
import torch.distributed as dist

from course_lib import CommCounter, rank, world_size
from course_lib.network import SlowNetwork, Straggler

BANDWIDTH = 100e6  # bytes per second
LATENCY = 20e-3  # seconds
REPS = 5
BAND = 0.2  # the emulation's promised accuracy


def within_band(measured: float, expected: float) -> bool:
    return abs(measured - expected) <= BAND * expected


def send_to_rank_1(numel, dtype, late_sender=0.0, any_source=False):
    """Rank 0 sends a tensor to rank 1, REPS times; (start, end, data intact) per repetition."""
    out = torch.arange(numel).to(dtype)
    records = []
    for _ in range(REPS):
        into = torch.zeros(numel, dtype=dtype)
        dist.barrier()
        with SlowNetwork(bandwidth=BANDWIDTH, latency=LATENCY):
            if rank() == 0:
                time.sleep(late_sender)
            start = time.time()
            if rank() == 0:
                dist.send(out, 1)
            elif rank() == 1:
                dist.recv(into, None if any_source else 0)
            end = time.time()
        records.append((start, end, rank() != 1 or torch.equal(into, out)))
    return records


def elapsed_since_send(results, receiver=1):
    """Median over repetitions of (sender's end, receiver's end) minus the sender's start."""
    sender, received = [], []
    for (s_start, s_end, _), (_, r_end, _) in zip(results[0], results[receiver], strict=True):
        sender.append(s_end - s_start)
        received.append(r_end - s_start)
    return statistics.median(sender), statistics.median(received)


@pytest.mark.parametrize(
    "numel, dtype",
    [
        (256, torch.float32),
        (250_000, torch.float32),
        (1_250_000, torch.float32),
        (1_000_000, torch.uint8),
    ],
)
def test_send_recv_takes_latency_plus_bytes_over_bandwidth(pool4, numel, dtype):
    nbytes = numel * torch.tensor([], dtype=dtype).element_size()
    expected = LATENCY + nbytes / BANDWIDTH
    results = pool4.launch(send_to_rank_1, numel, dtype, timeout=60)
    sent, received = elapsed_since_send(results)
    assert within_band(sent, expected), f"send took {sent:.4f} s, model {expected:.4f} s"
    assert within_band(received, expected), f"recv ended {received:.4f} s, model {expected:.4f}"
    assert abs(sent - received) <= BAND * expected, "the two ends disagree"
    assert all(intact for _, _, intact in results[1]), "the data arrived changed"


def test_a_uint8_payload_costs_a_quarter_of_float32(pool4):
    numel = 1_000_000
    _, as_uint8 = elapsed_since_send(pool4.launch(send_to_rank_1, numel, torch.uint8))
    _, as_float = elapsed_since_send(pool4.launch(send_to_rank_1, numel, torch.float32))
    ratio = (as_uint8 - LATENCY) / (as_float - LATENCY)
    assert abs(ratio - 0.25) <= 0.1, f"transfer part of uint8 / float32 = {ratio:.2f}, not 1/4"


def test_a_receiver_waiting_early_still_waits_for_a_late_sender(pool4):
    numel, late = 250_000, 0.05
    expected = LATENCY + 4 * numel / BANDWIDTH  # after the sender's start, not the receiver's
    results = pool4.launch(send_to_rank_1, numel, torch.float32, late_sender=late)
    _, received = elapsed_since_send(results)
    assert within_band(received, expected), f"recv ended {received:.4f} s after the send"
    waited = statistics.median(end - start for start, end, _ in results[1])
    assert within_band(waited, late + expected), "the receiver did not wait for the late sender"


def test_recv_from_any_source_is_emulated_too(pool4):
    numel = 250_000
    expected = LATENCY + 4 * numel / BANDWIDTH
    results = pool4.launch(send_to_rank_1, numel, torch.float32, any_source=True)
    _, received = elapsed_since_send(results)
    assert within_band(received, expected), f"recv ended {received:.4f} s, model {expected:.4f}"
    assert all(intact for _, _, intact in results[1])


def ring_isend_irecv(numel, batched=False):
    """Every rank isends to the next and irecvs from the previous; times of call and wait."""
    p, r = world_size(), rank()
    out = torch.full((numel,), float(r))
    records = []
    for _ in range(REPS):
        into = torch.zeros(numel)
        dist.barrier()
        with SlowNetwork(bandwidth=BANDWIDTH, latency=LATENCY):
            start = time.time()
            if batched:
                ops = [
                    dist.P2POp(dist.isend, out, (r + 1) % p),
                    dist.P2POp(dist.irecv, into, (r - 1) % p),
                ]
                works = dist.batch_isend_irecv(ops)
            else:
                works = [dist.isend(out, (r + 1) % p), dist.irecv(into, (r - 1) % p)]
            returned = time.time()
            for work in works:
                work.wait()
            end = time.time()
        intact = torch.equal(into, torch.full((numel,), float((r - 1) % p)))
        records.append((start, returned, end, intact))
    return records


@pytest.mark.parametrize("batched", [False, True])
def test_isend_irecv_return_at_once_and_wait_until_the_emulated_finish(pool4, batched):
    numel = 1_250_000
    expected = LATENCY + 4 * numel / BANDWIDTH
    results = pool4.launch(ring_isend_irecv, numel, batched, timeout=60)
    p = len(results)
    for r in range(p):
        sender = results[(r - 1) % p]  # the message rank r waits for started there
        waited = statistics.median(
            end - s_start
            for (_, _, end, _), (s_start, _, _, _) in zip(results[r], sender, strict=True)
        )
        returned = statistics.median(ret - start for start, ret, _, _ in results[r])
        assert within_band(waited, expected), f"rank {r}: wait ended {waited:.4f} s"
        assert returned < expected / 2, f"rank {r}: isend/irecv blocked for {returned:.4f} s"
        assert all(intact for *_, intact in results[r]), f"rank {r}: wrong data"


def two_messages_on_one_link(numel):
    """Rank 0 isends two tensors to rank 1 at once: they share the link, one after another."""
    out = torch.ones(numel)
    records = []
    for _ in range(REPS):
        into = [torch.zeros(numel), torch.zeros(numel)]
        dist.barrier()
        with SlowNetwork(bandwidth=BANDWIDTH, latency=LATENCY):
            start, ends = time.time(), []
            if rank() < 2:
                op = dist.isend if rank() == 0 else dist.irecv
                works = [op(out if rank() == 0 else into[i], 1 - rank()) for i in range(2)]
                for work in works:
                    work.wait()
                    ends.append(time.time())
        records.append((start, ends))
    return records


def test_messages_to_the_same_rank_queue_on_the_port(pool4):
    numel = 625_000  # 2.5 MB: 25 ms on the wire each
    wire = 4 * numel / BANDWIDTH
    results = pool4.launch(two_messages_on_one_link, numel)
    arrivals = [
        [end - start for end in ends]
        for (start, _), (_, ends) in zip(results[0], results[1], strict=True)
    ]
    first, second = (statistics.median(column) for column in zip(*arrivals, strict=True))
    assert within_band(first, LATENCY + wire), f"first message after {first:.4f} s"
    assert within_band(second, LATENCY + 2 * wire), f"second message after {second:.4f} s"


def star(numel, into_root):
    """Ranks 1..3 each send a tensor to rank 0 at once (`into_root`), or rank 0 isends one to
    each of them; (start, end of every recv or send on this rank) per repetition."""
    records = []
    for _ in range(REPS):
        dist.barrier()
        with SlowNetwork(bandwidth=BANDWIDTH, latency=LATENCY):
            start, ends = time.time(), []
            if rank() == 0 and into_root:
                for peer in range(1, world_size()):
                    dist.recv(torch.zeros(numel), peer)
                    ends.append(time.time())
            elif rank() == 0:  # all three sends under way at once, as isend allows
                works = [dist.isend(torch.ones(numel), peer) for peer in range(1, world_size())]
                for work in works:
                    work.wait()
                    ends.append(time.time())
            else:
                t = torch.ones(numel) if into_root else torch.zeros(numel)
                (dist.send if into_root else dist.recv)(t, 0)
                ends.append(time.time())
        records.append((start, ends))
    return records


@pytest.mark.parametrize("into_root", [True, False], ids=["gather", "scatter"])
def test_a_root_is_the_bottleneck_its_one_port_makes_it(pool4, into_root):
    """Three messages into (or out of) one rank cross its single port one after another: the
    last is done after latency + 3 wire times, not latency + 1 as on three separate links."""
    numel = 625_000  # 2.5 MB: 25 ms on the wire each
    wire = 4 * numel / BANDWIDTH
    results = pool4.launch(star, numel, into_root, timeout=60)
    done = statistics.median(
        ends[-1] - min(rep[r][0] for r in range(4))
        for rep in zip(*results, strict=True)
        for ends in [rep[0][1]]
    )
    # Sending, the root's last isend completes as its message is delivered (latency + 3
    # wires); receiving, its last recv ends once the third message has passed its port in.
    assert within_band(done, LATENCY + 3 * wire), f"root done after {done:.4f} s"
    if into_root:
        first = statistics.median(rep[0][1][0] - rep[0][0] for rep in zip(*results, strict=True))
        assert within_band(first, LATENCY + wire), f"first message after {first:.4f} s"


# Slow links and small messages here, so that two real transfers at once on a busy machine stay
# well inside the emulated times. The node's own links have 2.5x the network's bandwidth.
ACROSS_BANDWIDTH, NODE_BANDWIDTH, NODE_LATENCY = 10e6, 25e6, LATENCY


def inside_and_across(numel):
    """Nodes of 2 ranks: rank 0 isends one tensor to rank 1 (its node) and one to rank 2 (the
    other node) at once; (start, end of each delivery on its receiver) per repetition."""
    records = []
    for _ in range(REPS):
        into = torch.zeros(numel)
        dist.barrier()
        net = SlowNetwork(
            ACROSS_BANDWIDTH,
            LATENCY,
            node_size=2,
            node_bandwidth=NODE_BANDWIDTH,
            node_latency=NODE_LATENCY,
        )
        with net:
            start, end = time.time(), None
            if rank() == 0:
                for work in [dist.isend(torch.ones(numel), peer) for peer in (1, 2)]:
                    work.wait()
            elif rank() in (1, 2):
                dist.recv(into, 0)
                end = time.time()
        records.append((start, end))
    return records


def test_messages_inside_a_node_take_its_own_links_and_ports(pool4):
    """Rank 0's message to rank 1 (same node) takes the node's latency + bytes / node
    bandwidth, and does not queue behind, or hold up, its message to rank 2 over the network."""
    # 0.5 MB: 20 ms on the node's links, 50 ms on the network's, which would start 20 ms late
    # if both messages queued at one port (90 ms, not 70)
    numel = 125_000
    results = pool4.launch(inside_and_across, numel, timeout=60)
    links = ((1, NODE_BANDWIDTH, NODE_LATENCY), (2, ACROSS_BANDWIDTH, LATENCY))
    for peer, bandwidth, latency in links:
        took = statistics.median(
            end - start for (start, _), (_, end) in zip(results[0], results[peer], strict=True)
        )
        expected = latency + 4 * numel / bandwidth
        assert within_band(took, expected), f"to rank {peer}: {took:.4f} s, not {expected:.4f}"


def timed_collective(name, numel, bandwidth, latency, async_op=False, late=0.0):
    """Every rank runs collective `name` (rank 3 `late` s later); (start, return, end, first
    and last value) per repetition."""
    records = []
    slow = Straggler(delays={3: late})
    for _ in range(REPS):
        t = torch.full((numel,), float(rank() + 1))
        dist.barrier()
        with SlowNetwork(bandwidth=bandwidth, latency=latency):
            slow.step()
            start = time.time()
            if name == "all_reduce":
                work = dist.all_reduce(t, async_op=bool(async_op))
            else:
                work = dist.broadcast(t, src=0, async_op=bool(async_op))
            returned = time.time()
            if async_op == "future":
                work.get_future().wait()
            elif async_op:
                work.wait()
            end = time.time()
        records.append((start, returned, end, t[0].item(), t[-1].item()))
    return records


def elapsed_since_last_start(results):
    """Per rank: median over repetitions of its end minus the last rank's start."""
    reps = list(zip(*results, strict=True))
    per_rank = []
    for r in range(len(results)):
        per_rank.append(
            statistics.median(rep[r][2] - max(start for start, *_ in rep) for rep in reps)
        )
    return per_rank


@pytest.mark.parametrize(
    "numel, bandwidth, latency",
    [(1_000, 1e12, 10e-3), (1_000_000, BANDWIDTH, 1e-3), (250_000, BANDWIDTH, LATENCY)],
    ids=["latency-bound", "bandwidth-bound", "both"],
)
def test_all_reduce_takes_the_ring_model_time(pool4, numel, bandwidth, latency):
    p, nbytes = 4, 4 * numel
    expected = 2 * (p - 1) * (latency + nbytes / p / bandwidth)  # 2(P-1) steps of N/P bytes
    results = pool4.launch(timed_collective, "all_reduce", numel, bandwidth, latency)
    for r, elapsed in enumerate(elapsed_since_last_start(results)):
        assert within_band(elapsed, expected), f"rank {r}: {elapsed:.4f} s, ring {expected:.4f}"
        for *_, first, last in results[r]:
            assert first == last == p * (p + 1) / 2, f"rank {r}: wrong sum"


@pytest.mark.parametrize("async_op", [True, "future"])
def test_async_all_reduce_returns_at_once_and_waits_the_ring_time(pool4, async_op):
    p, numel = 4, 250_000
    expected = 2 * (p - 1) * (LATENCY + 4 * numel / p / BANDWIDTH)
    results = pool4.launch(
        timed_collective, "all_reduce", numel, BANDWIDTH, LATENCY, async_op=async_op
    )
    for r, elapsed in enumerate(elapsed_since_last_start(results)):
        assert within_band(elapsed, expected), f"rank {r}: {elapsed:.4f} s, ring {expected:.4f}"
        returned = statistics.median(ret - start for start, ret, *_ in results[r])
        assert returned < expected / 2, f"rank {r}: async all_reduce blocked {returned:.4f} s"
        assert all(first == last == 10.0 for *_, first, last in results[r])


def test_a_late_rank_delays_the_all_reduce_for_everyone(pool4):
    p, numel, late = 4, 250_000, 0.1
    expected = 2 * (p - 1) * (LATENCY + 4 * numel / p / BANDWIDTH)
    results = pool4.launch(timed_collective, "all_reduce", numel, BANDWIDTH, LATENCY, late=late)
    for r, elapsed in enumerate(elapsed_since_last_start(results)):
        assert within_band(elapsed, expected), f"rank {r}: {elapsed:.4f} s after rank 3 began"
    for r in range(3):
        waited = statistics.median(end - start for start, _, end, *_ in results[r])
        assert within_band(waited, late + expected), f"rank {r} did not wait for rank 3"


def test_broadcast_takes_the_flat_tree_time(pool4):
    p, numel = 4, 250_000
    expected = (p - 1) * (LATENCY + 4 * numel / BANDWIDTH)  # the root sends P-1 messages
    results = pool4.launch(timed_collective, "broadcast", numel, BANDWIDTH, LATENCY)
    for r, elapsed in enumerate(elapsed_since_last_start(results)):
        assert within_band(elapsed, expected), f"rank {r}: {elapsed:.4f} s, tree {expected:.4f}"
        assert all(first == last == 1.0 for *_, first, last in results[r])


def run_collective(name, x, pair):
    """Run collective `name` on this rank's `x`; return what it produced on this rank."""
    p, r = world_size(), rank()
    if name == "all_reduce":
        dist.all_reduce(y := x.clone())
    elif name == "all_gather_into_tensor":
        dist.all_gather_into_tensor(y := torch.empty(8 * p), x)
    elif name == "reduce_scatter_tensor":
        dist.reduce_scatter_tensor(y := torch.empty(8 // p), x)
    elif name == "all_to_all_single":
        dist.all_to_all_single(y := torch.empty(8), x)
    elif name == "reduce":
        dist.reduce(y := x.clone(), dst=1)
    elif name == "gather":
        y = [torch.empty(8) for _ in range(p)] if r == 0 else None
        dist.gather(x, y, dst=0)
    elif name == "scatter":
        dist.scatter(y := torch.empty(8), [x + i for i in range(p)] if r == 2 else None, src=2)
    elif name == "barrier":
        dist.barrier()
        y = x
    else:  # an all-reduce within ranks 0 and 1 only
        y = x.clone()
        if r < 2:
            dist.all_reduce(y, group=pair)
    return y


COLLECTIVE_STEPS = {  # on 4 ranks (2 for the subgroup): 2(P-1), log2 P, P-1 otherwise
    "all_reduce": 6,
    "all_gather_into_tensor": 3,
    "reduce_scatter_tensor": 3,
    "all_to_all_single": 3,
    "reduce": 3,
    "gather": 3,
    "scatter": 3,
    "barrier": 2,
    "subgroup all_reduce": 2,
}


def every_collective(emulate):
    """Each collective once; (its output, seconds from the last rank's start to the end)."""
    p = world_size()
    x = torch.arange(8.0) + 10 * rank()
    pair = dist.new_group([0, 1])
    results = {}
    for name in COLLECTIVE_STEPS:
        dist.barrier()
        with SlowNetwork(bandwidth=1e12, latency=LATENCY) if emulate else CommCounter():
            start = time.time()
            out = run_collective(name, x, pair)
            end = time.time()
        starts = [torch.zeros(1, dtype=torch.float64) for _ in range(p)]
        dist.all_gather(starts, torch.tensor([start], dtype=torch.float64))
        results[name] = (out, end - max(s.item() for s in starts))
    return results


def test_every_collective_gives_torchs_result_and_takes_its_steps(pool4):
    emulated = pool4.launch(every_collective, True)
    plain = pool4.launch(every_collective, False)
    for r in range(4):
        for name, (out, elapsed) in emulated[r].items():
            torch.testing.assert_close(out, plain[r][name][0], rtol=0, atol=0)
            if name == "subgroup all_reduce" and r >= 2:
                continue  # not in the group: no call, no wait
            expected = COLLECTIVE_STEPS[name] * LATENCY  # latency-bound: steps * latency
            assert expected * (1 - BAND) <= elapsed < 2 * expected, (
                f"rank {r}: {name} took {elapsed:.4f} s, model {expected:.4f} s"
            )


def model_times():
    net = SlowNetwork(bandwidth=BANDWIDTH, latency=LATENCY)
    return net.message_time(1000), net.collective_time("all_reduce", 4000, 4)


def test_the_model_helpers_match_the_formulas():
    message, ring = model_times()
    assert message == pytest.approx(LATENCY + 1000 / BANDWIDTH, rel=1e-12)
    assert ring == pytest.approx(6 * (LATENCY + 1000 / BANDWIDTH), rel=1e-12)


def counted_under_emulation():
    """CommCounter inside and around SlowNetwork sees the user's bytes only."""
    t = torch.ones(1000)
    with CommCounter() as outer:
        with SlowNetwork(bandwidth=1e9, latency=1e-3), CommCounter() as inner:
            dist.all_reduce(t)
            if rank() < 2:
                dist.send(t, 1) if rank() == 0 else dist.recv(t, 0)
    return outer.bytes_sent, inner.bytes_sent, inner.bytes_received, dict(inner.calls)


def test_side_messages_are_not_counted(pool4):
    ring = 2 * 3 * 4000 // 4
    for r, (outer, sent, received, calls) in enumerate(pool4.launch(counted_under_emulation)):
        assert outer == sent
        assert sent == ring + (4000 if r == 0 else 0)
        assert received == ring + (4000 if r == 1 else 0)
        assert calls.get("all_reduce") == 1 and sum(calls.values()) == (2 if r < 2 else 1)


def all_reduce_time():
    """Seconds one all-reduce takes, after a block that modelled a 0.5 s latency."""
    t = torch.ones(10)
    with SlowNetwork(latency=0.5):
        pass
    dist.barrier()
    start = time.time()
    dist.all_reduce(t)
    return time.time() - start, hasattr(dist.all_reduce, "__wrapped_by_course_lib__")


def leave_network_on():
    SlowNetwork(latency=0.5).__enter__()
    return hasattr(dist.all_reduce, "__wrapped_by_course_lib__")


def test_emulation_is_off_after_the_block_and_after_the_call(pool4):
    emulated = 6 * 0.5  # what the all-reduce would take under the emulation
    for elapsed, patched in pool4.launch(all_reduce_time):
        assert elapsed < emulated / 3 and not patched, "still emulated after the block"
    assert pool4.launch(leave_network_on) == [True] * 4
    for elapsed, patched in pool4.launch(all_reduce_time):
        assert elapsed < emulated / 3 and not patched, "emulation leaked into the next call"


def straggler_steps(delays, jitter, seed, steps=3):
    slow = Straggler(delays=delays, jitter=jitter, seed=seed)
    records = []
    for _ in range(steps):
        start = time.perf_counter()
        slept = slow.step()
        records.append((slept, time.perf_counter() - start))
    return records


def test_straggler_sleeps_the_right_rank_the_right_time(pool4):
    results = pool4.launch(straggler_steps, {2: 0.05}, 0.0, 0)
    for r, records in enumerate(results):
        assert [slept for slept, _ in records] == [0.05 if r == 2 else 0.0] * 3, f"rank {r}"
    took = statistics.median(took for _, took in results[2])
    assert within_band(took, 0.05), f"rank 2 slept {took:.4f} s"


def test_straggler_jitter_is_seeded_per_rank_and_in_range(pool4):
    jitter = 0.02
    first = pool4.launch(straggler_steps, {}, jitter, 0)
    again = pool4.launch(straggler_steps, {}, jitter, 0)
    other_seed = pool4.launch(straggler_steps, {}, jitter, 1)
    slept = [[s for s, _ in records] for records in first]
    assert slept == [[s for s, _ in records] for records in again], "same seed, other delays"
    assert slept != [[s for s, _ in records] for records in other_seed], "seed is ignored"
    assert len({tuple(s) for s in slept}) == 4, "ranks draw the same jitter"
    for records in first:
        for s, took in records:
            assert 0 <= s < jitter
            assert took >= s * (1 - BAND)


def test_bad_settings_get_clear_errors():
    with pytest.raises(ValueError, match="bandwidth"):
        SlowNetwork(bandwidth=0)
    with pytest.raises(ValueError, match="latency"):
        SlowNetwork(latency=-1)
    with pytest.raises(ValueError, match="jitter"):
        Straggler(jitter=-0.1)
    with pytest.raises(ValueError, match="delays"):
        Straggler(delays={1: -0.5})
    with pytest.raises(ValueError, match="unknown collective"):
        SlowNetwork().collective_time("allreduce", 10, 4)
    with pytest.raises(ValueError, match="node_size"):
        SlowNetwork(node_size=0)
    with pytest.raises(ValueError, match="node_bandwidth"):
        SlowNetwork(node_size=2, node_bandwidth=-1)
