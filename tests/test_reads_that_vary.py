"""Reentrant regions whose parameters are read on some calls only (NOTE [Reads that vary]).

A parameter a call does not read gets no gradient unmarked, and its tensor hooks are not
called. A reentrant region that handed every parameter of its modules to its Function
called them with None from its second call on (an unused parameter on every step; the
expert an MoE layer skipped; the branch a random draw did not take), so a hook that clips
its gradient failed, and counting hooks counted wrong. Each test compares gradients bit for
bit and every parameter hook's calls with the unmarked model over several steps.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat
from tests._harness import assert_bitwise_equal


class Unused(nn.Module):
    """A module with a parameter its forward never reads (a pooler left unused)."""

    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.used(x))


class RandomBranch(nn.Module):
    """One of two linears, chosen by a draw read on the host."""

    def __init__(self) -> None:
        super().__init__()
        self.left, self.right = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh((self.left if torch.rand(()).item() < 0.5 else self.right)(x))


class SkippingMoE(nn.Module):
    """Mixtral's loop: each expert runs on the tokens routed to it, and an expert no token
    chose is skipped (``torch.where(mask)``: a shape that depends on the data)."""

    def __init__(self, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(6, experts)
        self.experts = nn.ModuleList(nn.Linear(6, 6) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights = torch.softmax(self.router(flat), dim=-1)
        choice = weights.argmax(dim=-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            (tokens,) = torch.where(choice == e)
            if tokens.shape[0] == 0:
                continue
            out = out.index_add(0, tokens, expert(flat[tokens]) * weights[tokens, e, None])
        return out.reshape(x.shape)


FLAG = {"left": True}


class GlobalBranch(nn.Module):
    """A branch on a Python value held outside the module: remat cannot see it."""

    def __init__(self) -> None:
        super().__init__()
        self.left, self.right = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh((self.left if FLAG["left"] else self.right)(x))


def _model(block: type) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 6), block(), nn.Linear(6, 1))


def _mark(model: nn.Sequential, how: str) -> nn.Module:
    if how == "cell":
        remat.recompute_module(model[1], use_reentrant=True)
    elif how == "apply":
        remat.apply(model, where=type(model[1]), use_reentrant=True)
    elif how == "checkpoint":
        inner = model[1]
        model[1] = _Call(inner)
    return model


class _Call(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return remat.checkpoint(self.inner, x, use_reentrant=True)


def _train(model: nn.Module, steps: int, between=None) -> tuple[list, list]:
    """Gradients of each step and every parameter hook's calls (None: called with None)."""
    calls: list = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        short = name.replace("inner.", "")
        p.register_hook(lambda g, n=short: calls.append((n, None if g is None else "grad")))
    x = torch.randn(3, 4, 6, generator=torch.Generator().manual_seed(1))
    grads = []
    for step in range(steps):
        if between is not None:
            between(step)
        torch.manual_seed(10 + step)
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()
        grads += [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        calls.append("step")
    return grads, sorted_calls(calls)


def sorted_calls(calls: list) -> list:
    """Per step, the hook calls as a sorted list (the order within a step is autograd's)."""
    out, step = [], []
    for c in calls:
        if c == "step":
            out.append(sorted(step))
            step = []
        else:
            step.append(c)
    return out


@pytest.mark.parametrize("how", ["cell", "apply", "checkpoint"])
@pytest.mark.parametrize("block", [Unused, RandomBranch, SkippingMoE])
def test_hooks_called_as_unmarked(block, how):
    grads, calls = _train(_model(block), steps=6)
    marked_grads, marked_calls = _train(_mark(_model(block), how), steps=6)
    assert_bitwise_equal(grads, marked_grads, "gradient")
    assert calls == marked_calls
    assert all(g != (name, None) for step in marked_calls for name, g in [(c[0], c) for c in step])


def test_the_draws_skip_parameters():
    """The comparison could fail: some step leaves a parameter without a gradient."""
    for block in (Unused, RandomBranch, SkippingMoE):
        grads, _ = _train(_model(block), steps=6)
        assert any(g is None for g in grads), block.__name__


def test_a_region_reading_its_tensors_on_the_host_is_watched_on_every_call(monkeypatch):
    """`.item()` and data-dependent shapes make a region watched on every call; one that
    reads no values on the host runs unwatched from its second call."""
    from tests._harness import observed_calls

    for block, watched in ((RandomBranch, 3), (SkippingMoE, 3), (Unused, 1)):
        model = _mark(_model(block), "cell")
        seen = observed_calls(monkeypatch)
        for step in range(3):
            torch.manual_seed(step)
            model(torch.randn(2, 6)).sum().backward()
        assert len(seen) == watched, (block.__name__, seen)
        monkeypatch.undo()


def test_reads_varying_unseen_are_refused_then_watched():
    """A branch on a Python value outside the region: the call that reads a parameter the
    observed call did not is refused in backward with a RecomputeError, and from the next
    call the region is watched: every later step trains bitwise as unmarked."""
    def flip(step: int) -> None:
        FLAG["left"] = step % 2 == 0

    expected, expected_calls = _train(_model(GlobalBranch), steps=5, between=flip)
    model = _mark(_model(GlobalBranch), "cell")
    x = torch.randn(3, 4, 6, generator=torch.Generator().manual_seed(1))
    FLAG["left"] = True
    model(x).sum().backward()  # observed: reads left
    FLAG["left"] = False
    model.zero_grad(set_to_none=True)
    with pytest.raises(remat.RecomputeError, match="did not read"):
        model(x).sum().backward()  # unwatched: reads right, not an input
    grads, calls = _train(model, steps=5, between=flip)
    FLAG["left"] = True
    assert_bitwise_equal(expected, grads, "gradient")
    assert calls == expected_calls


@pytest.mark.parametrize("unfreeze", [True, False])
def test_parameters_frozen_or_unfrozen_between_steps(unfreeze):
    """Progressive unfreezing (and freezing): a parameter that did not require grad when
    the region was observed, and does later, is an input of its Function then (it was
    read, frozen); one frozen later is not."""
    def between(model):
        def flip(step: int) -> None:
            if step == 2:
                for p in model[1].parameters():
                    p.requires_grad_(unfreeze)
        return flip

    def build() -> nn.Sequential:
        model = _model(Unused)
        for p in model[1].parameters():
            p.requires_grad_(not unfreeze)
        return model

    base = build()
    expected, expected_calls = _train(base, steps=4, between=between(base))
    marked = _mark(build(), "cell")
    grads, calls = _train(marked, steps=4, between=between(marked))
    assert_bitwise_equal(expected, grads, "gradient")
    assert calls == expected_calls


# Tensors held outside the region's modules (NOTE [Reads that vary]): a global parameter
# read behind a Python flag, and a list attribute whose item is replaced in place (the
# module tree holds the same list: nothing remat compares changed). The observed call did
# not read the new tensor, so it is not an input of the Function: its gradient would be
# lost, silently, where torch's reentrant checkpoint accumulates it.

OUTSIDE = {"read": False}
_SHARED = [torch.zeros(6)]  # the global tensor, made requiring grad by each test


class GlobalTensorBranch(nn.Module):
    """Reads a tensor held in a global, on calls where a global flag says so."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if OUTSIDE["read"]:
            y = y * _SHARED[0]
        return torch.tanh(y)


class ListHeld(nn.Module):
    """Reads the tensor its list attribute holds; the test replaces the list's item."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.held = [_SHARED[0]]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x) * self.held[0])


class _Functional(nn.Module):
    """The block through ``remat.checkpoint`` (with a policy's context or none) or
    ``remat.recompute`` (``output_recompute``): called on the block itself, or, with
    ``closure``, on a function region that closes over it."""

    def __init__(self, inner: nn.Module, closure: bool, **options) -> None:
        super().__init__()
        self.inner, self.closure, self.options = inner, closure, options

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fn = (lambda t: self.inner(t)) if self.closure else self.inner
        options = dict(self.options)
        if "policy" in options:
            options["context_fn"] = remat.policy_context(options.pop("policy"))
        if options.get("output_recompute"):
            return remat.recompute(fn, x, **options)
        return remat.checkpoint(fn, x, **options)


def _outside_pair() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return (torch.randn(6, generator=g).requires_grad_(), torch.randn(6, generator=g).requires_grad_())


def _mark_outside(model: nn.Sequential, how: str, **options) -> nn.Module:
    options = {"use_reentrant": True, **options}
    if how == "closure":
        model[1] = _Functional(model[1], True, **options)
    elif how == "checkpoint":
        model[1] = _Functional(model[1], False, **options)
    elif how == "cell":
        remat.recompute_module(model[1], **options)
    else:
        remat.apply(model, where=type(model[1]), **options)
    return model


def _switch(block: type, tensors: tuple) -> callable:
    """What changes between steps: the flag (step 1 on), or the list's item (step 1 on)."""
    def between(model: nn.Module, step: int) -> None:
        if block is GlobalTensorBranch:
            OUTSIDE["read"] = step >= 1
            _SHARED[0] = tensors[0]
        else:
            inner = model[1] if isinstance(model[1], ListHeld) else model[1].inner
            inner.held[0] = tensors[min(step, 1)]
    return between


def _train_outside(model: nn.Module, block: type, steps: int, tensors: tuple, refused: set) -> list:
    """Each step's gradients, the outside tensors' included; a step that raises
    RecomputeError is noted in ``refused`` and run again (its gradients zeroed)."""
    x = torch.randn(3, 4, 6, generator=torch.Generator().manual_seed(1))
    between = _switch(block, tensors)
    grads = []
    for step in range(steps):
        between(model, step)
        for attempt in range(2):
            model.zero_grad(set_to_none=True)
            for t in tensors:
                t.grad = None
            try:
                loss = model(x).sum()
                if loss.requires_grad:  # a frozen model reading nothing that requires grad
                    loss.backward()
                break
            except remat.RecomputeError as err:
                assert attempt == 0 and "did not read" in str(err), err
                refused.add(step)
        grads += [None if p.grad is None else p.grad.clone() for p in (*model.parameters(), *tensors)]
    OUTSIDE["read"] = False
    return grads


def _outside_model(block: type, tensors: tuple) -> nn.Sequential:
    _SHARED[0] = tensors[0]
    return _model(block)


@pytest.mark.parametrize("how", ["cell", "apply", "checkpoint", "closure"])
@pytest.mark.parametrize("block", [GlobalTensorBranch, ListHeld])
def test_a_tensor_outside_the_modules_read_unseen_is_refused_then_watched(block, how):
    """Reentrant: the step that first reads the new tensor is refused in backward (typed),
    and every step, that one run again included, trains bitwise as unmarked."""
    tensors = _outside_pair()
    expected = _train_outside(_outside_model(block, tensors), block, 4, tensors, set())
    refused: set = set()
    grads = _train_outside(_mark_outside(_outside_model(block, tensors), how), block, 4, tensors, refused)
    assert_bitwise_equal(expected, grads, "gradient")
    assert refused <= {1}  # refused at most where the new tensor is first read, then watched
    assert any(g is not None for g in expected[-2:])  # the outside tensors get gradients


@pytest.mark.parametrize("how", ["cell", "apply", "checkpoint", "closure"])
@pytest.mark.parametrize("options", [{"use_reentrant": False}, {"use_reentrant": False, "output_recompute": True},
                                     {"use_reentrant": False, "policy": "save_compute_intensive"}])
@pytest.mark.parametrize("block", [GlobalTensorBranch, ListHeld])
def test_a_tensor_outside_the_modules_read_unseen_saved_tensor_modes(block, options, how):
    """The saved-tensor implementations see the read in autograd's own graph: bitwise,
    nothing refused."""
    if "policy" in options:
        options = {**options, "policy": remat.save_compute_intensive}
    tensors = _outside_pair()
    expected = _train_outside(_outside_model(block, tensors), block, 4, tensors, set())
    refused: set = set()
    grads = _train_outside(_mark_outside(_outside_model(block, tensors), how, **options), block, 4, tensors, refused)
    assert_bitwise_equal(expected, grads, "gradient")
    assert not refused


def _frozen(model: nn.Module) -> nn.Module:
    """Every parameter frozen: the region's Function has no input that requires grad."""
    for p in model.parameters():
        p.requires_grad_(False)
    return model


@pytest.mark.parametrize("how", ["cell", "apply", "checkpoint", "closure"])
@pytest.mark.parametrize("options", [{"use_reentrant": True}, {"use_reentrant": False},
                                     {"use_reentrant": False, "output_recompute": True}])
@pytest.mark.parametrize("block", [GlobalTensorBranch, ListHeld])
def test_a_tensor_read_unseen_by_a_region_with_nothing_to_differentiate(block, options, how):
    """NOTE [Forwards with nothing to differentiate]: a frozen block on data (no argument and
    no parameter requires grad) reads a tensor that does only from step 1 on. Its backward
    never runs, so nothing could be refused there: the forward runs with grad and hands its
    output back with the graph it made, bitwise as unmarked, nothing refused (torch's
    reentrant checkpoint drops that gradient)."""
    tensors = _outside_pair()
    expected = _train_outside(_frozen(_outside_model(block, tensors)), block, 4, tensors, set())
    refused: set = set()
    marked = _mark_outside(_frozen(_outside_model(block, tensors)), how, **options)
    grads = _train_outside(marked, block, 4, tensors, refused)
    assert_bitwise_equal(expected, grads, "gradient")
    assert not refused
    assert expected[-2] is not None or expected[-1] is not None  # an outside tensor trains


class _Outer(nn.Module):
    """A saved-tensor region around a block marked reentrant: the inner region runs in the
    outer one's forward and again in its re-run, and must take the same path both times."""

    def __init__(self, inner: nn.Module, **options) -> None:
        super().__init__()
        self.inner, self.options = remat.recompute_module(inner, use_reentrant=True), options

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return remat.recompute(self.inner, x, **self.options)


@pytest.mark.parametrize("options", [{"use_reentrant": False}, {"use_reentrant": False, "output_recompute": True}])
def test_a_frozen_reentrant_region_inside_another_reads_unseen_alike_in_forward_and_rerun(options):
    tensors = _outside_pair()
    expected = _train_outside(_frozen(_outside_model(GlobalTensorBranch, tensors)), GlobalTensorBranch, 4,
                              tensors, set())
    model = _frozen(_outside_model(GlobalTensorBranch, tensors))
    model[1] = _Outer(model[1], **options)
    refused: set = set()
    grads = _train_outside(model, GlobalTensorBranch, 4, tensors, refused)
    assert_bitwise_equal(expected, grads, "gradient")
    assert not refused
