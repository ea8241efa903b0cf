"""The same function under torchrun, as on a cluster (here: 2 CPU processes, gloo), and under
a bare `srun` on a real one-node Slurm cluster (tools/slurm.sh)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from course_lib.launch import resolve_backend
from course_lib.torchrun import (
    choose_backend,
    first_host,
    init_from_env,
    load_function,
    slurm_environment,
    tasks_per_node,
)
from tests.conftest import ROOT


def run(command: list[str]) -> subprocess.CompletedProcess:
    """`command` in the repository, with course_lib importable, its output captured."""
    return subprocess.run(
        command,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def test_example_runs_unchanged_under_torchrun():
    torchrun = Path(sys.executable).with_name("torchrun")
    result = run(
        [
            str(torchrun),
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "course_lib.torchrun",
            "examples/hello_allreduce.py:main",
            "8",
        ]
    )
    assert result.returncode == 0, result.stderr
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for rank in (0, 1):
        on = f"cuda:{rank}" if choose_backend("auto", 2, gpus) == "nccl" else "cpu"
        assert f"rank {rank} of 2 on {on}: all_reduce gave 1" in result.stdout
        assert f"[rank {rank}] returned 8.0" in result.stdout


def test_example_runs_unchanged_under_srun_on_two_tasks(slurm):
    """`srun -n 2 python -m course_lib.torchrun ...`: Slurm starts both processes, no
    torchrun; each finds its rank and the rendezvous in Slurm's variables."""
    command = [sys.executable, "-m", "course_lib.torchrun", "examples/hello_allreduce.py:main", "8"]
    result = subprocess.run(
        ["srun", "--ntasks", "2", "--time", "5", *command],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        env={**slurm, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for rank in (0, 1):
        assert f"rank {rank} of 2 on cpu: all_reduce gave 1" in result.stdout
        assert f"[rank {rank}] returned 8.0" in result.stdout


SRUN_TASK_1_OF_4 = {  # what srun set for the second task of `srun -N 2 -n 4`, job 7, step 1
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "0",
    "SLURM_NTASKS": "4",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_TASKS_PER_NODE": "2(x2)",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
    "SLURM_STEP_NODELIST": "node1,node2",
    "SLURM_JOB_ID": "7",
    "SLURM_STEP_ID": "1",
}


def test_srun_variables_become_torchruns():
    assert slurm_environment(SRUN_TASK_1_OF_4) == {
        "RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "node1",
        "MASTER_PORT": str(20000 + 701),
    }
    given = {**SRUN_TASK_1_OF_4, "MASTER_ADDR": "head", "MASTER_PORT": "29400"}
    assert slurm_environment(given)["MASTER_ADDR"] == "head"
    assert slurm_environment(given)["MASTER_PORT"] == "29400"
    # torchrun inside an srun task (examples/slurm.sbatch) set RANK itself: nothing changes.
    assert slurm_environment({**SRUN_TASK_1_OF_4, "RANK": "5"}) == {}
    assert slurm_environment({"RANK": "0"}) == {} and slurm_environment({}) == {}
    # A batch script's own process (sbatch --ntasks 2, no srun): Slurm sets SLURM_PROCID and
    # SLURM_NTASKS there too, but it is one process, not a task of a step.
    assert slurm_environment({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"}) == {}


def test_slurm_lists_are_read_as_slurm_writes_them():
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert tasks_per_node("4") == [4]
    with pytest.raises(ValueError, match="tasks per node"):
        tasks_per_node("2x3")
    assert first_host("vm") == "vm"
    assert first_host("cpu1,cpu2") == "cpu1"


def test_a_bracketed_node_list_is_expanded_by_scontrol(slurm, monkeypatch):
    monkeypatch.setenv("SLURM_CONF", slurm["SLURM_CONF"])  # as srun's tasks inherit it
    assert first_host("gpu[03-04],cpu1") == "gpu03"


def test_the_example_also_runs_as_a_script():
    result = run([sys.executable, "examples/hello_allreduce.py"])
    assert result.returncode == 0, result.stderr
    on = "cuda:3" if resolve_backend("auto", 4) == "nccl" else "cpu"
    assert f"[rank 3] rank 3 of 4 on {on}: all_reduce gave 6" in result.stdout
    assert result.stdout.strip().endswith("[24.0, 24.0, 24.0, 24.0]")


def test_load_function_from_file_or_module_and_clear_errors(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        "def main():\n    return 1\n\nif __name__ == '__main__':\n    raise SystemExit(9)\n"
    )
    assert load_function(f"{script}:main")() == 1  # the __main__ block did not run
    assert load_function("course_lib.runtime:rank")() == 0
    with pytest.raises(SystemExit, match="has no function 'nope'"):
        load_function(f"{script}:nope")
    with pytest.raises(SystemExit, match="expected FILE.py:FUNCTION"):
        load_function("no-colon")


@pytest.mark.parametrize(
    "backend, processes, gpus, expected",
    [
        ("auto", 2, 0, "gloo"),
        ("auto", 2, 1, "gloo"),  # one GPU for two processes: all of them on gloo
        ("auto", 2, 2, "nccl"),
        ("auto", 4, 8, "nccl"),
        ("gloo", 2, 8, "gloo"),
        ("nccl", 2, 2, "nccl"),
    ],
)
def test_every_process_on_a_machine_chooses_the_same_backend(
    monkeypatch, backend, processes, gpus, expected
):
    """Under torchrun each process decides alone: with fewer GPUs than processes, a choice
    made from its own LOCAL_RANK put some on NCCL and others on gloo, and start-up hung."""
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(dist, "init_process_group", lambda name, **kw: chosen.append(name))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(processes))
    for local_rank in range(processes):
        monkeypatch.setenv("LOCAL_RANK", str(local_rank))
        assert init_from_env(backend) == expected
    name = "cpu:gloo,cuda:nccl" if expected == "nccl" else "gloo"
    assert chosen == [name] * processes


def test_nccl_with_too_few_gpus_is_refused_before_joining(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: pytest.fail("joined"))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(SystemExit, match="needs one GPU per process: 2 processes .* 1 GPU visible"):
        init_from_env("nccl")


def test_nccl_binds_each_process_to_its_gpu_before_joining(monkeypatch):
    """torchrun and `launch` alike: set_device(r), then init_process_group with device_id
    cuda:r, so that NCCL's communicator and every later CUDA call use the rank's own GPU."""
    from course_lib import _worker

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(
        dist,
        "init_process_group",
        lambda backend, **kw: calls.append(("init", backend, kw.get("device_id"))),
    )
    monkeypatch.setattr(dist, "TCPStore", lambda *a, **k: None)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "2")
    init_from_env("auto")
    spec = {"store_host": "127.0.0.1", "store_port": 1, "pg_timeout_s": 60, "rank": 2}
    _worker._join_process_group({**spec, "world_size": 4, "backend": "nccl"})
    both = [("set_device", 2), ("init", "cpu:gloo,cuda:nccl", torch.device("cuda", 2))]
    assert calls == both + both


def test_the_readmes_gpu_table_is_what_the_code_chooses(monkeypatch):
    readme = (ROOT / "README.md").read_text().partition("## On GPUs")[2].partition("\n## ")[0]
    rows = re.findall(r"^\| (\d[^|]*) \| ([^|]+) \| ([^|]+) \|$", readme, flags=re.M)
    assert len(rows) >= 3, "the README's 'On GPUs' table is gone"

    def said(cell):
        return "nccl" if "NCCL" in cell else "gloo"

    for gpus_cell, launch_cell, torchrun_cell in rows:
        counts = [int(n) for n in re.findall(r"\d+", gpus_cell)]
        counts += [8] if "or more" in gpus_cell else []
        for gpus in counts:
            monkeypatch.setattr(torch.cuda, "is_available", lambda g=gpus: g > 0)
            monkeypatch.setattr(torch.cuda, "device_count", lambda g=gpus: g)
            assert resolve_backend("auto", 4) == said(launch_cell), (gpus, launch_cell)
            assert choose_backend("auto", 2, gpus) == said(torchrun_cell), (gpus, torchrun_cell)
