"""A region that returns a view of its argument, changed in place after the region (NOTE
[Views of an argument changed after the region] in ``_engine/reentrant.py``).

A block that passes its input through, transposed, beside its result. Unmarked, the
passed-through output is a view of the argument: writing through it rewrites the argument's
history, and the argument's later readers back-propagate through the write. The reentrant
implementation handed it out as an output of its Function: the write reached the values but
not the history, and gradients were silently wrong (a shared-fuzzer case, seed 1066241).
torch's reentrant checkpoint refuses this step; remat's reentrant implementation now
refuses it too, typed, before the re-run; the saved-tensor implementation is exact.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat
from tests._harness import assert_bitwise_equal


class _PassThrough(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.transpose(1, 2)
        return torch.tanh(self.fc(x.clone())), x


def _step(how: str, write: bool) -> tuple[list, nn.Module]:
    torch.manual_seed(0)
    pre, block, post = nn.Linear(8, 8), _PassThrough(), nn.Linear(8, 8)
    x = torch.randn(2, 6, 8, requires_grad=True)
    h = nn.functional.silu(pre(x)) + 0
    arg = h.transpose(1, 2)
    if how == "unmarked":
        a, b = block(arg)
    else:
        a, b = remat.checkpoint(block.forward, arg, use_reentrant=how == "reentrant")
    if write:
        b.transpose(1, 2).mul_(-0.5)  # through a view of the passed-through output
    (post(a).sum() + (h * h).sum()).backward()
    return [pre.weight.grad, pre.bias.grad, block.fc.weight.grad, block.fc.bias.grad, x.grad], pre


@pytest.mark.parametrize("write", [False, True], ids=["read", "written"])
def test_the_saved_tensor_implementation_is_exact(write):
    assert_bitwise_equal(_step("unmarked", write)[0], _step("non-reentrant", write)[0])


def test_reentrant_without_a_write_is_exact():
    assert_bitwise_equal(_step("unmarked", False)[0], _step("reentrant", False)[0])


def test_reentrant_with_a_write_is_refused_before_the_rerun():
    """Typed, from the region's backward, before any gradient of the region's own
    parameters or of what lies before it is written."""
    with pytest.raises(remat.RecomputeError, match="returned a view of its argument"):
        _step("reentrant", True)
    torch.manual_seed(0)  # the refusal comes before any of those gradients
    pre, block = nn.Linear(8, 8), _PassThrough()
    x = torch.randn(2, 6, 8, requires_grad=True)
    h = nn.functional.silu(pre(x)) + 0
    a, b = remat.checkpoint(block.forward, h.transpose(1, 2), use_reentrant=True)
    b.transpose(1, 2).mul_(-0.5)
    with pytest.raises(remat.RecomputeError):
        (a.sum() + (h * h).sum()).backward()
    assert pre.weight.grad is None and block.fc.weight.grad is None
