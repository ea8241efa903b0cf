"""One function, three ways to run it: a notebook cell, a script, and torchrun.

    python examples/hello_allreduce.py        # 4 CPU ranks through course_lib.launch
    torchrun --standalone --nproc-per-node 2 -m course_lib.torchrun \\
        examples/hello_allreduce.py:main 8    # the same function under torchrun
"""

import torch
import torch.distributed as dist

from course_lib import device, launch, rank, world_size


def main(n: int = 4) -> float:
    """Every rank contributes its rank; after all_reduce each holds 0 + 1 + ... + (P-1)."""
    t = torch.full((n,), float(rank()), device=device())
    dist.all_reduce(t)
    expected = world_size() * (world_size() - 1) / 2
    assert torch.all(t == expected), f"rank {rank()}: got {t.tolist()}, expected {expected}"
    print(f"rank {rank()} of {world_size()} on {device()}: all_reduce gave {t[0].item():g}")
    return t.sum().item()


if __name__ == "__main__":
    print(launch(main, world_size=4))
