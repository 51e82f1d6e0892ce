"""Doors other than a region's arguments and outputs: structured outputs, torch.func transforms.

Each test compares with the unmarked model bit for bit, or asserts a typed error raised
before any parameter, buffer or gradient changed.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from typing import NamedTuple

import pytest
import torch
from torch.func import functional_call, grad, jacrev, vjp

import remat
from tests._harness import assert_bitwise_equal

MODES = {
    "non-reentrant": {},
    "reentrant": {"use_reentrant": True},
    "output_recompute": {"output_recompute": True},
    "policy": {"policy": remat.save_compute_intensive},
}


@dataclasses.dataclass
class Out:
    h: torch.Tensor


class Pair(NamedTuple):
    h: torch.Tensor
    g: torch.Tensor


class Block(torch.nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.fc, self.kind = torch.nn.Linear(4, 4), kind

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        if self.kind == "dataclass":
            return Out(h)
        if self.kind == "namedtuple":
            return Pair(h, h * 2)
        return {"h": [h]}


def _tensor(out) -> torch.Tensor:
    if isinstance(out, Out):
        return out.h
    if isinstance(out, Pair):
        return out.h + out.g
    return out["h"][0]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind", ["dataclass", "namedtuple", "nested"])
def test_structured_outputs_carry_their_gradients(kind, mode):
    torch.manual_seed(0)
    stem, base, x = torch.nn.Linear(4, 4), Block(kind), torch.randn(3, 4)
    marked_stem, marked = copy.deepcopy(stem), remat.recompute_module(copy.deepcopy(base), **MODES[mode])
    _tensor(base(stem(x))).pow(2).sum().backward()
    want = [p.grad for p in (*stem.parameters(), *base.parameters())]
    _tensor(marked(marked_stem(x))).pow(2).sum().backward()
    assert_bitwise_equal([p.grad for p in (*marked_stem.parameters(), *marked.parameters())], want)


@pytest.mark.parametrize("transform", ["grad", "vjp", "jacrev"])
@pytest.mark.parametrize("mode", list(MODES))
def test_torch_func_over_a_marked_model_is_refused_with_the_alternative(mode, transform):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    x = torch.randn(3, 4)
    params = {k: v.detach() for k, v in net.named_parameters()}

    def loss(p, m):
        return functional_call(m, p, (x,)).sum()

    def run(m):
        if transform == "grad":
            return grad(loss)(params, m)
        if transform == "vjp":
            return vjp(lambda p: loss(p, m), params)[1](torch.ones(()))
        return jacrev(loss)(params, m)

    run(net)  # the unmarked model differentiates
    marked = copy.deepcopy(net)
    remat.recompute_module(marked[0], **MODES[mode])
    before = [p.clone() for p in marked.parameters()]
    with pytest.raises(remat.RecomputeError, match=r"torch.func transform.*remat.unmark"):
        run(marked)
    assert_bitwise_equal(list(marked.parameters()), before)
    remat.unmark(marked)
    run(marked)


class ForceBlock(torch.nn.Module):
    """A gradient of its own activation inside forward (a force field's -dE/dx, a PINN residual)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        dh, = torch.autograd.grad((h ** 2).sum(), h, retain_graph=True, create_graph=True)
        return x + self.fc2(h + 0.1 * dh)


INNER_GRAD_MODES = {
    "non-reentrant": {},
    "output_recompute": {"output_recompute": True},
    "policy": {"policy": remat.save_compute_intensive},
    "output_recompute+policy": {"output_recompute": True, "policy": remat.save_compute_intensive},
    "output_recompute+save_only": {"output_recompute": True, "policy": remat.save_only("aten::addmm")},
}


def _assert_same_gradients(base: torch.nn.Module, marked: torch.nn.Module) -> None:
    """One backward of each on the same input: every parameter's gradient bit for bit."""
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    got = []
    for model in (base, marked):
        model(x).pow(2).sum().backward()
        got.append([p.grad for p in model.parameters()])
    assert_bitwise_equal(got[1], got[0])


@pytest.mark.parametrize("mode", list(INNER_GRAD_MODES))
def test_gradients_taken_inside_forward_of_adjacent_regions_are_exact(mode):
    torch.manual_seed(0)
    base = torch.nn.Sequential(ForceBlock(), ForceBlock(), torch.nn.Linear(8, 2))
    marked = copy.deepcopy(base)
    remat.apply(marked, where=ForceBlock, **INNER_GRAD_MODES[mode])
    _assert_same_gradients(base, marked)


class _Checkpointed(torch.nn.Module):
    """``block`` through ``remat.checkpoint`` with ``options``."""

    def __init__(self, block: torch.nn.Module, **options) -> None:
        super().__init__()
        self.block, self.options = block, options

    def forward(self, x):
        return remat.checkpoint(self.block, x, use_reentrant=False, **self.options)


def _keep_every_call(ctx, op, *args, **kwargs):
    import torch.utils.checkpoint as tuc

    return tuc.CheckpointPolicy.MUST_SAVE


@pytest.mark.parametrize("policy", ["save_compute_intensive", "every call kept"])
def test_a_gradient_inside_forward_under_a_policy_without_early_stop_is_exact(policy):
    """The forward's own backward re-runs the region before the forward returns; without
    early stop that re-run runs past where the forward is waiting, into calls the forward has
    not made yet. It was refused as a region that is not deterministic (own fuzz case 10753;
    torch's selective checkpoint refuses a backward inside its forward)."""
    import functools

    import torch.utils.checkpoint as tuc

    torch.manual_seed(0)
    base = torch.nn.Sequential(ForceBlock(), torch.nn.Linear(8, 2))
    marked = copy.deepcopy(base)
    context = (remat.policy_context(remat.save_compute_intensive) if policy == "save_compute_intensive"
               else functools.partial(tuc.create_selective_checkpoint_contexts, _keep_every_call))
    marked[0] = _Checkpointed(marked[0], early_stop=False, context_fn=context)
    _assert_same_gradients(base, marked)


class AuxBlock(torch.nn.Module):
    """A side channel: an auxiliary loss stored on the module, or captured by a child's hook."""

    def __init__(self, channel: str) -> None:
        super().__init__()
        self.fc, self.norm = torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)
        self.channel, self.aux, self.captured = channel, None, []
        if channel == "hook":
            self.fc.register_forward_hook(lambda m, args, out: self.captured.append(out))

    def forward(self, x):
        h = torch.tanh(self.norm(self.fc(x)))
        if self.channel == "attribute":
            self.aux = h.pow(2).mean()
        return x + h

    def side_loss(self):
        return self.aux if self.channel == "attribute" else self.captured.pop().pow(2).mean()


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("channel", ["attribute", "hook"])
def test_a_loss_that_leaves_a_region_by_a_side_channel_trains(channel, mode):
    """A hook's capture under use_reentrant=True is handed back by position (NOTE [Escapes
    handed back by position]); torch's reentrant checkpoint trains it with no gradient."""
    torch.manual_seed(0)
    base = AuxBlock(channel)
    marked = _with_own_hook(copy.deepcopy(base))
    remat.recompute_module(marked, **MODES[mode])
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0), requires_grad=True)
    for model in (base, marked):
        for _ in range(2):  # the second call of a module region may run unwatched
            (model(x).sum() + model.side_loss()).backward()
    assert_bitwise_equal([p.grad for p in marked.parameters()] + list(marked.buffers()),
                         [p.grad for p in base.parameters()] + list(base.buffers()))


def _with_own_hook(marked: AuxBlock) -> AuxBlock:
    """The deep copy's hook appends to the original's list: register the copy's own."""
    if marked.channel == "hook":
        marked.fc._forward_hooks.clear()
        marked.fc.register_forward_hook(lambda m, args, out: marked.captured.append(out))
    return marked


class Collector:
    """A capture switched on for some calls only, as Hugging Face's output recorder is."""

    def __init__(self) -> None:
        self.on, self.seen = False, []

    def hook(self, module, args, out) -> None:
        if self.on:
            self.seen.append(out)


def test_a_hook_that_captures_on_a_later_call_only_is_still_watched():
    """The first call captures nothing and would teach that the region needs no
    watching; a reentrant region whose modules carry forward hooks is watched on every
    call (NOTE [Escapes handed back by position])."""
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
    marked = copy.deepcopy(base)
    remat.recompute_module(marked, use_reentrant=True)
    grads = []
    for model in (base, marked):
        collector = Collector()
        model[0].register_forward_hook(collector.hook)
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0), requires_grad=True)
        model(x).sum().backward()
        collector.on = True
        (model(x).sum() + collector.seen.pop().pow(2).sum()).backward()
        grads.append([p.grad for p in model.parameters()] + [x.grad])
    assert_bitwise_equal(grads[1], grads[0])


class Inner(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.norm = torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)

    def forward(self, x):
        return torch.tanh(self.norm(self.fc(x)))


@pytest.mark.parametrize("mode", list(MODES))
def test_a_capture_inside_a_marked_module_of_a_reentrant_function_region_trains(mode):
    """The inner region opens only in the re-run (the forward runs without grad); its own
    bookkeeping operators are not counted when the re-run finds the captured tensor."""
    torch.manual_seed(0)
    base = torch.nn.Sequential(Inner(), torch.nn.Linear(4, 4))
    marked = copy.deepcopy(base)
    remat.recompute_module(marked[0], **MODES[mode])
    grads = []
    for model in (base, marked):
        seen: list = []
        model[0].fc.register_forward_hook(lambda m, args, out, seen=seen: seen.append(out))
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0), requires_grad=True)
        for _ in range(2):
            y = (remat.checkpoint(lambda t, model=model: model(t) * 2, x, use_reentrant=True)
                 if model is marked else model(x) * 2)
            (y.sum() + seen.pop().pow(2).sum()).backward()
        grads.append([p.grad for p in model.parameters()] + [x.grad])
    assert_bitwise_equal(grads[1], grads[0])


def test_an_escape_whose_re_run_runs_other_operators_is_refused():
    """The re-run finds an escaped tensor by where the forward made it, and checks the
    operators before it: a re-run that branches otherwise is refused, never matched."""
    branch = [True]

    class Branchy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.captured = torch.nn.Linear(4, 4), []

        def forward(self, x):
            h = self.fc(x)
            h = torch.tanh(h) if branch[0] else torch.sigmoid(h)  # a global, not the module's
            self.captured.append(h * 2)
            return h

    model = remat.recompute_module(Branchy(), use_reentrant=True)
    x = torch.randn(3, 4, requires_grad=True)
    loss = model(x).sum() + model.captured.pop().sum()
    branch[0] = False
    with pytest.raises(remat.RecomputeError, match="re-run in backward runs aten.sigmoid"):
        loss.backward()
    assert model.fc.weight.grad is None and x.grad is None


def test_an_escaped_view_is_refused_under_reentrant_before_any_change():
    """A view cannot be given its history in place: refused, with the statistics put back."""

    class Viewing(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.norm, self.captured = torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), []

        def forward(self, x):
            h = self.norm(self.fc(x))
            self.captured.append(h[0])
            return h

    model = remat.recompute_module(Viewing(), use_reentrant=True)
    before = [t.clone() for t in model.state_dict().values()]
    with pytest.raises(remat.RecomputeError, match="as a view.*use_reentrant=False"):
        model(torch.randn(3, 4, requires_grad=True))
    assert_bitwise_equal(list(model.state_dict().values()), before)


def test_a_module_whose_hook_captures_is_freed_after_training():
    """The capture leads back to the region through autograd; the region lets go of its
    module after the backward (NOTE [Tensors that escape a reentrant region])."""
    import gc
    import weakref

    model = _with_own_hook(remat.recompute_module(AuxBlock("hook"), use_reentrant=True))
    (model(torch.randn(3, 4, requires_grad=True)).sum() + model.side_loss()).backward()
    model(torch.randn(3, 4, requires_grad=True))  # a capture left in the list, never used
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


def test_a_key_value_cache_passed_in_is_the_callers_container_not_an_escape():
    """A tensor stored into an object the region was called with is not refused."""

    class Cache:
        def __init__(self) -> None:
            self.keys: list = []

    class Attention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.k = torch.nn.Linear(4, 4)

        def forward(self, x, cache):
            k = self.k(x)
            cache.keys.append(k)
            return torch.tanh(k) + x

    torch.manual_seed(0)
    base = Attention()
    marked = remat.recompute_module(copy.deepcopy(base), use_reentrant=True)
    x = torch.randn(3, 4, requires_grad=True)
    caches = [Cache(), Cache()]
    base(x, caches[0]).sum().backward()
    marked(x, caches[1]).sum().backward()
    assert_bitwise_equal([p.grad for p in marked.parameters()], [p.grad for p in base.parameters()])
    # the re-run appends again, as torch's checkpoint does (NOTE [Module state at the boundary])
    assert_bitwise_equal(caches[1].keys[:1], caches[0].keys)


def test_a_gradient_inside_a_reentrant_forward_is_refused_with_the_fix():
    torch.manual_seed(0)
    model = torch.nn.Sequential(ForceBlock(), torch.nn.BatchNorm1d(8), ForceBlock())
    remat.recompute_module(model, use_reentrant=True)
    before = [t.clone() for t in model.state_dict().values()]
    with pytest.raises(remat.RecomputeError, match="differentiates inside its forward.*use_reentrant=False"):
        model(torch.randn(3, 8))
    assert_bitwise_equal(list(model.state_dict().values()), before)



class _HookedInside(torch.nn.Module):
    """A block that clips its activation's gradient with a hook, or keeps it (retain_grad)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how, self.fc1, self.fc2 = how, torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.norm = torch.nn.BatchNorm1d(8)

    def forward(self, x):
        h = torch.tanh(self.fc1(self.norm(x)))
        if self.how == "register_hook":
            h.register_hook(lambda g: g.clamp(-0.01, 0.01))
        else:
            h.retain_grad()
            self.kept = h
        return self.fc2(h)


@pytest.mark.parametrize("how", ["register_hook", "retain_grad"])
def test_a_hook_on_a_tensor_inside_a_reentrant_forward_is_refused_with_the_fix(how):
    """The reentrant forward runs without grad, so a hook on a tensor it computes fails (as in
    torch's reentrant checkpoint, with autograd's words): a RecomputeError names the fix, the
    state the forward wrote put back; use_reentrant=False trains it bitwise as unmarked."""
    torch.manual_seed(0)
    base = _HookedInside(how)
    marked, reentrant = copy.deepcopy(base), copy.deepcopy(base)
    remat.recompute_module(reentrant, use_reentrant=True)
    before = [t.clone() for t in reentrant.state_dict().values()]
    x = torch.randn(3, 8)
    with pytest.raises(remat.RecomputeError, match="registers a hook on a tensor it computes.*use_reentrant=False"):
        reentrant(x)
    assert_bitwise_equal(list(reentrant.state_dict().values()), before)
    remat.recompute_module(marked)
    for model in (base, marked):
        model(x).sum().backward()
    assert_bitwise_equal([p.grad for p in marked.parameters()], [p.grad for p in base.parameters()])


@pytest.mark.parametrize("channel", ["attribute", "hook"])
def test_a_reentrant_region_with_a_side_loss_backwards_twice_when_retained(channel):
    """It lets go of its module only after a backward that freed its graph (NOTE [Tensors
    that escape a reentrant region])."""
    torch.manual_seed(0)
    base = AuxBlock(channel)
    marked = remat.recompute_module(_with_own_hook(copy.deepcopy(base)), use_reentrant=True)
    x = torch.randn(3, 4, requires_grad=True)
    grads = []
    for model in (base, marked):
        loss = model(x).sum() + model.side_loss()
        loss.backward(retain_graph=True)
        loss.backward()
        grads.append([p.grad for p in model.parameters()])
    assert_bitwise_equal(grads[1], grads[0])

@pytest.mark.parametrize("mode", list(MODES))
def test_a_leaf_made_inside_a_region_is_its_own_temporary(mode):
    """T5 makes its position bias ``torch.zeros(..., requires_grad=True)`` inside each layer
    when gradient checkpointing is on; the reentrant re-run refused it before."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)

    def region(x):
        bias = torch.zeros(4, requires_grad=True)
        return lin(x) + bias

    x = torch.randn(2, 4, requires_grad=True)
    region(x).pow(2).sum().backward()
    want = [lin.weight.grad.clone(), lin.bias.grad.clone(), x.grad.clone()]
    lin.zero_grad()
    x.grad = None
    if mode == "reentrant":
        out = remat.checkpoint(region, x, use_reentrant=True)
    elif mode == "output_recompute":
        out = remat.recompute(region, x, output_recompute=True)
    else:
        context = remat.policy_context(remat.save_compute_intensive) if mode == "policy" else None
        out = remat.checkpoint(region, x, use_reentrant=False,
                               **({"context_fn": context} if context else {}))
    out.pow(2).sum().backward()
    assert_bitwise_equal([lin.weight.grad, lin.bias.grad, x.grad], want)


@pytest.mark.parametrize("mode", list(MODES))
def test_a_torch_reentrant_checkpoint_inside_a_region_trains(mode):
    """Hugging Face's own switch left on under remat.apply(use_reentrant=True): torch's
    reentrant checkpoint inside the region refused remat's nested torch.autograd.grad."""
    import torch.utils.checkpoint as tuc

    class Inner(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

        def forward(self, x, wrapped=False):
            if wrapped:
                x = tuc.checkpoint(self.fc1, x, use_reentrant=True)
            else:
                x = self.fc1(x)
            return self.fc2(torch.tanh(x))

    torch.manual_seed(0)
    base = Inner()
    marked = remat.recompute_module(copy.deepcopy(base), **MODES[mode])
    x = torch.randn(3, 4, requires_grad=True)
    base(x).pow(2).sum().backward()
    y = x.detach().clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: none of the inputs require grad
        marked(y, wrapped=True).pow(2).sum().backward()
    assert_bitwise_equal([p.grad for p in marked.parameters()] + [y.grad],
                         [p.grad for p in base.parameters()] + [x.grad])



class _LoRA(torch.nn.Module):
    def __init__(self, base: torch.nn.Linear, rank: int = 2) -> None:
        super().__init__()
        self.base = base
        self.a = torch.nn.Parameter(torch.randn(rank, base.in_features) * 0.1)
        self.b = torch.nn.Parameter(torch.randn(base.out_features, rank) * 0.1)

    def forward(self, x):
        return self.base(x) + x @ self.a.t() @ self.b.t()


class _Adapted(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.v = _LoRA(torch.nn.Linear(8, 8)), _LoRA(torch.nn.Linear(8, 8))
        self.o = torch.nn.Linear(8, 8)

    def forward(self, x):
        return x + self.o(torch.softmax(self.q(x), -1) * self.v(x))


@pytest.mark.parametrize("mode", list(MODES))
def test_adapters_on_a_frozen_model_train_exactly(mode):
    """LoRA-style adapters, the base frozen and no input requiring grad (token ids through a
    frozen embedding, no enable_input_require_grads): the reentrant pitfall of torch."""
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Embedding(20, 8), _Adapted(), _Adapted())
    for name, p in base.named_parameters():
        p.requires_grad_(name.endswith((".a", ".b")))
    ids = torch.randint(0, 20, (2, 5), generator=torch.Generator().manual_seed(0))

    def train(model):
        trained = [p for p in model.parameters() if p.requires_grad]
        opt, seen = torch.optim.SGD(trained, lr=0.1), []
        for _ in range(2):
            opt.zero_grad()
            model(ids).pow(2).sum().backward()
            seen += [p.grad.clone() for p in trained]
            opt.step()
        return seen

    marked = copy.deepcopy(base)
    remat.apply(marked, where=_Adapted, **MODES[mode])
    assert_bitwise_equal(train(marked), train(base))


def test_a_gradient_inside_an_inner_region_of_a_selective_region_is_exact():
    """The inner region's forward calls backward, re-running it inside the outer region's
    recomputation too; the outer replay numbered those calls as its own (own fuzz 3503)."""
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(8, 8), ForceBlock(), torch.nn.Linear(8, 8))
    marked = copy.deepcopy(base)
    remat.recompute_module(marked, policy=remat.save_compute_intensive)
    remat.recompute_module(marked[1])
    _assert_same_gradients(base, marked)
