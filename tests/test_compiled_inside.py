"""Code the user compiled, inside a region (NOTE [Compiled code inside a region], observe.py).

A block calls a ``torch.compile``'d submodule (a linear, a batch norm that updates its
statistics, pointwise functions Inductor fuses). Unmarked, and under torch's checkpoint, that
submodule runs compiled. remat's watching and selective modes made ``torch.compile`` fall back
to eager where they were active: the first (watched) call of a ``use_reentrant=False`` region
saved other tensors in its forward (eager) than in its re-run (compiled) and was refused, and
under Inductor the gradients of ``output_recompute`` and policy regions differed from the
unmarked model's in the last bits, silently. Each case trains three steps and compares every
gradient, parameter and buffer bitwise with the unmarked model, which calls the same compiled
submodules.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from torch import nn

import remat

D = 8

INDUCTOR = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("cc") is None,
                              reason="Inductor needs a C++ compiler on CPU")


class _Inner(nn.Module):
    """A linear, a batch norm (state written in forward) and pointwise functions."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.norm = nn.Linear(D, 2 * D), nn.BatchNorm1d(2 * D)

    def forward(self, x):
        h = self.norm(self.fc(x))
        return nn.functional.gelu(h) * torch.sigmoid(1.7 * h) + torch.tanh(h).exp()


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner, self.out = _Inner(), nn.Linear(2 * D, D)

    def forward(self, x):
        return x + self.out(self.inner(x))


class _Counting:
    """A ``torch.compile`` backend that counts the graphs it compiles."""

    def __init__(self, backend: str) -> None:
        self.backend, self.graphs = backend, 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        if self.backend == "aot_eager":
            from torch._dynamo.backends.debugging import aot_eager

            return aot_eager(gm, example_inputs)
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs)


class _TorchReentrant(nn.Module):
    """The baseline for how often a reentrant region compiles: torch's reentrant checkpoint."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.block, x, use_reentrant=True)


def _model(backend: _Counting) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, D), _Block(), _Block(), nn.Linear(D, D))
    for block in (model[1], model[2]):
        block.inner = torch.compile(block.inner, backend=backend)
    return model


def _train(model: nn.Module) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads: list = []
    for step in range(3):
        x = torch.randn(6, D, generator=torch.Generator().manual_seed(step), requires_grad=True)
        opt.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        grads = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
        opt.step()
    return grads + [t.detach().clone() for t in (*model.parameters(), *model.buffers())]


def _mark(model: nn.Module, front: str, options: dict) -> None:
    if front == "apply":
        remat.apply(model, where=_Block, **options)
    else:
        for block in (model[1], model[2]):
            remat.recompute_module(block, **options)


MODES = [
    pytest.param({}, id="non-reentrant"),
    pytest.param({"output_recompute": True}, id="output_recompute"),
    pytest.param({"policy": remat.save_compute_intensive}, id="policy"),
]


def _check(backend: str, front: str, options: dict) -> None:
    expected = _train(_model(_Counting(backend)))
    counting = _Counting(backend)
    model = _model(counting)
    _mark(model, front, options)
    got = _train(model)
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)
    # compiled as often as without remat (each call recompiled before, until torch gave up):
    # the modes no longer make torch.compile fall back to eager. A reentrant forward runs
    # without grad, so it compiles an inference graph too, as torch's reentrant checkpoint does
    baseline = _Counting(backend)
    reference = _model(baseline)
    if options.get("use_reentrant"):
        for i in (1, 2):
            reference[i] = _TorchReentrant(reference[i])
    _train(reference)
    assert counting.graphs == baseline.graphs


@pytest.mark.parametrize("front", ["apply", "recompute_module"])
@pytest.mark.parametrize("options", [*MODES, pytest.param({"use_reentrant": True}, id="reentrant")])
def test_a_compiled_submodule_inside_a_region_trains_as_unmarked(front, options):
    """``aot_eager``: every operator of the compiled code passes the modes, so every mode,
    reentrant included, trains bitwise (the non-reentrant first call was refused before)."""
    _check("aot_eager", front, options)


@INDUCTOR
@pytest.mark.parametrize("options", MODES)
def test_an_inductor_compiled_submodule_inside_a_region_trains_as_unmarked(options):
    """Inductor fuses the pointwise functions (other rounding than eager): the regions must run
    the compiled code wherever the unmarked model does (silently off by about 6e-8 before)."""
    _check("inductor", "apply", options)


@INDUCTOR
def test_a_reentrant_region_around_inductor_code_is_refused_not_wrong():
    """A compiled kernel reads the batch norm's weight inside itself, where no dispatch mode
    sees it: a reentrant region cannot make it an input of its Function, finds it in its
    re-run's graph, and refuses with a RecomputeError (the gradients differed by rounding
    before, silently); the optimizer never steps."""
    model = _model(_Counting("inductor"))
    remat.apply(model, where=_Block, use_reentrant=True)
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(6, D, requires_grad=True)
    with pytest.raises(remat.RecomputeError, match="compiled kernel"):
        model(x).pow(2).mean().backward()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))
