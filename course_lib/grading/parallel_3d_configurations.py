"""Memory and communication per rank of a DP x TP configuration, for the notebook.

`measure_configuration` runs one AdamW step with the student's code and measures what rank 0
held and sent; `formula` says what it should be; `configuration_table` shows both.
"""

from __future__ import annotations

from dataclasses import dataclass

from course_lib import models
from course_lib.comm import CommCounter
from course_lib.costs import all_reduce_bytes, tp_layer_bytes
from course_lib.grading.parallel_3d_layout import COLUMN, CONFIG, ROW
from course_lib.grading.parallel_3d_rank import Run2D
from course_lib.grading.parallel_3d_recording import CollectiveLog, group_ranks
from course_lib.grading.training import make_optimizer
from course_lib.launch import launch
from course_lib.memory import storage_bytes
from course_lib.runtime import world_size


@dataclass(frozen=True)
class Measured:
    """What rank 0 held and sent in one AdamW step (float32) of a DP x TP configuration."""

    dp: int
    tp: int
    params: int
    grads: int
    optimizer_state: int
    tp_sent: int  # bytes sent in TP-group collectives (CommCounter's ring model)
    dp_sent: int  # bytes sent in DP-group collectives
    total_sent: int  # everything CommCounter saw


def _measure_on_rank(make_groups, model_2d, train_step, tp_size: int, batch_size: int):
    tp_group, dp_group = make_groups(tp_size)
    model = model_2d(models.TinyGPT(CONFIG, seed=0), tp_group, dp_group)
    optimizer = make_optimizer("adamw", model.parameters())
    x, y = Run2D(batch_size=batch_size).batches()[0]
    tp_ranks, dp_ranks = group_ranks(tp_group), group_ranks(dp_group)
    with CommCounter() as counter, CollectiveLog() as log:
        train_step(model, optimizer, x, y, dp_group)
    # AdamW's two moments; its 0-d step counters (one per tensor, not per parameter) are left out
    state = [t for s in optimizer.state.values() for t in s.values() if t.dim() > 0]
    return Measured(
        dp=world_size() // tp_size,
        tp=tp_size,
        params=storage_bytes(model.parameters()),
        grads=storage_bytes(p.grad for p in model.parameters() if p.grad is not None),
        optimizer_state=storage_bytes(state),
        tp_sent=sum(c.sent for c in log.calls if c.ranks == tp_ranks and len(tp_ranks) > 1),
        dp_sent=sum(c.sent for c in log.calls if c.ranks == dp_ranks and len(dp_ranks) > 1),
        total_sent=counter.bytes_sent,
    )


def measure_configuration(
    make_groups, model_2d, train_step, tp_size: int, world: int = 4, batch_size: int = 8
) -> Measured:
    """Run one AdamW step of TinyGPT on `world` ranks with TP size `tp_size`; rank 0's
    bytes held and sent."""
    return launch(
        _measure_on_rank,
        make_groups,
        model_2d,
        train_step,
        tp_size,
        batch_size,
        world_size=world,
        timeout=60,
    )[0]


def split_counts(config: models.GPTConfig = CONFIG) -> tuple[int, int]:
    """(parameters split across TP ranks, parameters every rank holds whole) of TinyGPT."""
    dense = models.TinyGPT(config)
    split = sum(p.numel() for n, p in dense.named_parameters() if COLUMN.match(n) or ROW.match(n))
    return split, models.count_parameters(dense) - split


def formula(
    dp: int, tp: int, batch_size: int = 8, element_size: int = 4, config: models.GPTConfig = CONFIG
) -> dict[str, float]:
    """Bytes per rank by formula: parameters N_rep + N_split/t (gradients the same, AdamW's
    state twice that); TP sends 4 all-reduces per block of a (B/d) x s x h activation, DP one
    all-reduce of the rank's gradients, each 2(P-1)/P of its size in a ring of P."""
    split, replicated = split_counts(config)
    held = element_size * (replicated + split / tp)
    activation = batch_size / dp * config.seq_len * config.d_model * element_size
    tp_sent = config.n_layers * tp_layer_bytes(activation, tp)
    dp_sent = all_reduce_bytes(held, dp)
    return {
        "params": held,
        "grads": held,
        "optimizer_state": 2 * held,
        "tp_sent": tp_sent,
        "dp_sent": dp_sent,
        "total_sent": tp_sent + dp_sent,
    }


ROWS = {  # field of Measured: its label in the table
    "params": "parameters",
    "grads": "gradients",
    "optimizer_state": "AdamW state",
    "tp_sent": "sent in TP group",
    "dp_sent": "sent in DP group",
    "total_sent": "sent in total",
}


def configuration_table(runs: list[Measured], batch_size: int = 8) -> str:
    """Bytes rank 0 held and sent per step, "measured / formula", one column per layout."""
    width = 22
    rows = [
        f"{'bytes, rank 0':<18}" + "".join(f"{f'DP x TP = {m.dp} x {m.tp}':>{width}}" for m in runs)
    ]
    rows.append(f"{'':<18}" + f"{'measured / formula':>{width}}" * len(runs))
    formulas = [formula(m.dp, m.tp, batch_size) for m in runs]
    for kind, label in ROWS.items():
        cells = [
            f"{getattr(m, kind):,} / {f[kind]:,.0f}" for m, f in zip(runs, formulas, strict=True)
        ]
        rows.append(f"{label:<18}" + "".join(f"{c:>{width}}" for c in cells))
    return "\n".join(rows)
