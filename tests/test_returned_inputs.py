"""A region that returns its argument (a block passing its input through), changed in place
afterwards by the caller (NOTE [Arguments returned as outputs])."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import remat


class PassThrough(nn.Module):
    """Returns ``(tanh(fc(x)), x)``: the second output is the argument itself, or a view of it."""

    def __init__(self, view: bool) -> None:
        super().__init__()
        self.fc, self.view = nn.Linear(4, 4), view
        self.fc.weight.requires_grad_(False)  # frozen, as in the fuzz case (seed 1383)

    def forward(self, x):
        return torch.tanh(self.fc(x)), (x.transpose(0, 1) if self.view else x)


def _step(block, head, x, wrap):
    a, b = wrap(block, x)
    b.relu_()  # the caller changes the passed-through input in place
    return (head(a).sum() + b.sum() * 0.5).sum()


@pytest.mark.parametrize("view", [False, True])
@pytest.mark.parametrize("how", ["mark", "mark_reentrant", "checkpoint", "checkpoint_reentrant",
                                 "recompute_early_stop_off"])
@pytest.mark.parametrize("x_grad", [False, True])
def test_an_argument_returned_and_changed_in_place_after(how, view, x_grad):
    """Before: 'Output 1 of Reentrant is a view and is being modified inplace' (reentrant),
    or 'cannot be re-run: one of its inputs was changed in place' (both): a crash where the
    unmarked model runs. Now the argument is saved as a copy, and gradients are bitwise; but a
    reentrant region's view of its argument, written after it, is refused typed (the argument's
    later readers would miss the write: NOTE [Views of an argument changed after the region]),
    as torch's reentrant checkpoint refuses it."""
    torch.manual_seed(0)
    block, head = PassThrough(view), nn.Linear(4, 1)
    marked, mhead = copy.deepcopy(block), copy.deepcopy(head)
    reentrant = how.endswith("reentrant")
    if how.startswith("mark"):
        remat.recompute_module(marked, use_reentrant=reentrant, early_stop=False)
        wrap = lambda m, t: m(t)
    elif how.startswith("checkpoint"):
        wrap = lambda m, t: remat.checkpoint(m, t, use_reentrant=reentrant)
    else:
        wrap = lambda m, t: remat.checkpoint(m, t, use_reentrant=False, early_stop=False)
    x0 = torch.randn(3, 4)
    for _ in range(2):
        x, xm = x0.clone().requires_grad_(x_grad), x0.clone().requires_grad_(x_grad)
        h, hm = x * 1.0, xm * 1.0  # a non-leaf: in-place changes are allowed on it
        _step(block, head, h, lambda m, t: m(t)).backward()
        if view and reentrant:  # NOTE [Views of an argument changed after the region]
            with pytest.raises(remat.RecomputeError, match="returned a view of its argument"):
                _step(marked, mhead, hm, wrap).backward()
            assert all(p.grad is None for p in marked.parameters())
            return
        _step(marked, mhead, hm, wrap).backward()
        assert torch.equal(h, hm)
        for p, q in zip([*block.parameters(), *head.parameters()],
                        [*marked.parameters(), *mhead.parameters()], strict=True):
            assert (p.grad is None) == (q.grad is None)
            if p.grad is not None:
                assert torch.equal(p.grad, q.grad)
        if x_grad:
            assert torch.equal(x.grad, xm.grad)


@pytest.mark.parametrize("reentrant", [False, True])
def test_an_argument_returned_changed_in_place_and_read_again_through_its_own_name(reentrant):
    """Own fuzz case 1179: the region returned (an alias of) its argument; the caller changed
    that output in place and read the argument again. The argument's history must include
    the change, as without the mark (before: the gradient through the argument skipped the
    ``relu_``, silently)."""
    torch.manual_seed(0)
    block, conv = PassThrough(view=False), nn.Conv1d(4, 4, 3, padding=1, bias=False)
    marked, mconv = copy.deepcopy(block), copy.deepcopy(conv)
    remat.recompute_module(marked, use_reentrant=reentrant)

    def step(b, c):
        x = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(0), requires_grad=True)
        h = c(x.transpose(1, 2)).transpose(1, 2).transpose(0, 1)  # a view
        a, passed = b(h)
        y = a + passed.relu_()
        (y.pow(2).sum() + h.sum()).backward()  # h read again: it holds the relu now
        return [x.grad, *[p.grad for p in c.parameters()], *[p.grad for p in b.parameters()]]

    for want, got in zip(step(block, conv), step(marked, mconv), strict=True):
        assert (want is None) == (got is None)
        if want is not None:
            assert torch.equal(want, got)


def test_an_output_recompute_region_does_not_register_the_input_it_passes_through():
    """Own fuzz case 971: an ``output_recompute`` region returning its input registered that
    input as an output of its own (to be rebuilt by a re-run, and kept in the registry for
    as long as the input lived: remat's saved-tensor hook stayed armed after the step)."""
    from remat._engine import outputs as _outputs

    torch.manual_seed(0)
    block = remat.recompute_module(PassThrough(view=False), output_recompute=True)
    head = nn.Linear(4, 1)
    x = torch.randn(3, 4, requires_grad=True)  # the caller keeps it
    a, b = block(x)
    (head(a).sum() + (b * 2).sum()).backward()
    del a, b
    assert _outputs._registry == {} and not _outputs.hook_active()


def test_an_output_recompute_module_that_returns_its_input_leaves_no_hook_pushed():
    """Own fuzz case 7557 (8,000 cases): ``nn.Dropout(0.0)`` marked ``output_recompute`` returns
    its input itself; the region registered no output but pushed remat's saved-tensor hook,
    and nothing popped it: the hook stayed on the stack after the step. Gradients stay equal."""
    from remat._engine import outputs as _outputs

    def run(mark: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.0), nn.Linear(8, 8))
        if mark:
            remat.recompute_module(model[1], output_recompute=True)
        x = torch.randn(3, 8, requires_grad=True)
        model(x).sum().backward()
        return [p.grad for p in model.parameters()] + [x.grad]

    expected = run(False)
    got = run(True)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert _outputs._registry == {} and not _outputs.hook_active()
