"""What lecture 6 measures beyond the byte counts of `course_lib.memory`: a transformer layer
built as Korthikanti et al. count it, against sbh(34 + 5as/h), and mixed precision as
frameworks run it (autocast, fp32 master weights, fp16 loss scaling with skipped steps).

    block = PaperBlock(h=64, a=4)                      # 16-bit, dropout, fused mask-softmax
    layer_activations(block, s=128, b=2).live_bytes    # bytes saved for backward, one layer
    rows = activation_sweep(SWEEP); activation_table(rows); plot_activation_sweep(rows)
    split = sequence_split(activations, config, [16, 64], batch=4); sequence_table(split)
    autocast_memory(model, optimizer, lambda m: lm_loss(m(x), y))  # 16-bit copies, fp32 rest
    losses = train_losses(model, optimizer, steps=30, autocast=torch.bfloat16)
    log = scaled_training(model, LossScaler(2.0**30, growth_interval=3), steps=12)
    check_sgd_budget(sgd_bytes_per_parameter, gpus_for_13B)   # an exercise, checked

By what a reader looks for:

    activations.py      saved activations against the sequence length, `PaperBlock` and the
                        course's block against the formula, the sweep over s, b, h, a
    mixed_precision.py  autocast's bytes, 16-bit training losses, fp16 loss scaling
    exercises.py        the lecture's exercises and predictions, their expected values and
                        whys computed off the page

Import from `course_lib.measure.memory` itself: every name is one name here.
"""

from course_lib.measure.memory.activations import (
    BASE,
    SWEEP,
    VALUES,
    LayerRow,
    PaperBlock,
    SequenceSplit,
    activation_sweep,
    activation_table,
    course_block,
    layer_activations,
    plot_activation_sweep,
    plot_sequence_split,
    records_table,
    sequence_split,
    sequence_table,
)
from course_lib.measure.memory.exercises import (
    check_course_vs_formula,
    check_first_steps,
    check_s_part_overtakes,
    check_sgd_budget,
    check_smallest_peak,
)
from course_lib.measure.memory.mixed_precision import (
    SMALL_GPT,
    LossScaler,
    ScaledStep,
    autocast_memory,
    lm_batches,
    plot_losses,
    scaled_training,
    scaling_table,
    train_losses,
)

__all__ = [
    "BASE",
    "SMALL_GPT",
    "SWEEP",
    "VALUES",
    "LayerRow",
    "LossScaler",
    "PaperBlock",
    "ScaledStep",
    "SequenceSplit",
    "activation_sweep",
    "activation_table",
    "autocast_memory",
    "check_course_vs_formula",
    "check_first_steps",
    "check_s_part_overtakes",
    "check_sgd_budget",
    "check_smallest_peak",
    "course_block",
    "layer_activations",
    "lm_batches",
    "plot_activation_sweep",
    "plot_losses",
    "plot_sequence_split",
    "records_table",
    "scaled_training",
    "scaling_table",
    "sequence_split",
    "sequence_table",
    "train_losses",
]
