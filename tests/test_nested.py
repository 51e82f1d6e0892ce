"""Nested regions: torch's own nesting tests, and a region over a module that is itself marked.

Part 1 is a port of ``TestNestedCheckpoint`` from torch 2.13's ``test/test_autograd.py``
(pytorch/pytorch), with ``remat.checkpoint`` in place of ``torch.utils.checkpoint.checkpoint``
and ``remat.set_checkpoint_early_stop`` in place of torch's; torch's assertions are kept.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import remat
from tests._harness import assert_bitwise_equal_named

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
    for actual, expected in zip(actual_grads, expected_grads, strict=True):
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
        for actual, expected in zip(actual_grads, expected_grads, strict=True):
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

    def run(f, early_stop: bool) -> tuple[int, int, torch.Tensor]:
        """``(calls of f, sin dispatches, the input's gradient)`` over one forward and backward."""
        counter[0] = 0
        a = torch.tensor(1.0, requires_grad=True)
        with SinCounterMode() as python_dispatch_counter:
            with remat.set_checkpoint_early_stop(early_stop):
                out = remat.checkpoint(f, a, use_reentrant=False)
            out.backward()
        return counter[0], python_dispatch_counter.count, a.grad

    # remat reads the saved input back (NOTE [Saved arguments are read back]): nothing is
    # rebuilt, so fn is not called again, with early stopping (enabled by default) or
    # without it; torch calls fn again (counter 2) and stops before sin runs (count 1)
    for early_stop in (True, False):
        calls, sins, grad = run(fn, early_stop)
        assert (calls, sins) == (1, 1)
        assert torch.equal(grad, torch.tensor(1.0).cos())

    # Case 1b: the one tensor saved is made inside: the region is re-run as torch re-runs it
    def fn1b(x):
        counter[0] += 1
        return (x * 2).sin()

    for early_stop, sins in ((True, 1), (False, 2)):
        calls, dispatched, grad = run(fn1b, early_stop)
        assert (calls, dispatched) == (2, sins)
        assert torch.equal(grad, 2 * torch.tensor(2.0).cos())

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


# -- Backward inside a region's own forward (NOTE [Backward inside a region's forward]) --------


def _grad_inside(x):
    y = x.sin().exp()
    (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)  # re-runs the region it is in
    return (y * g).cos()


@pytest.mark.parametrize("early_stop", EARLY_STOP)
def test_backward_inside_forward(early_stop):
    x = torch.randn(3, requires_grad=True)
    expected = torch.autograd.grad(_grad_inside(x).sum(), x)
    with remat.set_checkpoint_early_stop(early_stop):
        out = remat.checkpoint(_grad_inside, x, use_reentrant=False)
    assert torch.equal(torch.autograd.grad(out.sum(), x)[0], expected[0])


def test_backward_inside_forward_still_checks_reruns_after_forward():
    def fn(x):
        out = _grad_inside(x)
        return out.exp() if remat.is_recomputing() else out  # one more saved tensor on re-runs

    x = torch.randn(3, requires_grad=True)
    with remat.set_checkpoint_early_stop(False):
        out = remat.checkpoint(fn, x, use_reentrant=False)  # its re-run inside forward: exempt
    with pytest.raises(remat.CheckpointError, match="trying to save more tensors during recomputation"):
        out.sum().backward()


# -- Part 2: a region over a module that is itself marked ---------------------------------
#
# The outer region is remat.checkpoint over the module in every form (the module, its bound
# forward, a lambda, a functools.partial), remat.recompute or remat.checkpoint_sequential; the
# module carries a mark of its own. Two SGD steps must match the unmarked model bitwise: loss,
# every gradient, batch-norm buffers and the random state.


class Nested(remat.nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Sequential(
            torch.nn.Linear(4, 4), torch.nn.GELU(), torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
        )
        self.out = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.out(self.inner(x))


class Frozen(remat.nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        self.fc1.weight.requires_grad_(False)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class Norm(remat.nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.bn, self.fc2 = torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


class Drop(remat.nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.drop, self.fc2 = torch.nn.Linear(4, 4), torch.nn.Dropout(0.5), torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.drop(self.fc1(x))))


class Net(torch.nn.Module):
    """``blk`` between two layers; ``inplace``: the block's output is written in place after it;
    ``first``: the block reads the data (which does not require grad), no layer before it."""

    def __init__(self, blk: torch.nn.Module, inplace: bool = False, first: bool = False) -> None:
        super().__init__()
        self.pre = None if first else torch.nn.Linear(4, 4)
        self.blk, self.head = blk, torch.nn.Linear(4, 2)
        self.inplace = inplace

    def forward(self, x, run=None):
        h = x if self.pre is None else self.pre(x)
        h = self.blk(h) if run is None else run(self.blk, h)
        if self.inplace:
            h = h.mul_(2).relu_()
        return self.head(h)


MODELS = {
    "nested": lambda: Net(Nested()),
    "frozen": lambda: Net(Frozen()),
    "batchnorm": lambda: Net(Norm()),
    "dropout": lambda: Net(Drop()),
    "inplace_after": lambda: Net(Nested(), inplace=True),
    "data_input": lambda: Net(Nested(), first=True),
}

MARKS = {
    "module": lambda blk: remat.recompute_module(blk),
    "module_reentrant": lambda blk: remat.recompute_module(blk, use_reentrant=True),
    "module_output": lambda blk: remat.recompute_module(blk, output_recompute=True),
    "module_early_stop_False": lambda blk: remat.recompute_module(blk, early_stop=False),
    "cell": lambda blk: blk.recompute(),
}

# outer region: (use_reentrant, early_stop argument, under set_checkpoint_early_stop(False))
OUTERS = {
    "hooks": (False, None, False),
    "hooks_early_stop_False": (False, False, False),
    "hooks_global_early_stop_False": (False, None, True),
    "reentrant": (True, None, False),
    "reentrant_global_early_stop_False": (True, None, True),
}

FORMS = ["module", "method", "lambda", "partial", "recompute", "sequential"]


def _outer(form: str, reentrant: bool, early_stop: bool | None):
    kw = {"use_reentrant": reentrant}
    if early_stop is not None:
        kw["early_stop"] = early_stop

    def run(blk, h):
        if form == "module":
            return remat.checkpoint(blk, h, **kw)
        if form == "method":
            return remat.checkpoint(blk.forward, h, **kw)
        if form == "lambda":
            return remat.checkpoint(lambda t: blk(t), h, **kw)
        if form == "partial":
            return remat.checkpoint(functools.partial(blk), h, **kw)
        if form == "recompute":
            return remat.recompute(blk, h, use_reentrant=reentrant)
        return remat.checkpoint_sequential([blk, torch.nn.Identity()], 2, h, use_reentrant=reentrant)

    return run


def _cases():
    for form in FORMS:
        for outer, (reentrant, early_stop, _) in OUTERS.items():
            if early_stop is not None and form in ("recompute", "sequential"):
                continue  # no early_stop argument there; the global switch covers them
            for mark in MARKS:
                for model in MODELS:
                    yield pytest.param(form, outer, mark, model, id=f"{form}-{outer}-{mark}-{model}")


def _state(net: torch.nn.Module) -> list:
    return [b.clone() for b in net.buffers()]


def _train(net: torch.nn.Module, run, early_stop_global: bool) -> list:
    """Two SGD steps; what must match: per step the loss, gradients, buffers and RNG state."""
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    seen = []
    for step in range(2):
        torch.manual_seed(10 + step)
        x = torch.randn(3, 4, requires_grad=net.pre is not None)
        ctx = remat.set_checkpoint_early_stop(False) if early_stop_global else contextlib.nullcontext()
        with ctx:
            loss = net(x, run).square().sum()
        loss.backward()
        seen.append(("loss", loss.detach()))
        seen += [(f"grad {name}", p.grad) for name, p in net.named_parameters()]
        seen.append(("grad x", x.grad))
        seen += [(f"buffer {name}", b.clone()) for name, b in net.named_buffers()]
        seen.append(("rng", torch.get_rng_state()))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return seen


@pytest.mark.parametrize("form, outer, mark, model", list(_cases()))
def test_region_over_marked_module(form, outer, mark, model):
    reentrant, early_stop, early_stop_global = OUTERS[outer]
    base = MODELS[model]()
    plain, marked = copy.deepcopy(base), copy.deepcopy(base)
    MARKS[mark](marked.blk)
    expected = _train(plain, None, False)
    actual = _train(marked, _outer(form, reentrant, early_stop), early_stop_global)
    assert_bitwise_equal_named(actual, expected)


def _with_grad_inside(blk, t):
    y = blk(t)
    (g,) = torch.autograd.grad(y.sum(), t, create_graph=True)  # backward inside the outer region
    return y + 0 * g


@pytest.mark.parametrize("mark", list(MARKS))
@pytest.mark.parametrize("model", ["batchnorm", "dropout"])
def test_backward_inside_outer_region_over_marked_module(mark, model):
    base = MODELS[model]()
    plain, marked = copy.deepcopy(base), copy.deepcopy(base)
    MARKS[mark](marked.blk)
    expected = _train(plain, _with_grad_inside, False)
    outer = functools.partial(remat.checkpoint, _with_grad_inside, use_reentrant=False)
    actual = _train(marked, outer, True)
    assert_bitwise_equal_named(actual, expected)
