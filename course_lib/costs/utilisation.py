"""Utilisation and failures: the FLOPs of training, model FLOPs utilisation, and how often to
checkpoint."""

from __future__ import annotations

import math

# --- utilisation and failures ----------------------------------------------------------------


def training_flops(n_params: float, tokens: float) -> float:
    """FLOPs to train an N-parameter transformer on D tokens, 6ND (Kaplan et al., 2020): per
    token and parameter, 2 in forward (a multiply and an add) and 4 in backward (gradients of
    the inputs and of the weights). N counts the matmul weights (not embedding lookups), and
    attention's scores (12 L s h per token, the 4bs^2h of `compute_seconds`) are left out."""
    return 6 * n_params * tokens


def mfu(model_flops: float, seconds: float, peak_flops_per_s: float, devices: int = 1) -> float:
    """Model FLOPs utilisation (Chowdhery et al., 2022): the model's own FLOPs (6ND, no
    recomputation) done in `seconds`, over what `devices` devices could do at their peak."""
    return model_flops / (seconds * devices * peak_flops_per_s)


def checkpoint_interval(checkpoint_seconds: float, mtbf_seconds: float) -> float:
    """Seconds of training between checkpoints that waste the least time, sqrt(2 C M) for a
    checkpoint stalling training C seconds and a failure every M seconds on average (Young,
    1974): more often and the checkpoints cost more, less often and each failure throws more
    work away (on average half an interval)."""
    return math.sqrt(2 * checkpoint_seconds * mtbf_seconds)
