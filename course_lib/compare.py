"""Single-process references, and parameter-by-parameter comparison against them.

A distributed run is right when it matches plain training of the same seeded model on the
whole batch, to within rounding. These helpers train that reference and say precisely where
two models differ: which parameter, by how much, against which tolerance.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn

Tensors = nn.Module | Mapping[str, torch.Tensor]


def train(
    model: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    optimizer: torch.optim.Optimizer,
) -> list[float]:
    """Plain single-process training, one optimizer step per batch; returns the losses."""
    losses = []
    for x, y in batches:
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _named(tensors: Tensors) -> dict[str, torch.Tensor]:
    if isinstance(tensors, nn.Module):
        return {name: p.detach() for name, p in tensors.named_parameters()}
    return {name: t.detach() for name, t in tensors.items()}


def errors(actual: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    """(max absolute error, max relative error) of `actual` against `expected`."""
    diff = (actual.double() - expected.double()).abs()
    if diff.numel() == 0:
        return 0.0, 0.0
    rel = diff / expected.double().abs().clamp_min(torch.finfo(torch.float64).tiny)
    return diff.max().item(), rel.max().item()


def find_mismatch(actual: Tensors, expected: Tensors, *, rtol: float, atol: float) -> str | None:
    """Describe the first parameter where |actual - expected| > atol + rtol * |expected|,
    or return None when all match (names, shapes and values)."""
    got, want = _named(actual), _named(expected)
    if got.keys() != want.keys():
        missing, extra = sorted(want.keys() - got.keys()), sorted(got.keys() - want.keys())
        return f"parameter names differ: missing {missing}, unexpected {extra}"
    for name, reference in want.items():
        value = got[name]
        if value.shape != reference.shape:
            return f"{name!r} has shape {tuple(value.shape)}, expected {tuple(reference.shape)}"
        value = value.to(reference.device)
        if value.dtype != reference.dtype:
            return f"{name!r} has dtype {value.dtype}, expected {reference.dtype}"
        bad = (value - reference).abs() > atol + rtol * reference.abs()
        bad |= value.isnan() != reference.isnan()
        if bad.any():
            max_abs, max_rel = errors(value, reference)
            where = tuple(int(i) for i in bad.nonzero()[0])
            got_value, want_value = value[where].item(), reference[where].item()
            return (
                f"{name!r} differs: max abs error {max_abs:.3g}, max rel error {max_rel:.3g} "
                f"(allowed atol={atol:g} + rtol={rtol:g} * |expected|); first bad element at "
                f"index {where}: got {got_value:.10g}, expected {want_value:.10g}"
            )
    return None


def assert_same_parameters(
    actual: Tensors, expected: Tensors, *, rtol: float, atol: float, context: str = ""
) -> None:
    """Raise AssertionError naming the parameter and error if the two do not match."""
    __tracebackhide__ = True
    problem = find_mismatch(actual, expected, rtol=rtol, atol=atol)
    if problem is not None:
        raise AssertionError(f"{context}: {problem}" if context else problem)


def error_table(actual: Tensors, expected: Tensors) -> str:
    """Per-parameter max abs and rel error, as a small table for a notebook."""
    got, want = _named(actual), _named(expected)
    width = max(len(name) for name in want)
    rows = [f"{'parameter':<{width}}  {'max abs err':>12}  {'max rel err':>12}"]
    for name, reference in want.items():
        max_abs, max_rel = errors(got[name].to(reference.device), reference)
        rows.append(f"{name:<{width}}  {max_abs:>12.3g}  {max_rel:>12.3g}")
    return "\n".join(rows)
