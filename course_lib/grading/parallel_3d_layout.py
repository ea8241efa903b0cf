"""How the capstone's DP x TP grid lays out ranks and TinyGPT's parameters.

`_partners` is the grid's rule (TP groups are blocks of consecutive ranks, DP groups take the
rank at the same position in each block); `tp_shard` is a TP rank's piece of a dense
parameter, as Assignment 9 defines it, and `gather_dense` puts one TP group's pieces back.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from course_lib import models

CONFIG = models.GPTConfig()  # the small TinyGPT: 2 blocks, d_model 32, 4 heads

# How Assignment 9 splits a dense parameter over the TP ranks, by its name in TinyGPT:
# column-parallel (rows of the weight and the bias; qkv as three stacked blocks), row-parallel
# (columns of the weight; the bias is whole). Every other parameter is replicated.
COLUMN = re.compile(r"^blocks\.\d+\.(attn\.qkv|mlp\.fc)\.(weight|bias)$")
ROW = re.compile(r"^blocks\.\d+\.(attn|mlp)\.proj\.weight$")


def tp_shard(name: str, dense: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """TP rank `tp_rank`'s piece of TinyGPT's parameter `name` (or its gradient)."""
    if COLUMN.match(name):
        parts = 3 if ".qkv." in name else 1  # q, k and v each split by heads
        blocks = dense.chunk(parts, dim=0)
        width = blocks[0].shape[0] // tp_size
        return torch.cat([b[tp_rank * width : (tp_rank + 1) * width] for b in blocks], dim=0)
    if ROW.match(name):
        width = dense.shape[1] // tp_size
        return dense[:, tp_rank * width : (tp_rank + 1) * width]
    return dense


def tp_shards(state: Mapping[str, torch.Tensor], tp_rank: int, tp_size: int) -> dict:
    return {name: tp_shard(name, t, tp_rank, tp_size) for name, t in state.items()}


def gather_dense(shards: list[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The dense TinyGPT state from the shards of one TP group, in TP-rank order: the inverse
    of `tp_shard`."""
    out = {}
    for name, first in shards[0].items():
        pieces = [s[name] for s in shards]
        if COLUMN.match(name):
            parts = 3 if ".qkv." in name else 1
            blocks = [p.chunk(parts, dim=0) for p in pieces]
            out[name] = torch.cat([b[i] for i in range(parts) for b in blocks], dim=0)
        elif ROW.match(name):
            out[name] = torch.cat(pieces, dim=1)
        else:
            out[name] = first
    return out


def _partners(world: int, tp_size: int, r: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Rank r's TP partners (the ranks of its block of tp_size consecutive ranks) and DP
    partners (the ranks at its position in every block), as the grid's rule defines them."""
    tp = tuple(s for s in range(world) if s // tp_size == r // tp_size)
    dp = tuple(s for s in range(world) if s % tp_size == r % tp_size)
    return tp, dp
