"""Write requirements.lock, the whole dependency tree at one version each, with hashes.

    make lock        # after changing a pin in pyproject.toml; commit both files

`make install` installs the lock, then torch from its pin in pyproject.toml (the CPU build
without an NVIDIA GPU, the CUDA build with one), then the course itself without dependencies,
so that next semester's install is this one. The lock is universal (any OS, Python 3.11+) and
leaves torch out, together with what only its CUDA build needs (nvidia-*, cuda-*, triton):
the CPU build must install without them, and torch's CUDA build pins each of them exactly.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "requirements.lock"
PYTHON = "3.11"  # the oldest Python the pins support (ipykernel 7.4 needs 3.11)
CUDA_ONLY = re.compile(r"(nvidia-.*|cuda-.*|triton)")


def compile_lock(uv: str, *options: str) -> str:
    """The lock `uv pip compile` writes for pyproject.toml's pins and its test extra."""
    command = [uv, "pip", "compile", "pyproject.toml", "--extra", "test", "--universal"]
    command += ["--python-version", PYTHON, "--no-emit-package", "torch", "--quiet"]
    command += ["--custom-compile-command", "make lock", "--no-header", *options]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"uv pip compile failed:\n{run.stderr}")
    return run.stdout


def cuda_only_packages(lock: str) -> list[str]:
    """Packages of torch's CUDA build, checked to be wanted by nothing else."""
    names = re.findall(r"^([A-Za-z0-9_.-]+)==", lock, re.MULTILINE)
    cuda = {n for n in names if CUDA_ONLY.fullmatch(n)}
    for block in re.split(r"\n(?=\S)", lock):
        name = block.split("==")[0]
        if name in cuda:
            wanted_by = set(re.findall(r"#\s+(?:via\s+)?([A-Za-z0-9_.-]+)\s*$", block, re.M))
            if not wanted_by - {"via"} <= cuda | {"torch"}:
                sys.exit(f"{name} is wanted by {sorted(wanted_by)}, not only by torch's CUDA build")
    return sorted(cuda)


def main() -> None:
    uv = str(Path(sys.executable).with_name("uv"))
    cuda = cuda_only_packages(compile_lock(uv))
    excluded = [f"--no-emit-package={name}" for name in cuda]
    body = compile_lock(uv, "--generate-hashes", *excluded)
    header = (
        "# The whole dependency tree, one version each, with hashes: `make install` installs\n"
        "# it. Regenerate with `make lock` (tools/lock.py) after changing pyproject.toml.\n"
        + textwrap.fill(
            "Left out: torch (installed from its pin, CPU or CUDA build) and what only its CUDA"
            f" build needs: {', '.join(cuda)}.",
            width=98,
            break_on_hyphens=False,
            initial_indent="# ",
            subsequent_indent="# ",
        )
        + "\n"
    )
    LOCK.write_text(header + body)
    print(f"wrote {LOCK.name}: {body.count('==')} packages, {len(cuda)} CUDA-only left out")


if __name__ == "__main__":
    main()
