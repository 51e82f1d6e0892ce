"""The zero-bubble backward split in two (``remat.planner._split_backward``, NOTE [A backward
split in two]): the same gradients as torch's stage computes, and the same bytes held between
the input and the weight backward and after it, checked against torch 2.13's own functions."""

from __future__ import annotations

import pytest
import torch

import remat
from remat.planner._split_backward import backward_input, backward_weight


def _stage() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.LayerNorm(16), torch.nn.Linear(16, 64), torch.nn.GELU(),
                               torch.nn.Linear(64, 16), torch.nn.Linear(16, 32), torch.nn.Tanh())


def _split(mine: bool, last: bool) -> dict:
    """One micro-batch's forward, input and weight backward; the bytes alive after each."""
    if mine:
        backward_in, backward_w = backward_input, backward_weight
    else:
        from torch.distributed.pipelining._backward import stage_backward_input as backward_in
        from torch.distributed.pipelining._backward import stage_backward_weight as backward_w
    stage = _stage()
    x = torch.randn(8, 64, 16, generator=torch.Generator().manual_seed(1)).requires_grad_()
    grad = torch.ones(8, 64, 32)
    with remat.memory.track() as tracker:
        out = stage(x)
        y = out.float().pow(2).sum() if last else out
        forward = tracker.live_bytes
        groups = backward_in([y], None if last else [grad], [x], stage.parameters())
        groups = groups if mine else groups[1]
        between = tracker.live_bytes
        backward_w(stage.parameters(), groups)
        after = tracker.live_bytes
    return {"bytes": (forward, between, after), "grads": [x.grad] + [p.grad for p in stage.parameters()]}


@pytest.mark.parametrize("last", [False, True])
def test_the_split_backward_holds_and_computes_what_torchs_stage_does(last):
    mine, torch_own = _split(True, last), _split(False, last)
    assert mine["bytes"] == torch_own["bytes"]
    _, between, after = mine["bytes"]
    assert between > after  # the graph and the recorded gradients are held until the weight backward
    for a, b in zip(mine["grads"], torch_own["grads"], strict=True):
        assert a is not None and torch.equal(a, b)
    # and they are the gradients of one whole backward
    stage = _stage()
    x = torch.randn(8, 64, 16, generator=torch.Generator().manual_seed(1)).requires_grad_()
    out = stage(x)
    (out.float().pow(2).sum() if last else out).backward(None if last else torch.ones(8, 64, 32))
    for a, b in zip(mine["grads"], [x.grad] + [p.grad for p in stage.parameters()], strict=True):
        torch.testing.assert_close(a, b)
