"""Hooks on marked modules: recomputation replays forward as the first run saw it.

NOTE [Hooks of a marked module] (``remat/_front/marks.py``): hooks outside the region run
once; the re-run calls ``forward`` on the arguments forward got, not the module.
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
import torch.nn.utils.parametrizations as P
from torch.nn.utils import prune

import remat
from remat.models import ResidualBlock, resnet
from tests._harness import assert_bitwise_equal

MODES = [
    pytest.param({}, id="keep-output"),
    pytest.param({"output_recompute": True}, id="output-recompute"),
    pytest.param({"use_reentrant": True}, id="reentrant"),
]


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8), torch.nn.Tanh()
    )


def _net(block: torch.nn.Module) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 8), block, torch.nn.Linear(8, 8))


def _train(net: torch.nn.Module, steps: int = 2) -> tuple[list, list]:
    """Two SGD steps; return the last step's gradients and the parameters and buffers after."""
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    grads = []
    for step in range(steps):
        torch.manual_seed(step)
        x = torch.randn(4, 8, requires_grad=True)
        opt.zero_grad(set_to_none=True)
        net(x).pow(2).sum().backward()
        grads = [p.grad.clone() for p in net.parameters()] + [x.grad.clone()]
        opt.step()
    state = [t.detach().clone() for t in (*net.parameters(), *net.buffers())]
    return grads, state


def _double(module: torch.nn.Module, args: tuple) -> tuple:
    return (args[0] * 2 + 1,)


@pytest.mark.parametrize("options", MODES)
@pytest.mark.parametrize("order", ["hook-then-mark", "mark-then-hook"])
def test_pre_hook_that_rewrites_the_input_runs_once(options, order):
    base = _net(_mlp())
    calls = []

    def counted(module, args):
        calls.append(remat.is_recomputing())
        return _double(module, args)

    base[1].register_forward_pre_hook(_double)
    marked = _net(_mlp())
    marked.load_state_dict(base.state_dict())
    if order == "mark-then-hook":
        remat.recompute_module(marked[1], **options)
    marked[1].register_forward_pre_hook(counted)
    if order == "hook-then-mark":
        remat.recompute_module(marked[1], **options)
    want, _ = _train(base)
    got, _ = _train(marked)
    assert_bitwise_equal(got, want)
    assert calls == [False, False]  # once per step, never in recomputation


@pytest.mark.parametrize("options", MODES)
def test_forward_hooks_of_marked_blocks_fire_once_per_forward(options):
    net = resnet((2, 2, 2, 2), width=4, class_num=3)
    names = remat.apply(net, where=ResidualBlock, **options)
    assert len(names) == 8  # a ResNet-18-shaped net: two blocks per stage
    counts = {"pre": 0, "post": 0, "during": 0}

    def pre(module, args):
        counts["pre"] += 1

    def post(module, args, output):
        counts["post"] += 1
        counts["during"] += remat.is_recomputing()

    for name in names:
        block = net.get_submodule(name)
        block.register_forward_pre_hook(pre)
        block.register_forward_hook(post)
    before = remat._engine.state.recompute_count()
    net(torch.randn(2, 3, 16, 16)).sum().backward()
    assert remat._engine.state.recompute_count() > before  # the blocks were recomputed
    assert counts == {"pre": 8, "post": 8, "during": 0}


def test_forward_hook_registered_before_the_mark_that_changes_the_output_runs_once():
    def scale(module, args, output):
        return output * 3

    base = _net(_mlp())
    base[1].register_forward_hook(scale)
    marked = copy.deepcopy(base)
    remat.recompute_module(marked[1], output_recompute=True)
    want, _ = _train(base)
    got, _ = _train(marked)
    assert_bitwise_equal(got, want)


def _parametrized(kind: str) -> torch.nn.Module:
    block = _mlp()
    if kind == "weight_norm":
        P.weight_norm(block[0])
    elif kind == "spectral_norm":
        P.spectral_norm(block[2])
    elif kind == "old_weight_norm":  # a forward pre-hook of the Linear, inside the block
        torch.nn.utils.weight_norm(block[0])
    elif kind == "prune":  # a mask applied by a forward pre-hook of the Linear
        prune.l1_unstructured(block[0], name="weight", amount=0.5)
    return _net(block)


@pytest.mark.parametrize("options", MODES)
@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm", "old_weight_norm", "prune"])
def test_parametrized_and_pruned_layers_inside_marked_blocks(kind, options):
    torch.manual_seed(3)
    base = _parametrized(kind)
    torch.manual_seed(3)  # the same model again (deepcopy refuses old weight_norm and prune)
    marked = _parametrized(kind)
    remat.recompute_module(marked[1], **options)
    want_grads, want_state = _train(base)
    got_grads, got_state = _train(marked)
    assert_bitwise_equal(got_grads, want_grads)
    assert_bitwise_equal(got_state, want_state)  # spectral_norm's u and v updated once per step


@pytest.mark.parametrize("options", MODES)
def test_prune_on_the_marked_module_itself(options):
    torch.manual_seed(4)
    base = _net(torch.nn.Linear(8, 8))
    marked = copy.deepcopy(base)
    prune.random_unstructured(base[1], name="weight", amount=0.5)  # the same mask on both
    prune.custom_from_mask(marked[1], name="weight", mask=base[1].weight_mask.clone())
    remat.recompute_module(marked[1], **options)
    want, _ = _train(base)
    got, _ = _train(marked)
    assert_bitwise_equal(got, want)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpoint_around_a_marked_module(use_reentrant):
    torch.manual_seed(5)
    base = _mlp()
    marked = _mlp()
    marked.load_state_dict(base.state_dict())
    remat.recompute_module(marked)  # the outer region re-runs it: its mark opens again, as in forward
    x = torch.randn(4, 8, requires_grad=True)
    base(x).sum().backward()
    remat.checkpoint(marked, x, use_reentrant=use_reentrant).sum().backward()
    assert_bitwise_equal([p.grad for p in marked.parameters()], [p.grad for p in base.parameters()])


class _Capturing(torch.nn.Module):
    """A block whose activation's forward hook appends the output to ``self.captured``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.act, self.captured = torch.nn.Linear(8, 8), torch.nn.Tanh(), []
        self.act.register_forward_hook(lambda module, args, out: self.captured.append(out))

    def forward(self, x):
        return self.act(self.fc(x))


@pytest.mark.parametrize("options", [None, {}, {"use_reentrant": True}, {"output_recompute": True}],
                         ids=["unmarked", "non-reentrant", "reentrant", "output_recompute"])
def test_a_capture_list_the_module_drops_without_emptying_is_freed(options):
    """A hook appends the block's output (and, in the re-run, the re-run's) to a list the
    module holds; each step the model rebinds the list without emptying it. The region kept
    the list in its copy of the module's attributes, and the list's tensors led back to the
    region through autograd (its Function, or the re-run's saved-tensor hook): a cycle Python's
    collector cannot free, 5 (reentrant) and 9 (output_recompute) tensors more every step.
    Every tensor a list held must be freed once the model is gone (watched by weak
    references: a count of every live tensor saw an earlier test's tensors let go under
    pytest-xdist, on the code before and after)."""
    held: list[weakref.ref] = []

    def train(steps: int) -> None:
        model = torch.nn.Sequential(_Capturing(), _Capturing())
        if options is not None:
            remat.apply(model, where=_Capturing, **options)
        for _ in range(steps):
            model(torch.randn(4, 8, requires_grad=True)).sum().backward()
            for block in model:
                assert block.captured  # the hook ran
                held.extend(weakref.ref(t) for t in block.captured)
                block.captured = []

    train(3)
    gc.collect()
    assert len(held) >= 6 and [r for r in held if r() is not None] == []


class _SideLossBlock(torch.nn.Module):
    """A block whose linear records its outputs in a list on itself (its forward hook), the
    last of which the step adds to the loss (a router's balancing loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.fc.register_forward_hook(lambda m, args, out: m.__dict__.setdefault("captured", []).append(out))

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


@pytest.mark.parametrize("inner", [{}, {"output_recompute": True}], ids=["cell", "output_recompute"])
def test_a_capture_list_of_a_marked_child_inside_a_marked_block_is_freed(inner):
    """NOTE [Regions made inside a re-run]: the block's re-run runs the linear's mark again,
    which opens a region that copies the linear's attributes, the list among them; the
    re-run's output, appended to that list by the hook, leads back to that region through
    autograd. Once the model rebinds the list, nothing but that cycle held it: every step's
    tensors stayed alive (own fuzz case 1776). The region now lets go of its copies when the
    backward that made it ends."""
    from remat._engine import outputs

    held: list[weakref.ref] = []  # every tensor a list held (see the test above)

    def train(steps: int) -> None:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), _SideLossBlock(), torch.nn.Linear(8, 8))
        remat.apply(model, where=torch.nn.Linear, **inner)
        remat.recompute_module(model[1])
        x = torch.randn(2, 3, 8)
        for _ in range(steps):
            loss = model(x).square().mean() + model[1].fc.captured.pop().square().mean()
            loss.backward()
            held.extend(weakref.ref(t) for t in model[1].fc.captured)  # the re-run's
            model[1].fc.captured = []  # rebound, not emptied

    train(3)
    gc.collect()
    assert not outputs._registry
    assert held and [r for r in held if r() is not None] == []


def test_a_backward_through_a_re_runs_capture_is_refused():
    """The list holds the re-run's output too (hooks run again in a re-run, as with torch's
    checkpoint); differentiating that tensor later reaches a region made for the re-run's
    backward only: a RecomputeError says so, not a re-run with its copies gone."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), _SideLossBlock(), torch.nn.Linear(8, 8))
    remat.apply(model, where=torch.nn.Linear)
    remat.recompute_module(model[1])
    x = torch.randn(2, 3, 8)
    for _ in range(2):  # the list exists from the second forward on: its re-run appends to it
        loss = model(x).square().mean() + model[1].fc.captured.pop().square().mean()
        loss.backward()
    (rerun,) = model[1].fc.captured
    with pytest.raises(remat.RecomputeError, match="made inside another region's re-run"):
        rerun.sum().backward()


@pytest.mark.parametrize("outer", [{}, {"use_reentrant": True}], ids=["outer", "outer_reentrant"])
@pytest.mark.parametrize("inner", [{}, {"output_recompute": True}], ids=["cell", "output_recompute"])
def test_a_gradient_penalty_through_regions_made_inside_a_re_run(inner, outer):
    """Under ``create_graph=True`` what the re-run builds, the regions its marked children
    open included, is differentiated again by the penalty's backward: they do not expire
    with the first backward (NOTE [Regions made inside a re-run])."""
    def penalty_grads(marked: bool) -> list:
        torch.manual_seed(0)
        block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), block, torch.nn.Linear(8, 8))
        if marked:
            remat.apply(model, where=torch.nn.Linear, **inner)
            remat.recompute_module(model[1], **outer)
        x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
        (gx,) = torch.autograd.grad(model(x).square().mean(), x, create_graph=True)
        gx.square().sum().backward()
        return [p.grad for p in model.parameters()]

    if not outer:
        assert_bitwise_equal(penalty_grads(True), penalty_grads(False))
        return
    # a reentrant region's nested backward may sum in another order: the documented tolerance
    from tests.fuzz_models import REENTRANT_ATOL, REENTRANT_RTOL

    for got, want in zip(penalty_grads(True), penalty_grads(False), strict=True):
        torch.testing.assert_close(got, want, rtol=REENTRANT_RTOL, atol=REENTRANT_ATOL)


@pytest.mark.parametrize("options", [{}, {"output_recompute": True},
                                     {"policy": remat.save_calls("aten::addmm#0")}],
                         ids=["non-reentrant", "output_recompute", "policy"])
@pytest.mark.parametrize("refusing", [{}, {"use_reentrant": True}], ids=["refused", "refused_reentrant"])
def test_a_refused_backward_lets_go_of_the_regions_it_never_reached(options, refusing):
    """NOTE [Backward refused]: a backward remat refuses (here: the last block's weight changed
    in place after its forward) stops before the first block's backward runs. That block's copy
    of its modules' attributes held the list its linear's hook appends to, and the list's tensor
    led back to the region through autograd: once the model rebinds the list, a cycle Python's
    collector cannot free kept the step's tensors (and an output_recompute output registered)
    while the model lived (own fuzz case 6219). The refusal now lets go of every region whose
    backward it will never reach; a later backward through them is refused, not re-run."""
    from remat._engine import outputs

    torch.manual_seed(0)
    model = torch.nn.Sequential(_SideLossBlock(), torch.nn.Linear(8, 8))
    remat.recompute_module(model[0], **options)
    remat.recompute_module(model[1], **refusing)
    x = torch.randn(2, 3, 8, requires_grad=True)
    model(x).sum().backward()  # the list exists from the second forward on
    model[0].fc.captured = []
    h = model[0](x)
    out = model[1](h)
    held = [weakref.ref(t) for t in model[0].fc.captured]
    with torch.no_grad():
        model[1].weight.add_(1.0)
    with pytest.raises(remat.RecomputeError, match="changed in place after the region's forward"):
        out.sum().backward()
    with pytest.raises(remat.RecomputeError, match="whose backward remat refused"):
        h.sum().backward()
    model[0].fc.captured = []  # rebound, not emptied
    del h, out
    gc.collect()
    assert held and [r for r in held if r() is not None] == []
    assert not outputs._registry and not outputs.hook_active()


@pytest.mark.parametrize("options", [{}, {"output_recompute": True}], ids=["non-reentrant", "output_recompute"])
@pytest.mark.parametrize("workaround", ["no_grad", "cleared"])
def test_a_forward_never_differentiated_frees_its_captures_the_documented_ways(options, workaround):
    """The docs' limit (NOTE [Backward refused]): a forward no backward differentiates keeps a
    rebound capture list alive through its region's copies; under ``torch.no_grad()``, or with
    the list emptied in place, every captured tensor is freed."""
    from remat._engine import outputs

    model = torch.nn.Sequential(_SideLossBlock(), torch.nn.Linear(8, 8))
    remat.recompute_module(model[0], **options)
    x = torch.randn(2, 3, 8, requires_grad=True)
    model(x).sum().backward()
    model[0].fc.captured = []
    held = []
    for _ in range(3):  # validation forwards, never differentiated
        if workaround == "no_grad":
            with torch.no_grad():
                model(x)
        else:
            model(x)
        held.extend(weakref.ref(t) for t in model[0].fc.captured)
        model[0].fc.captured.clear()
    gc.collect()
    assert len(held) == 3 and [r for r in held if r() is not None] == []
    assert not outputs._registry
