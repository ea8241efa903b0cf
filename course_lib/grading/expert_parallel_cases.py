"""Assignment 12's cases, drawn and solved in the checking process: the router, the experts,
the whole batch and the gradient of the output, from a secret seed new for each call of a
check; the layer on one process (its routing, output and gradients); each rank's share.

The ranks that run the student's code receive only their own tokens, their own experts and
the router (`PerRank`), never the other ranks' tokens or experts nor the answer: a right
answer must come from the messages. With the default secret, 0, the same functions build the
layer and batch the notebook's try cells use (`layer`, `inputs`, `kept_rows` are given to
students); a check's secret gives other weights and tokens that no rank can regenerate.

    Case                     one run: world size, tokens, experts, k, capacity factor, sizes
    layer(case, secret)      the router and every expert
    inputs(case, secret)     the whole batch x and the output gradient g
    draw(case, secret)       both, as one dict
    solve(case, drawn)       routing, output and gradients on one process (float64)
    given(case, drawn, r)    what rank r's layer is called with: its tokens, the router, its
                             experts (and its rows of g, for backward)
    routing, reference, dropped, kept_rows   the same, for one case and secret
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from course_lib import models
from course_lib.costs import expert_capacity

PAIR_SPREAD = 0.03  # how far a paired expert's router row is from its twin's (see `layer`)


@dataclass(frozen=True)
class Case:
    """One run of the layer: P ranks, `tokens` in the whole batch, E experts, top-k routing;
    `paired`: experts 2i and 2i + 1 have nearly the same router row (see `layer`). `seed`
    tells cases apart; what they hold comes from it and the check's secret."""

    world_size: int
    tokens: int
    n_experts: int
    k: int
    capacity_factor: float
    seed: int
    d_model: int = 8
    d_ff: int = 12
    paired: bool = False

    def __str__(self) -> str:
        return (
            f"world size {self.world_size}, {self.tokens} tokens, {self.n_experts} experts, "
            f"k={self.k}, capacity_factor {self.capacity_factor:g}, seed {self.seed}"
            + (f", d_model {self.d_model}, paired router" if self.paired else "")
        )


def layer(case: Case, secret: int = 0) -> tuple[nn.Linear, list[nn.Module]]:
    """The router (d_model -> E, no bias) and the E experts (`models.MLPBlock`), float64.
    Router logits of a few units, so that the routing is far from ties and the gate weights
    differ. A paired router gives expert 2i + 1 the row of expert 2i plus 3% of its own: a
    token's two most probable experts are then mostly such a pair, which lives on one rank
    when P divides E / 2."""
    config = models.GPTConfig(d_model=case.d_model, d_ff=case.d_ff)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(secret ^ (1_000 + 7 * case.seed + case.n_experts))
        router = nn.Linear(case.d_model, case.n_experts, bias=False, dtype=torch.float64)
        with torch.no_grad():
            if case.paired:
                router.weight[1::2] = router.weight[0::2] + PAIR_SPREAD * router.weight[1::2]
            router.weight.mul_(3.0)
        experts = [models.MLPBlock(config, torch.float64) for _ in range(case.n_experts)]
    return router, experts


def inputs(case: Case, secret: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch x [tokens, d_model] and the gradient g of the output, float64."""
    seed = secret ^ (10_007 * case.seed + 101 * case.tokens + case.k)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(case.tokens, case.d_model, generator=g, dtype=torch.float64)
    return x, torch.randn(case.tokens, case.d_model, generator=g, dtype=torch.float64)


def draw(case: Case, secret: int) -> dict:
    """Everything one case holds: router, experts, the whole batch x and output gradient g."""
    router, experts = layer(case, secret)
    x, g = inputs(case, secret)
    return {"router": router, "experts": experts, "x": x, "g": g}


def lengths(case: Case) -> list[int]:
    """Tokens on each rank: torch.tensor_split's chunks."""
    return [len(c) for c in torch.arange(case.tokens).tensor_split(case.world_size)]


def expert_ids(case: Case, r: int) -> list[int]:
    """Rank r's experts: r E/P .. (r+1) E/P - 1 (torch.tensor_split's chunk when P does not
    divide E, for the case that must raise)."""
    return torch.arange(case.n_experts).tensor_split(case.world_size)[r].tolist()


def _route(case: Case, drawn: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    probs = torch.softmax(drawn["x"] @ drawn["router"].weight.detach().T, dim=-1)
    gates, chosen = probs.topk(case.k, dim=-1)
    capacity = expert_capacity(case.tokens, case.n_experts, case.k, case.capacity_factor)
    queue = [0] * case.n_experts
    kept = torch.zeros_like(chosen, dtype=torch.bool)
    for t in range(case.tokens):  # token order, whichever of its choices it is
        for j in range(case.k):
            e = int(chosen[t, j])
            kept[t, j] = queue[e] < capacity
            queue[e] += 1
    return chosen, gates, kept


def _kept_rows(case: Case, chosen: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    P, per = case.world_size, case.n_experts // case.world_size
    rows = torch.zeros(P, P, dtype=torch.long)
    for i, tokens in enumerate(torch.arange(case.tokens).tensor_split(P)):
        for e in chosen[tokens][kept[tokens]].tolist():
            rows[i, e // per] += 1
    return rows


def solve(case: Case, drawn: dict) -> dict:
    """The layer on one process over the whole batch, float64, written out here (never the
    lecture's code): the routing (`chosen`, `gates`, `kept`: [T, k] each), `kept_rows`, the
    output, and the gradients of sum(out * g) for x, the router's weight and every expert's
    parameters. `drawn` is left as it was: the ranks get fresh copies of its modules."""
    router, experts = copy.deepcopy((drawn["router"], drawn["experts"]))
    x = drawn["x"].clone().requires_grad_(True)
    chosen, gates, kept = _route(case, drawn)
    probs = torch.softmax(F.linear(x, router.weight), dim=-1)
    out = torch.zeros_like(x)
    for e, expert in enumerate(experts):
        token, _ = torch.nonzero((chosen == e) & kept, as_tuple=True)
        gate = probs[token, e].unsqueeze(1)
        out = out.index_add(0, token, gate * expert(x[token]))
    out.backward(drawn["g"])
    return {
        "chosen": chosen,
        "gates": gates,
        "kept": kept,
        "kept_rows": _kept_rows(case, chosen, kept),
        "out": out.detach(),
        "x_grad": x.grad,
        "router_grad": router.weight.grad,
        "expert_grads": [[p.grad for p in expert.parameters()] for expert in experts],
    }


def given(case: Case, drawn: dict, r: int) -> tuple:
    """Rank r's share: its tokens (chunk r of torch.tensor_split), its rows of the output
    gradient, the router (the same on every rank) and its experts. Nothing else of the batch
    or of the other experts reaches the rank."""
    P = case.world_size
    experts = [drawn["experts"][e] for e in expert_ids(case, r)]
    return (
        drawn["x"].tensor_split(P)[r].clone(),
        drawn["g"].tensor_split(P)[r].clone(),
        drawn["router"],
        experts,
    )


# The same for one case and a secret (0: the notebook's), for tests and the try cells.


def routing(case: Case, secret: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole batch's routing on one process: each token's k experts [T, k], their
    probabilities [T, k], and whether each choice is within its expert's capacity [T, k]."""
    return _route(case, draw(case, secret))


def reference(case: Case, secret: int = 0) -> dict:
    """`solve` of the case's draw: output and gradients of the layer on one process."""
    return solve(case, draw(case, secret))


def dropped(case: Case, secret: int = 0) -> int:
    """Choices over capacity in the case's batch."""
    return int((~routing(case, secret)[2]).sum())


def kept_rows(case: Case, secret: int = 0) -> torch.Tensor:
    """[P, P]: kept choices of rank i's tokens that go to rank j's experts."""
    chosen, _, kept = routing(case, secret)
    return _kept_rows(case, chosen, kept)


__all__ = [
    "Case",
    "draw",
    "dropped",
    "expert_ids",
    "given",
    "inputs",
    "kept_rows",
    "layer",
    "lengths",
    "reference",
    "routing",
    "solve",
]
