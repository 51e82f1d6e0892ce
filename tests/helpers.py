"""Shared test helpers: run a model with and without recompute and compare."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch


def grads_of(model: torch.nn.Module, *inputs: torch.Tensor) -> list[torch.Tensor]:
    """Gradients of every parameter and every input that requires grad, in a fixed order."""
    out = [p.grad.clone() if p.grad is not None else None for p in model.parameters()]
    return out + [x.grad.clone() for x in inputs if x.requires_grad]


def step_grads(model: torch.nn.Module, forward: Callable, inputs: list[torch.Tensor],
               seed: int = 1) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Run forward+backward on a deep copy of ``model``; return its grads and the loss."""
    model = copy.deepcopy(model)
    xs = [x.detach().clone().requires_grad_(x.requires_grad) for x in inputs]
    torch.manual_seed(seed)
    loss = forward(model, *xs)
    loss.backward()
    return grads_of(model, *xs), loss.detach()


def assert_same(a: list, b: list) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert (x is None) == (y is None), i
        if x is not None:
            assert torch.equal(x, y), f"tensor {i} differs: max abs diff {(x - y).abs().max()}"
