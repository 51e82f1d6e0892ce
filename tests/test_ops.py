"""remat.ops: primitives compute what torch computes, marks drop their outputs, bad input is named."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import remat
from remat import ops

torch.set_num_threads(1)
F32 = 4  # bytes per float32 element


# --- forward values against a torch oracle ------------------------------------------------


@pytest.mark.parametrize(
    "primitive, oracle",
    [
        (ops.ReLU(), torch.relu),
        (ops.GeLU(), lambda x: F.gelu(x, approximate="tanh")),  # MindSpore's GeLU: the tanh form
        (ops.Sigmoid(), torch.sigmoid),
        (ops.Tanh(), torch.tanh),
        (ops.Softmax(), lambda x: torch.softmax(x, -1)),
        (ops.Softmax(axis=0), lambda x: torch.softmax(x, 0)),
        (ops.Softmax(axis=(1,)), lambda x: torch.softmax(x, 1)),
    ],
)
def test_unary_primitive_matches_torch(primitive, oracle):
    x = torch.randn(3, 5)
    assert torch.equal(primitive(x), oracle(x))


def test_binary_primitives_match_torch():
    a, b = torch.randn(2, 3), torch.randn(3, 4)
    assert torch.equal(ops.Add()(a, 2.0), a + 2.0)
    assert torch.equal(ops.Add()(2.0, a), a + 2.0)
    assert torch.equal(ops.Mul()(a, a), a * a)
    assert torch.equal(ops.MatMul()(a, b), a @ b)
    assert torch.equal(ops.MatMul(transpose_a=True)(a.T, b), a @ b)
    assert torch.equal(ops.MatMul(transpose_b=True)(a, b.T), a @ b)
    assert torch.equal(ops.MatMul(True, True)(a.T, b.T), a @ b)


def test_bias_add_adds_along_the_channel_axis():
    x, bias = torch.randn(2, 3, 4, 5), torch.randn(3)
    assert torch.equal(ops.BiasAdd()(x, bias), x + bias[None, :, None, None])
    assert torch.equal(ops.BiasAdd("NHWC")(x.permute(0, 2, 3, 1), bias),
                       x.permute(0, 2, 3, 1) + bias)  # fmt: skip
    assert torch.equal(ops.BiasAdd()(x[:, :, 0, 0], bias), x[:, :, 0, 0] + bias)


# --- marks ------------------------------------------------------------------------------------


def test_recompute_marks_and_unmarks():
    relu = ops.ReLU()
    assert remat.mark_of(relu) is None and not relu.recomputed
    relu.recompute()
    assert remat.mark_of(relu) == remat.RegionSpec(output_recompute=True)
    relu.recompute()  # the same mark twice is fine
    assert "recompute=True" in repr(relu)
    relu.recompute(False)
    assert remat.mark_of(relu) is None
    assert relu._forward_pre_hooks == {} and relu._forward_hooks == {}


def test_primitive_changes_no_parameter_name_and_survives_copies():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), ops.ReLU(), torch.nn.Linear(4, 2))
    bare = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    model[1].recompute()
    assert list(model.state_dict()) == list(bare.state_dict())
    assert list(ops.ReLU().parameters()) == [] and ops.ReLU().state_dict() == {}
    clone = copy.deepcopy(model)
    assert remat.mark_of(clone[1]) == remat.RegionSpec(output_recompute=True)


class CountingTanh(ops.Tanh):
    """Tanh that counts how often it runs (forward plus recomputations).

    The count lives in a list: a re-run reads the module's attributes as its forward
    found them and puts back what it rebinds (NOTE [Module state at the boundary]), so
    ``self.runs += 1`` would count forwards only, as without the mark."""

    def __init__(self):
        super().__init__()
        self.counter = [0]

    @property
    def runs(self) -> int:
        return self.counter[0]

    def forward(self, x):
        self.counter[0] += 1
        return super().forward(x)


def _mlp(act: torch.nn.Module, seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), act, torch.nn.Linear(8, 3))


def _input_and_param_grads(model: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    x = x.clone().requires_grad_(True)
    model(x).square().sum().backward()
    return [x.grad] + [p.grad for p in model.parameters()]


def test_marked_primitive_runs_again_in_backward_and_gives_equal_gradients():
    x = torch.randn(5, 6)
    bare, marked = _mlp(CountingTanh()), _mlp(CountingTanh())
    marked[1].recompute()
    expected, got = _input_and_param_grads(bare, x), _input_and_param_grads(marked, x)
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    assert (bare[1].runs, marked[1].runs) == (1, 2)  # forward once; forward + one rebuild


@pytest.mark.parametrize("make", [ops.ReLU, ops.GeLU, ops.Sigmoid, ops.Tanh, ops.Softmax])
def test_every_unary_primitive_gives_equal_gradients_when_marked(make):
    x = torch.randn(5, 6)
    bare, marked = _mlp(make()), _mlp(make())
    marked[1].recompute()
    assert all(torch.equal(a, b) for a, b in zip(_input_and_param_grads(bare, x), _input_and_param_grads(marked, x), strict=True))


class Attention(torch.nn.Module):
    """Scores = softmax(q k^T) v with primitives, to mark MatMul, Mul, Softmax, BiasAdd, Add."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(dim, dim) for _ in range(3))
        self.bias = torch.nn.Parameter(torch.randn(dim))
        self.scores, self.mix = ops.MatMul(transpose_b=True), ops.MatMul()
        self.scale, self.softmax = ops.Mul(), ops.Softmax(-1)
        self.bias_add, self.add = ops.BiasAdd(), ops.Add()

    def forward(self, x):
        s = self.softmax(self.scale(self.scores(self.q(x), self.k(x)), 0.5))
        out = self.bias_add(self.mix(s, self.v(x)).flatten(0, 1), self.bias)
        return self.add(out, x.flatten(0, 1))


def test_binary_primitives_give_equal_gradients_when_marked():
    x = torch.randn(2, 4, 8)
    torch.manual_seed(1)
    bare = Attention()
    marked = copy.deepcopy(bare)
    for m in marked.modules():
        if isinstance(m, ops.Primitive):
            m.recompute()
    assert all(torch.equal(a, b) for a, b in zip(_input_and_param_grads(bare, x), _input_and_param_grads(marked, x), strict=True))


# --- memory: what a mark stops keeping ------------------------------------------------------


def test_marked_gelu_keeps_only_its_input():
    """fc1 -> gelu -> fc2 at batch B, width H: GeLU saves its input h, fc2 saves gelu's output g.

    Unmarked: h + g = 2*B*H floats. GeLU marked: g is rebuilt from h, so B*H floats.
    """
    B, H = 16, 32
    model = torch.nn.Sequential(torch.nn.Linear(8, H), ops.GeLU(), torch.nn.Linear(H, 4))
    x = torch.randn(B, 8)
    step = lambda: model(x).sum()
    assert remat.memory.saved_bytes(step) == 2 * B * H * F32
    model[1].recompute()
    assert remat.memory.saved_bytes(step) == B * H * F32


def test_two_adjacent_marked_primitives_keep_only_the_first_input():
    """fc1 -> gelu -> sigmoid -> fc2: unmarked keeps h (gelu) and s (sigmoid's output, fc2's input).

    Both marked, the regions merge: only h, the first primitive's input, is kept.
    """
    B, H = 16, 32
    model = torch.nn.Sequential(
        torch.nn.Linear(8, H), ops.GeLU(), ops.Sigmoid(), torch.nn.Linear(H, 4)
    )
    x = torch.randn(B, 8)
    step = lambda: model(x).sum()
    assert remat.memory.saved_bytes(step) == 2 * B * H * F32
    model[1].recompute()
    model[2].recompute()
    assert remat.memory.saved_bytes(step) == B * H * F32


# --- bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["yes", 1, None])
def test_recompute_mode_must_be_bool(mode):
    with pytest.raises(TypeError, match=r"ReLU\.recompute: 'mode' must be a bool.*pass True"):
        ops.ReLU().recompute(mode)


@pytest.mark.parametrize("axis", [1.0, "x", None, True, (0, 1)])
def test_softmax_axis_must_be_int(axis):
    with pytest.raises(TypeError, match=r"Softmax: 'axis' must be an int.*Softmax\(axis=-1\)"):
        ops.Softmax(axis)


def test_matmul_and_bias_add_reject_bad_options():
    with pytest.raises(TypeError, match=r"MatMul: 'transpose_a' must be a bool"):
        ops.MatMul(transpose_a="no")
    with pytest.raises(ValueError, match=r"BiasAdd: 'data_format' must be"):
        ops.BiasAdd("NWC")
    with pytest.raises(ValueError, match=r"BiasAdd: bias must be 1-D with one value per channel"):
        ops.BiasAdd()(torch.zeros(2, 3), torch.zeros(4))


@pytest.mark.parametrize("make", [ops.ReLU, ops.Sigmoid, ops.Tanh, ops.Softmax])
def test_marking_an_op_that_saves_its_own_output_keeps_its_input_instead(make):
    """Linear -> op -> Linear: the op's output (saved by the op and the next Linear) is kept
    unmarked; marked, the region keeps its input instead: B*H floats either way."""
    B, H = 16, 32
    bare = torch.nn.Sequential(torch.nn.Linear(8, H), make(), torch.nn.Linear(H, 4))
    marked = copy.deepcopy(bare)
    marked[1].recompute()
    x = torch.randn(B, 8)
    assert remat.memory.saved_bytes(lambda: bare(x).sum()) == B * H * F32
    assert remat.memory.saved_bytes(lambda: marked(x).sum()) == B * H * F32


def test_marked_sigmoid_and_mul_keep_only_their_inputs():
    """o(sigmoid(a) * b): unmarked keeps s (sigmoid out, Mul input), b, and m (o's input);
    Sigmoid and Mul marked merge and keep their inputs a and b only."""
    B, H = 16, 32
    a, b, o = torch.nn.Linear(8, H), torch.nn.Linear(8, H), torch.nn.Linear(H, 4)
    sig, mul = ops.Sigmoid(), ops.Mul()
    x = torch.randn(B, 8)
    step = lambda: o(mul(sig(a(x)), b(x))).sum()
    assert remat.memory.saved_bytes(step) == 3 * B * H * F32
    expected = torch.autograd.grad(step(), list(a.parameters()) + list(b.parameters()))
    sig.recompute()
    mul.recompute()
    assert remat.memory.saved_bytes(step) == 2 * B * H * F32
    got = torch.autograd.grad(step(), list(a.parameters()) + list(b.parameters()))
    assert all(torch.equal(e, g) for e, g in zip(expected, got, strict=True))


class ReusedRelu(torch.nn.Module):
    """One ReLU object called twice, as MindSpore's ResNet does with ``self.relu``."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = (torch.nn.Linear(6, 6) for _ in range(3))
        self.relu = CountingTanh()

    def forward(self, x):
        return self.fc3(self.relu(self.fc2(self.relu(self.fc1(x)))))


def test_a_primitive_called_twice_is_two_regions():
    torch.manual_seed(2)
    bare = ReusedRelu()
    marked = copy.deepcopy(bare)
    marked.relu.recompute()
    x = torch.randn(4, 6)
    assert all(torch.equal(a, b) for a, b in zip(_input_and_param_grads(bare, x), _input_and_param_grads(marked, x), strict=True))
    assert (bare.relu.runs, marked.relu.runs) == (2, 4)  # each call rebuilt once
