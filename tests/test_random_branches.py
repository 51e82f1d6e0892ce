"""Draws from torch's generators that decide what a region computes, replayed exactly.

Stochastic depth (skip a residual branch with probability p), a random scale, a random
choice of branch: the draw decides which operators run and what they save, so a re-run
that drew again would compute other gradients. Every way to mark replays torch's
generators as the forward drew them (NOTE [Random state] in ``_engine/rng.py``), so four
steps with different draws train bitwise equal to the unmarked model, both branches taken.
Draws from Python's ``random`` or numpy are not replayed (torch's checkpoint does not either):
the docs' Limits say so.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat
from tests._harness import assert_bitwise_equal


class StochasticBlock(nn.Module):
    """A residual MLP skipped with probability 1/2 (stochastic depth), scaled by a random
    factor when taken, then a branch chosen at random."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)
        self.left, self.right = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.rand(()) < 0.5:  # the residual branch taken
            x = x + self.fc2(torch.tanh(self.fc1(x))) * (1 + torch.rand(()))
        branch = self.left if torch.randint(0, 2, ()).item() else self.right
        return torch.sigmoid(branch(x))


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), StochasticBlock(), StochasticBlock(), nn.Linear(8, 1))


def _mark(model: nn.Sequential, how: str) -> nn.Module:
    """``model`` marked ``how``; returns what to call."""
    blocks = [model[1], model[2]]
    if how == "apply":
        remat.apply(model, where=StochasticBlock)
    elif how in ("plain", "reentrant", "output", "policy"):
        options = {"plain": {}, "reentrant": {"use_reentrant": True}, "output": {"output_recompute": True},
                   "policy": {"policy": remat.save_compute_intensive}}[how]
        for block in blocks:
            remat.recompute_module(block, **options)
    elif how in ("recompute", "checkpoint", "checkpoint_reentrant"):
        call = {"recompute": lambda b, x: remat.recompute(b, x),
                "checkpoint": lambda b, x: remat.checkpoint(b, x, use_reentrant=False),
                "checkpoint_reentrant": lambda b, x: remat.checkpoint(b, x, use_reentrant=True)}[how]

        class Functional(nn.Module):
            def __init__(self, inner: nn.Sequential) -> None:
                super().__init__()
                self.inner = inner

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                x = self.inner[0](x)
                x = call(self.inner[1], x)
                x = call(self.inner[2], x)
                return self.inner[3](x)

        return Functional(model)
    return model


def _train(model: nn.Module, steps: int = 4) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    for step in range(steps):
        torch.manual_seed(100 + step)  # each step draws other branches
        opt.zero_grad(set_to_none=True)
        x.grad = None
        loss = model(x).square().sum()
        loss.backward()
        out += [loss.detach(), x.grad.clone()] + [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        opt.step()
    return out


HOWS = ["apply", "plain", "reentrant", "output", "policy", "recompute", "checkpoint", "checkpoint_reentrant"]


def test_the_draws_take_both_branches():
    """The test would show nothing if every step drew alike: both branches are taken."""
    block, seen = StochasticBlock(), set()
    x = torch.randn(4, 8)
    for step in range(4):
        torch.manual_seed(100 + step)
        skipped = not bool(torch.rand(()) < 0.5)
        seen.add(skipped)
        block(x)
    assert seen == {True, False}


@pytest.mark.parametrize("how", HOWS)
def test_random_branches_replayed_exactly(how):
    expected = _train(_model())
    model = _model()
    assert_bitwise_equal(expected, _train(_mark(model, how)))


@pytest.mark.parametrize("how", ["plain", "reentrant", "output"])
def test_random_branches_replayed_exactly_compiled(how):
    """Under ``remat.compile`` the draws and the branch are compiled per step (a graph break
    at ``.item()``, inside the marked blocks: before, the mark called itself there until a
    RecursionError); the marked regions' random operators are kept, never re-drawn."""
    expected = _train(_model())
    model = _model()
    compiled = remat.compile(_mark(model, how), backend="aot_eager")
    assert_bitwise_equal(expected, _train(compiled))


def test_a_draw_in_the_re_run_would_change_the_gradients():
    """The comparison can fail: blocks whose re-run draws again (their random state not
    restored, ``preserve_rng_state=False``) do not train as the unmarked model: a typed error
    where the re-run takes the other branch, else other gradients."""
    from tests._harness import bitwise_equal

    expected = _train(_model())
    model = _model()
    for block in (model[1], model[2]):
        remat.recompute_module(block, use_reentrant=True, preserve_rng_state=False)
    try:
        got = _train(model)
    except remat.RecomputeError as err:
        assert "forward did not read" in str(err)
    else:
        assert not bitwise_equal(expected, got)


def test_marking_does_not_change_the_models_draws():
    """Marking draws nothing itself: after a forward, torch's generator is where the unmarked
    model's forward left it."""
    a, b = _model(), _model()
    _mark(b, "plain")
    states = []
    for model in (a, b):
        torch.manual_seed(7)
        model(torch.ones(2, 8)).sum().backward()
        states.append(torch.get_rng_state())
    assert torch.equal(*states)
