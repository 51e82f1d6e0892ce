"""State a region updates in place is replayed from what the forward found (NOTE [Observed writes])."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import remat


class Counter(nn.Module):
    """Reads a buffer, then updates it: the re-run must read the value the forward read."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("n", torch.ones(()))

    def forward(self, x):
        y = self.fc(x) * (self.n + 1)
        self.n.add_(1)
        return torch.tanh(y)


class Holder:
    """A plain object the region reaches through a closure (no module walk can see it)."""

    def __init__(self) -> None:
        self.bn = nn.BatchNorm1d(4)


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_buffer_read_then_updated_is_read_as_the_forward_read_it(reentrant):
    """Before: the re-run read the updated buffer (silently wrong gradients)."""
    torch.manual_seed(0)
    plain = Counter()
    marked = copy.deepcopy(plain)
    remat.recompute_module(marked, use_reentrant=reentrant)
    for _ in range(2):
        x = torch.randn(3, 4, requires_grad=True)
        xm = x.detach().clone().requires_grad_()
        plain(x).pow(2).sum().backward()
        marked(xm).pow(2).sum().backward()
        assert torch.equal(x.grad, xm.grad)
        for p, q in zip(plain.parameters(), marked.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad)
        assert torch.equal(plain.n, marked.n)  # updated once per step


@pytest.mark.parametrize("reentrant", [False, True])
def test_batch_norm_reached_through_a_plain_object_is_updated_once(reentrant):
    """Before: a batch norm the object walk could not reach was updated twice."""
    torch.manual_seed(0)
    holder = Holder()
    ref = copy.deepcopy(holder.bn)
    x = torch.randn(8, 4, requires_grad=True)
    ref(x).sum().backward()
    out = remat.checkpoint(lambda t: holder.bn(t), x, use_reentrant=reentrant)
    out.sum().backward()
    for a, b in zip(ref.buffers(), holder.bn.buffers(), strict=True):
        assert torch.equal(a, b)


def test_a_region_updating_a_tensor_that_requires_grad_in_place_is_refused():
    w = torch.randn(4, requires_grad=True)
    h = w * 2  # not a leaf: autograd lets it be changed in place

    def f(t):
        h.add_(1)
        return t * 2

    with pytest.raises(remat.RecomputeError, match="changes in place .* requires grad"):
        remat.checkpoint(f, torch.randn(4, requires_grad=True), use_reentrant=False)
