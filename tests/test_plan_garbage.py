"""NOTE [What planning leaves behind] (``remat/planner/_plan.py``): the planner's trial runs
leave nothing for Python's cyclic collector to free later, least of all tensors."""

from __future__ import annotations

import gc

import torch

import remat


def _blocks() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                                     torch.nn.Linear(256, 64)) for _ in range(4)])


def _garbage_after(run) -> list:
    """What ``run()`` left in reference cycles: the objects a collection right after it frees."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()  # the cycles stay until the check below, as they would in the user's loop
    try:
        result = run()
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        left = list(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if enabled:
            gc.enable()
    del result
    return left


def _tensors(objects: list) -> list:
    found = []
    for o in objects:
        try:
            if isinstance(o, torch.Tensor):
                found.append(o)
        except ReferenceError:  # a dead weak proxy
            pass
    return found


def test_the_eager_planner_leaves_no_tensor_in_a_cycle():
    net, x = _blocks(), torch.randn(256, 64)
    before = _tensors(_garbage_after(lambda: torch.nn.functional.mse_loss(net(x), x).backward()))
    assert before == []  # the baseline: an unmarked step leaves none
    left = _garbage_after(lambda: remat.plan(net, x, budget=0.85, repeat=1))
    assert _tensors(left) == []
    assert len(left) < 500, f"{len(left)} objects in cycles after remat.plan"


def test_remat_compile_with_a_budget_leaves_no_tensor_in_a_cycle():
    net, x = _blocks(), torch.randn(256, 64)
    left = _garbage_after(lambda: remat.compile(net, budget=0.7, example_inputs=(x,), rounds=1))
    assert _tensors(left) == []
    assert len(left) < 500, f"{len(left)} objects in cycles after remat.compile(budget=)"
