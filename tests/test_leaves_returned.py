"""A region that returns a tensor that requires grad and that its operators did not compute: its
parameter, a leaf read from outside, a fast weight computed before it, or a leaf it makes (NOTE
[Tensors returned as they were] in reentrant.py); and one it did compute without history, a
view of its parameter (made without grad in a reentrant forward, it reports ``requires_grad``
as its base does: handed out as itself, the parameter's gradient was lost, silently).

Under ``use_reentrant=True`` the Function returned such a leaf as one of its outputs: autograd
gave the parameter the Function's node as its history, so it stopped being a leaf, and the
first backward re-entered the Function from inside its own re-run without end (torch's
reentrant checkpoint hangs the same way). Every case trains two steps and compares every
gradient, the leaves' included, bitwise with the unmarked model.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat

D = 8
OUTSIDE = nn.Parameter(torch.randn(D, generator=torch.Generator().manual_seed(7)))
with torch.no_grad():
    OUTSIDE_VIEW = OUTSIDE[:]  # which="view outside": a view without history no module holds
CONSTANT = torch.linspace(0.5, 1.5, D)  # which="constant": a global that does not require grad


class _Returns(nn.Module):
    """``(x + tanh(fc(x)), leaf)``: the leaf is the block's parameter, a parameter no module
    holds, or a leaf the forward makes (T5's position bias); or a view of the block's
    parameter made in the forward, or made before it without grad (held by the block, or by
    no module)."""

    def __init__(self, which: str) -> None:
        super().__init__()
        self.fc, self.pos, self.which = nn.Linear(D, D), nn.Parameter(torch.randn(D)), which
        self.register_buffer("scale", torch.full((D,), 0.5))  # which="buffer"
        self.mask = torch.full((D,), 2.0)  # which="attribute"

    def forward(self, x):
        h = x + torch.tanh(self.fc(x))  # the leaf is not read: it is no input of the Function
        if self.which == "parameter":
            return h, self.pos
        if self.which == "outside":
            return h, OUTSIDE
        if self.which == "fast":  # computed from the parameter before the region (MAML's)
            return h, self.fast
        if self.which == "view":  # a slice of a position table
            return h, self.pos[:]
        if self.which == "view before":
            return h, self.before
        if self.which == "view outside":
            return h, OUTSIDE_VIEW
        if self.which in ("buffer", "attribute", "constant"):  # tensors that do not require grad
            return h, {"buffer": self.scale, "attribute": self.mask, "constant": CONSTANT}[self.which]
        self.made = torch.full((D,), 0.5, requires_grad=True)
        return h, self.made


class _Net(nn.Module):
    def __init__(self, which: str, call) -> None:
        super().__init__()
        self.first, self.a, self.b, self.head = nn.Linear(D, D), _Returns(which), _Returns(which), nn.Linear(D, D)
        self.call = call

    def forward(self, x):
        for block in (self.a, self.b):
            block.fast = block.pos * 1.5  # used by which="fast" only
            with torch.no_grad():
                block.before = block.pos[:]  # which="view before": a view without history
        h, p = self.call(self.a, self.first(x))
        h, q = self.call(self.b, h * p)
        return self.head(h + q)


def _plain(block, x):
    return block(x)


def _train(which: str, front: str | None, options: dict) -> list:
    torch.manual_seed(0)
    call = _plain
    if front == "checkpoint":
        call = lambda block, x: remat.checkpoint(block, x, **options)
    net = _Net(which, call)
    if front == "module":
        for block in (net.a, net.b):
            remat.recompute_module(block, **options)
    elif front == "apply":
        remat.apply(net, where=_Returns, **options)
    grads = []
    for step in range(2):
        x = torch.randn(4, D, generator=torch.Generator().manual_seed(step), requires_grad=True)
        net.zero_grad(set_to_none=True)
        OUTSIDE.grad = None
        loss = net(x).pow(2).mean()
        # returned from the reentrant Function as themselves, they took its history, and
        # the backward re-entered the Function without end
        assert all(t.grad_fn is None for t in (net.a.scale, net.a.mask, CONSTANT))
        loss.backward()
        leaves = [net.a.made, net.b.made] if which == "made" else [OUTSIDE]
        grads = [p.grad for p in net.parameters()] + [t.grad for t in leaves] + [x.grad]
        assert all(p.is_leaf for p in (*net.parameters(), OUTSIDE))
        with torch.no_grad():
            for p in net.parameters():
                if p.grad is not None:
                    p -= 0.1 * p.grad
    return grads


def _options(mode: str, front: str) -> dict:
    if mode == "reentrant":
        return {"use_reentrant": True}
    if mode == "non-reentrant":
        return {"use_reentrant": False}
    if front == "checkpoint":
        return {"use_reentrant": False, "context_fn": remat.policy_context(remat.save_compute_intensive)}
    return {"policy": remat.save_compute_intensive}


@pytest.mark.parametrize("which", ["parameter", "outside", "fast", "made", "view", "buffer", "attribute",
                                   "constant"])
@pytest.mark.parametrize("front", ["module", "apply", "checkpoint"])
@pytest.mark.parametrize("mode", ["reentrant", "non-reentrant", "policy"])
def test_a_leaf_returned_by_a_region_trains_as_unmarked(which, front, mode):
    expected = _train(which, None, {})
    got = _train(which, front, _options(mode, front))
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("which", ["view before", "view outside"])
@pytest.mark.parametrize("front", ["module", "apply", "checkpoint"])
@pytest.mark.parametrize("mode", ["reentrant", "non-reentrant", "policy"])
def test_a_view_made_without_grad_before_the_region_trains_as_unmarked(which, front, mode):
    """Unmarked, the view is a leaf of its own: its gradient stays on it, its base gets none.
    A reentrant region hands out one its module holds as itself; one no module holds comes back
    from the re-run without history, and that backward is refused."""
    expected = _train(which, None, {})
    if mode == "reentrant" and which == "view outside":
        with pytest.raises(remat.RecomputeError, match="made without grad before its forward"):
            _train(which, front, _options(mode, front))
        return
    for a, b in zip(_train(which, front, _options(mode, front)), expected, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("which", ["parameter", "made", "view"])
def test_a_leaf_returned_under_output_recompute_trains_as_unmarked(which):
    expected = _train(which, None, {})
    for a, b in zip(_train(which, "apply", {"output_recompute": True}), expected, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


def test_an_output_recompute_region_does_not_register_a_parameter_it_returns():
    """An ``output_recompute`` region registered every output as its own to rebuild, the
    parameter it returns too: the entry lived as long as the model, with remat's saved-tensor
    hook pushed (``torch.func`` refused every later call; own fuzz case 570)."""
    from remat._engine import outputs

    block = _Returns("parameter")
    remat.recompute_module(block, output_recompute=True)
    h, p = block(torch.randn(4, D, requires_grad=True))
    assert p is block.pos
    h.sum().backward()
    del h
    assert not outputs._registry and not outputs.hook_active()


def test_a_parameter_read_for_an_output_the_caller_drops_gets_its_hook_called_with_none():
    """A documented limit (the docs' torch page): every tensor a reentrant region reads is an
    input of its Function (NOTE [Reentrant gradients]); one whose gradient reaches no loss
    gets no gradient from the Function, and autograd calls its hooks with None, where the
    unmarked model never calls them. Its gradient stays None, as without the mark."""

    def train(mark: bool) -> tuple[list, list]:
        torch.manual_seed(0)
        block = _Returns("view")
        if mark:
            remat.recompute_module(block, use_reentrant=True)
        seen: list = []
        block.pos.register_hook(seen.append)
        for step in range(2):
            x = torch.randn(4, D, generator=torch.Generator().manual_seed(step), requires_grad=True)
            h, _ = block(x)  # the view of block.pos is dropped
            h.pow(2).mean().backward()
        return [p.grad for p in block.parameters()], seen

    (expected, unmarked_calls), (got, marked_calls) = train(False), train(True)
    assert unmarked_calls == [] and marked_calls == [None, None]
    assert block_grads_equal(got, expected)


def block_grads_equal(got: list, expected: list) -> bool:
    return all((a is None and b is None) or torch.equal(a, b) for a, b in zip(got, expected, strict=True))
