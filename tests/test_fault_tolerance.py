"""course_lib.fault_tolerance: a rank killed under torchrun and the job resumed with the losses
of an uninterrupted run, asynchronous checkpoints that load back equal and count only once
committed by every rank, a 2-rank checkpoint resumed on 1 rank, a watchdog that names the hung
rank and the straggler, two torchrun agents as two nodes, one of them lost under a fixed and
an elastic number of nodes. Every subprocess runs under a timeout, and none outlives its test."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from course_lib import RankError, WorkerPool
from course_lib.errors import LaunchError
from course_lib.fault_tolerance import (
    COMMITTED,
    AsyncCheckpointer,
    TorchrunResult,
    free_ports,
    latest_checkpoint,
    local_state,
    lose_node,
    loss_log,
    missing_ranks,
    run_agents,
    run_jobs,
    run_torchrun,
    slowest_rank,
    train,
    train_async,
    two_node_args,
)
from course_lib.fault_tolerance.jobs import _kill_tree
from course_lib.measure.fault_tolerance import (
    agents_report,
    attempts_report,
    check_minutes_between_checkpoints,
    check_named_rank,
    check_steps_redone,
    watched_steps,
)

STEPS, EVERY, KILL_AT = 8, 3, 7  # checkpoints after steps 2 and 5; rank 1 dies at step 7


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The losses of a run that never fails, under the course's launcher (not torchrun)."""
    with WorkerPool(2) as pool:
        return pool.launch(train, str(tmp_path_factory.mktemp("ref")), STEPS, EVERY)[0]


def test_a_killed_rank_is_restarted_and_the_losses_equal_an_uninterrupted_run(tmp_path, reference):
    args = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1"]
    result = run_torchrun(
        [*args, "--monitor-interval", "0.1"],
        "course_lib.fault_tolerance:train",
        tmp_path,
        STEPS,
        EVERY,
        KILL_AT,
        timeout=240,
    )
    assert result.returncode == 0, result.output[-3000:]
    log = loss_log(tmp_path)
    first = [row["step"] for row in log if row["attempt"] == 0]
    second = [row["step"] for row in log if row["attempt"] == 1]
    assert first == list(range(KILL_AT)), "attempt 0 should run until rank 1 dies"
    assert second == list(range(6, STEPS)), "attempt 1 should resume after the step-5 checkpoint"
    final = {row["step"]: row["loss"] for row in log}
    # Same data, same state, same order of operations: bit for bit, no tolerance.
    assert [final[s] for s in range(STEPS)] == reference


def commit_after_a_failed_flush(directory: str) -> tuple[str, bool]:
    """On each rank: an asynchronous checkpoint whose flush fails on rank 1 (a full disk),
    then the commit step; what the commit step raised here, and whether the marker exists."""
    import torch.distributed as dist

    from course_lib.fault_tolerance import COMMITTED, save_file
    from course_lib.fault_tolerance.restart import _AsyncCommitted
    from course_lib.runtime import rank

    def disk_full(state: dict, path: str) -> None:
        raise OSError("No space left on device")

    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    checkpoints = _AsyncCommitted(disk_full if rank() == 1 else save_file)
    checkpoints.save(model, optimizer, 0, directory)
    try:
        checkpoints.finish()
        raised = ""
    except RuntimeError as error:
        raised = str(error)
    dist.barrier()  # rank 0 would have committed before this
    return raised, os.path.exists(os.path.join(directory, COMMITTED))


def test_a_failed_flush_on_one_rank_is_not_committed_and_is_raised_there(tmp_path):
    with WorkerPool(2) as pool:
        results = pool.launch(commit_after_a_failed_flush, str(tmp_path), timeout=60)
    assert results[0] == ("", False), "rank 0's flush succeeded, but rank 1's did not"
    assert "No space left on device" in results[1][0] and results[1][1] is False


def test_a_two_rank_checkpoint_resumes_on_one_rank(tmp_path, reference):
    """DCP reshards on load: the step-2 checkpoint of 2 ranks (each half of every parameter
    and AdamW moment) is read by 1 rank, which then takes the whole global batch of 8."""
    with WorkerPool(2) as pool:
        pool.launch(train, str(tmp_path), EVERY, EVERY)  # steps 0-2, checkpoint after step 2
    with WorkerPool(1) as pool:
        resumed = pool.launch(train, str(tmp_path), STEPS, EVERY)[0]
    assert len(resumed) == STEPS - EVERY, "1 rank should resume after the step-2 checkpoint"
    # Not bit for bit: 1 rank sums the batch's gradient and loss in another order than 2 ranks
    # whose halves are then reduced. fp32 rounding, ~2e-7 on losses near 5 in our runs;
    # reloading the weights without AdamW's moments would part the curves by far more.
    torch.testing.assert_close(resumed, reference[EVERY:], rtol=0, atol=1e-5)


RENDEZVOUS = dict(
    join_timeout=6, last_call_timeout=3, keep_alive_interval=1, keep_alive_max_attempt=2
)


def test_a_lost_node_fails_a_fixed_job_and_an_elastic_one_goes_on_alone(tmp_path, reference):
    """Two jobs of two torchrun agents each, run at once; rank 1's node (its agent and worker)
    dies at step 4. `--nnodes 2`: the survivor finds no second node within join_timeout and
    fails. `--nnodes 1:2`: it restarts alone from the step-2 checkpoint, resharded on 1 rank."""
    folders = {"2": tmp_path / "fixed", "1:2": tmp_path / "elastic"}
    jobs = {
        nnodes: (
            two_node_args(port, nnodes=nnodes, max_restarts=1, **RENDEZVOUS),
            (folder, STEPS, EVERY, 4, 1, "node"),
        )
        for (nnodes, folder), port in zip(folders.items(), free_ports(2), strict=True)
    }
    results = run_jobs(jobs, "course_lib.fault_tolerance:train", timeout=240)
    for nnodes, (survivor, lost) in results.items():
        assert lost.returncode == -signal.SIGKILL, f"--nnodes {nnodes}: {lost.output[-2000:]}"
        assert lost.seconds < survivor.seconds, "each agent's time is when it ended"
    fixed, elastic = results["2"][0], results["1:2"][0]
    assert fixed.returncode != 0 and "RendezvousTimeoutError" in fixed.output, fixed.output[-3000:]
    assert elastic.returncode == 0, elastic.output[-3000:]

    assert [row["step"] for row in loss_log(folders["2"])] == list(range(4))
    log = loss_log(folders["1:2"])
    first = [row for row in log if row["attempt"] == 0]
    second = [row for row in log if row["attempt"] == 1]
    assert [(r["step"], r["world_size"]) for r in first] == [(s, 2) for s in range(4)]
    assert [(r["step"], r["world_size"]) for r in second] == [(s, 1) for s in range(3, STEPS)]
    assert [r["loss"] for r in first] == reference[:4], "two nodes train as two ranks do"
    # One rank sums what two summed: fp32 rounding only (see the test of the 1-rank resume).
    torch.testing.assert_close([r["loss"] for r in second], reference[3:], rtol=0, atol=1e-5)
    report = agents_report(results["1:2"])
    assert report[0].startswith("agent 0 (hosts the rendezvous): exit code 0 after ")
    assert "Connection closed by peer" in report[0] or "Connection reset" in report[0]
    assert report[1].startswith("agent 1: killed with its node (SIGKILL) after ")


def test_two_node_args_ask_for_the_nodes_restarts_and_rendezvous_settings():
    agents = two_node_args(1234, nnodes="1:2", max_restarts=3, join_timeout=8, last_call_timeout=1)
    for node, args in enumerate(agents):
        options = dict(zip(args[::2], args[1::2], strict=True))
        assert options["--nnodes"] == "1:2" and options["--max-restarts"] == "3"
        assert options["--rdzv-endpoint"] == "127.0.0.1:1234"
        assert (
            options["--rdzv-conf"] == f"is_host={int(node == 0)},join_timeout=8,last_call_timeout=1"
        )
    assert len(set(free_ports(3))) == 3


def test_lose_node_refuses_to_run_outside_torchrun(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    with pytest.raises(RuntimeError, match="under torchrun only"):
        lose_node()  # would otherwise SIGKILL this process's parent


def test_the_reports_say_how_each_agent_ended_and_each_attempt_trained():
    results = [
        TorchrunResult(
            0, "[rank0]: RuntimeError: [pair.cc:553] Connection closed by peer [x]:1. This is", 20.4
        ),
        TorchrunResult(-signal.SIGKILL, "", 8.6),
        TorchrunResult(
            1, "Traceback\ntorch.distributed.elastic.rendezvous.api.RendezvousTimeoutError\n", 30.0
        ),
    ]
    assert agents_report(results) == [
        "agent 0 (hosts the rendezvous): exit code 0 after 20 s; printed RuntimeError: "
        "Connection closed by peer [x]:1",
        "agent 1: killed with its node (SIGKILL) after 9 s",
        "agent 2: exit code 1 after 30 s; printed RendezvousTimeoutError",
    ]
    log = [
        {"attempt": 0, "world_size": 2, "step": 0, "loss": 3.0},
        {"attempt": 0, "world_size": 2, "step": 1, "loss": 2.0},
        {"attempt": 1, "world_size": 1, "step": 1, "loss": 2.0 + 2e-7},
    ]
    assert attempts_report(log, [3.0, 2.0]) == [
        "attempt 0: steps 0-1 on 2 ranks, largest |loss - uninterrupted| 0.0e+00",
        "attempt 1: steps 1-1 on 1 rank, largest |loss - uninterrupted| 2.0e-07",
    ]


def test_a_torchrun_that_runs_out_of_time_is_killed_and_says_what_each_agent_printed():
    args = ["--standalone", "--nproc-per-node", "1"]
    with pytest.raises(TimeoutError) as error:
        run_agents([args, args], "time:sleep", 120, timeout=10)
    message = str(error.value)
    assert "did not finish within 10 s" in message
    assert "--- agent 0 (still running)" in message and "--- agent 1 (still running)" in message


def test_the_async_checkpoint_is_the_state_when_save_was_called(tmp_path):
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 64)).sum().backward()
    optimizer.step()
    state = local_state(model, optimizer)
    expected = {name: t.clone() for name, t in state.items()}
    saver = AsyncCheckpointer()
    saver.save(state, str(tmp_path / "shard.pt"))
    with torch.no_grad():  # training goes on while the file is written
        for p in model.parameters():
            p.add_(1.0)
    saver.wait()
    loaded = torch.load(tmp_path / "shard.pt")
    assert set(loaded) == set(expected) and any(k.startswith("optimizer.") for k in loaded)
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), f"{name} was not saved as it was"
    assert not (tmp_path / "shard.pt.partial").exists()


def test_a_failed_async_write_is_raised_by_the_next_wait(tmp_path):
    saver = AsyncCheckpointer()
    saver.save({"w": torch.ones(2)}, str(tmp_path / "no such folder" / "shard.pt"))
    with pytest.raises(RuntimeError, match="writing a checkpoint failed"):
        saver.wait()


def test_an_incomplete_checkpoint_is_skipped(tmp_path):
    assert latest_checkpoint(str(tmp_path)) is None
    for step, complete in ((4, True), (9, False)):
        (tmp_path / f"step_{step:05d}").mkdir()
        if complete:
            (tmp_path / f"step_{step:05d}" / ".metadata").write_bytes(b"")
    assert latest_checkpoint(str(tmp_path)) == (4, str(tmp_path / "step_00004"))
    assert latest_checkpoint(str(tmp_path), COMMITTED) is None  # another marker, none written
    (tmp_path / "step_00009" / COMMITTED).write_bytes(b"")
    assert latest_checkpoint(str(tmp_path), COMMITTED) == (9, str(tmp_path / "step_00009"))


def test_a_rank_dying_mid_flush_leaves_its_checkpoint_uncommitted_and_the_resume_is_exact(
    tmp_path, reference
):
    """Rank 1 dies while writing its file of the step-5 checkpoint; rank 0's file of it is
    complete. Had rank 0 committed on its own flush alone, step 5 would be marked complete
    and the resumed run would look for rank 1's missing file."""
    with WorkerPool(2) as pool:
        with pytest.raises(LaunchError):  # whichever the launcher saw first: a death or a
            # peer's "Connection closed" in rank 0's all-reduce
            pool.launch(train_async, str(tmp_path), STEPS, EVERY, 5, pause_s=2.0, timeout=120)
        assert sorted(os.listdir(tmp_path / "step_00005")) == ["rank0.pt", "rank1.pt.partial"]
        assert (tmp_path / "step_00002" / COMMITTED).exists()
        assert latest_checkpoint(str(tmp_path), COMMITTED) == (2, str(tmp_path / "step_00002"))
        resumed = pool.launch(train_async, str(tmp_path), STEPS, EVERY, timeout=120)[0]
    # Steps 3 to 7 again, from rank files copied back bit for bit: equal, no tolerance.
    assert resumed == reference[EVERY:]
    assert (tmp_path / "step_00005" / COMMITTED).exists()  # written this time, at the end


def test_the_watchdog_names_the_hung_rank():
    with WorkerPool(3) as pool, pytest.raises(RankError) as error:
        pool.launch(watched_steps, 6, hang_rank=2, hang_at=2, timeout_s=1.0, timeout=60)
    message = str(error.value)
    assert "rank 2 never arrived (last heartbeat: step 1)" in message
    assert "rank 0 never" not in message and "rank 1 never" not in message
    assert error.value.exc_type == "HungRank" and error.value.attributes == {"ranks": [2]}


def test_the_watchdog_names_the_straggler():
    with WorkerPool(3) as pool:
        compute = pool.launch(watched_steps, 6, slow_rank=1, delay_s=0.05, timeout=60)
    assert slowest_rank(compute) == 1


def test_slowest_rank_and_missing_ranks_by_hand():
    assert slowest_rank([[1, 1, 1], [1, 1, 1], [3, 3, 3]]) == 2
    assert slowest_rank([[1, 1, 1], [1, 90, 1]]) is None  # one slow step is not a straggler
    assert slowest_rank([[2, 2], [2, 2]]) is None
    beats = {0: (4, 0.1, 0.0), 2: (4, 0.1, 0.0), 3: (3, 0.1, 0.0)}
    assert missing_ranks(beats, 4, 4) == [1, 3]  # 1 never beat, 3 is a step behind


def test_kill_tree_kills_children_in_sessions_of_their_own():
    """torchrun's workers are session leaders: killing the agent's group would miss them."""
    code = (
        "import subprocess, sys, time\n"
        "c = subprocess.Popen(['sleep', '60'], start_new_session=True)\n"
        "print(c.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    _kill_tree(parent.pid)
    parent.wait(timeout=10)
    for _ in range(100):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the grandchild {child} survived")


def async_save_then_train_then_load(directory: str) -> float:
    """On each rank: dcp.async_save a ZeRO-3 model on a group of its own, take a training step
    while it flushes, then load the checkpoint into a fresh model; the largest difference
    from the parameters at the time of saving."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from course_lib import models
    from course_lib.zero import build, full_parameters, load_sharded

    def fresh():
        return build("zero3", models.MLP((8, 64, 64, 4), seed=0).layers, lr=1e-2)

    model, optimizer = fresh()
    model_state, optimizer_state = get_state_dict(model, optimizer)
    saved = full_parameters(model)
    future = dcp.async_save(
        {"model": model_state, "optimizer": optimizer_state},
        checkpoint_id=directory,
        process_group=dist.new_group(backend="gloo"),
    )
    model(torch.randn(4, 8)).sum().backward()  # training goes on while the shards flush
    optimizer.step()
    future.result()
    other, other_optimizer = fresh()
    with torch.no_grad():
        for p in other.parameters():
            p.zero_()
    load_sharded(other, other_optimizer, directory)
    loaded = full_parameters(other)
    return max((loaded[k] - saved[k]).abs().max().item() for k in saved)


def test_dcp_async_save_loads_back_the_state_it_was_given(tmp_path):
    with WorkerPool(2) as pool:
        assert pool.launch(async_save_then_train_then_load, str(tmp_path), timeout=120) == [0, 0]


def test_the_planner_chart_draws_every_kind_in_its_legend_colour_in_every_row():
    """Lecture 13's 70B row once took the next colours of matplotlib's cycle: its compute was
    drawn in a colour the legend did not show, and its bubble in the legend's "compute"."""
    import matplotlib.colors
    import matplotlib.pyplot as plt

    from course_lib.measure.fault_tolerance import plot_planner_mfu

    rows = {
        "7B": {"plan": "a", "step_seconds": 4.0, "seconds": {"compute": 3.0, "dp": 1.0}},
        "70B": {
            "plan": "b",
            "step_seconds": 6.0,
            "seconds": {"compute": 3.0, "bubble": 1.0, "pp": 1.0, "dp": 1.0},
        },
    }
    fig = plot_planner_mfu(rows)
    ax = fig.axes[0]
    legend = {
        text.get_text(): matplotlib.colors.to_hex(handle.get_facecolor())
        for text, handle in zip(
            ax.get_legend().get_texts(), ax.get_legend().legend_handles, strict=True
        )
    }
    drawn = [kind for row in rows.values() for kind in row["seconds"]]
    assert sorted(legend) == sorted(set(drawn))
    assert len(set(legend.values())) == len(legend), "two kinds share a colour"
    for kind, bars in zip(drawn, ax.containers, strict=True):
        assert matplotlib.colors.to_hex(bars.patches[0].get_facecolor()) == legend[kind], kind
    plt.close(fig)


def test_the_planner_rows_use_one_n_and_the_planner_adds_only_attention():
    """N = 12 L h^2 (no embeddings) in both MFUs: the planner's own is 6ND's times 1 + s/(6h),
    its attention scores, to rounding (7B: s = h, a sixth; 70B: h = 2s, a twelfth)."""
    from course_lib.measure.fault_tolerance import planner_mfu
    from course_lib.parallel_3d import LLAMA_7B, LLAMA_70B

    rows = planner_mfu()
    for model in (LLAMA_7B, LLAMA_70B):
        row, shape = rows[model.name], model.shape
        assert row["n_params"] == 12 * shape.layers * shape.hidden**2 < model.params
        assert math.isclose(
            row["planner_mfu"], row["mfu"] * (1 + shape.seq / (6 * shape.hidden)), rel_tol=1e-9
        )
    assert math.isclose(rows["7B"]["attention_share"], 1 / 6, rel_tol=1e-12)


def test_the_young_check_takes_sqrt_2cm_in_minutes(capsys):
    """C = 30 s, M = 3 h = 10,800 s: sqrt(2 x 30 x 10,800) = sqrt(648,000) s, about 13.4 min."""
    assert check_minutes_between_checkpoints(math.sqrt(648_000) / 60) is True
    assert "✓ Right" in capsys.readouterr().out
    assert check_minutes_between_checkpoints(math.sqrt(648_000)) is False  # seconds, not minutes
    out = capsys.readouterr().out
    assert "then convert to minutes" in out and "13.42" not in out
    assert check_minutes_between_checkpoints(...) is None
    assert "Not answered yet" in capsys.readouterr().out


def test_the_named_rank_check_reads_the_ranks_the_error_names(capsys):
    error = RankError("rank 0 of 4 raised HungRank: ...", 0, "HungRank", "", {"ranks": [1]})
    assert check_named_rank("rank 1", error) is True
    assert "the heartbeats say who is missing" in capsys.readouterr().out
    assert check_named_rank("ranks 0, 2, 3", error) is False  # who waited, not who is missing
    assert check_named_rank(..., error) is None
    with pytest.raises(ValueError, match="expected the RankError of a HungRank"):
        check_named_rank("rank 1", RuntimeError("rank 1 never arrived"))


def test_the_steps_redone_check_counts_the_logged_steps_done_twice(capsys):
    """Checkpoints after steps 4, 9, 14; a crash at step 13: steps 10, 11 and 12 again."""
    assert check_steps_redone(3, [10, 11, 12]) is True
    assert check_steps_redone(4, [10, 11, 12]) is False  # counting the crash's step 13
    assert "newest checkpoint complete" in capsys.readouterr().out
    assert check_steps_redone(..., [10, 11, 12]) is None
