"""What training keeps in memory: counted tensor by tensor (lecture 6).

    breakdown = training_memory(model, optimizer)        # weights, gradients, optimizer state
    print(breakdown.table(BYTES_PER_PARAMETER))          # measured bytes/parameter vs formula
    trainer = MixedPrecisionAdamW(model, lr=1e-3)        # bf16 compute, fp32 master + AdamW
    with SavedTensors(exclude=model.parameters()) as saved:
        loss = loss_fn(model(x), y)                      # saved.live_bytes: activations
        loss.backward()                                  # saved.peak_bytes: the high-water mark
    run = measure_chain(chain(36, 64), x, k=6)           # activation checkpointing, k segments
    with CastMemory(model.parameters()) as casts: ...    # the 16-bit weights autocast makes

Bytes are the real bytes of tensor storages, each storage counted once (a view shares its
base's storage), so a number here is what the allocator had to provide, not a formula.

Its files: `counting` (storages, `training_memory`), `mixed_precision`, `activations` (what
autograd saves, `PeakMemory`) and `checkpointing`.
"""

# The formula's bytes per parameter, which `MemoryBreakdown.table` is read against (costs.py).
from course_lib.costs import BYTES_PER_PARAMETER
from course_lib.memory.activations import (
    CastMemory,
    PeakMemory,
    SavedRecord,
    SavedSnapshot,
    SavedTensors,
    attention_share,
    attention_square_bytes,
    saved_by_forward,
    square_bytes,
)
from course_lib.memory.checkpointing import (
    ChainRun,
    chain,
    checkpoint_units,
    checkpointed_forward,
    divisors,
    measure_chain,
    segments,
    time_chain,
    time_forward,
)
from course_lib.memory.counting import (
    GB,
    MemoryBreakdown,
    Row,
    storage_bytes,
    training_memory,
)
from course_lib.memory.mixed_precision import (
    MixedPrecisionAdamW,
    budget,
    budget_table,
)

__all__ = [
    "BYTES_PER_PARAMETER",
    "GB",
    "storage_bytes",
    "Row",
    "MemoryBreakdown",
    "training_memory",
    "MixedPrecisionAdamW",
    "budget",
    "budget_table",
    "SavedRecord",
    "SavedTensors",
    "SavedSnapshot",
    "saved_by_forward",
    "square_bytes",
    "attention_square_bytes",
    "attention_share",
    "PeakMemory",
    "CastMemory",
    "chain",
    "segments",
    "checkpointed_forward",
    "ChainRun",
    "measure_chain",
    "time_chain",
    "time_forward",
    "checkpoint_units",
    "divisors",
]
