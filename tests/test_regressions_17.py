"""Minimal reproducers of issue 17 (a leak and a crash) found by the independent fuzzer.

Each failed before its fix: the leak kept every finished step's graph alive (counted
with weak references, no timing), the crash raised where the unmarked model runs.
"""

from __future__ import annotations

import copy
import gc
import weakref

import torch
from torch import nn

import remat
from remat._engine import outputs as _outputs
from tests._harness import assert_bitwise_equal


def _alive(refs: list) -> int:
    gc.collect()
    return sum(r() is not None for r in refs)


class LinearThenInplaceAct(nn.Module):
    """A ``Linear`` on a 3-d input (its output is a view) then ``ReLU(inplace=True)``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.act = nn.Linear(6, 6), nn.ReLU(inplace=True)

    def forward(self, x):
        return self.act(self.fc(x))


def test_reentrant_region_writing_a_view_frees_its_graph_without_backward() -> None:
    """A reentrant region that writes a view argument in place, whose backward never runs,
    kept its graph (and the step's input) alive: a cycle through the autograd graph."""
    fc = nn.Linear(6, 6)
    act = remat.recompute_module(nn.ReLU(inplace=True), use_reentrant=True)
    refs = []
    for _ in range(3):
        x = torch.randn(2, 4, 6, requires_grad=True)
        y = act(fc(x))  # fc's output is a view (addmm's output reshaped), written in place
        refs.append(weakref.ref(x))
        del x, y  # no backward through the region
    assert _alive(refs) == 0


def test_output_recompute_with_reentrant_inplace_child_frees_finished_steps() -> None:
    """Fuzz seed 1487 (shrunk): an ``output_recompute`` module whose child is marked
    ``use_reentrant=True`` and writes its (view) argument in place kept every finished
    step's outputs alive (the child's re-run inside the parent's recomputation)."""
    torch.manual_seed(0)
    plain = LinearThenInplaceAct()
    marked = copy.deepcopy(plain)
    remat.recompute_module(marked.act, use_reentrant=True)
    remat.recompute_module(marked, output_recompute=True)
    refs = []
    for step in range(3):
        x = torch.randn(2, 4, 6, requires_grad=True)
        grads = []
        for model in (plain, marked):
            model.zero_grad(set_to_none=True)
            xi = x.detach().clone().requires_grad_()
            y = model(xi)
            (y * torch.tanh(y)).sum().backward()  # saves y: rebuilt by the output pass
            grads.append([xi.grad, *(p.grad for p in model.parameters())])
            refs += [weakref.ref(xi), weakref.ref(y)]
            del xi, y
        for a, b in zip(*grads, strict=True):
            assert torch.equal(a, b), f"step {step}"
        del x, grads
        assert _alive(refs) == 0, f"step {step}: tensors of finished steps are still alive"
        assert not _outputs._registry and not _outputs.hook_active()


class LinearBatchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.bn = nn.Linear(4, 4), nn.BatchNorm1d(4)

    def forward(self, x):
        return torch.relu(self.bn(self.fc(x)))


def _step(model: nn.Module, run, x: torch.Tensor) -> list:
    xi = x.detach().clone().requires_grad_()
    run(model, xi).square().sum().backward()
    return [xi.grad, *(p.grad for p in model.parameters()), *model.buffers()]


def test_save_all_mark_under_checkpoint_with_save_all_context() -> None:
    """Issue 17: a block marked with ``policy=save_all`` whose bound method (opaque to remat:
    the mark's wrapper) is also checkpointed with a save_all ``context_fn`` raised "aten.clone
    call #0 ran in recomputation but not in forward": the state guard's copy of the batch norm
    statistics went through the context's mode."""
    torch.manual_seed(0)
    plain = LinearBatchNorm()
    marked = remat.recompute_module(copy.deepcopy(plain), policy=remat.save_all)
    x = torch.randn(3, 4)
    want = _step(plain, lambda m, t: m(t), x)
    got = _step(marked, lambda m, t: remat.checkpoint(
        m.forward, t, use_reentrant=False, early_stop=False,
        context_fn=remat.policy_context(remat.save_all)), x)
    assert_bitwise_equal(want, got)


def test_output_recompute_mark_under_checkpoint_with_torch_sac() -> None:
    """Fuzz seed 1330 (shrunk): the same through torch's selective-checkpoint contexts."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy_fn(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

    torch.manual_seed(0)
    plain = LinearBatchNorm()
    marked = remat.recompute_module(copy.deepcopy(plain), output_recompute=True)
    x = torch.randn(3, 4)
    want = _step(plain, lambda m, t: m(t), x)
    got = _step(marked, lambda m, t: remat.checkpoint(
        m.forward, t, use_reentrant=False, early_stop=False,
        context_fn=lambda: create_selective_checkpoint_contexts(policy_fn)), x)
    assert_bitwise_equal(want, got)
