"""A tensor several reentrant regions read, each more than once (NOTE [Per-use gradients]).

A decoder's layers all read the encoder's output, twice each (keys and values). Each
layer's gradients for it reach the encoder's buffer after the later layers': unmarked,
one addition per read; a reentrant Function returning one summed gradient per input
added them in another order, so every gradient upstream of the encoder moved in its
last bits (these tests failed so before).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import remat
from tests._harness import assert_bitwise_equal


class CrossLayer(nn.Module):
    """Reads ``memory`` twice (keys and values) and ``h`` once more for the residual."""

    def __init__(self, width: int = 24) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, h, memory):
        scores = self.q(h) @ self.k(memory).transpose(-1, -2) / 5.0
        return h + scores.softmax(-1) @ self.v(memory)


class Decoder(nn.Module):
    def __init__(self, n: int = 5, width: int = 24, call=None) -> None:
        super().__init__()
        self.encoder = nn.Linear(width, width)
        self.layers = nn.ModuleList(CrossLayer(width) for _ in range(n))
        self.call = call

    def forward(self, x, y):
        memory = torch.tanh(self.encoder(x))
        h = y
        for layer in self.layers:
            h = self.call(layer, h, memory) if self.call is not None else layer(h, memory)
        return h


def _step(model: nn.Module) -> list[torch.Tensor]:
    torch.manual_seed(1)
    x = torch.randn(3, 7, 24, requires_grad=True)
    y = torch.randn(3, 7, 24)
    model(x, y).pow(2).mean().backward()
    return [x.grad, *(p.grad for p in model.parameters())]


FRONTS = {
    "cell marks": lambda m: [remat.recompute_module(layer, use_reentrant=True) for layer in m.layers],
    "apply": lambda m: remat.apply(m, where=CrossLayer, use_reentrant=True),
    "checkpoint": lambda m: setattr(m, "call", lambda layer, h, memory: remat.checkpoint(
        layer, h, memory, use_reentrant=True)),
    "recompute": lambda m: setattr(m, "call", lambda layer, h, memory: remat.recompute(
        layer, h, memory, use_reentrant=True)),
}


@pytest.mark.parametrize("front", list(FRONTS))
def test_every_layer_reading_the_encoders_output_twice_trains_bitwise(front):
    torch.manual_seed(0)
    base = Decoder()
    marked = copy.deepcopy(base)
    FRONTS[front](marked)
    want = _step(base)
    for _ in range(3):  # the first call is watched, the next ones run on its facts
        for p in marked.parameters():
            p.grad = None
        assert_bitwise_equal(_step(marked), want)


def test_a_later_region_reading_it_once_still_splits_the_earlier_ones():
    """The last layer reads ``memory`` once (a plain projection); its gradient arrives
    first, so the layers before it must hand theirs on one read at a time."""

    class Last(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(24, 24)

        def forward(self, h, memory):
            return h * self.proj(memory)

    torch.manual_seed(0)
    base = Decoder(n=3)
    base.layers.append(Last())
    marked = copy.deepcopy(base)
    remat.apply(marked, where=(CrossLayer, Last), use_reentrant=True)
    assert_bitwise_equal(_step(marked), _step(base))


def test_more_reads_in_the_re_run_than_in_the_forward_are_summed_into_the_last_input():
    """A layer that reads ``memory`` once more only under grad (its re-run) has more edges
    than its Function has inputs for it: the extra ones are summed into the last, a rounding
    difference at most (NOTE [Per-use gradients]); every gradient still arrives."""

    class Branchy(CrossLayer):
        def forward(self, h, memory):
            out = super().forward(h, memory)
            if torch.is_grad_enabled():  # the re-run: two more reads
                return out + memory.sin() + memory.cos()
            copy = memory.clone()  # the forward, without grad: one more read
            return out + copy.sin() + copy.cos()

    torch.manual_seed(0)
    base = Decoder(n=3)
    base.layers = nn.ModuleList(Branchy() for _ in range(3))
    marked = copy.deepcopy(base)
    remat.apply(marked, where=Branchy, use_reentrant=True)
    got, want = _step(marked), _step(base)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
