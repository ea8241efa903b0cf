"""Assignment 2's cases, drawn and solved in the checking process: every rank's inputs, and
what torch.distributed's collective leaves on each rank.

The ranks that run the student's code receive only their own inputs (`PerRank`), never the
others' nor the result: with nothing on a rank to copy, a right answer must come from the
messages. The inputs are drawn from a secret seed chosen afresh by each check, so a rank
cannot regenerate the others' from its own either.

    draw(kind, case, secret)       every rank's inputs for one case
    reference(kind, case, inputs)  what torch's collective gives each rank
"""

from __future__ import annotations

import torch

from course_lib.grading.collectives_ranks import Case

INT64_LIMIT = 2**58  # int64 inputs reach far past 2**53, where float64 stops being exact


def _random(case: Case, generator: torch.Generator) -> torch.Tensor:
    if case.dtype.is_floating_point:
        return torch.randn(case.shape, generator=generator, dtype=case.dtype)
    return torch.randint(
        -INT64_LIMIT, INT64_LIMIT, case.shape, generator=generator, dtype=case.dtype
    )


def draw(kind: str, case: Case, secret: int) -> list[dict]:
    """Every rank's inputs for one case: what the student's collective is called with. For
    all-gather and reduce-scatter, the outputs the caller passes hold garbage to begin with
    (torch overwrites them)."""
    generator = torch.Generator().manual_seed(secret ^ (1_000_003 * case.seed))
    ranks = []
    for _ in range(case.world_size):
        if kind == "all_gather":
            given = {
                "tensor": _random(case, generator),
                "tensor_list": [_random(case, generator) for _ in range(case.world_size)],
            }
        elif kind == "reduce_scatter":
            given = {
                "input_list": [_random(case, generator) for _ in range(case.world_size)],
                "output": _random(case, generator),
            }
        else:
            given = {"tensor": _random(case, generator)}
        ranks.append(given)
    return ranks


def _sum(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The exact sum for int64; for floats, in float64 and then rounded once, which is within
    any summation order's rounding of what torch's collective gives."""
    if not tensors[0].dtype.is_floating_point:
        return torch.stack(tensors).sum(0)
    return torch.stack([t.double() for t in tensors]).sum(0).to(tensors[0].dtype)


def reference(kind: str, case: Case, inputs: list[dict]) -> list[dict]:
    """Per rank, the tensors torch.distributed's `kind` leaves there (by name, as the ranks
    report them): a reduce's other ranks are left out, as torch leaves them unspecified."""
    p = case.world_size
    if kind == "broadcast":
        return [{"tensor": inputs[case.root]["tensor"]} for _ in range(p)]
    if kind == "all_reduce":
        total = _sum([given["tensor"] for given in inputs])
        return [{"tensor": total} for _ in range(p)]
    if kind == "reduce":
        total = _sum([given["tensor"] for given in inputs])
        return [{"tensor": total} if r == case.root else {} for r in range(p)]
    if kind == "all_gather":
        gathered = {f"tensor_list[{i}]": given["tensor"] for i, given in enumerate(inputs)}
        return [dict(gathered) for _ in range(p)]
    if kind == "reduce_scatter":
        return [{"output": _sum([given["input_list"][r] for given in inputs])} for r in range(p)]
    raise ValueError(kind)
