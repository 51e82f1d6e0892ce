"""NOTE [The nested backward called directly]: the reentrant backward's nested differentiation
enters the engine as ``torch.autograd.grad`` does, without its argument handling, for plain
tensors only; what it returns is what ``torch.autograd.grad`` returns, bit for bit."""

import copy

import pytest
import torch

import remat
from remat._engine import nested


def _graph():
    torch.manual_seed(0)
    w = torch.randn(4, 4, requires_grad=True)
    b = torch.randn(4, requires_grad=True)
    unused = torch.randn(3, requires_grad=True)
    x = torch.randn(2, 4, requires_grad=True)
    y = torch.tanh(x @ w + b) * x
    return y, [x, w, b, unused], torch.randn(2, 4)


@pytest.mark.parametrize("create_graph", [False, True])
def test_it_returns_what_torch_autograd_grad_returns(create_graph):
    y, wrt, g = _graph()
    expected = torch.autograd.grad((y,), wrt, (g,), allow_unused=True, create_graph=create_graph)
    y, wrt, g = _graph()
    found = nested.grad((y,), wrt, (g,), create_graph)
    assert found[3] is None and expected[3] is None  # an input the graph does not reach
    for a, e in zip(found[:3], expected[:3], strict=True):
        assert torch.equal(a, e)
        assert a.requires_grad == e.requires_grad == create_graph


def test_a_gradient_of_another_shape_is_refused_as_by_torch():
    y, wrt, _ = _graph()
    with pytest.raises(RuntimeError, match="shape"):
        nested.grad((y,), wrt, (torch.ones(3),))


class _Tagged(torch.Tensor):
    """A tensor subclass: its ``__torch_function__`` must be honoured, so it takes torch's path."""


def test_a_subclass_a_missing_gradient_or_a_function_mode_goes_through_torch_autograd_grad(monkeypatch):
    calls = []
    real = torch.autograd.grad
    monkeypatch.setattr(torch.autograd, "grad", lambda *a, **k: calls.append(1) or real(*a, **k))
    y, wrt, g = _graph()
    nested.grad((y,), wrt, (g,))
    assert calls == []
    x = torch.randn(3).as_subclass(_Tagged).requires_grad_()
    nested.grad(((x * 2).sum(),), [x], (torch.ones(()),))
    assert calls  # (a subclass's __torch_function__ calls it once more)
    calls.clear()
    x = torch.randn(3, requires_grad=True)
    nested.grad(((x * 2).sum(),), [x], (None,))
    assert calls == [1]
    calls.clear()
    y, wrt, g = _graph()
    with torch.device("cpu"):  # a TorchFunctionMode: it sees the call, as without remat
        nested.grad((y,), wrt, (g,))
    assert calls


def test_a_lean_reentrant_backward_enters_the_engine_directly_and_stays_bitwise(monkeypatch):
    torch.manual_seed(0)
    base = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.Linear(8, 8), torch.nn.GELU())
                                 for _ in range(3)])
    marked = copy.deepcopy(base)
    remat.apply(marked, where=lambda name, m: name in ("0", "1", "2"), use_reentrant=True)
    x = torch.randn(4, 8, requires_grad=True)
    for _ in range(2):  # the first call of each region is observed
        marked(x).square().sum().backward()
    marked.zero_grad(set_to_none=True)
    x.grad = None
    calls = []
    real = torch.autograd.grad
    monkeypatch.setattr(torch.autograd, "grad", lambda *a, **k: calls.append(1) or real(*a, **k))
    marked(x).square().sum().backward()
    got = [x.grad.clone(), *(p.grad.clone() for p in marked.parameters())]
    monkeypatch.undo()
    assert calls == []
    x.grad = None
    base(x).square().sum().backward()
    want = [x.grad, *(p.grad for p in base.parameters())]
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
