"""Lecture 12's layer and data, and what its router does on one process: tokens per expert,
the choices dropped at each capacity factor, and SGD on the balancing loss alone."""

from __future__ import annotations

import matplotlib.pyplot as plt
import torch

from course_lib.expert_parallel import MoE, load_balancing_loss, route

D_MODEL, D_FF, N_EXPERTS, K = 16, 32, 8, 2


def small_moe(capacity_factor: float = 1.25, n_experts: int = N_EXPERTS, **kw) -> MoE:
    """The lecture's layer: width 16, experts of 32, top-2, seeded (float64)."""
    return MoE(D_MODEL, D_FF, n_experts, K, capacity_factor, **kw)


def batch(n_tokens: int, d_model: int = D_MODEL, seed: int = 1) -> torch.Tensor:
    """The same n_tokens x d_model tokens (float64) wherever it is called."""
    return torch.randn(
        n_tokens, d_model, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)
    )


def balanced(moe: MoE, n_tokens: int) -> torch.Tensor:
    """Make `moe`'s router send token t to experts t, t+1, ... (mod E) and return such tokens:
    every expert gets the same number of tokens from every stretch of E tokens."""
    n, d = moe.n_experts, moe.router.weight.shape[1]
    with torch.no_grad():
        moe.router.weight.copy_(torch.eye(n, d, dtype=moe.router.weight.dtype))
    x = torch.zeros(n_tokens, d, dtype=torch.float64)
    for j in range(moe.k):  # choice j of token t: expert t + j, a little less probable
        x[torch.arange(n_tokens), (torch.arange(n_tokens) + j) % n] = 2.0 - j / moe.k
    return x


# --- routing, on one process ----------------------------------------------------------------


def expert_load(n_tokens: int = 256, capacity_factor: float = 1.0) -> dict:
    """Choices each expert got from the router of `small_moe` on `batch(n_tokens)`, how many
    it kept, and the capacity."""
    moe = small_moe(capacity_factor)
    r = route(batch(n_tokens), moe.router.weight.detach(), moe.k, capacity_factor)
    n = moe.n_experts
    return {
        "chosen": torch.bincount(r.experts.flatten(), minlength=n).tolist(),
        "kept": torch.bincount(r.experts[r.kept], minlength=n).tolist(),
        "capacity": r.capacity,
    }


def plot_expert_load(load: dict):
    """Bars of tokens per expert, kept and dropped, and the capacity as a line."""
    fig, ax = plt.subplots(figsize=(6.5, 3.5))
    experts = range(len(load["chosen"]))
    dropped = [c - k for c, k in zip(load["chosen"], load["kept"], strict=True)]
    ax.bar(experts, load["kept"], label="kept")
    ax.bar(experts, dropped, bottom=load["kept"], color="tab:red", label="dropped")
    ax.axhline(load["capacity"], color="black", linestyle="--", label="capacity C")
    ax.set_xticks(list(experts), [f"expert {e}" for e in experts], fontsize=8)
    ax.set_ylabel("tokens routed to it")
    ax.set_ylim(0, 1.35 * max(load["chosen"]))  # room for the legend above the bars
    ax.set_title("Tokens per expert (top-2 router at initialisation)")
    ax.legend(loc="upper center", ncol=3)
    return fig


def dropped_share(capacity_factors: list[float], n_tokens: int = 256) -> list[float]:
    """Share of the T*k choices dropped, for each capacity factor (`small_moe`'s router)."""
    moe = small_moe()
    x, w = batch(n_tokens), moe.router.weight.detach()
    return [1 - route(x, w, moe.k, cf).kept.double().mean().item() for cf in capacity_factors]


def plot_dropped_share(capacity_factors: list[float], shares: list[float]):
    """The measured dropped share against the capacity factor, and a perfectly even router's."""
    fig, ax = plt.subplots(figsize=(6.5, 3.5))
    ax.plot(capacity_factors, shares, "o-", label="this router")
    even = [max(0.0, 1 - cf) for cf in capacity_factors]
    ax.plot(capacity_factors, even, "--", color="gray", label="a perfectly even router: 1 - factor")
    ax.set_xlabel("capacity factor")
    ax.set_ylabel("share of choices dropped")
    ax.set_title("Dropped tokens against capacity")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return fig


def balance_router(steps: int = 60, lr: float = 1.0, n_tokens: int = 256) -> dict[str, list]:
    """Train `small_moe`'s router by SGD on the load-balancing loss alone, on `batch(n_tokens)`:
    the loss, the share of choices dropped at capacity factor 1 and the tokens per expert,
    before each step."""
    moe = small_moe(capacity_factor=1.0)
    x, weight = batch(n_tokens), moe.router.weight
    optimizer = torch.optim.SGD([weight], lr=lr)
    history: dict[str, list] = {"loss": [], "dropped": [], "chosen": []}
    for _ in range(steps + 1):
        r = route(x, weight, moe.k, 1.0)
        loss = load_balancing_loss(r.probs, r.experts)
        history["loss"].append(loss.item())
        history["dropped"].append(1 - r.kept.double().mean().item())
        history["chosen"].append(torch.bincount(r.experts.flatten(), minlength=N_EXPERTS).tolist())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return history


def plot_balancing(history: dict[str, list]):
    """The dropped share (capacity factor 1) as SGD on the balancing loss alone goes on."""
    fig, ax = plt.subplots(figsize=(6.5, 3))
    ax.plot(history["dropped"], "o-", markersize=3)
    ax.set_xlabel("SGD step on the load-balancing loss")
    ax.set_ylabel("share of choices dropped")
    ax.set_title("The balancing loss evens out the router (capacity factor 1)")
    ax.grid(True, alpha=0.3)
    return fig
