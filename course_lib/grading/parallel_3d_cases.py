"""Part of check_2d_training (grading/parallel_3d.py): the weights and batches, drawn in the
checking process, what each rank of the DP x TP grid is given of them, and the reference.

Every call of the check draws a new secret (`_harness.new_secret`), and from it the initial
weights and the global batches; none of it, nor the seeds, ever reaches a rank. A rank is
given (`PerRank`) only what a rank of the grid holds:

- the dense TinyGPT's state with everything outside its TP shard zeroed (`tp_shard`, as
  Assignment 9 defines it): its 2-D model is built from its shard alone, so the other TP
  ranks' outputs can only come from the messages;
- per step, a global batch in which only its DP group's rows (`data.shard`) are real; the
  other rows are noise drawn for that rank alone. Right code trains on its shard and never
  notices; code that trains every rank on the whole batch trains on noise, and the other DP
  groups' gradients can only come from the messages.

The reference, single-process SGD on the real global batches, is trained in the checking
process (parallel_3d_judge), never on a rank.

    draw()                        a new secret draw of weights, batches and noise
    initial(drawn)                the dense initial state (checking process only)
    global_batches(run, drawn)    the real global batches (checking process only)
    given(run, drawn, world)      each rank's share of it (a `PerRank` argument)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from course_lib import data, models
from course_lib.calls import PerRank
from course_lib.grading._harness import new_secret
from course_lib.grading.parallel_3d_layout import COLUMN, CONFIG, ROW, gather_dense, tp_shards
from course_lib.grading.parallel_3d_rank import DTYPE, Run2D


@dataclass(frozen=True)
class Drawn:
    """One call's draw: the seeds of the initial weights, of the tokens and order of the
    global batches, and of the noise around each rank's real rows."""

    weights: int
    tokens: int
    order: int
    noise: int


def draw() -> Drawn:
    """Weights, batches and noise from a secret no rank ever sees (new for every call)."""
    g = torch.Generator().manual_seed(new_secret())
    return Drawn(*(int(torch.randint(2**62, (), generator=g)) for _ in range(4)))


def initial(drawn: Drawn) -> dict[str, torch.Tensor]:
    """The dense TinyGPT every rank's shard is cut from, and the reference starts from."""
    model = models.TinyGPT(CONFIG, seed=drawn.weights, dtype=DTYPE)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def global_batches(run: Run2D, drawn: Drawn) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The real global batches of a draw, as `Run2D.batches` cuts its seed's."""
    c = CONFIG
    x, y = data.tokens(4 * run.batch_size, c.seq_len, c.vocab_size, seed=drawn.tokens)
    return data.batches(x, y, run.batch_size, run.steps, seed=drawn.order)


def zeroed_outside(dense: dict[str, torch.Tensor], tp_rank: int, tp_size: int) -> dict:
    """The dense state with every TP shard but `tp_rank`'s zeroed: what a TP rank holds, in
    the dense layout GPT2D takes."""
    mine = tp_shards(dense, tp_rank, tp_size)
    pieces = [
        mine if t == tp_rank else {n: torch.zeros_like(s) for n, s in mine.items()}
        for t in range(tp_size)
    ]
    whole = gather_dense(pieces)  # takes replicated parameters from the first piece
    return {
        n: (whole[n] if COLUMN.match(n) or ROW.match(n) else t).clone() for n, t in mine.items()
    }


def given(run: Run2D, drawn: Drawn, world: int) -> PerRank:
    """Per rank: its zeroed-outside-its-shard weights and, per step, a global batch whose
    rows of its DP group's shard are real and the rest noise drawn for it alone."""
    tp = run.tp_size
    dp = world // tp
    dense, batches = initial(drawn), global_batches(run, drawn)
    noise = torch.Generator().manual_seed(drawn.noise)
    out = []
    for r in range(world):
        mine = []
        for x, y in batches:
            nx = torch.randint(CONFIG.vocab_size, x.shape, generator=noise, dtype=x.dtype)
            ny = torch.randint(CONFIG.vocab_size, y.shape, generator=noise, dtype=y.dtype)
            for noisy, real in ((nx, x), (ny, y)):
                data.shard(noisy, r // tp, dp).copy_(data.shard(real, r // tp, dp))
            mine.append((nx, ny))
        out.append({"weights": zeroed_outside(dense, r % tp, tp), "batches": mine})
    return PerRank(out)
