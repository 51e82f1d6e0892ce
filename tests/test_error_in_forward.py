"""A forward that raises inside regions leaves nothing alive (own fuzz case 4070)."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import remat
from remat._engine import outputs as _outputs


class Boom(nn.Module):
    def forward(self, x):
        raise ValueError("boom")


@pytest.mark.parametrize("outer_reentrant", [False, True])
def test_an_error_inside_nested_regions_frees_their_saved_tensors(outer_reentrant):
    """Before: the outer regions, never closed, held the tensors their forward had saved,
    whose graphs led back to them through their hooks; with an ``output_recompute`` region
    inside, its output stayed registered (remat's saved-tensor hook stayed armed)."""
    from remat._engine import hooked, reentrant

    kinds = (hooked.HookedFrame, reentrant.ReentrantFrame)
    gc.collect()
    before = {id(o) for o in gc.get_objects() if isinstance(o, kinds)}  # other tests' graphs
    inner = remat.recompute_module(nn.Sequential(nn.Linear(4, 4), nn.GELU()), output_recompute=True)
    stage = nn.Sequential(inner, nn.Linear(4, 4), Boom())
    remat.recompute_module(stage, output_recompute=True)
    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(ValueError, match="boom"):
        remat.checkpoint(stage.forward, x, use_reentrant=outer_reentrant)
    gc.collect()
    assert _outputs._registry == {} and not _outputs.hook_active()
    alive = [o for o in gc.get_objects() if isinstance(o, kinds) and id(o) not in before]
    assert alive == []


def test_the_output_hook_is_popped_when_the_last_output_dies_in_backward():
    """Shared fuzz seed 2125: the last registered ``output_recompute`` output died while
    backward tore its graph down; the pop made there was undone when the engine restored
    the caller's saved-tensor hooks, so remat's hook stayed pushed after the step
    (``torch.func`` refuses to run under one)."""
    add = remat.ops.Add()
    add.recompute()  # a primitive mark: an output_recompute region
    a, w = torch.randn(2, 4, requires_grad=True), torch.randn(4, requires_grad=True)
    y = add(a, a)  # registered: remat's hook is pushed
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):  # someone else's
        z = y * w  # saves y itself: it is freed in backward, right after this operator's step
    del y
    assert _outputs.hook_active()
    z.sum().backward()  # the graph, and y with it, goes here
    del z
    gc.collect()
    assert _outputs._registry == {} and not _outputs.hook_active()


@pytest.mark.parametrize("reentrant", [False, True])
def test_an_input_changed_in_place_after_the_region_is_a_typed_error(reentrant):
    """Shared fuzz seeds 2764, 8170: the reentrant implementation let torch's RuntimeError
    through; both implementations now raise remat.RecomputeError (torch's words included)."""
    lin = nn.Linear(4, 4)
    h = torch.randn(3, 4, requires_grad=True) * 1.0
    out = remat.checkpoint(lambda t: lin(t).tanh(), h, use_reentrant=reentrant)
    h.mul_(2)  # the region's input, changed after it ran
    with pytest.raises(remat.RecomputeError, match="cannot be re-run.*modified by an inplace"):
        out.sum().backward()
