"""An output the caller drops: the parameters reached only from it keep no gradient, as
without the mark (NOTE [Outputs without a gradient] in reentrant.py).

A custom Function's backward is handed zeros for an output that got no gradient, so a
``use_reentrant=True`` region differentiated its re-run against zeros and gave those
parameters a gradient of zeros where the unmarked model leaves ``.grad`` None; AdamW then
moved them (its weight decay applies to every parameter with a gradient), silently. torch's
reentrant checkpoint does the same. Each case trains three steps with AdamW and compares
every gradient (None included) and every parameter bitwise with the unmarked model.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat
from remat._engine import state as _state
from tests.test_leaves_returned import _options as _leaf_options

D = 8


class _TwoResults(nn.Module):
    """``(a(x), b(x))``: the caller uses the first only."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        return torch.tanh(self.a(x)), self.b(x)


class _Net(nn.Module):
    def __init__(self, call) -> None:
        super().__init__()
        self.first, self.block, self.head = nn.Linear(D, D), _TwoResults(), nn.Linear(D, D)
        self.call = call

    def forward(self, x):
        kept, _ = self.call(self.block, self.first(x))
        return self.head(kept)


def _train(front: str | None, options: dict) -> list:
    torch.manual_seed(0)
    call = (lambda block, x: remat.checkpoint(block, x, **options)) if front == "checkpoint" else (
        lambda block, x: block(x))
    net = _Net(call)
    if front == "module":
        remat.recompute_module(net.block, **options)
    elif front == "apply":
        remat.apply(net, where=_TwoResults, **options)
    opt = torch.optim.AdamW(net.parameters(), lr=0.1, weight_decay=0.1)
    seen = []
    for step in range(3):
        x = torch.randn(4, D, generator=torch.Generator().manual_seed(step), requires_grad=True)
        opt.zero_grad(set_to_none=True)
        net(x).pow(2).mean().backward()
        seen += [p.grad for p in net.parameters()] + [x.grad]
        opt.step()
    return seen + [p.detach().clone() for p in net.parameters()]


def _options(mode: str, front: str) -> dict:
    if mode == "output_recompute":
        return {"use_reentrant": False, "output_recompute": True}
    return _leaf_options(mode, front)


@pytest.mark.parametrize("front", ["module", "apply", "checkpoint"])
@pytest.mark.parametrize("mode", ["reentrant", "non-reentrant", "output_recompute", "policy"])
def test_a_dropped_output_leaves_its_parameters_as_unmarked(front, mode):
    if mode == "output_recompute" and front == "checkpoint":
        pytest.skip("remat.checkpoint takes torch's arguments; output_recompute is remat.recompute's")
    expected = _train(None, {})
    got = _train(front, _options(mode, front))
    assert sum(g is None for g in expected) == 6  # block.b's weight and bias, three steps
    for a, b in zip(got, expected, strict=True):
        assert (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


class _Cut(torch.autograd.Function):
    """Sends no gradient back (a custom operator whose input is not differentiable)."""

    @staticmethod
    def forward(ctx, t):
        return t.clone()

    @staticmethod
    def backward(ctx, grad):
        return None


def test_a_reentrant_region_whose_outputs_get_no_gradient_runs_no_re_run():
    block = _TwoResults()
    remat.recompute_module(block, use_reentrant=True)
    x = torch.randn(4, D, requires_grad=True)
    for _ in range(2):  # the first call is watched, the second unwatched
        kept, _ = block(x)
        before = _state.recompute_count()
        (_Cut.apply(kept).sum() + x.sum()).backward()
        assert _state.recompute_count() == before
        assert all(p.grad is None for p in block.parameters())
        assert torch.equal(x.grad, torch.ones_like(x))
        x.grad = None


class _Detached(nn.Module):
    """``(tanh(a(x)), a target computed without grad)``, as an EMA teacher's."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.t = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        with torch.no_grad():
            target = self.t(x).tanh()
        return torch.tanh(self.a(x)), target


@pytest.mark.parametrize("reentrant", [True, False])
def test_an_output_computed_without_grad_changes_no_number(reentrant):
    """A documented limit (the docs' torch page): under ``use_reentrant=True`` it requires grad
    (torch's reentrant checkpoint alike), and nothing reaches anything through it."""
    def train(mark: bool) -> tuple[list, bool]:
        torch.manual_seed(0)
        block, head = _Detached(), nn.Linear(D, D)
        if mark:
            remat.recompute_module(block, use_reentrant=reentrant)
        grads = []
        for step in range(2):
            x = torch.randn(4, D, generator=torch.Generator().manual_seed(step), requires_grad=True)
            pred, target = block(x)
            (head(pred) - target).pow(2).mean().backward()
            grads += [p.grad.clone() if p.grad is not None else None for p in (*block.parameters(), *head.parameters())]
            grads.append(x.grad)
        return grads, target.requires_grad

    (expected, unmarked), (got, marked) = train(False), train(True)
    assert not unmarked and marked == reentrant
    for a, b in zip(got, expected, strict=True):
        assert (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
