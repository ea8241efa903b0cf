"""An emulated slow network and slow ranks, so loopback behaves like a real cluster.

    with SlowNetwork(bandwidth=125e6, latency=5e-3):   # 1 Gbit/s links, 5 ms latency
        dist.all_reduce(grad)        # takes 2(P-1) * (5 ms + N / (P * 125e6 B/s))
    slow = Straggler(delays={2: 0.05})
    slow.step()                      # rank 2 sleeps 50 ms: call once per training step

On one machine a message crosses loopback in microseconds, so compressing it or sending it to
fewer ranks never pays off. Inside a `SlowNetwork` block every torch.distributed call this
rank makes still moves the real data, and then waits until the time the modelled network
would have needed:

- every rank has one port out and one port in, each carrying one message at a time at
  `bandwidth` (a full-duplex link to a switch that never blocks). A message of n bytes
  leaves when this rank's port out is free (t0 at the earliest), its first byte reaches the
  receiver `latency` later, and it is delivered n / bandwidth after the receiver's port in
  has started taking it (messages a rank receives queue there, in the order it receives
  them). So a root that sends to or receives from P - 1 ranks is the bottleneck it is on a
  real network. With `node_size=k`, ranks 0..k-1, k..2k-1, ... form nodes: a message between
  two ranks of one node crosses the node's own links instead (`node_bandwidth`,
  `node_latency`: NVLink, say), through a second pair of ports, so a rank can talk inside its
  node and across the network at once (built-in collectives use the network's links).
  `send` returns when its message would be delivered on an idle receiver, `recv` no earlier
  than its delivery. The sender passes the first byte's arrival to the receiver in a small
  side message, so a receiver that was waiting early still waits for a late sender.
- a collective ends `collective_time` after the last rank of the group entered it: its
  textbook algorithm's steps (one latency each) plus the busiest rank's bytes (as counted by
  `course_lib.costs.COLLECTIVE_MODEL`) over the bandwidth. The ranks exchange their start
  times in a small side all-reduce. A built-in collective runs in C++, out of Python's
  sight, so its time is the model's: a measurement of one under `SlowNetwork` shows the
  model, not an emergent time (a collective built from send and recv shows its own).
- async calls (isend, irecv, `async_op=True`) return at once; `wait()` (and the future of
  `get_future()`) completes no earlier than the emulated finish.

The real transfer happens within the emulated time, not on top of it, so the emulation holds
while the modelled time exceeds the real one (true on loopback for tens of milliseconds).
`bench/shaped_network.py` checks the model against real links: ranks in network namespaces
joined by a bridge, every port shaped by the kernel's token bucket, gloo over TCP.

Every rank of a group must be inside a `SlowNetwork` when it communicates (the side messages
must match). Like `CommCounter`, calls from C++ (DistributedDataParallel's own all-reduce)
are not seen; DDP communication hooks written in Python (`powerSGD_hook`) are.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from course_lib import comm, runtime
from course_lib.costs import COLLECTIVE_MODEL, alpha_beta_time, busiest_bytes, collective_steps

# Side messages carrying delivery times use the user's tag plus this, so they never match data.
STAMP_TAG = 1 << 30


class SlowNetwork:
    """Every torch.distributed call in the block takes its time on the modelled network."""

    def __init__(
        self,
        bandwidth: float = 125e6,
        latency: float = 5e-3,
        *,
        node_size: int | None = None,
        node_bandwidth: float = math.inf,
        node_latency: float = 0.0,
    ) -> None:
        for name, value in (("bandwidth", bandwidth), ("node_bandwidth", node_bandwidth)):
            if not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(
                    f"{name} is in bytes per second and must be > 0 (math.inf for no limit), "
                    f"got {value!r}; 1 Gbit/s is 125e6"
                )
        for name, value in (("latency", latency), ("node_latency", node_latency)):
            if not (isinstance(value, (int, float)) and 0 <= value < math.inf):
                raise ValueError(f"{name} is in seconds and must be >= 0, got {value!r}")
        if node_size is not None and not (isinstance(node_size, int) and node_size >= 1):
            raise ValueError(f"node_size is a number of ranks >= 1 (or None), got {node_size!r}")
        self.bandwidth = float(bandwidth)
        self.latency = float(latency)
        self.node_size = node_size
        self.node_bandwidth = float(node_bandwidth)
        self.node_latency = float(node_latency)
        self.waited = 0.0  # seconds calls spent waiting for the emulated network

    def link(self, me: int, peer: int) -> tuple[str, float, float]:
        """(ports, bandwidth, latency) of a message between global ranks `me` and `peer`:
        the node's own links when both are in one node of `node_size` consecutive ranks."""
        if self.node_size is not None and me // self.node_size == peer // self.node_size:
            return "node ", self.node_bandwidth, self.node_latency
        return "", self.bandwidth, self.latency

    def message_time(self, nbytes: int) -> float:
        """Seconds for one message of `nbytes` bytes: latency + bytes / bandwidth."""
        return alpha_beta_time(nbytes, self.latency, self.bandwidth)

    def collective_time(self, op: str, nbytes: int, world_size: int) -> float:
        """Seconds for collective `op` on N = `nbytes` (see `COLLECTIVE_MODEL`) and P ranks."""
        if op not in COLLECTIVE_MODEL:
            raise ValueError(f"unknown collective {op!r}; known: {', '.join(COLLECTIVE_MODEL)}")
        busiest = busiest_bytes(op, nbytes, world_size)
        steps = collective_steps(op, world_size)
        return alpha_beta_time(busiest, self.latency, self.bandwidth, messages=steps)

    def __enter__(self) -> SlowNetwork:
        with _lock:
            if not _stack:
                comm.add_around_hook(_emulate)
            _stack.append(self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        with _lock:
            if self in _stack:
                _stack.remove(self)
            if not _stack:
                comm.remove_around_hook(_emulate)
                _ports.clear()

    def __repr__(self) -> str:
        nodes = (
            f", node_size={self.node_size}, node_bandwidth={self.node_bandwidth:g}, "
            f"node_latency={self.node_latency:g}"
            if self.node_size
            else ""
        )
        return f"SlowNetwork(bandwidth={self.bandwidth:g}, latency={self.latency:g}{nodes})"

    def _sleep_until(self, deadline: float) -> None:
        pause = deadline - time.time()
        if pause > 0:
            time.sleep(pause)
            self.waited += pause


class Straggler:
    """Per-rank compute slow-downs: `step()` sleeps this rank's delay (+ seeded jitter)."""

    def __init__(
        self, delays: dict[int, float] | None = None, jitter: float = 0.0, seed: int = 0
    ) -> None:
        delays = dict(delays or {})
        for rank, delay in delays.items():
            if not (isinstance(rank, int) and rank >= 0 and delay >= 0):
                raise ValueError(
                    f"delays maps a rank (int >= 0) to extra seconds per step (>= 0), got "
                    f"{rank!r}: {delay!r}"
                )
        if not jitter >= 0:
            raise ValueError(f"jitter is in seconds and must be >= 0, got {jitter!r}")
        self.delays = delays
        self.jitter = float(jitter)
        self.seed = seed
        self._rngs: dict[int, random.Random] = {}

    def delay(self) -> float:
        """This rank's delay for the next step (draws the jitter: call once per step)."""
        rank = runtime.rank()
        extra = 0.0
        if self.jitter > 0:
            # One generator per rank, made on first use in the rank's own process.
            rng = self._rngs.setdefault(rank, random.Random(self.seed * 1_000_003 + rank))
            extra = rng.uniform(0.0, self.jitter)
        return self.delays.get(rank, 0.0) + extra

    def step(self) -> float:
        """Sleep this rank's delay for one training step; return the seconds slept."""
        seconds = self.delay()
        if seconds > 0:
            time.sleep(seconds)
        return seconds


_stack: list[SlowNetwork] = []  # nested blocks: the innermost one sets the network
_ports: dict[str, float] = {}  # "out" / "in" -> when this rank's port finishes its queue
_lock = threading.Lock()


def _emulate(op: str, args: dict, sent: int, received: int, call: Callable[[], Any]) -> Any:
    """The around-call hook (see `comm.add_around_hook`): real call, then the emulated wait."""
    if not _stack:
        return call()
    net = _stack[-1]
    if op in ("send", "isend"):
        return _send(net, op, args, call)
    if op in ("recv", "irecv"):
        return _recv(net, op, args, call)
    return _collective(net, op, args, max(sent, received), call)


def _stamp_kwargs(args: dict, stamp: torch.Tensor) -> dict:
    """The call's own arguments with the stamp as tensor and the side tag."""
    return {**args, "tensor": stamp, "tag": args.get("tag", 0) + STAMP_TAG}


def _send(net: SlowNetwork, op: str, args: dict, call: Callable[[], Any]) -> Any:
    tensor = args["tensor"]
    group = args.get("group")
    dst = args.get("dst")
    if dst is None:
        dst = c10d.get_global_rank(c10d._group_or_default_group(group), args["group_dst"])
    nbytes = tensor.numel() * tensor.element_size()
    ports, bandwidth, latency = net.link(dist.get_rank(), dst)
    with _lock:
        # This rank's port out carries one message at a time: this one leaves when it is free.
        start = max(time.time(), _ports.get(ports + "out", 0.0))
        _ports[ports + "out"] = start + nbytes / bandwidth
    first_byte = start + latency
    deliver = first_byte + nbytes / bandwidth  # if the receiver's port in is idle
    result = call()
    stamp = torch.tensor([first_byte], dtype=torch.float64, device=tensor.device)
    if op == "send":
        comm.unwrapped("send")(**_stamp_kwargs(args, stamp))
        net._sleep_until(deliver)
        return result
    stamp_work = comm.unwrapped("isend")(**_stamp_kwargs(args, stamp))
    return EmulatedWork(net, result, lambda: _wait(stamp_work, deliver), keep=(stamp,))


def _recv(net: SlowNetwork, op: str, args: dict, call: Callable[[], Any]) -> Any:
    stamp = torch.empty(1, dtype=torch.float64, device=args["tensor"].device)
    nbytes = args["tensor"].numel() * args["tensor"].element_size()
    group = c10d._group_or_default_group(args.get("group"))
    if op == "recv":
        source = call()  # the sender's global rank
        comm.unwrapped("recv")(**{**_stamp_kwargs(args, stamp), "src": source, "group_src": None})
        net._sleep_until(_delivered(net, stamp.item(), nbytes, source))
        return source
    work = call()
    if args.get("src") is None and args.get("group_src") is None:
        # From any source: the stamp can only be asked for once the data says who sent it.
        def deliver() -> float:
            work.wait()
            source = work._source_rank()
            side = {**_stamp_kwargs(args, stamp), "src": None, "group_src": source}
            comm.unwrapped("recv")(**side)
            return _delivered(net, stamp.item(), nbytes, c10d.get_global_rank(group, source))

        return EmulatedWork(net, work, deliver, keep=(stamp,))
    source = args.get("src")
    if source is None:
        source = c10d.get_global_rank(group, args["group_src"])
    stamp_work = comm.unwrapped("irecv")(**_stamp_kwargs(args, stamp))

    def delivered() -> float:
        stamp_work.wait()
        return _delivered(net, stamp.item(), nbytes, source)

    return EmulatedWork(net, work, delivered, keep=(stamp,))


def _delivered(net: SlowNetwork, first_byte: float, nbytes: int, source: int) -> float:
    """When a message from global rank `source` whose first byte reaches this rank at
    `first_byte` is delivered: its bytes pass this rank's port in (the node's, from a rank of
    this node) after those of the messages received before it."""
    ports, bandwidth, _ = net.link(dist.get_rank(), source)
    with _lock:
        start = max(first_byte, _ports.get(ports + "in", 0.0))
        _ports[ports + "in"] = start + nbytes / bandwidth
        return _ports[ports + "in"]


def _collective(net: SlowNetwork, op: str, args: dict, nbytes: int, call: Callable[[], Any]) -> Any:
    group = args.get("group")
    steps = collective_steps(op, dist.get_world_size(group))
    # [when this rank entered, its bytes]; their maxima over the group set the finish.
    stamp = torch.tensor([time.time(), float(nbytes)], dtype=torch.float64, device=runtime.device())
    result = call()
    async_op = bool(args.get("async_op", False))
    exchange = comm.unwrapped("all_reduce")(
        stamp, op=dist.ReduceOp.MAX, group=group, async_op=async_op
    )

    def finish() -> float:
        if async_op:
            exchange.wait()
        last_start, busiest = stamp.tolist()
        return last_start + alpha_beta_time(busiest, net.latency, net.bandwidth, messages=steps)

    if not async_op:
        net._sleep_until(finish())
        return result
    return EmulatedWork(net, result, finish, keep=(stamp,))


def _wait(work: Any, value: float) -> float:
    work.wait()
    return value


class EmulatedWork:
    """A torch.distributed work handle whose `wait()` returns at the emulated finish."""

    def __init__(
        self, net: SlowNetwork, work: Any, finish: Callable[[], float], keep: tuple = ()
    ) -> None:
        self._net = net
        self._work = work
        self._finish = finish  # waits for the side message if needed; returns the finish time
        self._finish_at: float | None = None
        self._keep = keep  # side-message tensors must outlive their transfer
        self._lock = threading.Lock()

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        done = self._work.wait(*args, **kwargs)
        with self._lock:
            if self._finish_at is None:
                self._finish_at = self._finish()
        self._net._sleep_until(self._finish_at)
        return done

    def is_completed(self) -> bool:
        """True once the real transfer is done and the emulated finish has passed."""
        if not self._work.is_completed():
            return False
        with self._lock:
            if self._finish_at is None:  # the side message follows the data right away
                self._finish_at = self._finish()
        return time.time() >= self._finish_at

    def get_future(self) -> torch.futures.Future:
        """A future completed at the emulated finish (DDP communication hooks use this)."""
        real = self._work.get_future()
        future: torch.futures.Future = torch.futures.Future()

        def complete() -> None:
            try:
                self.wait()
                future.set_result(real.value())
            except Exception as exc:  # noqa: BLE001 (handed to whoever waits on the future)
                future.set_exception(exc)

        threading.Thread(target=complete, daemon=True).start()
        return future

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _reset() -> None:
    """After a launched call: no emulation left on for the next call on a warm worker."""
    with _lock:
        _stack.clear()
        _ports.clear()
        comm.remove_around_hook(_emulate)


runtime.at_call_end(_reset)
