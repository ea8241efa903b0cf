"""The same function under torchrun, as on a cluster (here: 2 CPU processes, gloo)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from course_lib.torchrun import load_function
from tests.conftest import ROOT


def test_example_runs_unchanged_under_torchrun():
    torchrun = Path(sys.executable).with_name("torchrun")
    result = subprocess.run(
        [
            str(torchrun),
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "course_lib.torchrun",
            "examples/hello_allreduce.py:main",
            "8",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        assert f"rank {rank} of 2 on cpu: all_reduce gave 1" in result.stdout
        assert f"[rank {rank}] returned 8.0" in result.stdout


def test_the_example_also_runs_as_a_script():
    result = subprocess.run(
        [sys.executable, "examples/hello_allreduce.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stderr
    assert "[rank 3] rank 3 of 4 on cpu: all_reduce gave 6" in result.stdout
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
