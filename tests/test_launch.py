"""course_lib.launch: results, live output, errors, hangs, bad input, clean-up, warm pools."""

from __future__ import annotations

import _thread
import gc
import os
import random
import signal
import subprocess
import sys
import threading
import time

import cloudpickle
import numpy as np
import psutil
import pytest
import torch
import torch.distributed as dist

import course_lib
from course_lib import LaunchTimeout, PerRank, RankError, WorkerDied, WorkerPool, launch
from course_lib.calls import pickle_call
from course_lib.launch import default_pool, resolve_backend
from course_lib.rank_env import rank_environment
from course_lib.rank_process import RankProcess, fork_server
from tests.conftest import ROOT, alive, all_gone, descendants, wait_until

# --- functions run on the ranks (module level, so workers import them by reference) -------


def rank_info(offset, scale=1):
    return (course_lib.rank() + offset) * scale, course_lib.world_size(), str(course_lib.device())


def all_reduce_ranks():
    t = torch.tensor([float(course_lib.rank())])
    dist.all_reduce(t)
    return t.item()


def print_then_sleep(pause):
    print(f"first line from {course_lib.rank()}")
    print(f"to stderr from {course_lib.rank()}", file=sys.stderr)
    time.sleep(pause)
    print("last words without newline", end="")
    return course_lib.rank()


def raise_on_rank_two():
    if course_lib.rank() == 2:
        raise ValueError("rank two does not like this")
    t = torch.zeros(1)
    dist.recv(t, src=2)  # never comes: these ranks are blocked when rank 2 raises


def unmatched_recv():
    t = torch.zeros(1)
    if course_lib.rank() == 0:
        dist.recv(t, src=1)  # rank 1 never sends
    return course_lib.rank()


def exit_abruptly():
    if course_lib.rank() == 1:
        os._exit(3)
    time.sleep(30)


def return_lock():
    return threading.Lock()


def start_sleeper():
    child = subprocess.Popen(["sleep", "300"])
    return child.pid


def start_dataloader_workers():
    """A DataLoader with persistent workers, kept alive in a global: its processes must still
    not outlive the call."""
    global _loader
    data = torch.utils.data.TensorDataset(torch.arange(8.0))
    _loader = iter(torch.utils.data.DataLoader(data, num_workers=2, persistent_workers=True))
    next(_loader)
    return [p.pid for p in psutil.Process().children(recursive=True)]


def listening_addresses():
    return sorted(
        {c.laddr.ip for c in psutil.Process().net_connections("inet") if c.status == "LISTEN"}
    )


def draw_random_state():
    return torch.rand(3).tolist(), np.random.rand(), random.random()


def disturb_global_state(module_dir):
    sys.path.insert(0, module_dir)
    import course_test_user_module

    course_test_user_module.counter += 1
    torch.manual_seed(123)
    np.random.seed(5)
    random.seed(5)
    torch.set_default_dtype(torch.float64)
    torch.nn.modules.module.register_module_forward_hook(lambda *args: None)
    gc.disable()
    return course_test_user_module.counter


def read_global_state(module_dir):
    sys.path.insert(0, module_dir)
    import course_test_user_module

    hooks = len(torch.nn.modules.module._global_forward_hooks)
    counter = course_test_user_module.counter
    return draw_random_state(), torch.get_default_dtype(), hooks, counter, gc.isenabled()


def destroy_group():
    dist.destroy_process_group()
    return "destroyed"


def noop():
    return None


def groups_after_making_one():
    dist.new_group([0, 1])
    return len(dist.distributed_c10d._world.pg_map)


def pretend_cuda_work_is_pending():
    """CUDA stood in for: initialised, with work that fails when it is waited for."""

    def synchronize(device=None):
        raise RuntimeError("the pending CUDA work was waited for")

    torch.cuda.is_initialized = lambda: True
    torch.cuda.synchronize = synchronize


def device_from_a_new_thread():
    """device() asked from a thread the rank started, with NCCL and per-thread CUDA devices
    stood in for (no GPU here): torch.cuda.current_device() is rank r in the main thread and
    0 in any other, as on a GPU machine."""
    main = threading.main_thread()
    saved = dist.get_backend, torch.cuda.current_device
    dist.get_backend = lambda group=None: "cpu:gloo,cuda:nccl"
    torch.cuda.current_device = lambda: (
        course_lib.rank() if threading.current_thread() is main else 0
    )
    try:
        found = []
        thread = threading.Thread(target=lambda: found.append(str(course_lib.device())))
        thread.start()
        thread.join()
        return str(course_lib.device()), found[0]
    finally:
        dist.get_backend, torch.cuda.current_device = saved


def exit_soon_on_rank_one():
    """Let the call end normally, then let rank 1 leave while the pool sits idle."""
    if course_lib.rank() == 1:
        threading.Timer(0.3, os._exit, args=(0,)).start()


# --- results ------------------------------------------------------------------------------


def test_returns_results_in_rank_order_with_args_and_kwargs():
    results = launch(rank_info, 10, scale=2, world_size=4)
    on_gpus = resolve_backend("auto", 4) == "nccl"  # a machine with 4 GPUs or more
    devices = [f"cuda:{r}" if on_gpus else "cpu" for r in range(4)]
    assert results == [(20 + 2 * r, 4, devices[r]) for r in range(4)]


def _everything_in_reach(mine):
    """What a rank can find of the values sent to the ranks: its argument, and every tensor
    of the kind on its heap."""
    heap = [o.tolist() for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.numel() == 3]
    return mine.tolist(), heap


def test_a_per_rank_argument_reaches_only_its_own_rank():
    values = [torch.tensor([r, 100.0 + r, 7.5]) for r in range(3)]
    results = launch(_everything_in_reach, PerRank(values), world_size=3)
    for r, (mine, heap) in enumerate(results):
        assert mine == values[r].tolist()
        others = [v.tolist() for i, v in enumerate(values) if i != r]
        assert not [t for t in heap if t in others], f"rank {r} holds another rank's value"


def test_a_per_rank_argument_needs_one_value_per_rank():
    with pytest.raises(ValueError, match="2 values for 3 ranks"):
        launch(_everything_in_reach, PerRank([torch.ones(3)] * 2), world_size=3)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_process_group_spans_exactly_the_ranks(world_size):
    expected = float(sum(range(world_size)))
    assert launch(all_reduce_ranks, world_size=world_size) == [expected] * world_size


def test_prints_appear_live_and_prefixed(monkeypatch):
    """Each line reaches the launcher's stdout while the ranks are still running."""
    arrivals: list[tuple[float, str]] = []

    class Recorder:
        def write(self, text):
            arrivals.append((time.monotonic(), text))

        def flush(self):
            pass

    launch(noop, world_size=2)  # warm the pool, so timing only covers the call
    monkeypatch.setattr(sys, "stdout", Recorder())
    monkeypatch.setattr(sys, "stderr", Recorder())
    launch(print_then_sleep, 1.5, world_size=2)
    returned = time.monotonic()
    monkeypatch.undo()
    text = {t for _, t in arrivals}
    for rank in (0, 1):
        assert f"[rank {rank}] first line from {rank}\n" in text
        assert f"[rank {rank}] to stderr from {rank}\n" in text
        assert f"[rank {rank}] last words without newline\n" in text
    first = min(when for when, t in arrivals if "first line" in t)
    assert returned - first > 1.0, "the first line only arrived when the call ended"


# --- errors and hangs ---------------------------------------------------------------------


def test_raising_rank_stops_all_and_is_named():
    launch(noop)
    old = default_pool().pids
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        launch(raise_on_rank_two, timeout=60)
    assert time.monotonic() - start < 5, "blocked ranks were not stopped promptly"
    error = info.value
    assert error.rank == 2 and error.exc_type == "ValueError"
    message = str(error)
    assert message.startswith("rank 2 of 4 raised ValueError: rank two does not like this")
    assert 'raise ValueError("rank two does not like this")' in message  # the remote line
    assert "raise_on_rank_two" in message
    assert all_gone(old, 5)


class _Label(str):
    """A string of a class of its own: its pickle names the class, which the launcher refuses
    to load, so it must not travel."""


class _Refused(Exception):
    def __init__(self) -> None:
        super().__init__("refused")
        self.ranks, self.why, self.ratio = [1, 3], "late", 0.5  # plain data: it travels
        self.model, self._private = torch.nn.Linear(1, 1), 7  # not plain, not public: not
        self.label, self.nested = _Label("x"), [[[[[1]]]]]  # not plain data, too deep: not


def raise_with_attributes():
    raise _Refused()


def test_a_rank_errors_plain_attributes_travel_with_it():
    with pytest.raises(RankError) as info:
        launch(raise_with_attributes, world_size=1, timeout=60)
    assert info.value.exc_type == "_Refused"
    assert info.value.attributes == {"ranks": [1, 3], "why": "late", "ratio": 0.5}


def test_hang_times_out_with_each_rank_stack():
    launch(noop)
    old = default_pool().pids
    start = time.monotonic()
    with pytest.raises(LaunchTimeout) as info:
        launch(unmatched_recv, timeout=2)
    assert time.monotonic() - start < 6
    message = str(info.value)
    assert "did not finish within 2 s: rank 0 still running (ranks 1, 2, 3 had returned)" in message
    assert "--- rank 0 ---" in message
    assert "in unmatched_recv" in message and "dist.recv(t, src=1)" in message
    assert set(info.value.stacks) == {0}
    assert all_gone(old, 5)


def test_worker_that_dies_is_reported_with_exit_code():
    launch(noop)
    old = default_pool().pids
    with pytest.raises(WorkerDied, match=r"rank 1 of 4 died.*exited with code 3"):
        launch(exit_abruptly, timeout=60)
    assert all_gone(old, 5)


def test_unsendable_return_value_is_an_error_of_that_rank():
    with pytest.raises(RankError, match="return value cannot be sent back"):
        launch(return_lock, world_size=2)


def test_pool_recovers_after_crash_and_hang():
    with pytest.raises(RankError):
        launch(raise_on_rank_two)
    assert launch(all_reduce_ranks) == [6.0] * 4
    with pytest.raises(LaunchTimeout):
        launch(unmatched_recv, timeout=1)
    assert launch(all_reduce_ranks) == [6.0] * 4


def make_groups():
    """Groups of every shape a check's answer makes: all ranks, one rank, the others."""
    groups = [dist.new_group([0, 1]), dist.new_group([0]), dist.new_group([1])]
    dist.all_reduce(torch.ones(1), group=groups[0])
    return os.getpid(), len(dist.distributed_c10d._world.pg_map)


@pytest.mark.parametrize("untrusted", [False, True], ids=["gloo", "counted group"])
def test_groups_a_call_made_are_destroyed_and_the_workers_stay(untrusted):
    """A call's `new_group`s do not pile up in a warm worker, and destroying them does not
    cost the pool its workers: the next call runs in the same processes."""
    with WorkerPool(2, "gloo", untrusted=untrusted) as pool:
        first = pool.launch(make_groups, timeout=60)
        second = pool.launch(make_groups, timeout=60)
    assert [pid for pid, _ in first] == [pid for pid, _ in second], "the workers were restarted"
    # The default group, the call's three groups (on a rank that is not in one, a
    # placeholder): the same count each call, so nothing was left from the first.
    assert [n for _, n in first] == [n for _, n in second]


def test_destroying_the_process_group_restarts_the_pool():
    assert launch(destroy_group, world_size=2) == ["destroyed"] * 2
    assert launch(all_reduce_ranks, world_size=2) == [1.0, 1.0]


# --- bad input gets a clear error before any process starts -------------------------------


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"world_size": 0}, ValueError, "world_size must be a whole number >= 1"),
        ({"world_size": -2}, ValueError, "world_size must be a whole number >= 1"),
        ({"world_size": 2.5}, ValueError, "world_size must be a whole number >= 1"),
        ({"backend": "mpi"}, ValueError, "backend must be 'auto', 'gloo' or 'nccl'"),
        ({"timeout": 0}, ValueError, "timeout must be a number of seconds > 0"),
    ],
)
def test_bad_arguments_fail_before_starting(kwargs, error, match):
    course_lib.shutdown()
    before = descendants()
    with pytest.raises(error, match=match):
        launch(noop, **kwargs)
    assert descendants() <= before


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine with fewer GPUs than ranks")
def test_more_nccl_ranks_than_gpus_fails_before_starting():
    before = descendants()
    with pytest.raises(ValueError, match="backend='nccl' needs one GPU per rank: 2 ranks"):
        launch(noop, world_size=2, backend="nccl")
    assert descendants() <= before


def test_non_callable_and_unpicklable_arguments_fail_before_starting():
    course_lib.shutdown()
    before = descendants()
    with pytest.raises(TypeError, match="must be callable, got int 3"):
        launch(3)
    with pytest.raises(TypeError, match=r"positional argument 1 \(lock\) cannot be sent"):
        launch(rank_info, 1, threading.Lock())
    with pytest.raises(TypeError, match=r"keyword argument 'scale' \(generator\) cannot be sent"):
        launch(rank_info, 1, scale=(i for i in range(3)))
    assert descendants() <= before


@pytest.mark.parametrize(
    "gpus, world_size, chosen, said",
    [
        (0, 4, "gloo", None),  # no GPU: nothing to choose between
        (4, 2, "nccl", "chose nccl, one GPU for each of the 2 ranks (4 visible)"),
        (2, 4, "gloo", "chose gloo, 4 ranks but 2 GPUs: every rank on the CPU"),
    ],
)
def test_auto_says_once_which_backend_it_chose_and_why(
    monkeypatch, capsys, gpus, world_size, chosen, said
):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr("course_lib.backends._said", set())
    assert resolve_backend("auto", world_size) == chosen
    assert resolve_backend("auto", world_size) == chosen
    err = capsys.readouterr().err
    if said is None:
        assert err == ""
    else:
        assert err.count("course_lib: backend='auto' " + said) == 1, err
    assert resolve_backend("gloo", world_size) == "gloo" and capsys.readouterr().err == ""


def test_nccl_ranks_wait_for_each_collective_so_a_hang_shows_its_line(monkeypatch):
    """Under NCCL a collective returns before it runs; with blocking wait, the rank stays in
    the collective until it completes, and a hung rank's stack shows that line (no GPU here:
    the ranks' start-up settings are read, not run)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr("course_lib.backends._said", set())
    nccl, gloo = WorkerPool(2, "nccl"), WorkerPool(2, "gloo")
    assert rank_environment(0, 2, nccl.backend, 29500)["TORCH_NCCL_BLOCKING_WAIT"] == "1"
    assert "TORCH_NCCL_BLOCKING_WAIT" not in rank_environment(0, 2, gloo.backend, 29500)


def test_pool_rejects_a_different_world_size():
    with WorkerPool(2) as pool, pytest.raises(ValueError, match="this pool has 2 workers"):
        pool.launch(noop, world_size=3)


# --- processes: nothing left behind -------------------------------------------------------


def test_processes_started_by_a_call_do_not_outlive_it():
    sleepers = launch(start_sleeper, world_size=2)
    assert all_gone(sleepers, 5)
    pids = launch(start_dataloader_workers, world_size=2)
    assert len(pids[0]) == 2
    assert all_gone(pids[0] + pids[1], 5)


def test_close_stops_every_worker():
    pool = WorkerPool(2)
    pool.launch(noop)
    pids = pool.pids
    assert all(alive(pid) for pid in pids)
    pool.close()
    assert all_gone(pids, 5)


def test_groups_a_call_makes_do_not_pile_up_in_a_warm_pool():
    counts, pids = [], []
    with WorkerPool(2) as pool:
        for _ in range(3):
            counts.append(pool.launch(groups_after_making_one))
            pids.append(pool.pids)
    assert counts == [[2, 2]] * 3  # the default group and the call's own
    assert pids[0] == pids[1] == pids[2]  # the same warm workers all along


def test_a_call_ends_only_when_its_cuda_work_has_finished():
    """NCCL collectives return before they run: a call must wait for its CUDA work, or a
    collective that never completes is blamed on the next call."""
    with WorkerPool(1) as pool, pytest.raises(RankError, match="pending CUDA work was waited"):
        pool.launch(pretend_cuda_work_is_pending)


def test_device_is_the_ranks_own_from_any_thread():
    assert launch(device_from_a_new_thread, world_size=2) == [
        ("cuda:0", "cuda:0"),
        ("cuda:1", "cuda:1"),
    ]


def test_a_gpu_tensor_sent_to_the_ranks_lands_on_each_ranks_own_device(monkeypatch):
    """Pickled as they are, GPU tensors would land on the launcher's GPU (cuda:0) on every
    rank. No GPU here: CPU tensors stand in for GPU ones on the way out, and the "meta"
    device for the rank's own GPU on the way in."""
    sent = (torch.ones(3), torch.nn.Parameter(torch.ones(2)), torch.zeros(1).requires_grad_())
    monkeypatch.setattr("course_lib.calls._on_gpu", lambda obj: any(obj is t for t in sent))
    payload = pickle_call(noop, sent, {})
    monkeypatch.setattr(course_lib.runtime, "device", lambda: torch.device("meta"))
    _, (plain, parameter, leaf), _ = cloudpickle.loads(payload)
    assert plain.is_meta and type(plain) is torch.Tensor and not plain.requires_grad
    assert parameter.is_meta and type(parameter) is torch.nn.Parameter and parameter.requires_grad
    assert leaf.is_meta and leaf.requires_grad


def test_a_function_that_uses_torch_ops_is_sent_by_value():
    """A notebook's function travels by value; `torch.ops` (a module object of a class of its
    own) travels by name, and the rank finds the same operators."""
    namespace = {"torch": torch}
    exec("def add_op():\n    return torch.ops.aten.add", namespace)  # as a notebook cell
    fn, _, _ = cloudpickle.loads(pickle_call(namespace["add_op"], (), {}))
    assert fn is not namespace["add_op"] and fn() is torch.ops.aten.add


def test_closing_a_pool_never_signals_the_number_of_a_rank_that_is_gone(monkeypatch):
    """Pid numbers are reused (they wrap at 32768 on many machines): a signal sent to the number
    of a rank the fork server has already reaped could kill a rank of another pool."""
    pool = WorkerPool(2)
    pool.launch(exit_soon_on_rank_one)
    living, gone = pool.pids
    server = fork_server()
    assert server.exit_code(gone, timeout=10) == 0, "rank 1 should have left and been reaped"
    signalled = []
    for name in ("kill", "killpg"):
        real = getattr(os, name)
        monkeypatch.setattr(
            os, name, lambda pid, sig, real=real: (signalled.append(pid), real(pid, sig))
        )
    pool.close()
    assert gone not in signalled
    assert living in signalled and all_gone([living], 5)


CUDA_STUBS = """
import os, torch

def _stub(name, real):
    def stub(*args, **kwargs):
        with open(os.environ["CUDA_CALLS"], "a") as f:
            f.write(f"{os.getpid()} {name}\\n")
        return real(*args, **kwargs)
    return stub

for _name in ("is_available", "device_count", "init", "_lazy_init", "current_device",
              "set_device", "synchronize", "get_rng_state_all", "mem_get_info"):
    setattr(torch.cuda, _name, _stub(_name, getattr(torch.cuda, _name)))
torch._C._cuda_getDeviceCount = _stub("_cuda_getDeviceCount", torch._C._cuda_getDeviceCount)
"""


def test_the_fork_server_makes_no_cuda_call(tmp_path):
    """A process forked after a CUDA call inherits a CUDA state that is broken in the child,
    so the fork server, which every worker is forked from, must make none. CUDA's entry
    points are stubbed to log their callers (a sitecustomize runs in every new interpreter)."""
    (tmp_path / "sitecustomize.py").write_text(CUDA_STUBS)
    calls = tmp_path / "calls.txt"
    script = (
        "from course_lib import launch\n"
        "from course_lib.rank_process import fork_server\n"
        "launch(lambda: None, world_size=2)\n"
        "print(fork_server().pid)\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}", "CUDA_CALLS": str(calls)}
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    server = result.stdout.split()[-1]
    logged = calls.read_text().splitlines()
    assert logged, "the stubs logged nothing: the launcher asks for the GPU count"
    assert not [line for line in logged if line.split()[0] == server]


def test_killing_the_launcher_leaves_no_process_behind(run_script, tmp_path):
    """SIGKILL of the launching process (a kernel's death): workers, the processes they
    started, and the fork server all go."""
    script = run_script(
        f"""
        import subprocess, time
        from course_lib import launch
        from course_lib.launch import default_pool
        from course_lib.rank_process import fork_server

        def work(path):
            child = subprocess.Popen(["sleep", "300"])
            with open(path + str(child.pid), "w"):
                pass
            time.sleep(300)

        launch(lambda: None, world_size=2)
        print(*default_pool().pids, fork_server().pid, flush=True)
        launch(work, {str(tmp_path / "child-")!r}, world_size=2, timeout=600)
        """
    )
    pids = [int(p) for p in script.stdout.readline().split()]
    assert len(pids) == 3
    children = []
    assert_wait = time.monotonic() + 20
    while len(children) < 2 and time.monotonic() < assert_wait:
        children = [int(p.name.split("-")[1]) for p in tmp_path.glob("child-*")]
        time.sleep(0.05)
    assert len(children) == 2 and all(alive(pid) for pid in pids + children)
    script.kill()
    script.wait()
    assert all_gone(pids + children, 5)


def test_ctrl_c_stops_the_ranks_and_reports_where_they_were(run_script):
    script = run_script(
        """
        import signal, time
        from course_lib import launch
        from course_lib.launch import default_pool

        # Ctrl-C as in a terminal, even if this test runs in the background, where a shell
        # without job control starts commands with SIGINT ignored
        signal.signal(signal.SIGINT, signal.default_int_handler)

        def wait_forever():
            print("waiting", flush=True)
            time.sleep(300)

        launch(lambda: None, world_size=2)
        print(*default_pool().pids, flush=True)
        try:
            launch(wait_forever, world_size=2, timeout=600)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
        """
    )
    pids = [int(p) for p in script.stdout.readline().split()]
    # Interrupt once both ranks are in the call (a fixed sleep is too short on a busy machine)
    assert [script.stdout.readline().split()[-1] for _ in pids] == ["waiting"] * len(pids)
    script.send_signal(signal.SIGINT)
    out, err = script.communicate(timeout=30)
    assert "interrupted" in out
    assert "Interrupted: stopped all 2 ranks" in err
    assert "time.sleep(300)" in err
    assert all_gone(pids, 5)


def own_pid():
    return os.getpid()


def test_ctrl_c_while_a_pool_starts_leaves_no_rank_and_the_next_start_works(monkeypatch):
    """Ctrl-C while the fork server starts rank 1: rank 0 is stopped, rank 1 (forked, but its
    pid never reached the pool) too, and the next start gets the pids of its own ranks, not
    the late reply meant for the interrupted start."""
    server = fork_server()

    def ranks_forked():
        return {p.pid for p in psutil.Process(server.pid).children()}

    others = ranks_forked()  # other pools' (launch's default pool's, say)
    gets = []

    def get_interrupted_on_rank_one(*args, **kwargs):
        gets.append(1)
        if len(gets) == 2:
            raise KeyboardInterrupt  # as a SIGINT landing in this wait does
        return queue_get(*args, **kwargs)

    queue_get = server._forked.get
    monkeypatch.setattr(server._forked, "get", get_interrupted_on_rank_one)
    with WorkerPool(2) as pool:
        with pytest.raises(KeyboardInterrupt):
            pool.launch(noop)
        monkeypatch.undo()
        assert pool.launch(own_pid) == pool.pids
        assert wait_until(lambda: ranks_forked() == others | set(pool.pids))


def sleep_long():
    time.sleep(300)


def test_a_second_ctrl_c_while_ranks_are_stopped_still_gives_fresh_ranks(monkeypatch):
    """A second Ctrl-C that cuts short the stopping of the ranks after the first: the next
    call must not go to ranks still running the interrupted one."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with WorkerPool(2) as pool:
            pool.launch(noop)
            old = pool.pids
            kills = []

            def kill_interrupted_once(worker):
                kills.append(worker.rank)
                if len(kills) == 1:
                    raise KeyboardInterrupt  # the second Ctrl-C, before any rank is stopped
                real_kill(worker)

            real_kill = RankProcess.kill
            monkeypatch.setattr(RankProcess, "kill", kill_interrupted_once)
            threading.Timer(1.0, _thread.interrupt_main).start()  # the first Ctrl-C
            with pytest.raises(KeyboardInterrupt):
                pool.launch(sleep_long, timeout=60)
            monkeypatch.undo()
            assert pool.launch(own_pid, timeout=20) == pool.pids
            assert not set(pool.pids) & set(old)
        assert all_gone(old, 5)
    finally:
        signal.signal(signal.SIGINT, previous)


# --- networking ---------------------------------------------------------------------------


def test_everything_listens_on_loopback_only():
    pool = WorkerPool(2)
    try:
        worker_addresses = pool.launch(listening_addresses)
        store_addresses = listening_addresses()  # the rendezvous store lives in this process
    finally:
        pool.close()
    addresses = set(store_addresses).union(*worker_addresses)
    assert addresses and addresses <= {"127.0.0.1", "::1"}, addresses


def test_concurrent_launches_from_separate_processes_do_not_collide(run_script):
    source = """
        import torch, torch.distributed as dist
        from course_lib import launch, rank

        def total():
            t = torch.tensor([rank() + 1.0])
            dist.all_reduce(t)
            return t.item()

        for _ in range(3):
            assert launch(total, world_size=2) == [3.0, 3.0]
        print("ok")
        """
    scripts = [run_script(source, name=f"concurrent{i}.py") for i in range(3)]
    for script in scripts:
        out, err = script.communicate(timeout=120)
        assert script.returncode == 0, err
        assert out.strip() == "ok"


def test_functions_defined_in_a_script_are_shipped_by_value(run_script):
    script = run_script(
        """
        from course_lib import launch, rank

        class Greeter:
            def __init__(self, word):
                self.word = word

            def __call__(self):
                print(self.word, rank())
                return rank()

        print(launch(Greeter("hi from"), world_size=2))
        """
    )
    out, err = script.communicate(timeout=120)
    assert script.returncode == 0, err
    assert "[rank 0] hi from 0" in out and "[rank 1] hi from 1" in out
    assert out.strip().endswith("[0, 1]")


# --- warm pools ---------------------------------------------------------------------------


def test_warm_pool_reuses_workers_and_isolates_calls(tmp_path):
    (tmp_path / "course_test_user_module.py").write_text("counter = 0\n")
    with WorkerPool(2) as pool:
        fresh = pool.launch(draw_random_state)
        pids = pool.pids
        assert pool.launch(disturb_global_state, str(tmp_path)) == [1, 1]
        state = pool.launch(read_global_state, str(tmp_path))
        assert pool.pids == pids, "the workers were restarted instead of reused"
    for rank in range(2):
        random_state, dtype, hooks, counter, gc_enabled = state[rank]
        assert random_state == fresh[rank], "random state leaked from the previous call"
        assert dtype == torch.float32
        assert hooks == 0
        assert counter == 0, "a module imported by the previous call kept its globals"
        assert gc_enabled


def test_fallback_start_method_runs_and_reports_errors():
    with WorkerPool(2, start_method="subprocess") as pool:
        assert pool.launch(all_reduce_ranks) == [1.0, 1.0]
        with pytest.raises(RankError, match="rank 1 of 2 raised"):
            pool.launch(raise_on_rank_two_of_two)


def raise_on_rank_two_of_two():
    if course_lib.rank() == 1:
        raise RuntimeError("boom")


def test_default_pool_follows_the_world_size():
    assert len(launch(noop, world_size=2)) == 2
    assert len(launch(noop, world_size=3)) == 3
    assert default_pool().world_size == 3


def test_free_port_is_not_reused_while_a_pool_runs():
    """Two pools at once get different rendezvous ports on loopback."""
    with WorkerPool(1) as a, WorkerPool(1) as b:
        a.launch(noop)
        b.launch(noop)
        ports = {a._store.port, b._store.port}
    assert len(ports) == 2
