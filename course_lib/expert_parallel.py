"""Expert parallelism: a mixture of experts whose experts live on different ranks (lecture 12).

    moe = MoE(d_model=16, d_ff=32, n_experts=4, k=2, capacity_factor=1.25)  # all experts here
    y, aux = moe(x)              # x: [tokens, d_model]; aux: the load-balancing loss
    ep = ExpertParallelMoE(moe)  # this rank: the router, and experts r*E/P .. (r+1)*E/P - 1
    y_mine, aux = ep(x_mine)     # this rank's tokens: chunk `rank` of the batch, in order
    dist.all_reduce(ep.router.weight.grad)  # after backward: the router saw only its tokens

A mixture-of-experts layer (Shazeer et al., 2017; GShard, Lepikhin et al., 2020; Switch,
Fedus et al., 2022) replaces a transformer's MLP by E MLPs, the experts, and a router that
sends each token to k of them: E times the parameters of one MLP, for the compute of k. The
rules, the same on one process (`MoE`) and on many (`ExpertParallelMoE`):

- **top-k**: the router's probabilities are softmax(x W^T); a token goes to its k most
  probable experts, and expert e's output is weighted by p_e, not renormalised over the k,
  as in Switch Transformer (k = 1, where a renormalised weight would always be 1 and the
  router would get no gradient from the task). GShard and Mixtral renormalise their two.
- **capacity**: expert e takes at most C = ceil(capacity_factor * T k / E) of the T tokens
  (`costs.expert_capacity`), so every expert's batch has a bound known in advance. The
  choices beyond C are **dropped in token order**: the first C tokens of the batch (by
  position) that chose e are kept, whichever of their k choices e was. A dropped choice adds
  nothing, so a token all of whose choices were dropped gets a **zero output**: the residual
  connection around the layer (x + MoE(x)) carries it on unchanged.
- **load balancing** (`load_balancing_loss`): E * sum_e f_e P_e, with f_e the share of the
  T k choices that went to e (before dropping) and P_e the mean probability of e; 1 when the
  router spreads tokens evenly, up to E when it sends them all to one expert.

Under expert parallelism over P ranks, rank r holds a copy of the router, experts r E/P to
(r+1) E/P - 1, and its own T/P tokens (data parallelism for the rest of the model). An
all-gather of each rank's per-expert counts tells every rank where its tokens stand in each
expert's queue, so capacity and dropping are the whole batch's, as on one process. Then an
all-to-all sends each kept token to its expert's rank (dispatch), the experts run, and a
second all-to-all brings their outputs home (combine); backward runs the two in reverse.
The pieces differ in size with the routing: the all-to-all is torch's own `all_to_all_single`
with uneven splits, through `torch.distributed.nn.functional`, whose backward is the same
all-to-all the other way; it runs on gloo, and `CommCounter` counts it by its splits (see
`course_lib.measure.expert_parallel.torch_all_to_all`). The router's gradients are summed
over the ranks after backward by one all-reduce, as in data parallelism.
"""

from __future__ import annotations

import copy
import warnings
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.nn.functional import all_to_all_single

from course_lib import models
from course_lib.costs import expert_capacity

# --- routing --------------------------------------------------------------------------------


class Routing(NamedTuple):
    """Where the tokens of a batch go: probs [T, E]; for each of a token's k choices, most
    probable first, experts [T, k], weights [T, k] (their probabilities) and kept [T, k]
    (within the expert's capacity); and the capacity C itself."""

    probs: torch.Tensor
    experts: torch.Tensor
    weights: torch.Tensor
    kept: torch.Tensor
    capacity: int


def choose(x: torch.Tensor, router_weight: torch.Tensor, k: int):
    """The router: softmax probabilities [T, E] and each token's k most probable experts with
    their probabilities, [T, k] each (ties, which random inputs never produce, as topk has them)."""
    n_experts = router_weight.shape[0]
    if not 1 <= k <= n_experts:
        raise ValueError(f"k = {k}: each token picks between 1 and {n_experts} experts")
    probs = torch.softmax(x @ router_weight.T, dim=-1)
    weights, experts = probs.topk(k, dim=-1)
    return probs, weights, experts


def within_capacity(
    experts: torch.Tensor, n_experts: int, capacity: int, earlier: torch.Tensor | None = None
) -> torch.Tensor:
    """Which choices fit: a token's choice of e is kept if fewer than `capacity` choices of e
    came before it, by token position. `earlier[e]` counts choices of e made before this
    batch's first token (on lower ranks, under expert parallelism)."""
    chose = F.one_hot(experts, n_experts).sum(1)  # [T, E]: 1 where the token chose e
    before = chose.cumsum(0) - chose  # choices of e by earlier tokens of this batch
    if earlier is not None:
        before = before + earlier
    return (before < capacity).gather(1, experts)


def route(x: torch.Tensor, router_weight: torch.Tensor, k: int, capacity_factor: float) -> Routing:
    """Route the whole batch x [T, d] on one process: top-k, then the capacity in token order."""
    probs, weights, experts = choose(x, router_weight, k)
    n_experts = router_weight.shape[0]
    capacity = expert_capacity(x.shape[0], n_experts, k, capacity_factor)
    return Routing(probs, experts, weights, within_capacity(experts, n_experts, capacity), capacity)


def _balance(counts: torch.Tensor, prob_sums: torch.Tensor, tokens: int, k: int) -> torch.Tensor:
    """E * sum_e f_e P_e from the choices of each expert and the sums of its probabilities."""
    return counts.numel() * ((counts / (tokens * k)) * (prob_sums / tokens)).sum()


def load_balancing_loss(probs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """Switch / GShard's auxiliary loss E * sum_e f_e P_e: f_e the share of the T k choices
    that went to expert e (counted, so not differentiable), P_e the mean router probability
    of e (differentiable: its gradient pushes probability away from busy experts)."""
    tokens, n_experts = probs.shape
    counts = F.one_hot(experts, n_experts).sum((0, 1)).to(probs.dtype)
    return _balance(counts, probs.sum(0), tokens, experts.shape[1])


# --- the layer on one process ---------------------------------------------------------------


class MoE(nn.Module):
    """A mixture-of-experts MLP with every expert on this process: the reference that
    `ExpertParallelMoE` must equal. Seeded: the same arguments give the same weights."""

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        n_experts: int,
        k: int = 2,
        capacity_factor: float = 1.25,
        seed: int = 0,
        dtype: torch.dtype = torch.float64,
    ) -> None:
        super().__init__()
        if not 1 <= k <= n_experts:
            raise ValueError(f"k = {k}: each token picks between 1 and {n_experts} experts")
        if not capacity_factor > 0:
            raise ValueError(f"capacity_factor must be > 0, got {capacity_factor!r}")
        self.n_experts, self.k, self.capacity_factor = n_experts, k, capacity_factor
        config = models.GPTConfig(d_model=d_model, d_ff=d_ff)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.router = nn.Linear(d_model, n_experts, bias=False, dtype=dtype)
            self.experts = nn.ModuleList(models.MLPBlock(config, dtype) for _ in range(n_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's output for x [T, d_model] (zero for dropped choices) and the
        load-balancing loss of the batch."""
        _check_tokens(x, self.router.weight.shape[1])
        r = route(x, self.router.weight, self.k, self.capacity_factor)
        y = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            # The expert's kept tokens, in token order; an expert with none still runs (on
            # no rows), so its gradient is zeros, not None, as under expert parallelism.
            token, slot = torch.nonzero((r.experts == e) & r.kept, as_tuple=True)
            y = y.index_add(0, token, r.weights[token, slot, None] * expert(x[token]))
        return y, load_balancing_loss(r.probs, r.experts)


def _check_tokens(x: torch.Tensor, d_model: int) -> None:
    if x.dim() != 2 or x.shape[1] != d_model:
        raise ValueError(
            f"the MoE layer takes tokens as [tokens, d_model={d_model}], got shape "
            f"{tuple(x.shape)}; flatten batch and sequence first: x.reshape(-1, {d_model})"
        )


# --- the all-to-all, with its backward ------------------------------------------------------


def _world(group) -> tuple[int, int]:
    """(ranks, this rank) of the group; (1, 0) without torch.distributed."""
    if not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _exchange(x: torch.Tensor, send: list[int], receive: list[int], group) -> torch.Tensor:
    """Rows send[j] of x (in rank order) go to rank j; returns the rows received, rank 0's
    first. torch's all-to-all, whose backward sends the gradients back the same way."""
    if _world(group)[0] == 1:
        return x.clone()
    out = x.new_empty((sum(receive), *x.shape[1:]))
    with warnings.catch_warnings():
        # torch 2.13 points to its functional collectives instead, which neither CommCounter
        # nor the emulated network sees (they bypass torch.distributed's Python functions).
        warnings.filterwarnings("ignore", "torch.distributed.nn.functional", FutureWarning)
        return all_to_all_single(out, x.contiguous(), receive, send, group=group)


# --- the layer under expert parallelism -----------------------------------------------------


class ExpertParallelMoE(nn.Module):
    """`moe` with its experts spread over the ranks, E/P per rank, each rank taking its own
    tokens: equal to `moe` on the whole batch (the concatenation of the ranks' tokens in rank
    order), output, loss and gradients. The router is replicated and sees only this rank's
    tokens: all-reduce (sum) `router.weight.grad` after backward."""

    def __init__(self, moe: MoE, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        p, me = _world(group)
        if moe.n_experts % p:
            raise ValueError(
                f"ExpertParallelMoE puts E/P experts on each rank: {moe.n_experts} experts "
                f"cannot be split evenly over {p} ranks; use a number of experts divisible "
                f"by the world size"
            )
        self.group, self.k, self.capacity_factor = group, moe.k, moe.capacity_factor
        self.n_experts, self.per_rank = moe.n_experts, moe.n_experts // p
        self.first = me * self.per_rank  # this rank's experts: first, first + 1, ...
        self.router = copy.deepcopy(moe.router)
        mine = range(self.first, self.first + self.per_rank)
        self.experts = nn.ModuleList(copy.deepcopy(moe.experts[e]) for e in mine)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's output for this rank's tokens x [T/P, d_model], and the whole batch's
        load-balancing loss (its gradient flows through this rank's tokens only)."""
        _check_tokens(x, self.router.weight.shape[1])
        p, me = _world(self.group)
        n, k = self.n_experts, self.k
        probs, weights, experts = choose(x, self.router.weight, k)

        # 1. Every rank's choices per expert (and probability sums, for the loss): one small
        # all-gather. From it each rank knows the batch size, the capacity, where its tokens
        # stand in each expert's queue, and how many rows every rank sends to every other.
        # (Counts travel as floats with the sums: exact up to 2^24 choices in float32.)
        mine = torch.stack([F.one_hot(experts, n).sum((0, 1)).to(x.dtype), probs.detach().sum(0)])
        every = mine.unsqueeze(0)
        if p > 1:
            every = torch.empty((p * 2, n), dtype=x.dtype)  # rank j's rows at 2j, 2j + 1
            dist.all_gather_single(every, mine, group=self.group)
            every = every.view(p, 2, n)
        counts, prob_sums = every[:, 0].round().long(), every[:, 1]  # [P, E] each
        tokens = int(counts.sum()) // k
        capacity = expert_capacity(tokens, n, k, self.capacity_factor)
        earlier = counts.cumsum(0) - counts  # choices of e on lower ranks: ahead in e's queue
        kept = within_capacity(experts, n, capacity, earlier[me])
        fits = (capacity - earlier).clamp(min=0).minimum(counts)  # [P, E]: kept, per rank

        # 2. Dispatch: the kept (token, choice) pairs sorted by expert, then by position, so
        # rank j receives its experts' tokens in expert order, each expert's in token order.
        token, slot = kept.nonzero(as_tuple=True)
        order = torch.argsort(experts[token, slot] * x.shape[0] + token)
        token, slot = token[order], slot[order]
        mine_cols = slice(self.first, self.first + self.per_rank)
        send = fits[me].view(p, self.per_rank).sum(1).tolist()  # rows to each rank
        receive = fits[:, mine_cols].sum(1).tolist()  # rows from each rank
        arrived = _exchange(x[token], send, receive, self.group)

        # 3. The experts, each on all its rows from every rank (rank 0's first).
        ids = torch.arange(self.first, self.first + self.per_rank).repeat(p)
        expert_of_row = torch.repeat_interleave(ids, fits[:, mine_cols].flatten())
        rows, outs = [], []
        for i, expert in enumerate(self.experts):
            here = torch.nonzero(expert_of_row == self.first + i).flatten()
            rows.append(here)
            outs.append(expert(arrived[here]))
        done = torch.cat(outs)[torch.cat(rows).argsort()]  # back in the order they arrived

        # 4. Combine: outputs go home, weighted there by their router probabilities.
        back = _exchange(done, receive, send, self.group)
        y = torch.zeros_like(x).index_add(0, token, weights[token, slot, None] * back)

        # The loss of the whole batch: the other ranks' probability sums enter as constants,
        # so backward reaches this rank's router inputs only, and summing the router's
        # gradients over the ranks (an all-reduce) gives the whole batch's gradient.
        others = prob_sums.sum(0) - prob_sums[me]
        aux = _balance(counts.sum(0).to(x.dtype), probs.sum(0) + others, tokens, k)
        return y, aux
