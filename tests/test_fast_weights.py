"""Regions run on weights computed from the parameters: meta-learning's fast weights.

MAML and its kin run a model on weights one inner step away from its parameters,
``torch.func.functional_call(model, {name: p - lr * g}, x)``: every weight a region reads is
a tensor with a history, not a leaf. A reentrant region stops its nested backward at an alias
of each such weight and hands the alias's gradient to the weight (NOTE [Observed reads] in
``_engine/observe.py``). With several of them, the gradients were handed to the wrong weights:
a shape error where shapes differed, and where they did not (two bias-free layers of one
width) the first weight got both gradients and the second none, silently.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call

import remat
from tests._harness import assert_bitwise_equal

MODES = {
    "non-reentrant": {},
    "reentrant": {"use_reentrant": True},
    "output_recompute": {"output_recompute": True},
    "policy": {"policy": remat.save_compute_intensive},
}


class _Net(nn.Module):
    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.pre = nn.Linear(6, 6)
        self.block = nn.Sequential(nn.Linear(6, 6, bias=bias), nn.Tanh(), nn.Linear(6, 6, bias=bias))
        self.post = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(self.block(self.pre(x)))


class _Checkpointed(_Net):
    def __init__(self, bias: bool, **options) -> None:
        super().__init__(bias)
        self.options = options

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(remat.checkpoint(self.block, self.pre(x), **self.options))


def _model(front: str, mode: str, bias: bool) -> nn.Module:
    torch.manual_seed(0)
    if front == "none":
        return _Net(bias)
    if front == "checkpoint":
        return _Checkpointed(bias, use_reentrant=mode == "reentrant")
    net = _Net(bias)
    remat.recompute_module(net.block, **MODES[mode])
    return net


FRONTS = [("mark", mode) for mode in MODES] + [("checkpoint", "non-reentrant"), ("checkpoint", "reentrant")]


def _fast_weights_step(model: nn.Module, second_order: bool) -> list:
    """Two meta-steps: the loss of weights one inner step away; the parameters' gradients."""
    found = []
    for step in range(2):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
        params = dict(model.named_parameters())
        if second_order:  # MAML: the inner step's gradient is differentiated again
            inner = model(x).square().mean()
            grads = torch.autograd.grad(inner, list(params.values()), create_graph=True)
            fast = {k: p - 0.1 * g for (k, p), g in zip(params.items(), grads, strict=True)}
        else:  # weights that are functions of the parameters (a hypernetwork's, a first-order step's)
            fast = {k: p * 1.5 + 0.01 for k, p in params.items()}
        functional_call(model, fast, (2 * x,)).square().mean().backward()
        found += [p.grad.clone() if p.grad is not None else None for p in model.parameters()]
        model.zero_grad(set_to_none=True)
    return found


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize(("front", "mode"), FRONTS)
def test_weights_computed_from_the_parameters_get_their_own_gradients(front, mode, bias):
    """Bitwise as unmarked, every parameter its own gradient; without biases the two layers'
    weights have one shape, where the old code sent both gradients to the first, silently."""
    expected = _fast_weights_step(_model("none", mode, bias), second_order=False)
    assert_bitwise_equal(expected, _fast_weights_step(_model(front, mode, bias), second_order=False))


@pytest.mark.parametrize(("front", "mode"), FRONTS)
def test_maml_second_order_step(front, mode):
    """MAML's outer gradient runs a second backward through the regions: bitwise in the
    saved-tensor implementations; the reentrant one's second backward sums a parameter's
    two contributions in another order (NOTE [Written arguments], last paragraph), so it
    agrees within rounding."""
    expected = _fast_weights_step(_model("none", mode, True), second_order=True)
    got = _fast_weights_step(_model(front, mode, True), second_order=True)
    if mode == "reentrant":
        for a, b in zip(expected, got, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
    else:
        assert_bitwise_equal(expected, got)


class _Generated(nn.Module):
    """Reads two weights a hypernetwork made outside it, bound as plain attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = self.w2 = None
        self.bias = nn.Parameter(torch.zeros(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(torch.tanh(nn.functional.linear(x, self.w1)), self.w2) + self.bias


class _Hyper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.h1, self.h2 = nn.Linear(3, 36), nn.Linear(3, 36)
        self.block, self.post = _Generated(), nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = torch.ones(3)
        self.block.w1, self.block.w2 = self.h1(z).view(6, 6), self.h2(z).view(6, 6)
        return self.post(self.block(x))


@pytest.mark.parametrize("mode", sorted(MODES))
def test_weights_a_hypernetwork_binds_as_attributes(mode):
    """Two same-shaped weights computed outside the region and read as attributes: the
    reentrant region's nested backward stops at each and hands each its own gradient
    (before, the second weight's went to the first, silently). Two steps bitwise."""
    def train(model: nn.Module) -> list:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        found = []
        for step in range(2):
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
            model(x).square().mean().backward()
            found += [p.grad.clone() for p in model.parameters()]
            opt.step()
            opt.zero_grad(set_to_none=True)
        return found

    torch.manual_seed(0)
    plain = _Hyper()
    torch.manual_seed(0)
    marked = _Hyper()
    remat.recompute_module(marked.block, **MODES[mode])
    assert_bitwise_equal(train(plain), train(marked))
