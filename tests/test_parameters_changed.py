"""A parameter changed in place between a region's forward and its re-run (NOTE
[Parameters changed before backward] in ``_engine/boundary.py``).

Weight clipping or an EMA update of a shared weight right after the forward, a GAN's
discriminator stepped between the generator's forward and its backward: the parameter the
forward read now holds another value. Unmarked, autograd refuses the backward ("modified by
an inplace operation") wherever an operator saved the parameter; a re-run that read the new
value trained silently wrong in every mode, before. Now the re-run is refused with a typed
error before it runs, and a step that changes parameters only after backward trains bitwise
as unmarked.
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import remat
from tests._harness import assert_bitwise_equal


@pytest.fixture(autouse=True)
def _no_fsdp_units_left():
    """Versions are not compared while FSDP2 units exist in the process (NOTE [Parameters
    changed before backward]): units an earlier test made in this worker may still wait for
    the collector (cycles), so collect them first, and say so if one is still alive."""
    from remat.parallel._fsdp import _fsdp_refills

    gc.collect()
    assert not _fsdp_refills(), "an FSDP2 unit from an earlier test is still alive in this process"

MODES = {"plain": {}, "reentrant": {"use_reentrant": True}, "output": {"output_recompute": True},
         "policy": {"policy": remat.save_compute_intensive}}


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6))
    return nn.Sequential(nn.Linear(6, 6), block, nn.Linear(6, 1))


class _Functional(nn.Module):
    def __init__(self, inner: nn.Sequential, **options) -> None:
        super().__init__()
        self.inner, self.options = inner, options

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inner[0](x)
        x = remat.checkpoint(self.inner[1], x, **self.options)
        return self.inner[2](x)


def _marked(front: str, mode: str) -> nn.Module:
    model = _model()
    options = MODES[mode]
    if front == "cell":
        remat.recompute_module(model[1], **options)
    elif front == "apply":
        remat.apply(model, where=lambda name, m: name == "1", **options)
    else:
        return _Functional(model, use_reentrant=mode == "reentrant")
    return model


FRONTS = [("cell", mode) for mode in MODES] + [("apply", "plain"), ("checkpoint", "plain"),
                                                ("checkpoint", "reentrant")]


def _edit(model: nn.Module) -> nn.Parameter:
    inner = model.inner if isinstance(model, _Functional) else model
    return inner[1][0].weight


@pytest.mark.parametrize(("front", "mode"), FRONTS)
def test_parameter_changed_before_backward_is_refused(front, mode):
    """The unmarked model refuses this backward; the marked one refuses the re-run, typed,
    before any gradient of the region's parameters is written."""
    x = torch.randn(3, 6, requires_grad=True)
    base = _model()
    loss = base(x).sum()
    with torch.no_grad():
        base[1][0].weight.mul_(0.5)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()

    model = _marked(front, mode)
    loss = model(x).sum()
    with torch.no_grad():
        _edit(model).mul_(0.5)
    with pytest.raises(remat.RecomputeError, match="changed in place after the region's forward"):
        loss.backward()
    assert _edit(model).grad is None


@pytest.mark.parametrize(("front", "mode"), FRONTS)
def test_parameters_changed_after_backward_train_as_unmarked(front, mode):
    """The usual loop (forward, backward, then the optimizer's in-place step) is unaffected:
    three steps bitwise equal to unmarked."""
    def train(model: nn.Module) -> list:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(3, 6, generator=torch.Generator().manual_seed(1))
        out = []
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            model(x).sum().backward()
            out += [p.grad.clone() for p in model.parameters()]
            opt.step()
        return out

    assert_bitwise_equal(train(_model()), train(_marked(front, mode)))


@pytest.mark.parametrize(("front", "mode"), FRONTS)
@pytest.mark.parametrize("frozen_in_forward", [False, True], ids=["frozen-after", "unfrozen-after"])
def test_parameter_frozen_or_unfrozen_before_backward_trains_as_unmarked(front, mode, frozen_in_forward):
    """NOTE [Parameters frozen before backward]: a parameter's ``requires_grad`` flipped
    between the forward and the backward (a discriminator frozen right after its forward).
    Unmarked, the graph the forward built decides, and ``AccumulateGrad`` drops the gradient of
    a parameter frozen since; before, the re-run read the new flag: refused as a re-run that
    differs (saved-tensor hooks) or torch's raw error (reentrant). Now bitwise as unmarked:
    every gradient, ``None`` where unmarked has none."""
    def grads(model: nn.Module) -> list:
        x = torch.randn(3, 6, generator=torch.Generator().manual_seed(2), requires_grad=True)
        weight = _edit(model)
        weight.requires_grad_(not frozen_in_forward)
        loss = model(x).sum()
        weight.requires_grad_(frozen_in_forward)
        loss.backward()
        assert weight.requires_grad is frozen_in_forward  # the caller's flag, after the re-run
        return [p.grad for p in model.parameters()] + [x.grad]

    base = grads(_model())
    assert base[2] is None  # frozen in the forward or since: unmarked, no gradient either way
    assert_bitwise_equal(base, grads(_marked(front, mode)))


def test_a_wrapper_that_refills_parameters_turns_the_comparison_off(monkeypatch):
    """While an adapter says a wrapper refills parameters in place (FSDP2 gathers into the
    same parameters for backward: a version that moves with the same values), versions are
    not compared: the FSDP adapter registers such a check."""
    from remat._engine import boundary
    from remat.parallel import _fsdp

    assert _fsdp._fsdp_refills in boundary._REFILL_CHECKS
    monkeypatch.setattr(boundary, "_REFILL_CHECKS", [lambda: True])
    model = _marked("cell", "plain")
    x = torch.randn(3, 6)
    loss = model(x).sum()
    with torch.no_grad():
        _edit(model).add_(0.0)  # a write that keeps the values, as a gather into the parameter
    loss.backward()
    assert _edit(model).grad is not None
