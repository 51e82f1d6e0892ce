"""Nested regions: torch's own nesting tests, and a region over a module that is itself marked.

Part 1 is a port of ``TestNestedCheckpoint`` from torch 2.13's ``test/test_autograd.py``
(pytorch/pytorch), with ``remat.checkpoint`` in place of ``torch.utils.checkpoint.checkpoint``
and ``remat.set_checkpoint_early_stop`` in place of torch's; torch's assertions are kept.
"""

from __future__ import annotations

import collections
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import remat

EARLY_STOP = [True, False]


# -- Part 1: torch's TestNestedCheckpoint ----------------------------------------------


def grad(fn):
    def wrapper(x):
        with torch.enable_grad():
            out = fn(x)
            (grad_input,) = torch.autograd.grad(out, inputs=(x,), create_graph=True)
        return grad_input

    return wrapper


def sum_(fn):
    def wrapped(x):
        return fn(x).sum()

    return wrapped


def c(fn):
    def wrapped(*args, **kwargs):
        return remat.checkpoint(fn, *args, use_reentrant=False, **kwargs)

    return wrapped


def get_tests(fn):
    return (
        # function <> tuple of function arbitrarily wrapped in checkpoint in various ways
        (fn, (c(fn), c(c(fn)))),
        (grad(fn), (grad(c(fn)), grad(c(c(fn))))),
        (grad(grad(fn)), (grad(c(grad(fn))), c(grad(grad(c(fn)))), grad(c(grad(c(fn)))))),
        (grad(grad(grad(fn))), (grad(c(grad(grad(c(fn))))), grad(c(grad(c(grad(c(fn)))))))),
    )


def check_graph_dies(fn):
    def iter_graph(roots):
        seen = set()
        q = collections.deque()
        for node in roots:
            if node is not None:
                seen.add(node)
                q.append(node)
        while q:
            node = q.popleft()
            for fn_, _idx in node.next_functions:
                if fn_ in seen or fn_ is None:
                    continue
                seen.add(fn_)
                q.append(fn_)
            yield node

    class Handle:
        def __init__(self, node_name):
            self.node_name = node_name

    def scope():
        a = torch.randn((), requires_grad=True)
        out = fn(a)
        refs = []
        for node in iter_graph([out.grad_fn]):
            handle = Handle(node.name())
            refs.append(weakref.ref(handle))
            node.metadata["blah"] = handle
        return refs

    refs = scope()
    node_names = [ref().node_name for ref in refs if ref() is not None]
    assert node_names == [], f"nodes still alive: {node_names}"


@pytest.mark.parametrize("early_stop", EARLY_STOP)
def test_nested_checkpoint(early_stop):
    with remat.set_checkpoint_early_stop(early_stop):
        x = torch.randn((), requires_grad=True)

        def f(x):
            return x.sin().exp().sin()

        def g(x):
            a = x.sin().exp().sin()
            b = x.sin().exp().sin()
            torch.autograd.grad(a, x)
            torch.autograd.grad(b, x)
            return x.sin()

        for fn in (f, g):
            for expected_fn, actual_fns in get_tests(fn):
                expected = expected_fn(x)
                for actual_fn in actual_fns:
                    actual = actual_fn(x)
                    assert torch.allclose(expected, actual)
                    check_graph_dies(actual_fn)


@pytest.mark.parametrize("early_stop", EARLY_STOP)
def test_nested_checkpoint_two_children(early_stop):
    with remat.set_checkpoint_early_stop(early_stop):

        def f(x):
            return x.sin().exp().sin()

        def g(x):
            return x.cos().sin().exp()

        def hc(x):
            return c(g)(c(f)(x))

        def h(x):
            return g(f(x))

        a = torch.randn(3, 3, requires_grad=True)
        expected = grad(sum_(grad(sum_(h))))(a)
        actual = grad(sum_(grad(sum_(c(hc)))))(a)
        assert torch.allclose(expected, actual)

        actual = grad(sum_(c(grad(sum_(c(hc))))))(a)
        assert torch.allclose(expected, actual)

        check_graph_dies(grad(c(hc)))
        check_graph_dies(grad(sum_(grad(sum_(c(hc))))))
        check_graph_dies(grad(sum_(c(grad(sum_(c(hc)))))))


@pytest.mark.parametrize("early_stop", EARLY_STOP)
def test_nested_checkpoint_non_tensor_inputs_and_outputs(early_stop):
    def fn(k, a, b, f):
        return f(k * a * b.exp()), 1, "abcd"

    k = 3
    a = torch.tensor(2.0, requires_grad=True)
    b = torch.tensor(3.0, requires_grad=True)

    def f(x):
        return x.sin()

    with remat.set_checkpoint_early_stop(early_stop):
        out, _unused1, _unused2 = remat.checkpoint(fn, k, a, b, f, use_reentrant=False)
    actual_grads = torch.autograd.grad(out, (a, b))

    out, _unused1, _unused2 = fn(k, a, b, f)
    expected_grads = torch.autograd.grad(out, (a, b))
    for actual, expected in zip(actual_grads, expected_grads):
        assert torch.allclose(actual, expected)


@pytest.mark.parametrize("early_stop", EARLY_STOP)
def test_nested_checkpoint_kwargs(early_stop):
    def fn(a, blah=None):
        out = a.sin().exp()
        if blah is not None:
            out = out * blah
        return out.sin().exp()

    a = torch.tensor(2.0, requires_grad=True)
    b = torch.tensor(3.0, requires_grad=True)

    with remat.set_checkpoint_early_stop(early_stop):
        out = remat.checkpoint(fn, a, blah=b, use_reentrant=False)
        actual_grads = torch.autograd.grad(out, (a, b))

        out = fn(a, blah=b)
        expected_grads = torch.autograd.grad(out, (a, b))
        for actual, expected in zip(actual_grads, expected_grads):
            assert torch.allclose(actual, expected)


@pytest.mark.parametrize("early_stop", EARLY_STOP)
def test_nested_checkpoint_same_graph(early_stop):
    counter = [0]

    def hook(*_unused_args):
        counter[0] += 1

    def fn(a):
        return a.sin().cos().sin()

    a = torch.tensor(1.0, requires_grad=True)

    with remat.set_checkpoint_early_stop(early_stop):
        out = remat.checkpoint(fn, a, use_reentrant=False)
    # The hook is registered on the original graph
    out.grad_fn.next_functions[0][0].register_hook(hook)
    # And backward is performed on the original graph
    out.backward()

    assert counter[0] == 1


@pytest.mark.parametrize("early_stop", EARLY_STOP)
def test_nested_checkpoint_reentrant_backwards(early_stop):
    def fn(a):
        x = a.sin().cos()
        out = x.sin()
        return x, out

    def hook(*_unused_args):
        # do backward again, but skip over the part of the graph where
        # the hook was registered
        x.backward(retain_graph=True)

    a = torch.tensor(1.0, requires_grad=True)
    with remat.set_checkpoint_early_stop(early_stop):
        x, out = remat.checkpoint(fn, a, use_reentrant=False)
    out.grad_fn.register_hook(hook)
    out.backward(retain_graph=True)


def test_nested_checkpoint_set_early_stop():
    counter = [0]

    def clone(x):
        counter[0] += 1
        return x.clone()

    def fn(x):
        # Since clone does not save anything, it is not recomputed iff
        # early stop is enabled.
        return clone(x.sin().cos())

    def run(**kwargs):
        counter[0] = 0
        a = torch.tensor(1.0, requires_grad=True)
        out = remat.checkpoint(fn, a, use_reentrant=False, **kwargs)
        out.backward()
        return counter[0]

    # Test default: early stopping is enabled by default
    assert run() == 1
    # Test local setting
    assert run(early_stop=False) == 2
    assert run(early_stop=True) == 1

    # Test context manager: early stopping is disabled for all checkpoints ran
    # under the context manager, even though it is no longer active when
    # backward/recomputation is performed.
    for enable, expected in ((False, 2), (True, 1)):
        counter[0] = 0
        a = torch.tensor(1.0, requires_grad=True)
        with remat.set_checkpoint_early_stop(enable):
            out = remat.checkpoint(fn, a, use_reentrant=False)
        out.backward()
        assert counter[0] == expected

    # Test context manager nesting
    counter[0] = 0
    a = torch.tensor(1.0, requires_grad=True)
    with remat.set_checkpoint_early_stop(False), remat.set_checkpoint_early_stop(True):
        out = remat.checkpoint(fn, a, use_reentrant=False, early_stop=False)
    out.backward()
    assert counter[0] == 1

    # Test precedence
    for enable, arg, expected in ((False, True, 2), (True, False, 1)):
        counter[0] = 0
        a = torch.tensor(1.0, requires_grad=True)
        with remat.set_checkpoint_early_stop(enable):
            out = remat.checkpoint(fn, a, use_reentrant=False, early_stop=arg)
        out.backward()
        assert counter[0] == expected


def test_nested_checkpoint_set_early_stop_no_recompution_needed():
    # Case 1: We have one tensor saved and its the input

    # We have two different counters here because in this case we actually
    # do call into x.sin() at the python level during recomputation whether
    # or not early stop is enabled. This is because the early stopping
    # only happens at the autograd level (preventing us from reaching the
    # backend).
    counter = [0]

    class SinCounterMode(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = {} if kwargs is None else kwargs
            if func is torch.ops.aten.sin.default:
                self.count += 1
            return func(*args, **kwargs)

    def fn(x):
        counter[0] += 1
        return x.sin()

    # With early stopping (enabled by default)
    a = torch.tensor(1.0, requires_grad=True)
    with SinCounterMode() as python_dispatch_counter:
        out = remat.checkpoint(fn, a, use_reentrant=False)
        out.backward()
    assert counter[0] == 2
    assert python_dispatch_counter.count == 1

    # Without early stopping
    counter = [0]
    a = torch.tensor(1.0, requires_grad=True)
    with SinCounterMode() as python_dispatch_counter:
        with remat.set_checkpoint_early_stop(False):
            out = remat.checkpoint(fn, a, use_reentrant=False)
        out.backward()
    assert counter[0] == 2
    assert python_dispatch_counter.count == 2

    # Case 2: Forward saves no tensors

    # Since unpack isn't even called, counter is 1 whether or not early stop
    # is enabled!
    counter = [0]

    def fn2(x):
        counter[0] += 1
        return x.clone()

    # With early stopping (enabled by default)
    a = torch.tensor(1.0, requires_grad=True)
    out = remat.checkpoint(fn2, a, use_reentrant=False)
    out.backward()
    assert counter[0] == 1

    # Without early stopping
    counter = [0]
    a = torch.tensor(1.0, requires_grad=True)
    with remat.set_checkpoint_early_stop(False):
        out = remat.checkpoint(fn2, a, use_reentrant=False)
    out.backward()
    assert counter[0] == 1
