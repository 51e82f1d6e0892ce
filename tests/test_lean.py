"""The lean path of reentrant module regions (NOTE [Lean reentrant calls] in ``_engine/lean.py``).

Each case runs three steps (the first observed, the next two on the facts) and is bitwise
against the unmarked model; the counts say which path each call took, so a case that
should go lean and does not, or one that should leave it and does not, fails.
"""

from __future__ import annotations

import copy

import pytest
import torch

import remat
from remat._engine import lean as _lean
from remat._engine import reentrant_backward as _backward
from tests._harness import assert_bitwise_equal


def _count(monkeypatch) -> dict:
    """How many calls opened lean, closed lean and went back through the lean backward."""
    seen = {"open": 0, "close": 0, "backward": 0}
    open_frame, close, backward = _lean.open_frame, _lean.close, _backward._lean

    def counting_open(*args):
        frame, lean = open_frame(*args)
        seen["open"] += lean
        return frame, lean

    def counting_close(frame, output):
        result = close(frame, output)
        seen["close"] += result is not None
        return result

    def counting_backward(*args):
        seen["backward"] += 1
        return backward(*args)

    monkeypatch.setattr(_lean, "open_frame", counting_open)
    monkeypatch.setattr(_lean, "close", counting_close)
    monkeypatch.setattr(_backward, "_lean", counting_backward)
    return seen


class Block(torch.nn.Module):
    """``kind`` picks what the forward returns: a tensor, a tuple, a view, its argument."""

    def __init__(self, kind: str = "tensor") -> None:
        super().__init__()
        self.fc, self.kind = torch.nn.Linear(4, 4), kind

    def forward(self, x, *, mask=None, scale=1.0):
        h = torch.tanh(self.fc(x)) * scale
        if mask is not None:
            h = h * mask
        if self.kind == "tuple":
            return h, h.sum(-1)
        if self.kind == "view":
            return h.t()
        if self.kind == "argument":
            return x, h
        return h


WEIGHTS = torch.randn(2, 4)


def _train(model: torch.nn.Module, call, steps: int = 3, create_graph: bool = False) -> list:
    g = torch.Generator().manual_seed(0)
    got = []
    for _ in range(steps):
        model.zero_grad()
        x = torch.randn(2, 4, generator=g).requires_grad_()
        out = call(model, x)
        outs = out if isinstance(out, tuple) else (out,)
        if create_graph:  # a gradient penalty: the re-run's graph is differentiated again (the
            # loss linear in the output: one the output's gradient depends on reaches the
            # parameters through a second re-run, a separate sum, rounding as documented)
            (gx,) = torch.autograd.grad((outs[0] * WEIGHTS).sum(), x, create_graph=True)
            loss = gx.pow(2).sum()
        else:
            loss = sum(o.pow(2).sum() for o in outs)
        loss.backward()
        got += [x.grad, *(p.grad for p in model.parameters())]
    return got


def _compare(monkeypatch, kind: str, call, create_graph: bool = False) -> dict:
    torch.manual_seed(0)
    base = Block(kind)
    marked = remat.recompute_module(copy.deepcopy(base), use_reentrant=True)
    want = _train(base, call, create_graph=create_graph)
    seen = _count(monkeypatch)
    assert_bitwise_equal(_train(marked, call, create_graph=create_graph), want)
    return seen


MASK = torch.rand(2, 4)


@pytest.mark.parametrize("keywords", [False, True])
def test_a_plain_call_goes_lean_after_its_first_and_trains_bitwise(monkeypatch, keywords):
    def call(model, x):
        return model(x, mask=MASK, scale=0.5) if keywords else model(x)

    assert _compare(monkeypatch, "tensor", call) == {"open": 2, "close": 2, "backward": 2}


@pytest.mark.parametrize("kind", ["tuple", "view", "argument"])
def test_an_output_the_lean_close_does_not_take_goes_through_the_generic_one(monkeypatch, kind):
    seen = _compare(monkeypatch, kind, lambda model, x: model(x))
    assert seen == {"open": 2, "close": 0, "backward": 0}


def test_a_gradient_penalty_leaves_the_lean_backward(monkeypatch):
    seen = _compare(monkeypatch, "tensor", lambda model, x: model(x), create_graph=True)
    assert seen == {"open": 2, "close": 2, "backward": 0}


def test_a_parameter_hook_registered_after_forward_leaves_the_lean_backward(monkeypatch):
    """A hook on a parameter is silenced in the nested backward and runs once, when the
    Function hands the gradient on: the generic backward does that."""
    torch.manual_seed(0)
    base = Block()
    marked = remat.recompute_module(copy.deepcopy(base), use_reentrant=True)
    x = torch.randn(2, 4, requires_grad=True)
    marked(x).sum().backward()  # observed
    seen = _count(monkeypatch)
    calls = []
    out, want = marked(x), base(x)
    for model in (marked, base):
        model.fc.weight.register_hook(lambda g: calls.append(g.clone()))
    out.sum().backward()
    want.sum().backward()
    assert seen == {"open": 1, "close": 1, "backward": 0}
    assert len(calls) == 2
    assert_bitwise_equal(calls[0], calls[1])


def test_an_argument_repeated_in_a_call_does_not_go_lean(monkeypatch):
    class Twice(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, a, b):
            return torch.tanh(self.fc(a)) * b

    torch.manual_seed(0)
    base = Twice()
    marked = remat.recompute_module(copy.deepcopy(base), use_reentrant=True)
    want = _train(base, lambda model, x: model(x, x))
    seen = _count(monkeypatch)
    assert_bitwise_equal(_train(marked, lambda model, x: model(x, x)), want)
    assert seen == {"open": 0, "close": 0, "backward": 0}


def test_a_re_run_that_returns_another_structure_is_refused(monkeypatch):
    """The forward returned a tensor, the re-run (a branch on a flag changed before
    backward, which remat cannot see) a tuple: refused, not paired by guess."""
    flag = [False]

    class Branches(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x):
            h = torch.tanh(self.fc(x))
            return (h, h.sum()) if flag[0] else h

    block = remat.recompute_module(Branches(), use_reentrant=True)
    x = torch.randn(2, 4, requires_grad=True)
    block(x).sum().backward()  # observed
    before = [x.grad.clone(), *(p.grad.clone() for p in block.parameters())]
    seen = _count(monkeypatch)
    out = block(x)
    flag[0] = True
    with pytest.raises(remat.RecomputeError, match="re-run in backward returned tuple"):
        out.sum().backward()
    assert seen == {"open": 1, "close": 1, "backward": 1}
    assert_bitwise_equal([x.grad, *(p.grad for p in block.parameters())], before)  # nothing changed


class _Gain(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.spare = torch.nn.Linear(4, 4), 2.0

    def forward(self, x):
        return torch.tanh(self.fc(x)) * getattr(self, "gain", 1.0)


def test_an_attribute_swapped_for_another_under_the_same_count_is_seen(monkeypatch):
    """A key removed and another added keep the ``__dict__``'s size: the tree check still
    sees it (the values are read under the keys seen: a key gone is a change)."""
    torch.manual_seed(0)
    base = _Gain()
    marked = remat.recompute_module(copy.deepcopy(base), use_reentrant=True)
    seen = _count(monkeypatch)
    g = torch.Generator().manual_seed(0)
    for step in range(4):
        if step == 2:
            for m in (base, marked):
                del m.spare
                m.gain = 3.0
        x = torch.randn(2, 4, generator=g)
        got = []
        for m in (base, marked):
            m.zero_grad()
            xi = x.clone().requires_grad_()
            m(xi).pow(2).sum().backward()
            got.append([xi.grad, *(p.grad for p in m.parameters())])
        assert_bitwise_equal(got[1], got[0])
    assert seen["open"] == 2  # steps 1 and 3 on the facts; 0 and 2 (the tree changed) observed


def test_attribute_getters_read_every_key_or_raise():
    from remat._engine.tree import _getter

    for keys in ((), ("a",), ("a", "b")):
        d = {k: object() for k in keys}
        assert _getter(keys)(d) == tuple(d[k] for k in keys)
        if keys:
            with pytest.raises(KeyError):
                _getter(keys)({})


def test_a_module_without_a_hook_dictionary_reads_as_one_without_hooks():
    from remat._engine.tree import _STRIDE, _dicts

    full, bare = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    del bare.__dict__["_backward_pre_hooks"]
    got = _dicts([full, bare])  # kind by kind: the __dicts__, then each registry of both
    assert len(got) == 2 * _STRIDE
    assert got[1] is bare.__dict__ and got[3] is bare._parameters
    assert [len(d) for d in got[9::2]] == [0, 0, 0, 0]
    assert got[8::2] == [full._forward_hooks, full._forward_pre_hooks, full._backward_hooks,
                         full._backward_pre_hooks]
