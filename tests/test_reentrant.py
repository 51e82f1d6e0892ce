"""``use_reentrant=True`` regions against the unmarked model, bit for bit (NOTE [Reentrant gradients])."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import remat
from tests import fuzz_models as fm
from tests._harness import assert_bitwise_equal


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def _marks(model: nn.Module) -> dict:
    return {
        "recompute": lambda x: remat.recompute(model, x),
        "checkpoint": lambda x: remat.checkpoint(model, x, use_reentrant=True),
        "closure": lambda x: remat.checkpoint(lambda t: model(t), x, use_reentrant=True),
    }


def _param_and_input_grads(model: nn.Module, *inputs: torch.Tensor) -> list:
    return [p.grad for p in model.parameters()] + [x.grad for x in inputs]


# -- 3: create_graph=True (a gradient penalty) ----------------------------------------------
@pytest.mark.parametrize("how", ["recompute", "checkpoint", "closure"])
def test_gradient_penalty_is_differentiable_and_exact(how):
    """The gradient a reentrant region returns under create_graph=True has its graph."""
    model, x0, weights = _mlp(), torch.randn(5, 4), torch.randn(5, 3)

    def penalty(forward, model):
        x = x0.clone().requires_grad_()
        params = list(model.parameters())
        grads = torch.autograd.grad((forward(x) * weights).sum(), [x, *params], create_graph=True)
        assert grads[0].requires_grad and grads[1].requires_grad
        sum(g.pow(2).sum() for g in grads).backward()
        return _param_and_input_grads(model, x)

    plain = copy.deepcopy(model)
    assert_bitwise_equal(penalty(plain, plain), penalty(_marks(model)[how], model))


def test_gradient_penalty_through_shared_weights_is_exact():
    """A parameter used before the region and inside it: the nested backward stops at the input."""
    lin, x0 = nn.Linear(4, 4), torch.randn(3, 4)

    def run(mark):
        x = x0.clone().requires_grad_()
        h = lin(x)
        f = lambda t: lin(torch.tanh(t))
        out = remat.checkpoint(f, h, use_reentrant=True) if mark else f(h)
        (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        gx.pow(2).sum().backward()
        grads = _param_and_input_grads(lin, x)
        lin.zero_grad(set_to_none=True)
        return grads

    assert_bitwise_equal(run(False), run(True))


@pytest.mark.parametrize("loss", ["penalty_plus_loss", "penalty_of_a_square"])
def test_gradient_penalty_through_the_output_differs_at_most_in_the_last_bits(loss):
    """When the second backward also runs through the region's output (the loss is added, or
    the gradient fed to the output depends on it), that part reaches the parameters through a
    second re-run, as a separate sum (README, "Where remat differs from torch"). Before the fix
    the penalty added nothing (differences of 0.1 and more)."""
    model, x0 = _mlp(), torch.randn(5, 4)

    def run(forward, model):
        x = x0.clone().requires_grad_()
        out = forward(x)
        if loss == "penalty_plus_loss":
            (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
            (gx.pow(2).sum() + out.pow(2).sum()).backward()
        else:
            (gx,) = torch.autograd.grad(out.pow(2).sum(), x, create_graph=True)
            gx.pow(2).sum().backward()
        return _param_and_input_grads(model, x)

    plain = copy.deepcopy(model)
    for want, got in zip(run(plain, plain), run(_marks(model)["recompute"], model), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


# -- 4: a closure that reads the argument as well ----------------------------------------------
@pytest.mark.parametrize("call", ["grad", "backward"])
def test_closure_reading_the_argument_sends_both_contributions(call):
    torch.manual_seed(0)
    l0, l1, x = nn.Linear(4, 4), nn.Linear(4, 4), torch.randn(3, 4)
    params = [*l0.parameters(), *l1.parameters()]

    def run(mark):
        h = l0(x)
        f = lambda a: l1(a) * h  # reads h through the closure and as its argument
        out = remat.checkpoint(f, h, use_reentrant=True) if mark else f(h)
        if call == "grad":
            return list(torch.autograd.grad(out.pow(2).sum(), params))
        out.pow(2).sum().backward()
        grads = [p.grad for p in params]
        for p in params:
            p.grad = None
        return grads

    assert_bitwise_equal(run(False), run(True))


@pytest.mark.parametrize("call", ["backward", "grad"])
def test_closure_tensor_computed_from_the_regions_parameters(call):
    """Refused before (the nested backward ran on past ``h`` into ``lin``'s parameters); the
    re-run now reads an alias of ``h`` (NOTE [Observed reads]), so each path is counted once."""
    torch.manual_seed(0)
    lin, x, a = nn.Linear(4, 4), torch.randn(3, 4), torch.randn(3, 4, requires_grad=True)

    def run(mark):
        h = lin(x)
        f = lambda t: lin(t) * h
        out = remat.checkpoint(f, a, use_reentrant=True) if mark else f(a)
        wrt = [*lin.parameters(), a]
        if call == "grad":
            return list(torch.autograd.grad(out.pow(2).sum(), wrt))
        out.pow(2).sum().backward()
        grads = [p.grad for p in wrt]
        for p in wrt:
            p.grad = None
        return grads

    assert_bitwise_equal(run(False), run(True))


# -- 8: an in-place operator on an output that is a view --------------------------------------
@pytest.mark.parametrize("how", ["recompute", "checkpoint", "closure"])
def test_in_place_on_a_view_output(how):
    model, x0 = nn.Linear(4, 4), torch.randn(2, 3, 4)  # a 3-D input: Linear returns a view
    assert model(x0)._is_view()

    def run(forward, model):
        x = x0.clone().requires_grad_()
        out = forward(x)
        out.relu_()
        out.pow(2).sum().backward()
        return _param_and_input_grads(model, x)

    plain = copy.deepcopy(model)
    assert_bitwise_equal(run(plain, plain), run(_marks(model)[how], model))


# -- 9: a region that writes its own argument in place ----------------------------------------
class _Block(nn.Module):
    """Starts with an in-place activation on its input, as pre-activation blocks do."""

    def __init__(self) -> None:
        super().__init__()
        self.act, self.lin = nn.ReLU(inplace=True), nn.Linear(4, 4)

    def forward(self, x):
        x = self.act(x)
        return self.lin(x) * x


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("how", ["recompute", "checkpoint"])
def test_region_writing_its_argument_backward_twice(requires_grad, how):
    model, x0 = _Block(), torch.randn(3, 4)

    def run(forward, model):
        x = x0.clone().requires_grad_(requires_grad)
        a = x * 1.5
        out = forward(a)
        loss = (out.sum() + a.pow(2).sum())  # a later reader sees (and differentiates) the ReLU
        loss.backward(retain_graph=True)
        first = [g.clone() for g in _param_and_input_grads(model, *([x] if requires_grad else []))]
        loss.backward(retain_graph=True)
        return first + _param_and_input_grads(model, *([x] if requires_grad else []))

    plain = copy.deepcopy(model)
    assert_bitwise_equal(run(plain, plain), run(_marks(model)[how], model))


def test_region_reading_its_argument_before_writing_it_is_refused():
    lin = nn.Linear(4, 4)

    def f(a):
        y = a * 3  # read, then written: the re-run cannot see the old value
        a.mul_(2)
        return lin(a) + y

    out = remat.checkpoint(f, torch.randn(3, 4), use_reentrant=True)
    with pytest.raises(remat.RecomputeError, match=r"reads its argument 0 and then changes it in place"):
        out.sum().backward()


# -- 10: each parameter's gradient arrives once --------------------------------------------
@pytest.mark.parametrize("how", ["recompute", "checkpoint", "closure"])
def test_each_parameter_gradient_arrives_once(how):
    """DDP's readiness hooks sit on the gradient accumulators: each must run once per backward."""
    model = _mlp()
    calls: dict[int, int] = {}
    keep = []
    for i, p in enumerate(model.parameters()):
        acc = p.view_as(p).grad_fn.next_functions[0][0]
        acc.register_hook(lambda *_, i=i: calls.__setitem__(i, calls.get(i, 0) + 1))
        keep.append(acc)
    x = torch.randn(5, 4, requires_grad=True)
    _marks(model)[how](x).sum().backward()
    assert calls == {i: 1 for i in range(4)}
    grads = _param_and_input_grads(model, x)
    plain = copy.deepcopy(model)
    for p in plain.parameters():
        p.grad = None
    y = x.detach().clone().requires_grad_()
    plain(y).sum().backward()
    assert_bitwise_equal(_param_and_input_grads(plain, y), grads)


def test_backward_with_inputs_gets_only_those():
    model, x = _mlp(), torch.randn(5, 4, requires_grad=True)
    first = model[0].weight
    remat.recompute(model, x).sum().backward(inputs=[first])
    assert first.grad is not None and x.grad is None
    assert all(p.grad is None for p in model.parameters() if p is not first)
    plain = copy.deepcopy(model)
    plain[0].weight.grad = None
    plain(x.detach()).sum().backward(inputs=[plain[0].weight])
    assert torch.equal(first.grad, plain[0].weight.grad)


# -- the one place a reentrant region is not bitwise --------------------------------------
class _Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.a(x) * self.b(x)  # x read twice inside


@pytest.mark.parametrize("outside", [False, True])
def test_gradients_bitwise_unless_read_twice_inside_and_also_outside(outside):
    """Bitwise, except for a tensor read twice inside the region and again outside it: the
    region's contributions are summed before the engine adds the outside one (README, "Where
    remat differs from torch"), so that tensor's gradient may differ in the last bit."""
    torch.manual_seed(3)
    block, x0 = _Twice(), torch.randn(64, 8)

    def run(reentrant):
        model = copy.deepcopy(block)
        x = x0.clone().requires_grad_()
        h = torch.sin(x)
        out = remat.checkpoint(model, h, use_reentrant=reentrant)
        loss = out.sum() + (h.pow(2).sum() if outside else 0)
        loss.backward()
        return _param_and_input_grads(model, x)

    plain = copy.deepcopy(block)
    x = x0.clone().requires_grad_()
    h = torch.sin(x)
    (plain(h).sum() + (h.pow(2).sum() if outside else 0)).backward()
    want = _param_and_input_grads(plain, x)
    assert_bitwise_equal(want, run(False))
    got = run(True)
    assert_bitwise_equal(want[:-1], got[:-1])  # the parameters: bitwise
    if outside:
        torch.testing.assert_close(got[-1], want[-1], rtol=1e-6, atol=1e-7)
    else:
        assert torch.equal(got[-1], want[-1])


# -- a parameter's own gradient hooks run once (fuzz: 383 of 1200 cases) -------------------
class _Nested(nn.Module):
    """A reentrant region inside a reentrant region."""

    def __init__(self) -> None:
        super().__init__()
        self.inner, self.out = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):
        return self.out(torch.tanh(remat.checkpoint(self.inner, x, use_reentrant=True)))


class _KeepsWeightsAside(nn.Module):
    """Reads its parameters through a list (as ``nn.RNNBase._flat_weights`` does)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.flat = [self.lin.weight]

    def forward(self, x):
        return self.lin(x) + x[:, :3] @ self.flat[0][:, :3]


def _hooked(model: nn.Module) -> list:
    """Scale every parameter's gradient by a hook (applied twice: a wrong gradient); count calls."""
    calls = [0] * len(list(model.parameters()))

    def hook(g, i):
        calls[i] += 1
        return g * 0.5

    for i, p in enumerate(model.parameters()):
        p.register_hook(lambda g, i=i: hook(g, i))
    return calls


@pytest.mark.parametrize("call", ["backward", "grad", "penalty"])
@pytest.mark.parametrize("how", ["recompute", "checkpoint", "closure", "nested", "aside"])
def test_parameter_gradient_hooks_run_once(how, call):
    """The nested backward captures each gradient at an alias of the parameter, not at the
    parameter itself, so ``param.register_hook`` runs once per backward, as without marks.
    Before the fix it ran twice (inside the nested backward and again when the Function
    returned the gradient): a hook that scales the gradient was applied twice."""
    torch.manual_seed(0)
    model = {"nested": _Nested, "aside": _KeepsWeightsAside}.get(how, _mlp)()
    x0, weights = torch.randn(5, 4), torch.randn(5, 3)

    def run(model, forward):  # a linear loss: the penalty is bitwise (see the test above)
        calls = _hooked(model)
        x = x0.clone().requires_grad_()
        loss = (forward(x) * weights).sum()
        params = list(model.parameters())
        if call == "backward":
            loss.backward()
            grads = _param_and_input_grads(model, x)
        elif call == "grad":
            grads = list(torch.autograd.grad(loss, [x, *params]))
        else:
            (gx,) = torch.autograd.grad(loss, x, create_graph=True)
            gx.pow(2).sum().backward()
            grads = _param_and_input_grads(model, x)
        return grads, calls

    plain = copy.deepcopy(model)
    want, want_calls = run(plain, plain)
    if how in ("nested", "aside"):
        forward = lambda x: remat.checkpoint(model, x, use_reentrant=True)
    else:
        forward = _marks(model)[how]
    got, got_calls = run(model, forward)
    assert got_calls == want_calls
    assert_bitwise_equal(want, got)


def test_parametrized_module_in_a_reentrant_region():
    """A parametrization reads its original parameter through its own module: aliased too."""
    from torch.nn.utils import parametrize

    class Symmetric(nn.Module):
        def forward(self, w):
            return w.triu() + w.triu(1).transpose(0, 1)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    parametrize.register_parametrization(model[0], "weight", Symmetric())
    x0 = torch.randn(5, 4)

    def run(model, forward):
        calls = _hooked(model)
        x = x0.clone().requires_grad_()
        forward(x).pow(2).sum().backward()
        return _param_and_input_grads(model, x), calls

    plain = copy.deepcopy(model)
    want = run(plain, plain)
    got = run(model, lambda x: remat.checkpoint(model, x, use_reentrant=True))
    assert got[1] == want[1]
    assert_bitwise_equal(want[0], got[0])
    assert isinstance(model[0].parametrizations.weight.original, nn.Parameter)  # restored


# -- a region that writes its argument in place: a view, and a gradient penalty -----------
class _WritesArgument(nn.Module):
    """Writes its argument in place before reading it (legal without marks)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        x.mul_(0.5)
        return torch.tanh(self.lin(x))


@pytest.mark.parametrize("readers", [1, 2])
@pytest.mark.parametrize("how", ["recompute", "checkpoint", "closure"])
def test_region_writing_an_argument_that_is_a_view(how, readers):
    """Fuzz case 50: the argument is a transpose of another tensor. Before the fix autograd
    refused the Function ("If your Function modifies inplace an input that is a view of
    another Tensor, your Function cannot return more than one Tensor"); now the base is
    marked instead, and the base's later readers and the view's both differentiate through
    the write, bitwise."""
    torch.manual_seed(0)
    model, x0 = _WritesArgument(), torch.randn(4, 3)

    def run(forward, model):
        x = x0.clone().requires_grad_()
        base = x * 1.5
        view = base.t()  # (3, 4), a view: the region writes it
        out = forward(view)
        loss = out.pow(2).sum() + (base * torch.arange(3.0)).sum() + view[0].sum() * 3
        if readers == 2:
            loss = loss + base.exp().sum()
        loss.backward()
        return _param_and_input_grads(model, x)

    plain = copy.deepcopy(model)
    assert_bitwise_equal(run(plain, plain), run(_marks(model)[how], model))


@pytest.mark.parametrize("view", [False, True])
@pytest.mark.parametrize("how", ["recompute", "checkpoint"])
def test_gradient_penalty_through_a_region_writing_its_argument(how, view):
    """Before the fix the second backward ran into the region's own Function (the written
    argument's saved value leads there) and recursed without end (memory grew past 20 GB);
    now it reaches the argument's history before the write, bitwise."""
    with fm._memory_cap(2 << 30):  # a runaway recursion fails fast
        torch.manual_seed(0)
        model, x0, weights = _WritesArgument(), torch.randn(3, 4), torch.randn(3, 4)

        def run(forward, model):
            x = x0.clone().requires_grad_()
            a = x * 1.5
            arg = a.t().t() if view else a
            out = forward(arg)
            (gx,) = torch.autograd.grad((out * weights).sum() + a.sum(), x, create_graph=True)
            gx.pow(2).sum().backward()
            return _param_and_input_grads(model, x)

        plain = copy.deepcopy(model)
        assert_bitwise_equal(run(plain, plain), run(_marks(model)[how], model))


def test_region_writing_an_argument_that_shares_memory_with_another_is_refused():
    lin = nn.Linear(4, 4)

    def f(base, view):
        view.mul_(2)
        return lin(base)

    x = torch.randn(3, 4, requires_grad=True)
    base = x * 1
    with pytest.raises(remat.RecomputeError, match=r"changes in place argument 1, which shares memory"):
        remat.checkpoint(f, base, base[:2], use_reentrant=True)


# -- a tensor the region's module holds as an attribute (fuzz cases 45, 154, 395, 885) ----------
class _Memo(nn.Module):
    memo: torch.Tensor | None = None  # set by the caller before each call

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) * self.memo


class _MemoNet(nn.Module):
    def __init__(self, calls: int) -> None:
        super().__init__()
        self.a, self.b, self.calls = nn.Linear(4, 4), _Memo(), calls

    def forward(self, x):
        h = self.a(x)
        for _ in range(self.calls):  # a new memo before each call: the re-run must read the old one
            self.b.memo = torch.sigmoid(h)
            h = self.b(h)
        return h


@pytest.mark.parametrize("calls", [1, 2])
@pytest.mark.parametrize("call", ["backward", "grad"])
def test_tensor_held_as_a_module_attribute(call, calls):
    """``self.memo``, a non-leaf tensor the module reads besides its argument: before the fix
    the nested backward stopped there and its contribution to ``a.*`` and to the input was
    lost, silently. Now it is an input of the Function (NOTE [Observed reads]). With two
    calls the attribute is replaced before the first call's backward: its re-run reads the
    memo its forward read, put back for it (NOTE [Module state at the boundary]); it was
    refused before."""
    torch.manual_seed(0)
    plain, x0 = _MemoNet(calls), torch.randn(3, 4)
    marked = copy.deepcopy(plain)
    remat.recompute_module(marked.b, use_reentrant=True)

    def run(net):
        x = x0.clone().requires_grad_()
        loss = net(x).pow(2).sum()
        params = [*net.parameters(), x]
        if call == "grad":
            return list(torch.autograd.grad(loss, params))
        loss.backward()
        return [p.grad for p in params]

    want = run(plain)
    assert_bitwise_equal(want, run(marked))


class _Gated(nn.Module):
    def __init__(self, fc: nn.Linear) -> None:
        super().__init__()
        self.fc = fc

    def forward(self, x, gate=None):
        return torch.tanh(self.fc(x) + gate)


def test_closure_tensor_from_shared_weights_handed_to_a_nested_reentrant_region():
    """Shared fuzz seed 3774: the outer region reads ``h`` (computed from a weight the region
    also uses) through its closure and hands it to a marked reentrant block; the block's
    Function took ``h`` itself, not the outer re-run's alias of it, so the nested backward
    ran on past ``h`` and the region was refused. Now the engine hands it the alias."""
    torch.manual_seed(0)
    fc = nn.Linear(4, 4)
    b0, b1 = _Gated(fc), _Gated(fc)  # a shared weight
    plain = nn.ModuleList([b0, b1])
    marked = copy.deepcopy(plain)
    remat.recompute_module(marked[1], use_reentrant=True)

    def run(net, mark):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1), requires_grad=True)
        h = net[0](x, gate=x)
        f = lambda t: net[1](t, gate=h)
        out = remat.checkpoint(f, h, use_reentrant=True) if mark else f(h)
        out.pow(2).sum().backward()
        return [x.grad, *[p.grad for p in net.parameters()]]

    assert_bitwise_equal(run(plain, False), run(marked, True))


def test_an_outer_region_around_an_inner_one_whose_module_has_an_unused_parameter():
    """An unwatched inner region takes every parameter of its modules as an input of its
    Function (NOTE [Observed once, confirmed every call]), one its forward does not use
    included; the outer region's graph walk found that parameter outside its own inputs
    and refused, though no gradient reaches it (shared fuzzer seed 32202)."""

    class PassOne(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 4)  # fc2 unused

        def forward(self, x):
            return torch.tanh(self.fc1(x)), x

    torch.manual_seed(0)
    base = PassOne()
    marked = remat.recompute_module(copy.deepcopy(base), use_reentrant=True)
    x = torch.randn(3, 4, requires_grad=True)

    def run(model, call):
        a, b = call(model, x)
        loss = (a * b).sum()
        loss.backward(retain_graph=True)
        first = [p.grad.clone() if p.grad is not None else None for p in model.parameters()]
        loss.backward()
        return first + [p.grad for p in model.parameters()]

    want = run(base, lambda m, t: m(t))
    got = run(marked, lambda m, t: remat.checkpoint(m.forward, t, use_reentrant=True))
    assert_bitwise_equal(got, want)
