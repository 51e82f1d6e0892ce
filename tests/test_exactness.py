"""Recompute changes no number: engine corner cases that once went wrong (issue 10).

Each test builds a small model, marks a copy, runs both with the same seed and
compares loss, outputs, every gradient and every buffer with ``torch.equal``.
"""

from __future__ import annotations

import copy
import gc
import weakref
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import create_selective_checkpoint_contexts

import remat
from remat._engine import outputs as _outputs
from tests._harness import assert_bitwise_equal

W = 6


def _run(model: nn.Module, forward: Callable, x: torch.Tensor, seed: int, backwards: int) -> dict:
    x = x.detach().clone().requires_grad_(x.requires_grad)
    torch.manual_seed(seed)
    out = forward(model, x)
    loss = out.square().sum() if isinstance(out, torch.Tensor) else sum(o.square().sum() for o in out)
    for i in range(backwards):
        loss.backward(retain_graph=i + 1 < backwards)
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    return {
        "loss": [loss.detach()],
        "outputs": [o.detach() for o in (out if isinstance(out, tuple) else (out,))],
        "grads": grads + [x.grad],
        "buffers": [b.clone() for b in model.buffers()],
    }


def assert_exact(model: nn.Module, mark: Callable[[nn.Module], None], x: torch.Tensor,
                 forward: Callable | None = None, *, seed: int = 0, steps: int = 2,
                 backwards: int = 1) -> nn.Module:
    """Run ``model`` unmarked and ``mark``-ed for ``steps`` SGD steps; assert every number equal."""
    forward = forward or (lambda m, t: m(t))
    plain, marked = copy.deepcopy(model), copy.deepcopy(model)
    mark(marked)
    for step in range(steps):
        a = _run(plain, forward, x, seed + step, backwards)
        b = _run(marked, forward, x, seed + step, backwards)
        for key in a:
            assert_bitwise_equal(a[key], b[key], what=f"step {step}: {key}")
        for m in (plain, marked):
            with torch.no_grad():
                for p in m.parameters():
                    if p.grad is not None:
                        p -= 0.1 * p.grad
                        p.grad = None
    assert not _outputs.hook_active()
    return marked


def _x(*shape: int, grad: bool = True) -> torch.Tensor:
    torch.manual_seed(123)
    return torch.randn(*shape, requires_grad=grad)


def _seq(*layers: nn.Module) -> nn.Sequential:
    torch.manual_seed(7)
    return nn.Sequential(*layers)


# --- 1. an output_recompute output changed in place by the next operator ------------------


def test_output_recompute_then_inplace_relu():
    model = _seq(nn.Linear(W, W), nn.ReLU(inplace=True), nn.Linear(W, W))
    assert_exact(model, lambda m: remat.recompute_module(m[0], output_recompute=True), _x(4, W))


def test_output_recompute_then_inplace_twice_and_two_backwards():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(W, W), nn.Linear(W, W)

        def forward(self, x):
            h = self.fc1(x)
            h.mul_(2).relu_()
            return self.fc2(h)

    torch.manual_seed(7)
    assert_exact(Net(), lambda m: remat.recompute_module(m.fc1, output_recompute=True),
                 _x(4, W), backwards=2)


def test_output_recompute_chain_then_inplace():
    model = _seq(nn.Linear(W, W), nn.Linear(W, W), nn.ReLU(inplace=True), nn.Linear(W, W))
    assert_exact(model, lambda m: remat.apply(m, where=nn.Linear, output_recompute=True), _x(4, W))


def test_output_recompute_view_output_changed_in_place():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(W, W), nn.Linear(W, W)

        def forward(self, x):
            h = self.fc1(x)
            h[:, :2].mul_(-2)
            return self.fc2(h.sin())

    torch.manual_seed(7)
    assert_exact(Net(), lambda m: remat.recompute_module(m.fc1, output_recompute=True), _x(4, W))


# --- 2. a cell mark and remat.checkpoint over the same module ------------------------------


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_cell_mark_inside_checkpoint_of_same_module(use_reentrant):
    model = _seq(nn.Sigmoid(), nn.Linear(W, W), nn.Tanh(), nn.Linear(W, W))

    def forward(m, x):
        return remat.checkpoint(m, x, use_reentrant=use_reentrant)

    assert_exact(model, lambda m: remat.recompute_module(m), _x(4, W), forward)


@pytest.mark.parametrize("options", [{"output_recompute": True}, {"use_reentrant": True},
                                     {"policy": remat.save_compute_intensive}])
def test_cell_mark_inside_checkpoint_of_same_module_options(options):
    model = _seq(nn.Tanh(), nn.Linear(W, W), nn.ReLU(), nn.Linear(W, W), nn.Sigmoid())

    def forward(m, x):
        return remat.checkpoint(m, x, use_reentrant=False) * 2

    assert_exact(model, lambda m: remat.recompute_module(m, **options), _x(4, W), forward,
                 backwards=2)


def test_marked_module_inside_functional_recompute_of_itself():
    model = _seq(nn.Sigmoid(), nn.Linear(W, W), nn.Tanh())

    def forward(m, x):
        return remat.recompute(m, x, output_recompute=True).exp()

    assert_exact(model, lambda m: remat.recompute_module(m), _x(4, W), forward)


# --- 5. a batch norm used outside a region and again inside one ---------------------------


class SharedNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(W, W), nn.Linear(W, W)
        self.bn = nn.BatchNorm1d(W)
        self.reentrant: bool | None = None  # None: no region

    def block(self, h):
        return self.fc2(self.bn(h)).tanh()

    def forward(self, x):
        h = self.bn(self.fc1(x))
        if self.reentrant is None:
            return self.block(h)
        return remat.checkpoint(self.block, h, use_reentrant=self.reentrant)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_batch_norm_outside_and_inside_a_region(use_reentrant):
    torch.manual_seed(7)

    def mark(m):
        m.reentrant = use_reentrant

    assert_exact(SharedNorm(), mark, _x(8, W))


def test_batch_norm_outside_and_inside_a_cell_mark():
    torch.manual_seed(7)
    bn = nn.BatchNorm1d(W)
    model = nn.Sequential(nn.Linear(W, W), bn, nn.Sequential(nn.Linear(W, W), bn, nn.Tanh()))
    assert_exact(model, lambda m: remat.recompute_module(m[2]), _x(8, W))


# --- 6. context_fn on a region with batch norm ----------------------------------------------


def _torch_policy(ctx, func, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


@pytest.mark.parametrize("context", ["torch_ops", "torch_fn", "save_all", "compute_intensive"])
def test_context_fn_with_batch_norm(context):
    model = _seq(nn.Linear(W, W), nn.BatchNorm1d(W), nn.ReLU(), nn.Linear(W, W), nn.BatchNorm1d(W))
    context_fn = {
        "torch_ops": lambda: create_selective_checkpoint_contexts([torch.ops.aten.mm.default]),
        "torch_fn": lambda: create_selective_checkpoint_contexts(_torch_policy),
        "save_all": remat.policy_context(remat.save_all),
        "compute_intensive": remat.policy_context(remat.save_compute_intensive),
    }[context]

    def forward(m, x):
        return remat.checkpoint(m, x, use_reentrant=False, context_fn=context_fn)

    # torch's own contexts hand each saved value back once: one backward per graph
    assert_exact(model, lambda m: None, _x(8, W), forward, backwards=1 if "torch" in context else 2)


def test_policy_mark_with_batch_norm():
    model = _seq(nn.Linear(W, W), nn.BatchNorm1d(W), nn.ReLU(), nn.Linear(W, W))
    assert_exact(model, lambda m: remat.recompute_module(m, policy=remat.save_compute_intensive),
                 _x(8, W))


# --- 7. the primitive-mark recipe on an in-place activation ---------------------------------


@pytest.mark.parametrize("act", [nn.ReLU, nn.Dropout])  # dropout_ saves its mask, then writes
def test_primitive_mark_on_inplace_activation(act):
    model = _seq(nn.Linear(W, W), act(inplace=True), nn.Linear(W, W), act(inplace=True),
                 nn.Linear(W, W))
    assert_exact(model, lambda m: remat.apply(m, where=act, output_recompute=True), _x(4, W),
                 backwards=2)


def test_primitive_marks_on_linear_and_inplace_relu():
    model = _seq(nn.Linear(W, W), nn.ReLU(inplace=True), nn.Linear(W, W), nn.Tanh(), nn.Linear(W, W))
    mark = lambda m: remat.apply(m, where=(nn.Linear, nn.ReLU), output_recompute=True)
    assert_exact(model, mark, _x(4, W), backwards=2)


def test_primitive_mark_on_inplace_relu_keeps_what_the_unmarked_model_keeps():
    model = _seq(nn.Linear(W, W), nn.ReLU(inplace=True), nn.Linear(W, W), nn.Tanh())
    marked = copy.deepcopy(model)
    remat.apply(marked, where=nn.ReLU, output_recompute=True)
    x = _x(4, W)
    plain = remat.memory.saved_bytes(lambda: model(x).sum())
    assert plain > 0
    assert remat.memory.saved_bytes(lambda: marked(x).sum()) == plain


def test_cell_mark_on_inplace_relu():
    model = _seq(nn.Linear(W, W), nn.ReLU(inplace=True), nn.Linear(W, W))
    assert_exact(model, lambda m: remat.apply(m, where=nn.ReLU), _x(4, W))


def test_region_changing_its_input_in_place():
    model = _seq(nn.Linear(W, W), nn.Sequential(nn.ReLU(inplace=True), nn.Linear(W, W)))
    assert_exact(model, lambda m: remat.recompute_module(m[1]), _x(4, W), backwards=2)


class WritesInputLate(nn.Module):
    """A checkpointed block that saves temporaries, then changes its input in place."""

    def __init__(self, depth: int, region: bool) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.fc, self.out = nn.Linear(W, W), nn.Linear(W, W)
        self.depth, self.region = depth, region

    def block(self, x):
        y = x * 2
        for _ in range(self.depth):
            y = y.cos()  # saves its input, which nothing else holds
        x.relu_()
        return y + x

    def forward(self, x):
        h = self.fc(x)
        y = remat.checkpoint(self.block, h, use_reentrant=False) if self.region else self.block(h)
        return self.out(y)


def test_region_that_writes_its_input_after_saving_a_temporary():
    def mark(m):
        m.region = True

    assert_exact(WritesInputLate(depth=1, region=False), mark, _x(4, W), backwards=2)


def test_region_that_writes_its_input_after_a_lost_save_raises():
    model = WritesInputLate(depth=2, region=True)
    with pytest.raises(remat.RecomputeError, match="changed one of its inputs in place"):
        model(_x(4, W))


def test_input_changed_in_place_after_the_region_raises_a_typed_error():
    fc, block = nn.Linear(W, W), nn.Linear(W, W)
    h = fc(_x(4, W))
    y = remat.checkpoint(lambda t: block(t * 3), h, use_reentrant=False)
    h.mul_(2)
    with pytest.raises(remat.RecomputeError, match="changed in place after the region ran") as info:
        (y.sum() + h.sum()).backward()
    assert "has been modified by an inplace operation" in str(info.value)  # torch's words too


class KeptThenInPlace(nn.Module):
    """A cell mark keeps tanh's result (its output); the caller then changes it in place."""

    def __init__(self, inplace: bool) -> None:
        super().__init__()
        self.inplace = inplace
        torch.manual_seed(7)
        self.block = nn.Sequential(nn.Linear(W, W), nn.Tanh())
        self.fc = nn.Linear(W, W)

    def forward(self, x):
        h = self.block(x)
        h = h.mul_(2) if self.inplace else h * 2
        return self.fc(h)


def test_kept_output_changed_in_place_is_rebuilt():
    # plain torch refuses the in-place version (tanh saved its result); remat rebuilds the
    # kept tensor, so the marked in-place model equals the plain out-of-place one
    plain, marked = KeptThenInPlace(inplace=False), KeptThenInPlace(inplace=True)
    marked.load_state_dict(plain.state_dict())
    remat.recompute_module(marked.block)
    grads = []
    for model in (plain, marked):
        model(_x(4, W)).square().sum().backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


# --- 11. leaks -------------------------------------------------------------------------------


def _output_recompute_model() -> nn.Sequential:
    model = _seq(nn.Linear(W, W), nn.Tanh(), nn.Linear(W, W))
    remat.recompute_module(model[0], output_recompute=True)
    return model


def test_hook_popped_after_a_step():
    model = _seq(nn.Linear(W, W), nn.Tanh(), nn.Linear(W, W))
    remat.apply(model, where=nn.Linear, output_recompute=True)
    out = model(_x(4, W))  # the model's output, a marked region's, outlives the step
    out.sum().backward()
    assert not _outputs.hook_active()
    # torch.func.grad refuses to run under a saved-tensor hook
    g = torch.func.grad(lambda t: (t * t).sum())(torch.ones(3))
    assert torch.equal(g, torch.full((3,), 2.0))
    # the next step is exact again: the hook comes back with the next marked region
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    out = model(_x(4, W))
    assert _outputs.hook_active()
    out.sum().backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
    assert not _outputs.hook_active()


def test_hook_popped_when_output_kept_past_backward():
    model = _output_recompute_model()
    x = _x(4, W)
    h = model[0](x)
    out = model[2](model[1](h))
    out.sum().backward()
    assert not _outputs.hook_active()
    assert torch.equal(torch.func.grad(lambda t: (t * t).sum())(torch.ones(3)), torch.full((3,), 2.0))
    del h


@pytest.mark.parametrize("inplace", [False, True])
def test_outputs_freed_after_an_exception_in_backward(inplace):
    model = _seq(nn.Linear(W, W), nn.ReLU(inplace=inplace), nn.Linear(W, W), nn.Tanh(), nn.Linear(W, W))
    remat.apply(model, where=lambda name, m: name in ("1", "2"), output_recompute=True)

    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            raise RuntimeError("boom")

    def step() -> list:
        probes = []
        h = _x(4, W)
        for layer in model:
            h = layer(h)
            probes.append(weakref.ref(h))
        with pytest.raises(RuntimeError, match="boom"):
            Boom.apply(h).sum().backward()
        return probes

    probes = step()
    gc.collect()
    assert [p() for p in probes] == [None] * len(probes)
    assert not _outputs._registry
    assert not _outputs.hook_active()
