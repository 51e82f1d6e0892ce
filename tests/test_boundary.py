"""State that crosses a region's boundary by an attribute, and facts observed once and re-checked.

NOTE [Module state at the boundary] (``_engine/boundary.py``), NOTE [Observed once,
confirmed every call] (``_engine/facts.py``).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.utils.prune

import remat
from remat._engine.errors import RecomputeError
from tests._harness import assert_bitwise_equal, observed_calls

MODES = {
    "non-reentrant": {},
    "reentrant": {"use_reentrant": True},
    "output_recompute": {"output_recompute": True},
    "policy": {"policy": remat.save_compute_intensive},
}


class Recurrent(torch.nn.Module):
    """Truncated BPTT: the hidden state is carried to the next call in an attribute."""

    def __init__(self, start: torch.Tensor | None = None) -> None:
        super().__init__()
        self.fc, self.out = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        self.prev = start

    def forward(self, x):
        h = torch.tanh(self.fc(x) + (0 if self.prev is None else self.prev))
        self.prev = h.detach()
        return self.out(h)


class Host(torch.nn.Module):
    def __init__(self, start) -> None:
        super().__init__()
        self.cell = Recurrent(start)

    def forward(self, x):
        return self.cell(x)


def _front(front: str, mode: dict):
    """How the cell is marked: returns (model, call)."""
    def call_plain(m, x):
        return m(x)

    if front == "recompute_module":
        return (lambda m: remat.recompute_module(m, **mode)), call_plain
    if front == "apply":
        return (lambda m: remat.apply(m, where=Recurrent, **mode)), call_plain
    if front in ("checkpoint", "lambda"):  # a lambda: the modules it calls are seen as called
        if "output_recompute" in mode or "policy" in mode:
            pytest.skip("remat.checkpoint takes torch's options only")
        if front == "lambda":
            return (lambda m: m), (lambda m, x: remat.checkpoint(lambda t: m.cell(t), x,
                                                                 use_reentrant=bool(mode)))
        return (lambda m: m), (lambda m, x: remat.checkpoint(m.cell, x, use_reentrant=bool(mode)))
    raise AssertionError(front)


def _train(model, call, chunks=3):
    """Three chunks of a sequence, one backward and one SGD step each; every gradient and state."""
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    for _ in range(chunks):
        opt.zero_grad()
        x = torch.randn(3, 4, generator=g).requires_grad_()
        call(model, x).pow(2).sum().backward()
        seen += [p.grad.clone() for p in model.parameters()] + [x.grad, model.cell.prev]
        opt.step()
    return seen


@pytest.mark.parametrize("start", ["none", "zeros"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("front", ["recompute_module", "apply", "checkpoint", "lambda"])
def test_an_attribute_rebound_across_calls_is_read_as_the_forward_read_it(front, mode, start):
    torch.manual_seed(0)
    base = Host(None if start == "none" else torch.zeros(3, 4))
    mark, call = _front(front, MODES[mode])
    marked = copy.deepcopy(base)
    mark(marked.cell if front == "recompute_module" else marked)
    want = _train(base, lambda m, x: m(x))
    assert_bitwise_equal(_train(marked, call), want)
    assert marked.cell.prev is not None


def test_an_attribute_rebound_between_forward_and_backward_is_put_back_for_the_rerun():
    torch.manual_seed(0)
    base = Host(torch.zeros(3, 4))
    marked = copy.deepcopy(base)
    remat.recompute_module(marked.cell)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(3, 4, generator=g) for _ in range(2)]
    grads = []
    for model in (base, marked):
        first = model(xs[0]).sum()
        second = model(xs[1]).sum()  # rebinds prev again before the first backward
        (first + second).backward()
        grads.append([p.grad for p in model.parameters()] + [model.cell.prev])
    assert_bitwise_equal(grads[1], grads[0])


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("swap", ["child replaced", "child removed then another added"])
def test_a_child_swapped_between_forward_and_backward_is_put_back_for_the_rerun(mode, swap):
    """Module surgery between a region's forward and its backward (an activation replaced):
    unmarked, the backward is the forward's graph; a re-run that called the new child
    trained silently wrong in every mode, before. The forward's children are put back for
    the re-run, and the new child is there again after it."""
    def build() -> torch.nn.Sequential:
        torch.manual_seed(0)
        block = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.GELU(), torch.nn.Linear(12, 6))
        return torch.nn.Sequential(torch.nn.Linear(6, 6), block, torch.nn.Linear(6, 1))

    def surgery(model: torch.nn.Sequential) -> torch.nn.Module:
        new = torch.nn.Tanh()
        if swap == "child replaced":
            model[1][1] = new
        else:
            del model[1]._modules["1"]
            model[1]._modules["1"] = new
        return new

    def step(model: torch.nn.Sequential) -> list:
        x = torch.randn(3, 6, generator=torch.Generator().manual_seed(1), requires_grad=True)
        loss = model(x).sum()
        new = surgery(model)
        keys = list(model[1]._modules)  # the new order stays after the re-run
        loss.backward()
        assert model[1]._modules["1"] is new and list(model[1]._modules) == keys
        return [x.grad] + [p.grad for p in model.parameters()]

    marked = build()
    remat.recompute_module(marked[1], **MODES[mode])
    assert_bitwise_equal(step(marked), step(build()))


class Normalizer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x):
        return torch.tanh(self.fc(x) * self.scale)


@pytest.mark.parametrize("mode", list(MODES))
def test_a_buffer_changed_in_place_after_forward_is_refused_not_read(mode):
    model = remat.recompute_module(Normalizer(), **MODES[mode])
    out = model(torch.randn(2, 4, requires_grad=True)).sum()
    with torch.no_grad():
        model.scale.mul_(2)  # the value the forward read is gone
    with pytest.raises(RecomputeError, match=r"Normalizer.scale .* changed in place"):
        out.backward()


_HANDLES: dict = {}


def _change(kind: str, model: torch.nn.Module) -> None:
    """Change what the block's forward depends on, between two calls."""
    if kind == "parameter":
        model.register_parameter("extra", torch.nn.Parameter(torch.full((4,), 0.25)))
    elif kind == "buffer":
        model.register_buffer("shift", torch.full((4,), 0.5))
    elif kind == "hook":
        model.fc.register_forward_hook(lambda m, args, out: out * 2)
    elif kind == "attribute":
        model.scale = torch.full((4,), 3.0)
    elif kind == "moved":  # the same tensor, under the same name, in another registry
        model.fc._buffers["bias"] = model.fc._parameters.pop("bias")
    elif kind == "hook replaced":  # as many hooks as before, another one (its handle kept elsewhere)
        _HANDLES.pop(id(model)).remove()
        model.fc.register_forward_pre_hook(lambda m, args: (args[0] * 3,))
    elif kind == "training":
        model.train(False)


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.scale = None

    def forward(self, x, flag=False):
        h = self.fc(x) if self.training else self.fc(x) * 0.5
        if self.scale is not None:
            h = h * self.scale
        if "extra" in self._parameters:
            h = h + self.extra
        if "shift" in self._buffers:
            h = h + self.shift
        return torch.tanh(h) * (2 if flag else 1)


@pytest.mark.parametrize("mode", ["non-reentrant", "reentrant"])
@pytest.mark.parametrize("kind", ["parameter", "buffer", "hook", "attribute", "moved", "inputs", "hook replaced",
                                  "training"])
def test_a_region_whose_module_changed_between_calls_is_observed_again(monkeypatch, kind, mode):
    torch.manual_seed(0)
    base = Block()
    if kind == "hook replaced":
        base.fc.register_forward_pre_hook(lambda m, args: (args[0] * 2,))
    marked = remat.recompute_module(copy.deepcopy(base), **MODES[mode])
    entered = observed_calls(monkeypatch)
    g = torch.Generator().manual_seed(0)

    def step(model, changed):
        model.zero_grad()
        x = torch.randn(2, 4, generator=g).requires_grad_()
        args = (x, True) if changed and kind == "inputs" else (x,)
        model(*args).pow(2).sum().backward()
        return [p.grad for p in model.parameters()] + [model.fc.bias.grad, x.grad]

    for model in (base, marked):
        if kind == "hook replaced":
            _HANDLES[id(model)] = torch.utils.hooks.RemovableHandle(model.fc._forward_pre_hooks)
            _HANDLES[id(model)].id = next(iter(model.fc._forward_pre_hooks))
        g.manual_seed(0)
        results = [step(model, False), step(model, False)]
        if kind != "inputs":
            _change(kind, model)
        results += [step(model, True), step(model, True)]
        if model is base:
            want = results
    # the first call, and the first after the change; a reentrant region whose modules
    # carry a forward hook is watched on every call (NOTE [Escapes handed back by position]),
    # and so is one that reads a tensor requiring grad that is not its modules' parameter
    watched = mode == "reentrant" and kind in ("hook", "moved")
    assert entered.count("Block") == (3 if watched else 2)
    for got, expected in zip(results, want, strict=True):
        assert_bitwise_equal(got, expected)


class SometimesWrites(torch.nn.Module):
    """Writes its buffer only on the third call: a branch on Python state remat cannot see."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.register_buffer("count", torch.zeros(()))
        self.calls = [0]  # the same list object every call: the key does not change

    def forward(self, x):
        self.calls[0] += not remat.is_recomputing()
        if self.calls[0] == 3:
            self.count.add_(1)
        return torch.tanh(self.fc(x))


def test_an_unforeseen_write_in_an_unwatched_forward_is_refused_then_watched():
    model = remat.recompute_module(SometimesWrites())
    x = torch.randn(2, 4, requires_grad=True)
    for _ in range(2):
        model(x).sum().backward()
    with pytest.raises(RecomputeError, match=r"SometimesWrites.count .* in place"):
        model(x)
    model.calls[0] = 2
    before = model.count.clone()
    out = model(x)  # watched again: the write is seen and replayed
    out.sum().backward()
    assert torch.equal(model.count, before + 1)


@pytest.mark.parametrize("mode", list(MODES))
def test_state_written_by_two_forwards_before_one_backward_ends_as_unmarked(mode):
    """A GAN discriminator on the real and the fake batch: spectral norm's power iteration
    overwrites ``_u`` (an ``out=``) and updates ``_v`` in each forward; the re-run of the
    first forward must not leave the first forward's ``_u`` behind."""
    torch.manual_seed(0)
    sn = torch.nn.utils.parametrizations.spectral_norm
    base = torch.nn.Sequential(sn(torch.nn.Linear(4, 4)), torch.nn.Tanh())
    marked = remat.recompute_module(copy.deepcopy(base), **MODES[mode])
    seen = []
    for model in (base, marked):
        g = torch.Generator().manual_seed(0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        buffers = []
        for _ in range(2):
            real, fake = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)
            opt.zero_grad()
            (model(real).sum() - model(fake).sum()).backward()
            buffers.append([b.clone() for b in model.buffers()])
            opt.step()
        seen.append(([p.grad for p in model.parameters()], buffers))
    assert_bitwise_equal(seen[1][1][0], seen[0][1][0], "buffer")  # the first step's state: exact
    if mode == "reentrant":  # the weight is read twice in each region: its two terms are summed
        # inside the nested backward first (NOTE [Reentrant gradients]): rounding, which the
        # next step's power iteration carries into the state
        torch.testing.assert_close(seen[1], seen[0], rtol=1e-5, atol=1e-6)
    else:
        assert_bitwise_equal(seen[1][0] + seen[1][1][1], seen[0][0] + seen[0][1][1])


class _Keeps(torch.nn.Module):
    """Keeps an activation on the module (attention maps kept for inspection), or is pruned
    (prune's pre-hook sets ``fc1.weight`` in every forward)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.fc1, self.fc2, self.kind, self.last = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), kind, None
        if kind == "prune":
            torch.nn.utils.prune.l1_unstructured(self.fc1, "weight", amount=0.3)

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        if self.kind == "attr":
            self.last = h
        return x + self.fc2(h)


def _live_tensors() -> int:
    import gc

    gc.collect()
    return sum(isinstance(o, torch.Tensor) for o in gc.get_objects())


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind", ["attr", "prune"])
def test_a_model_whose_blocks_keep_activations_is_freed_after_a_step(kind, mode):
    """The re-run rebound ``self.last`` to a tensor of its own, whose graph led back to the
    region: a cycle through autograd that gc cannot free (the model leaked after ``del``)."""
    start = _live_tensors()
    model = torch.nn.Sequential(_Keeps(kind), _Keeps(kind))
    remat.apply(model, where=_Keeps, **MODES[mode])
    model(torch.randn(4, 8)).pow(2).sum().backward()
    del model
    assert _live_tensors() - start <= 0  # (another test's tensors may be freed meanwhile)


class Memory(torch.nn.Module):
    """Transformer-XL style: the forward keeps its hidden state for the next call."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.prev = torch.nn.Linear(4, 4), None

    def forward(self, x):
        h = torch.tanh(self.fc(x) + (0 if self.prev is None else self.prev))
        self.prev = h.detach()
        return h


@pytest.mark.parametrize("mode", ["non-reentrant", "reentrant"])
def test_what_a_region_learned_of_its_module_holds_no_object_the_module_let_go_of(mode):
    """NOTE [Snapshots reused while nothing changed]: the per-module cache keeps identities
    and weak references only; a value the module drops is freed as without remat."""
    import gc
    import weakref

    model = remat.recompute_module(Memory(), **MODES[mode])
    for _ in range(2):
        model(torch.randn(2, 4, requires_grad=True)).sum().backward()
    kept = weakref.ref(model.prev)
    model(torch.randn(2, 4, requires_grad=True)).sum().backward()  # its forward read `kept`
    model.prev = None
    gc.collect()
    assert kept() is None
