"""remat.ms: MindSpore names, defaults and return shapes on torch, checked against torch itself."""

from __future__ import annotations

import copy
import math
import warnings
from collections import OrderedDict

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import remat
import remat.ms as mindspore
from remat.ms import Tensor, nn, ops

torch.set_num_threads(1)


# --- imports and namespaces ------------------------------------------------------------------


def test_submodules_are_real_and_share_remat_objects():
    import remat.ms.ops as ms_ops

    assert ms_ops is ops and mindspore.nn is nn
    assert nn.Cell is remat.nn.Cell and mindspore.recompute is remat.recompute
    assert ops.ReLU is remat.ops.ReLU and mindspore.ops.grad is mindspore.grad


# --- Tensor and dtypes -------------------------------------------------------------------


def test_tensor_from_numpy_list_and_dtype():
    a = np.random.randn(2, 3)
    t = Tensor(a, dtype=mindspore.float32)
    assert isinstance(t, torch.Tensor) and t.dtype == torch.float32
    assert torch.equal(t, torch.tensor(a, dtype=torch.float32))
    assert Tensor(a).dtype == torch.float64  # numpy's dtype is kept, as MindSpore does
    assert Tensor([1.5, 2.0]).dtype == torch.float32 and Tensor([1, 2]).dtype == torch.int64
    assert Tensor([1, 2], dtype=mindspore.int32).dtype == torch.int32
    assert Tensor(shape=(2, 2), dtype=mindspore.float16).shape == (2, 2)


def test_tensor_prints_like_mindspore_and_does_not_propagate():
    t = Tensor(np.arange(4).reshape(2, 2).astype(np.float32))
    assert str(t) == str(np.arange(4).reshape(2, 2).astype(np.float32))
    assert repr(t) == f"Tensor(shape=[2, 2], dtype=Float32, value=\n{t.asnumpy()})"
    assert repr(Tensor([1, 2], dtype=mindspore.int32)) == "Tensor(shape=[2], dtype=Int32, value= [1 2])"
    y = t * 2 + 1
    assert type(y) is torch.Tensor  # torch ops return plain tensors
    assert torch.equal(y, torch.tensor([[1.0, 3.0], [5.0, 7.0]]))


def test_tensor_rejects_bad_input():
    with pytest.raises(TypeError, match=r"remat.ms.Tensor: 'dtype' must be a dtype"):
        Tensor([1.0], dtype="float32")
    with pytest.raises(TypeError, match=r"remat.ms.Tensor: pass input_data"):
        Tensor()
    with pytest.raises(TypeError, match=r"remat.ms.Tensor: unknown keyword.*'device'"):
        Tensor([1.0], device="cpu")


# --- context and seeds -----------------------------------------------------------------------


def test_set_context_records_and_validates(fresh_ms_context):
    mindspore.set_context(mode=mindspore.GRAPH_MODE, save_graphs=True, save_graphs_path="/tmp/g")
    assert mindspore.get_context("mode") == mindspore.GRAPH_MODE == 0
    assert mindspore.get_context("save_graphs_path") == "/tmp/g"
    with pytest.raises(ValueError, match=r"set_context: 'mode' must be remat.ms.GRAPH_MODE"):
        mindspore.set_context(mode=2)
    with pytest.raises(ValueError, match=r"set_context: 'device_target' must be one of"):
        mindspore.set_context(device_target="TPU")
    with pytest.raises(ValueError, match=r"set_context: 'save_graphs' must be a bool or 0-3"):
        mindspore.set_context(save_graphs="yes")
    with pytest.raises(TypeError, match=r"set_context: unknown keyword.*'modes'.*accepted: mode"):
        mindspore.set_context(modes=1)
    with pytest.raises(ValueError, match=r"get_context: unknown key 'x'"):
        mindspore.get_context("x")


def test_graph_mode_gives_pynative_gradients_without_warning(fresh_ms_context):
    fc = nn.Dense(3, 2)
    x = torch.randn(4, 3)
    eager = ops.grad(fc, None, fc.weight)(x)
    mindspore.set_context(mode=mindspore.GRAPH_MODE)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        first = ops.grad(fc, None, fc.weight)(x)
        second = mindspore.value_and_grad(fc, None, fc.weight)(x)[1]
    assert torch.equal(first, eager) and torch.equal(second, eager)


def test_set_seed_repeats_torch_and_numpy_draws():
    mindspore.set_seed(7)
    a, na = torch.rand(3), np.random.rand(3)
    mindspore.set_seed(7)
    assert torch.equal(torch.rand(3), a) and np.array_equal(np.random.rand(3), na)
    with pytest.raises(TypeError, match=r"set_seed: 'seed' must be a non-negative int"):
        mindspore.set_seed(-1)


# --- layers --------------------------------------------------------------------------------


def test_dense_is_a_linear_cell_with_mindspore_arguments():
    fc = nn.Dense(3, 2, weight_init="ones", bias_init="zeros", activation="relu")
    assert isinstance(fc, torch.nn.Linear) and isinstance(fc, nn.Cell)
    assert [n for n, _ in fc.named_parameters()] == ["weight", "bias"]
    x = torch.randn(5, 3)
    # the baseline is the same linear operator (x.sum(1) adds in another order: last bits)
    want = torch.relu(torch.nn.functional.linear(x, torch.ones(2, 3), torch.zeros(2)))
    assert torch.equal(fc(x), want)
    assert nn.Dense(3, 2, has_bias=False).bias is None
    w = np.random.randn(2, 3).astype(np.float32)
    assert torch.equal(nn.Dense(3, 2, weight_init=Tensor(w)).weight.detach(), torch.from_numpy(w))


@pytest.mark.parametrize(
    "name, check",
    [
        ("zeros", lambda w: bool((w == 0).all())),
        ("ones", lambda w: bool((w == 1).all())),
        ("normal", lambda w: abs(w.std().item() - 0.01) < 0.002),
        ("TruncatedNormal", lambda w: w.abs().max().item() <= 0.02),
        ("uniform", lambda w: w.abs().max().item() <= 0.07),
        ("he_uniform", lambda w: w.abs().max().item() <= math.sqrt(6 / 200)),
        ("HeNormal", lambda w: w.abs().max().item() > 0),
        ("xavier_uniform", lambda w: w.abs().max().item() <= math.sqrt(6 / 300)),
        ("XavierNormal", lambda w: w.abs().max().item() > 0),
    ],
)
def test_weight_init_names(name, check):
    w = nn.Dense(200, 100, weight_init=name).weight.detach()
    assert check(w)


def test_weight_init_rejects_unknown_names_and_shapes():
    with pytest.raises(ValueError, match=r"Dense: unknown weight_init 'gaussian'; accepted names"):
        nn.Dense(2, 2, weight_init="gaussian")
    with pytest.raises(ValueError, match=r"Conv2d: weight_init has shape \[2, 2\].*needs"):
        nn.Conv2d(2, 2, 2, weight_init=Tensor(np.ones([2, 2])))
    with pytest.raises(TypeError, match=r"Dense: bias_init must be an initializer name"):
        nn.Dense(2, 2, bias_init=object())
    with pytest.raises(ValueError, match=r"Dense: unknown activation 'swish'"):
        nn.Dense(2, 2, activation="swish")


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
@pytest.mark.parametrize("kernel, dilation", [(1, 1), (2, 1), (3, 1), (4, 1), (3, 2)])
def test_conv_same_padding_matches_torch_same_at_stride_one(kernel, dilation):
    conv = nn.Conv2d(2, 3, kernel, dilation=dilation, has_bias=True)
    x = torch.randn(1, 2, 7, 6)
    torch_same = F.conv2d(x, conv.weight, conv.bias, padding="same", dilation=dilation)
    assert torch.equal(conv(x), torch_same)


@pytest.mark.parametrize("size, kernel, stride, before, after", [
    (7, 3, 2, 1, 1), (8, 3, 2, 0, 1), (2, 2, 1, 0, 1), (5, 1, 2, 0, 0), (6, 4, 3, 0, 1),
])  # fmt: skip
def test_conv_same_padding_rule_with_stride(size, kernel, stride, before, after):
    conv = nn.Conv2d(1, 1, kernel, stride=stride, weight_init="normal")
    x = torch.randn(1, 1, size, size)
    padded = F.pad(x, (before, after, before, after))
    assert torch.equal(conv(x), F.conv2d(padded, conv.weight, stride=stride))
    assert conv(x).shape[-1] == math.ceil(size / stride)


def test_conv_valid_and_pad_modes():
    x = torch.randn(1, 2, 5, 5)
    valid = nn.Conv2d(2, 2, 3, pad_mode="valid")
    assert torch.equal(valid(x), F.conv2d(x, valid.weight))
    pad = nn.Conv2d(2, 2, 3, pad_mode="pad", padding=1)
    assert torch.equal(pad(x), F.conv2d(x, pad.weight, padding=1))
    pad4 = nn.Conv2d(2, 2, 3, pad_mode="pad", padding=(1, 0, 2, 1))  # top, bottom, left, right
    assert torch.equal(pad4(x), F.conv2d(F.pad(x, (2, 1, 1, 0)), pad4.weight))
    assert nn.Conv2d(2, 2, 3).bias is None  # has_bias=False by default, as MindSpore


def test_conv_rejects_bad_padding():
    with pytest.raises(ValueError, match=r"Conv2d: 'pad_mode' must be one of \('same', 'valid', 'pad'\)"):
        nn.Conv2d(2, 2, 3, pad_mode="SAME")
    with pytest.raises(ValueError, match=r"Conv2d: 'padding' is 1 but pad_mode is 'same'.*pad_mode='pad'"):
        nn.Conv2d(2, 2, 3, padding=1)
    with pytest.raises(ValueError, match=r"Conv2d: 'kernel_size' must be a positive int"):
        nn.Conv2d(2, 2, 0)


def test_batchnorm_momentum_is_mindspores():
    """MindSpore: moving = momentum * moving + (1 - momentum) * batch, with momentum 0.9."""
    bn = nn.BatchNorm2d(3)
    x = torch.randn(4, 3, 2, 2)
    bn(x)
    assert torch.allclose(bn.running_mean, 0.9 * 0 + 0.1 * x.mean((0, 2, 3)), rtol=0, atol=1e-7)
    bn_fast = nn.BatchNorm2d(3, momentum=0.5)
    bn_fast(x)
    assert torch.allclose(bn_fast.running_mean, 0.5 * x.mean((0, 2, 3)), rtol=0, atol=1e-7)
    torch_bn = torch.nn.BatchNorm2d(3, momentum=0.1)
    assert torch.equal(torch_bn(x), nn.BatchNorm2d(3)(x))
    frozen = nn.BatchNorm2d(3, use_batch_statistics=False)
    assert torch.equal(frozen(x), x / math.sqrt(1 + 1e-5))
    with pytest.raises(ValueError, match=r"BatchNorm2d: 'momentum' must be in \[0, 1\]"):
        nn.BatchNorm2d(3, momentum=1.5)


def test_dropout_sequential_flatten_and_activations():
    assert nn.Dropout(keep_prob=0.8).p == pytest.approx(0.2) and nn.Dropout(p=0.3).p == 0.3
    with pytest.raises(ValueError, match=r"Dropout: 'keep_prob' must be in \(0, 1\]"):
        nn.Dropout(keep_prob=0)
    seq = nn.SequentialCell([nn.Dense(4, 4), nn.ReLU(), nn.Flatten()])
    named = nn.SequentialCell(OrderedDict(fc=nn.Dense(4, 4), act=nn.Tanh()))
    assert isinstance(seq, nn.Cell) and [n for n, _ in named.named_children()] == ["fc", "act"]
    x = torch.randn(2, 4)
    assert torch.equal(seq(x), torch.relu(seq[0](x)))
    assert torch.equal(nn.Softmax(axis=0)(x), torch.softmax(x, 0))
    assert torch.equal(nn.GELU()(x), F.gelu(x, approximate="tanh"))


def test_ms_ops_gelu_is_mindspores_tanh_primitive():
    """mindspore.ops.GeLU is the tanh approximation; the erf form differs in the last bits."""
    x = torch.randn(64, 64)
    assert remat.ms.ops.GeLU is remat.ops.GeLU
    assert torch.equal(remat.ms.ops.GeLU()(x), F.gelu(x, approximate="tanh"))
    assert not torch.equal(remat.ms.ops.GeLU()(x), F.gelu(x))
    xg = x.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(remat.ms.ops.GeLU()(xg).sum(), xg)
    (expected,) = torch.autograd.grad(F.gelu(xg, approximate="tanh").sum(), xg)
    assert torch.equal(g, expected)


def test_layers_take_recompute_marks_and_keep_gradients():
    torch.manual_seed(0)
    bare = nn.SequentialCell(nn.Conv2d(2, 4, 3, has_bias=True), nn.BatchNorm2d(4), nn.ReLU(),
                             nn.Flatten(), nn.Dense(4 * 25, 3))  # fmt: skip
    marked = copy.deepcopy(bare)
    marked[0].recompute()
    marked[1].recompute()
    x = torch.randn(2, 2, 5, 5)
    g_bare = ops.grad(bare, 0, tuple(bare.parameters()))(x)
    g_marked = ops.grad(marked, 0, tuple(marked.parameters()))(x)
    assert torch.equal(g_bare[0], g_marked[0])
    assert all(torch.equal(a, b) for a, b in zip(g_bare[1], g_marked[1], strict=True))
    assert torch.equal(bare[1].running_mean, marked[1].running_mean)  # updated once, not again in recompute
    assert marked[1].num_batches_tracked.item() == bare[1].num_batches_tracked.item() == 1


# --- grad and value_and_grad -------------------------------------------------------------


def _fn(x, y):
    return (x * y * y).sum(), x + y


def test_grad_positions_weights_and_aux_follow_mindspore():
    x, y = torch.randn(3), torch.randn(3)
    gx, gy = 1.0 * y * y, 2 * x * y  # d/dx, d/dy of sum(x y^2)
    only_loss = lambda a, b: _fn(a, b)[0]
    assert torch.equal(ops.grad(only_loss)(x, y), gx)
    g = ops.grad(only_loss, (0, 1))(x, y)
    assert isinstance(g, tuple) and torch.equal(g[0], gx) and torch.equal(g[1], gy)
    grads, aux = ops.grad(_fn, 1, has_aux=True)(x, y)
    assert torch.equal(grads, gy) and isinstance(aux, tuple) and torch.equal(aux[0], x + y)
    # without has_aux every output is differentiated, each with ones as sensitivity
    assert torch.equal(ops.grad(_fn)(x, y), gx + 1)


def test_value_and_grad_with_weights():
    fc = nn.Dense(3, 2)
    x = torch.randn(4, 3)

    def forward(data):
        logits = fc(data)
        return logits.sum(), logits

    (loss, _), grads = mindspore.value_and_grad(forward, None, (fc.weight,), has_aux=True)(x)
    assert isinstance(grads, tuple) and len(grads) == 1
    assert torch.equal(grads[0], x.sum(0).expand(2, 3))
    assert torch.equal(loss, fc(x).sum().detach()) and not loss.requires_grad
    both = mindspore.value_and_grad(lambda d: fc(d).sum(), 0, fc.bias)(x)[1]
    assert torch.equal(both[0], fc.weight.sum(0).expand(4, 3).detach())
    assert torch.equal(both[1], torch.full((2,), 4.0))
    assert fc.weight.grad is None  # gradients are returned, not accumulated


def test_unused_input_gets_zeros():
    g = ops.grad(lambda a, b: a.sum(), (0, 1))(torch.ones(2), torch.ones(3))
    assert torch.equal(g[1], torch.zeros(3))


def test_grad_rejects_bad_arguments():
    f = lambda x: x.sum()
    with pytest.raises(ValueError, match=r"grad: 'grad_position' and 'weights' cannot both be None"):
        ops.grad(f, None)
    with pytest.raises(TypeError, match=r"grad: 'grad_position' must be a non-negative int"):
        ops.grad(f, "0")
    with pytest.raises(TypeError, match=r"value_and_grad: 'has_aux' must be a bool"):
        mindspore.value_and_grad(f, has_aux="yes")
    with pytest.raises(TypeError, match=r"grad: 'weights' must be a parameter"):
        ops.grad(f, None, [torch.ones(2)])
    with pytest.raises(TypeError, match=r"grad: 'fn' must be callable"):
        ops.grad(3)
    with pytest.raises(TypeError, match=r"grad: input 0 must be a floating-point Tensor"):
        ops.grad(f)(torch.ones(2, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"grad: grad_position 2 is out of range for 1 inputs"):
        ops.grad(f, 2)(torch.ones(2))
    with pytest.raises(TypeError, match=r"grad: has_aux=True needs fn to return \(output, aux"):
        ops.grad(f, has_aux=True)(torch.ones(2))
