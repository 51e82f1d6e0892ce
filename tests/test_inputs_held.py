"""A saved-tensor region holds its arguments itself when no saved-tensor hook is outside
it, and saves them through those hooks when one is (NOTE [Inputs held directly] in
``hooked.py``): the same gradients, the same refusal of an argument changed in place, the
same tensors handed to an outer hook, either way."""

import pytest
import torch

import remat
from remat import ops
from tests._harness import assert_bitwise_equal


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.act = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8), ops.GeLU()

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(x)))


def _grads(model: torch.nn.Module, x: torch.Tensor) -> list:
    xi = x.clone().requires_grad_()
    model(xi).pow(2).sum().backward()
    return [xi.grad, *(p.grad for p in model.parameters())]


class _Outer(torch.autograd.graph.saved_tensors_hooks):
    """An outer hook that keeps what it is given (as CPU offload would hand it back)."""

    def __init__(self) -> None:
        self.packed: list[torch.Tensor] = []
        super().__init__(self._pack, lambda x: x)

    def _pack(self, x: torch.Tensor) -> torch.Tensor:
        self.packed.append(x)
        return x


def _marked(how: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(_Block(), _Block())
    if how == "primitive":
        for block in model:
            block.act.recompute()
    elif how == "output_recompute":
        remat.apply(model, where=_Block, output_recompute=True)
    else:
        remat.apply(model, where=_Block)
    return model


@pytest.mark.parametrize("outer", [False, True], ids=["held", "through-outer-hooks"])
@pytest.mark.parametrize("how", ["blocks", "primitive", "output_recompute"])
def test_gradients_are_bitwise_either_way(how, outer):
    torch.manual_seed(0)
    base = torch.nn.Sequential(_Block(), _Block())
    x = torch.randn(4, 8)
    want = _grads(base, x)
    model = _marked(how)
    if outer:
        with _Outer():
            got = _grads(model, x)
    else:
        got = _grads(model, x)
    assert_bitwise_equal(got, want)


def test_an_outer_hook_still_packs_the_region_input():
    """The region's argument reaches the outer hook, as torch's checkpoint hands it on (an
    enclosing region counts it; CPU offload moves it)."""
    block = remat.recompute_module(torch.nn.Linear(8, 8))
    h = torch.randn(4, 8, requires_grad=True) * 2
    outer = _Outer()
    with outer:
        y = block(h)
    assert any(p is h for p in outer.packed)
    y.sum().backward()


def test_a_held_argument_changed_in_place_is_refused():
    """Held without a Function, an argument changed in place after the region ran is refused
    in torch's words, as the Function's saved input was (under an outer hook the hook decides,
    as for every saved tensor: CPU offload keeps a copy)."""
    block = remat.recompute_module(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()))
    h = torch.randn(4, 8, requires_grad=True) * 2
    y = block(h)
    h.mul_(2)
    with pytest.raises(remat.RecomputeError, match="changed in place after the region ran") as info:
        (y.sum() + h.sum()).backward()
    assert "has been modified by an inplace operation" in str(info.value)


def test_a_held_argument_comes_back_as_itself():
    """NOTE [Inputs come back as themselves]: a custom Function in the region that saves the
    region's argument (one that does not require grad) gets the very object back in the
    re-run, as without the mark."""
    seen = []

    class Keep(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x)
            return x * w

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            seen.append(x)
            return None, g * x

    x, w = torch.randn(3), torch.randn(3, requires_grad=True)
    remat.checkpoint(lambda t: Keep.apply(t, w).sin(), x, use_reentrant=False).sum().backward()
    assert seen and seen[0] is x
