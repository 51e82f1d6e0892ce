"""NOTE [Plain arguments flattened directly]: a region's plain arguments are flattened without
pytree into the leaves pytree gives, rebuilt as they were, and anything else goes to pytree."""

from __future__ import annotations

import collections
import functools

import pytest
import torch
from torch.utils import _pytree as pytree

import remat
from remat._engine import flat
from tests._harness import assert_bitwise_equal

_Pair = collections.namedtuple("_Pair", "a b")


def _plain_calls() -> list:
    t, u, v = torch.ones(2), torch.zeros(3), torch.arange(4.0)
    return [
        ((t,), {}),
        ((t, None, 3, "x"), {}),
        ((t,), {"mask": None, "positions": u, "use_cache": False}),
        ((t,), {"rotary": (u, v), "ids": [1, 2], "scale": 0.5}),
        (((t, u), [v, None]), {"empty": (), "also": []}),
    ]


@pytest.mark.parametrize("case", range(len(_plain_calls())))
def test_plain_calls_flatten_to_pytrees_leaves_and_rebuild(case):
    args, kwargs = _plain_calls()[case]
    leaves, structure = flat.flatten(args, kwargs)
    assert type(structure) is flat.Plain
    expected, _ = pytree.tree_flatten((args, kwargs))
    assert len(leaves) == len(expected) and all(a is b for a, b in zip(leaves, expected, strict=True))
    rebuilt = structure.unflatten(list(leaves))
    assert pytree.tree_structure(rebuilt) == pytree.tree_structure((args, kwargs))
    assert all(a is b for a, b in zip(pytree.tree_leaves(rebuilt), expected, strict=True))
    hash(structure)  # the facts' key holds it


@pytest.mark.parametrize("value", [
    _Pair(torch.ones(1), torch.ones(1)), {"nested": torch.ones(1)}, torch.Size([2, 3]),
    collections.OrderedDict(a=torch.ones(1)), ((torch.ones(1),),), [{"a": 1}],
])
def test_other_structures_go_to_pytree(value):
    args = (torch.ones(2), value)
    leaves, structure = flat.flatten(args, {})
    assert type(structure) is not flat.Plain
    expected, spec = pytree.tree_flatten((args, {}))
    assert structure == spec and all(a is b for a, b in zip(leaves, expected, strict=True))


class _Layer(torch.nn.Module):
    """A layer called the way Hugging Face calls its layers: keywords bound in a partial."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x, mask=None, rotary=None, scale=1.0, use_cache=False):
        cos, sin = rotary
        h = torch.tanh(self.fc(x)) * cos + sin
        if mask is not None:
            h = h * mask
        return x + scale * h


@pytest.mark.parametrize("use_reentrant", [True, False])
@pytest.mark.parametrize("mask", [True, False])
def test_a_layer_called_with_plain_keywords_trains_bitwise(use_reentrant, mask):
    torch.manual_seed(0)
    base = _Layer()
    marked = _Layer()
    marked.load_state_dict(base.state_dict())
    cos, sin = torch.randn(3, 4, requires_grad=True), torch.randn(3, 4)
    keywords = {"mask": torch.ones(3, 4) if mask else None, "rotary": (cos, sin), "scale": 0.5}
    grads = []
    for layer, call in ((base, lambda fn, x: fn(x)),
                        (marked, lambda fn, x: remat.checkpoint(fn, x, use_reentrant=use_reentrant))):
        seen = []
        for _ in range(3):  # the later calls run on what the first observed
            x = torch.randn(3, 4, requires_grad=True, generator=torch.Generator().manual_seed(len(seen)))
            cos.grad = None
            layer.zero_grad()
            call(functools.partial(layer.__call__, **keywords), x).pow(2).sum().backward()
            seen.append((x.grad, cos.grad, layer.fc.weight.grad, layer.fc.bias.grad))
        grads.append(seen)
    for a, b in zip(*grads, strict=True):
        assert_bitwise_equal(list(a), list(b))
