"""Tensors a region reads from outside its arguments and modules (NOTE [Tensors read from
outside the module] in ``_engine/boundary.py``): a global table, a closure's tensor, an item
of a list attribute (a Transformer-XL memory kept as a list).

Changed in place between the forward and the re-run, such a tensor holds another value
than the forward read: unmarked, autograd refuses the backward where an operator saved it;
every remat mode re-ran with the new value and trained silently wrong, before. Now the
re-run is refused with a typed error, and a loop that leaves them alone until backward
trains bitwise as unmarked.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat
from tests._harness import assert_bitwise_equal, observed_calls

MODES = {"plain": {}, "reentrant": {"use_reentrant": True}, "output": {"output_recompute": True},
         "policy": {"policy": remat.save_compute_intensive}}
TABLE = {"scale": torch.ones(6)}  # a module-level table the block reads


class GlobalReader(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x) * TABLE["scale"])


class MemoryList(nn.Module):
    """A memory kept as a list attribute, read by the next call (Transformer-XL)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.mems = [torch.ones(6)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x) * self.mems[0])


def _the_tensor(kind: str, model: nn.Module) -> torch.Tensor:
    return TABLE["scale"] if kind == "global" else model[1].mems[0]


def _model(kind: str) -> nn.Sequential:
    torch.manual_seed(0)
    TABLE["scale"] = torch.ones(6)
    block = GlobalReader() if kind == "global" else MemoryList()
    return nn.Sequential(nn.Linear(6, 6), block, nn.Linear(6, 1))


def _marked(kind: str, mode: str) -> nn.Sequential:
    model = _model(kind)
    remat.recompute_module(model[1], **MODES[mode])
    return model


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind", ["global", "list item"])
def test_a_tensor_read_from_outside_changed_before_backward_is_refused(kind, mode):
    x = torch.randn(3, 6, requires_grad=True)
    base = _model(kind)
    loss = base(x).sum()
    with torch.no_grad():
        _the_tensor(kind, base).mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()

    model = _marked(kind, mode)
    loss = model(x).sum()
    with torch.no_grad():
        _the_tensor(kind, model).mul_(2)
    with pytest.raises(remat.RecomputeError, match="neither its argument nor its modules' state"):
        loss.backward()


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind", ["global", "list item"])
def test_a_tensor_read_from_outside_changed_after_backward_trains_as_unmarked(kind, mode):
    """Changed between steps (after backward), as a memory is: bitwise as unmarked, every
    call watched (its reads are the ones checked)."""
    def train(model: nn.Sequential) -> list:
        x = torch.randn(3, 6, generator=torch.Generator().manual_seed(1), requires_grad=True)
        out = []
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            x.grad = None
            model(x).sum().backward()
            out += [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
            with torch.no_grad():
                _the_tensor(kind, model).mul_(1.5)
        return out

    expected = train(_model(kind))
    assert_bitwise_equal(train(_marked(kind, mode)), expected)


def test_a_closure_tensor_changed_before_backward_is_refused():
    """A region that is a plain function reads its closure's tensor."""
    fc = nn.Linear(6, 6)
    gate = torch.ones(6)
    x = torch.randn(3, 6, requires_grad=True)
    loss = remat.checkpoint(lambda t: torch.tanh(fc(t) * gate), x, use_reentrant=False).sum()
    with torch.no_grad():
        gate.mul_(2)
    with pytest.raises(remat.RecomputeError, match="neither its argument nor its modules' state"):
        loss.backward()


def test_a_region_reading_from_outside_is_watched_on_every_call(monkeypatch):
    seen = observed_calls(monkeypatch)
    for kind, watched in (("global", 3), ("list item", 3)):
        model = _marked(kind, "plain")
        seen.clear()
        for _ in range(3):
            model(torch.randn(2, 6)).sum().backward()
        assert len(seen) == watched, kind
    plain = nn.Sequential(nn.Linear(6, 6), nn.Sequential(nn.Linear(6, 6), nn.Tanh()), nn.Linear(6, 1))
    remat.recompute_module(plain[1])
    seen.clear()
    for _ in range(3):
        plain(torch.randn(2, 6)).sum().backward()
    assert len(seen) == 1  # its own state only: watched once
