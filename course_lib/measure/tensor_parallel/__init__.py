"""What lecture 9 measures about tensor parallelism, and how it shows it.

    runs = launch(run_all_layers, world_size=2)        # every layer against its dense original
    print(layer_table(runs[0], tokens, hidden, 2))     # errors, and bytes against the formula
    run_torch_mlp()                                    # torch's parallelize_module beside ours
    activation_table(GPT3_175B)                        # GB of activations per GPU, by TP degree
    link_table(GPT3_175B, t, p, links, flops_per_s)    # TP against PP traffic per micro-batch
    check_tp_over_pp(tp_over_pp)                       # an exercise: right, or a hint
    check_block_all_reduces(block_all_reduces, runs)   # a prediction, against the counts

By what a reader looks for:

    layers.py        each layer on ranks against its dense original, its all-reduces and bytes
                     against the formula; torch's tensor parallelism beside ours; f and g
    activations.py   activation memory per GPU by TP degree, and the MLP's saved bytes
    links.py         why TP stays inside a node and PP crosses nodes, per link
    exercises.py     the checks of the lecture's exercises (`check_f_and_g_backward`,
                     `check_head_loss_backward`, `check_row_backward_all_reduces`,
                     `check_block_all_reduces`, `check_tp_over_pp`), whose expected values
                     and whys the notebook does not show

Import from `course_lib.measure.tensor_parallel` itself: every name is one name here. The
layers are in `course_lib.tensor_parallel`, the formulas in `course_lib.costs`.
"""

from course_lib.measure.tensor_parallel.activations import (
    VARIANTS,
    activation_table,
    measure_mlp_saved,
    mlp_saved_formula,
    plot_activation_memory,
)
from course_lib.measure.tensor_parallel.exercises import (
    check_block_all_reduces,
    check_f_and_g_backward,
    check_head_loss_backward,
    check_row_backward_all_reduces,
    check_tp_over_pp,
)
from course_lib.measure.tensor_parallel.layers import (
    ALL_REDUCES,
    LAYERS,
    LayerRun,
    comm_formula,
    f_and_g_all_reduces,
    layer_table,
    run_against_dense,
    run_all_layers,
    run_torch_mlp,
    torch_parallel_mlp,
)
from course_lib.measure.tensor_parallel.links import link_table

__all__ = [
    "ALL_REDUCES",
    "LAYERS",
    "VARIANTS",
    "LayerRun",
    "activation_table",
    "check_block_all_reduces",
    "check_f_and_g_backward",
    "check_head_loss_backward",
    "check_row_backward_all_reduces",
    "check_tp_over_pp",
    "comm_formula",
    "f_and_g_all_reduces",
    "layer_table",
    "link_table",
    "measure_mlp_saved",
    "mlp_saved_formula",
    "plot_activation_memory",
    "run_against_dense",
    "run_all_layers",
    "run_torch_mlp",
    "torch_parallel_mlp",
]
