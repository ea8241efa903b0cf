"""Assignment 7's cheats (each scores 0 on its part) and right answers written differently
(full marks). Their sources are in `a07_zero_stage12.py` (ZeRO-1 and ZeRO-2),
`a07_zero_comm.py` (what ZeRO-1 takes from other ranks: samples, full gradients, the whole
batch; and right answers that communicate differently) and `a07_zero_stage3.py` (ZeRO-3)."""

from __future__ import annotations

from tests.cheats import Alternative, Cheat
from tests.cheats.a07_zero_comm import (
    ZERO1_ALL_REDUCE,
    ZERO1_FLAT_RING,
    ZERO1_GATHERS_FULL_GRADIENTS,
    ZERO1_GATHERS_SAMPLES,
    ZERO1_GATHERS_SAMPLES_AS_FLOATS,
    ZERO1_GATHERS_SAMPLES_UNREPORTED,
    ZERO1_WHOLE_BATCH_IN_SIGHT,
)
from tests.cheats.a07_zero_stage3 import (
    ZERO3_BUFFERS_MADE_ONCE,
    ZERO3_COUNTER_FORGED,
    ZERO3_GATHER_INTO_A_LIST,
    ZERO3_KEEPS_FULL,
)
from tests.cheats.a07_zero_stage12 import (
    FULL_STATE_ZERO1,
    PATCH_FIND_MISMATCH,
    ZERO1_COPIED_PARAM_GROUPS,
    ZERO1_PARAM_GROUPS_ATTRIBUTE,
    ZERO2_ADD_IN_PLACE,
    ZERO2_BUFFERS_MADE_BEFORE,
    ZERO2_ONE_BUFFER,
    ZERO2_OVERWRITES,
    ZERO2_PARENT_STEP,
    ZERO2_SHARDS_AT_THE_END,
)

CHEATS = [
    Cheat(
        "ZeRO-1 without sharding",
        "zero1",
        FULL_STATE_ZERO1,
        frozenset({"test_zero1", "test_zero2"}),
    ),  # ZeRO-2 builds on ZeRO-1
    Cheat(
        "ZeRO-3 keeping the full weights gathered",
        "zero3",
        ZERO3_KEEPS_FULL,
        frozenset({"test_zero3", "test_zero3_peak"}),  # Part 4 measures the same shard_module
    ),
    Cheat("ZeRO-2 that is ZeRO-1", "zero2", ZERO2_PARENT_STEP, frozenset({"test_zero2"})),
    Cheat(
        "ZeRO-2 overwriting the gradient shard on a second backward",
        "zero2",
        ZERO2_OVERWRITES,
        frozenset({"test_zero2"}),
    ),
    Cheat(
        "ZeRO-2 keeping every full gradient until the end of backward",
        "zero2",
        ZERO2_SHARDS_AT_THE_END,
        frozenset({"test_zero2"}),
    ),
    Cheat(
        "ZeRO-2 copying full gradients into buffers made beforehand",
        "zero2",
        ZERO2_BUFFERS_MADE_BEFORE,
        frozenset({"test_zero2"}),
    ),
    Cheat(  # ZeRO-2 inherits param_groups
        "ZeRO-1 whose param_groups is a copy",
        "zero1",
        ZERO1_COPIED_PARAM_GROUPS,
        frozenset({"test_zero1", "test_zero2"}),
    ),
    Cheat(
        "ZeRO-3 gathering into full buffers made once",
        "zero3",
        ZERO3_BUFFERS_MADE_ONCE,
        frozenset({"test_zero3", "test_zero3_peak"}),
    ),
    # A module-level patch runs on every rank before every part: all four score 0.
    Cheat(
        "patching course_lib.compare.find_mismatch",
        "zero2",
        PATCH_FIND_MISMATCH,
        frozenset({"test_zero1", "test_zero2", "test_zero3", "test_zero3_peak"}),
        alone=True,
    ),
    Cheat(
        "ZeRO-1 averaging nothing: the whole batch found on the heap or regenerated from the "
        "seed up the stack",
        "zero1",
        ZERO1_WHOLE_BATCH_IN_SIGHT,
        frozenset({"test_zero1"}),
    ),
    Cheat(
        "ZeRO-3 gathering nothing in backward, the gathers booked in the rank's counters",
        "zero3",
        ZERO3_COUNTER_FORGED,
        frozenset({"test_zero3"}),
    ),
    Cheat(
        "ZeRO-1 all-gathering every rank's samples and computing the full gradient itself",
        "zero1",
        ZERO1_GATHERS_SAMPLES,
        frozenset({"test_zero1"}),
    ),
    Cheat(
        "ZeRO-1 all-gathering every rank's samples as float64",
        "zero1",
        ZERO1_GATHERS_SAMPLES_AS_FLOATS,
        frozenset({"test_zero1"}),
    ),
    Cheat(
        "ZeRO-1 all-gathering every rank's samples on the inner gloo group, unreported",
        "zero1",
        ZERO1_GATHERS_SAMPLES_UNREPORTED,
        frozenset({"test_zero1"}),
    ),
    Cheat(
        "ZeRO-1 all-gathering the full gradients",
        "zero1",
        ZERO1_GATHERS_FULL_GRADIENTS,
        frozenset({"test_zero1"}),
    ),
]


ALTERNATIVES = [
    Alternative("ZeRO-2 accumulating with add_", "zero2", ZERO2_ADD_IN_PLACE),
    Alternative("ZeRO-2 with one buffer reused from hook to hook", "zero2", ZERO2_ONE_BUFFER),
    Alternative("ZeRO-1 with param_groups an attribute", "zero1", ZERO1_PARAM_GROUPS_ATTRIBUTE),
    Alternative(
        "ZeRO-3 gathering into a list and concatenating", "zero3", ZERO3_GATHER_INTO_A_LIST
    ),
    Alternative("ZeRO-1 all-reducing the gradients", "zero1", ZERO1_ALL_REDUCE),
    # ZeRO-2's solution subclasses ZeRO-1's and uses its per-parameter `shards`: a student
    # with one flat bucket writes ZeRO-2 on it instead (tests/test_grading_zero_comm.py checks
    # this ZeRO-1 alone).
    Alternative(
        "ZeRO-1 with one flat bucket and rings of sends",
        "zero1",
        ZERO1_FLAT_RING,
        reworked_by=frozenset({"test_zero2"}),
    ),
]
