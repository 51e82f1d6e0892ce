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
    inner = remat.recompute_module(nn.Sequential(nn.Linear(4, 4), nn.GELU()), output_recompute=True)
    stage = nn.Sequential(inner, nn.Linear(4, 4), Boom())
    remat.recompute_module(stage, output_recompute=True)
    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(ValueError, match="boom"):
        remat.checkpoint(stage.forward, x, use_reentrant=outer_reentrant)
    gc.collect()
    assert _outputs._registry == {} and not _outputs.hook_active()
    from remat._engine import hooked, reentrant

    alive = [o for o in gc.get_objects() if isinstance(o, (hooked.HookedFrame, reentrant.ReentrantFrame))]
    assert alive == []
