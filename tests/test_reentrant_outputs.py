"""A reentrant region's output of any structure carries its gradients (NOTE [Outputs of any
structure] in ``_engine/structure.py``).

Every test compares with the unmarked model bit for bit: the loss, every parameter's
gradient and the input's; or asserts a typed error raised with nothing changed.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch

import remat
from tests._harness import assert_bitwise_equal, observed_calls


@dataclasses.dataclass
class Out:
    h: torch.Tensor


@dataclasses.dataclass(frozen=True)
class Frozen:
    h: torch.Tensor
    g: torch.Tensor


@dataclasses.dataclass
class Tagged:
    h: torch.Tensor
    tag: str = "block"
    made: int = dataclasses.field(default=0, init=False)

    def __post_init__(self) -> None:
        self.made += 1  # run once: a rebuilt output does not run it again


class WithDict(NamedTuple):
    h: torch.Tensor
    extra: dict


class Block(torch.nn.Module):
    """A linear layer and tanh, returning ``shape(h, x)``; counts its runs."""

    def __init__(self, shape: Callable) -> None:
        super().__init__()
        self.fc, self.shape = torch.nn.Linear(4, 4), shape
        self.runs = [0]  # a list: the re-run would put back a rebound attribute

    def forward(self, x):
        self.runs[0] += 1
        h = torch.tanh(self.fc(x))
        return self.shape(h, x)


class CellBlock(remat.nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def construct(self, x):
        return Out(torch.tanh(self.fc(x)))


def _tensors(out: Any) -> list[torch.Tensor]:
    """Every tensor of an output, dataclass fields included, in order."""
    if dataclasses.is_dataclass(out):
        return _tensors([getattr(out, f.name) for f in dataclasses.fields(out)])
    if isinstance(out, dict):
        return _tensors(list(out.values()))
    if isinstance(out, (list, tuple)):
        return [t for item in out for t in _tensors(item)]
    return [out] if isinstance(out, torch.Tensor) else []


def _loss(out: Any) -> torch.Tensor:
    return sum((i + 1) * t.pow(2).sum() for i, t in enumerate(_tensors(out)))


def _step(stem: torch.nn.Module, call: Callable, block: torch.nn.Module, x: torch.Tensor,
          loss_of: Callable) -> list:
    x = x.detach().clone().requires_grad_()
    s = stem(x)
    loss = loss_of(call(s), s, block)
    loss.backward()
    return [loss.detach(), x.grad, *(p.grad.clone() for p in (*stem.parameters(), *block.parameters()))]


def _compare(block: torch.nn.Module, mark: Callable, steps: int = 1,
             loss_of: Callable = lambda out, s, block: _loss(out)) -> torch.nn.Module:
    """Train ``block`` unmarked and under ``mark(copy) -> callable`` for ``steps`` steps;
    assert every step's loss and gradients equal bit for bit; return the marked copy.
    ``loss_of(output, the block's input, the block)``: the loss."""
    torch.manual_seed(0)
    stem, x = torch.nn.Linear(4, 4), torch.randn(3, 4)
    ref, ref_stem = copy.deepcopy(block), copy.deepcopy(stem)
    marked, marked_stem = copy.deepcopy(block), copy.deepcopy(stem)
    call = mark(marked)
    for _ in range(steps):
        want = _step(ref_stem, ref, ref, x, loss_of)
        got = _step(marked_stem, call, marked, x, loss_of)
        assert_bitwise_equal(got, want)
    return marked


def _module(block: torch.nn.Module) -> Callable:
    return remat.recompute_module(block, use_reentrant=True)


SHAPES = {
    "dataclass": lambda h, x: Out(h),
    "frozen dataclass": lambda h, x: Frozen(h, h * 2),
    "dataclass with a non-tensor field": lambda h, x: Tagged(h, tag="mine"),
    "nested dict and list": lambda h, x: {"a": [h, h.sin()], "b": {"c": h * 3}, "n": None},
    "list": lambda h, x: [h, 7, h.cos()],
    "named tuple holding a dict": lambda h, x: WithDict(h, {"g": h.exp(), "k": 2}),
    "tuple holding a dataclass": lambda h, x: (h.sin(), Out(h)),
    "the same tensor twice": lambda h, x: {"a": h, "b": [h, Out(h)]},
    "its input passed through": lambda h, x: {"h": h, "x": x},
    "its input in a dataclass": lambda h, x: Frozen(h, x),
    "a dataclass in a dataclass": lambda h, x: Out(Frozen(h, h.sin())),
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_structured_output_carries_its_gradients(shape):
    marked = _compare(Block(SHAPES[shape]), _module)
    assert marked.runs == [2]  # the forward and one re-run


def test_the_structure_comes_back_as_it_was():
    block = _module(Block(lambda h, x: {"a": [h, Tagged(h, tag="mine")], "x": x, "n": 3}))
    x = torch.randn(3, 4, requires_grad=True)
    out = block(x)
    assert list(out) == ["a", "x", "n"] and out["n"] == 3 and out["x"] is x
    tagged = out["a"][1]
    assert type(tagged) is Tagged and tagged.tag == "mine" and tagged.made == 1
    assert tagged.h is out["a"][0] and tagged.h.requires_grad  # one output in both places
    frozen = _module(Block(lambda h, x: Frozen(h, h)))(x)
    assert type(frozen) is Frozen and frozen.h is frozen.g and frozen.h.grad_fn is not None


def test_every_front_end_carries_a_dataclass_output():
    _compare(Block(SHAPES["dataclass"]), lambda m: (lambda h: remat.checkpoint(m, h, use_reentrant=True)))
    _compare(Block(SHAPES["frozen dataclass"]),
             lambda m: (lambda h: remat.recompute(m, h, use_reentrant=True)))
    model = torch.nn.Sequential(Block(SHAPES["dataclass"]))

    def apply(m):
        remat.apply(m, where=Block, use_reentrant=True)
        return m

    _compare(model, apply)

    def cell(m):
        m.recompute(use_reentrant=True)
        return m

    _compare(CellBlock(), cell)


def test_two_steps_the_second_on_observed_facts(monkeypatch):
    entered = observed_calls(monkeypatch)
    marked = _compare(Block(SHAPES["nested dict and list"]), _module, steps=3)
    assert len(entered) == 1  # the first call only (NOTE [Observed once, confirmed every call])
    assert marked.runs == [6]


def test_autograd_grad_through_a_dataclass_output():
    torch.manual_seed(0)
    block, x = Block(SHAPES["frozen dataclass"]), torch.randn(3, 4, requires_grad=True)
    marked = _module(copy.deepcopy(block))
    want = torch.autograd.grad(_loss(block(x)), [x, *block.parameters()])
    got = torch.autograd.grad(_loss(marked(x)), [x, *marked.parameters()])
    assert_bitwise_equal(list(got), list(want))


class Aux(Block):
    """Binds a tensor that carries a gradient to an attribute (NOTE [Tensors that escape a
    reentrant region])."""

    def forward(self, x):
        out = super().forward(x)
        self.aux = _tensors(out)[0].pow(2).mean()
        return out


class Writes(Block):
    """Changes its argument in place first (NOTE [Written arguments])."""

    def forward(self, x):
        x.mul_(2)
        return super().forward(x)


def test_escapes_written_arguments_and_views_with_a_structured_output():
    _compare(Aux(SHAPES["frozen dataclass"]), _module, steps=2,
             loss_of=lambda out, s, block: _loss(out) + block.aux * 3)
    _compare(Writes(SHAPES["nested dict and list"]), _module, steps=2,
             loss_of=lambda out, s, block: _loss(out) + s.sin().sum())
    _compare(Writes(SHAPES["its input in a dataclass"]), _module,
             loss_of=lambda out, s, block: _loss(out) + s.sin().sum())

    def changed_views(out, s, block):  # NOTE [Views changed after the region]
        out["t"].add_(1)
        return _loss(out)

    _compare(Transposed(), _module, loss_of=changed_views)


class Transposed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):  # views of a tensor it makes and of its argument
        return {"t": self.fc(x).t(), "x": [x.t()]}


def test_a_rerun_of_another_structure_is_refused():
    calls = []

    def shape(h, x):
        calls.append(remat.is_recomputing())
        return {"h": h} if not calls[-1] else {"h": h, "g": h.sin()}

    out = _module(Block(shape))(torch.randn(3, 4, requires_grad=True))
    with pytest.raises(remat.RecomputeError, match=r"region '.*Block.*'.*another structure.*"
                                                   r"2 tensor\(s\) in a dict, against 1 in a dict"):
        out["h"].sum().backward()


class Opaque:
    """An object neither pytree nor a dataclass opens, holding a tensor in an attribute."""

    def __init__(self, h: torch.Tensor) -> None:
        self.h = h


class NormBlock(torch.nn.Module):
    def __init__(self, holder: Callable) -> None:
        super().__init__()
        self.fc, self.norm, self.holder = torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), holder

    def forward(self, x):
        return self.holder(self.norm(self.fc(x)))


def _with_hidden_attribute(h: torch.Tensor) -> Out:
    out = Out(h.sin())
    out.extra = h  # an attribute that is not a field
    return out


@dataclasses.dataclass
class MappingOut(dict):
    """A dataclass that is a dict pytree does not open (as a ``ModelOutput`` not registered)."""

    h: torch.Tensor

    def __post_init__(self) -> None:
        self["h"] = self.h


@pytest.mark.parametrize("holder", [Opaque, _with_hidden_attribute, MappingOut])
def test_an_output_holding_tensors_out_of_reach_is_refused_with_nothing_changed(holder):
    block = remat.recompute_module(NormBlock(holder), use_reentrant=True)
    before = copy.deepcopy(block.state_dict())
    x = torch.randn(3, 4, requires_grad=True)
    for _ in range(2):  # refused on every call, watched again each time
        with pytest.raises(TypeError, match=r"use_reentrant=True\) returned an object of type "
                                            r"(Opaque|Out|MappingOut) holding 1 tensor.*use_reentrant=False"):
            block(x)
        after = block.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)  # running stats too
    assert block.norm.num_batches_tracked.item() == 0
    assert all(p.grad is None for p in block.parameters())
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def test_a_hugging_face_model_output_carries_its_gradients():
    utils = pytest.importorskip("transformers.utils")

    @dataclasses.dataclass
    class BlockOutput(utils.ModelOutput):
        last: torch.Tensor | None = None
        hidden: tuple | None = None

    class HFBlock(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x):
            h = torch.tanh(self.fc(x))
            return BlockOutput(last=h.sin(), hidden=(x, h))

    marked = _compare(HFBlock(), _module, steps=2)
    out = marked(torch.randn(3, 4))
    assert type(out) is BlockOutput and out.last.grad_fn is not None and out[0] is out.last


@dataclasses.dataclass
class WithAux:
    h: torch.Tensor
    aux: dict


class AuxBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        return WithAux(h, {"s": h.sum(), "n": 3})


class AuxNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.b, self.head = AuxBlock(), torch.nn.Linear(4, 1)

    def forward(self, x):
        out = self.b(x)
        return self.head(out.h).sum() + out.aux["s"] * out.aux["n"]


@pytest.mark.parametrize("mode", [{"use_reentrant": True}, {"use_reentrant": False},
                                  {"output_recompute": True}], ids=str)
def test_a_dataclass_output_under_remat_compile(mode):
    """Graph mode reads the structure as eager does: the compiled step with the block
    marked gives the unmarked eager step's gradients, and the mark is applied."""
    torch.manual_seed(0)
    x = torch.randn(3, 4)
    base = AuxNet()
    ref = copy.deepcopy(base)
    ref(x).backward()
    marked = copy.deepcopy(base)
    remat.recompute_module(marked.b, **mode)
    compiled = remat.compile(marked, backend="aot_eager")
    compiled(x).backward()
    assert any(r.recomputed for r in compiled.remat_reports)
    assert_bitwise_equal([p.grad for p in marked.parameters()], [p.grad for p in ref.parameters()])
