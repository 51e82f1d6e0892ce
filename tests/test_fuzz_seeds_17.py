"""Regressions: a marked module whose call is also wrapped in a reentrant ``remat.checkpoint``.

An independent differential fuzzer found silently wrong gradients for the seeds below.
Each one shrinks to the same pair of marks: a module carries a recompute mark (a cell
mark, ``remat.recompute_module`` or ``remat.apply``; any options) and one of its calls
is also written ``remat.checkpoint(block.forward, x, use_reentrant=True)``, a bound
method of the marked module. The reentrant region did not see the module's parameters
through the bound method: where its inputs need no gradient the parameters got none,
and where the module is called again unwrapped (or the region's output is changed in
place afterwards) the gradients came out wrong.

Each case below is a small model of the structure its seed shrinks to, written here in
this project's words. It trains two SGD steps unmarked and marked from identical copies
and requires loss, every gradient (parameters and inputs), every buffer and the updated
parameters to be bitwise equal.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat import ops
from tests._harness import assert_bitwise_equal_named

torch.set_num_threads(1)


# --- a program of block calls, one of which the marked copy wraps ------------------------


class Program(nn.Module):
    """A model whose ``forward`` calls its blocks through :meth:`call`.

    ``wrapped`` maps a call index to the options of the ``remat.checkpoint`` that wraps
    that call in the marked copy; the unmarked model leaves it empty.
    """

    def __init__(self) -> None:
        super().__init__()
        self.wrapped: dict[int, dict] = {}

    def call(self, index: int, block: nn.Module, *args, **kwargs):
        opts = self.wrapped.get(index)
        if opts is None:
            return block(*args, **kwargs)
        return remat.checkpoint(block.forward, *args, use_reentrant=True, **opts, **kwargs)


def _losses(outs: tuple, kinds: str) -> torch.Tensor:
    """A scalar from several outputs: ``s`` mean square, ``w`` weighted sum,
    ``l`` weighted log-softmax, ``t`` sum of ``o * tanh(o)``."""
    total = 0.0
    for i, (o, kind) in enumerate(zip(outs, kinds, strict=True)):
        w = torch.linspace(-1.0, 1.0, o.shape[-1]) * (i + 1)
        if kind == "s":
            total = total + o.pow(2).mean()
        elif kind == "w":
            total = total + (o * w).sum()
        elif kind == "l":
            total = total + (F.log_softmax(o, dim=-1) * w).sum()
        else:
            total = total + (o * torch.tanh(o)).sum()
    return total


def _train(model: nn.Module, inputs: list, loss: Callable, steps: int = 2) -> list:
    """Run ``steps`` SGD steps; return every number worth comparing, with its name."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    seen = []
    for step in range(steps):
        xs = [x.detach().clone().requires_grad_(x.requires_grad) for x in inputs]
        opt.zero_grad(set_to_none=True)
        torch.manual_seed(1000 + step)
        value = loss(model(*xs))
        value.backward()
        seen.append((f"step {step} loss", value.detach()))
        seen += [(f"step {step} grad {n}", p.grad) for n, p in model.named_parameters()]
        seen += [(f"step {step} grad input {i}", x.grad) for i, x in enumerate(xs)
                 if x.requires_grad]
        opt.step()
        seen += [(f"step {step} buffer {n}", b.clone()) for n, b in model.named_buffers()]
        seen += [(f"step {step} param {n}", p.detach().clone())
                 for n, p in model.named_parameters()]
    return seen


# --- blocks -------------------------------------------------------------------------------
# Values are (B, T, D); a block works on the last dimension unless it says otherwise.


class MLP(nn.Module):
    def __init__(self, d: int, hidden: int, act: nn.Module, drop: float = 0.0) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(d, hidden), act, nn.Linear(hidden, d)
        self.drop = nn.Dropout(drop) if drop else None

    def forward(self, x):
        h = self.act(self.fc1(x))
        return self.fc2(self.drop(h) if self.drop is not None else h)


class CellMLP(MLP, remat.nn.Cell):
    pass


class LinearAct(nn.Module):
    """A Linear, an activation, optionally keyword arguments (a scale, a gate, a sign)."""

    def __init__(self, d: int, act: nn.Module) -> None:
        super().__init__()
        self.fc, self.act = nn.Linear(d, d), act

    def forward(self, x, gate=None, scale=1.0, negate=False):
        h = self.act(self.fc(x))
        if gate is not None:
            h = h * torch.sigmoid(gate)
        return (-h if negate else h) * scale


class CellLinearAct(LinearAct, remat.nn.Cell):
    pass


class LNLinear(nn.Module):
    def __init__(self, d: int, act: nn.Module, drop: float = 0.0) -> None:
        super().__init__()
        self.ln, self.fc, self.act = nn.LayerNorm(d), nn.Linear(d, d), act
        self.drop = nn.Dropout(drop) if drop else None

    def forward(self, x):
        h = self.act(self.fc(self.ln(x)))
        return self.drop(h) if self.drop is not None else h


class CellLNLinear(LNLinear, remat.nn.Cell):
    pass


class BNLinear(nn.Module):
    def __init__(self, d: int, act: nn.Module) -> None:
        super().__init__()
        self.fc, self.bn, self.act = nn.Linear(d, d, bias=False), nn.BatchNorm1d(d), act

    def forward(self, x):
        h = self.fc(x)
        return self.act(self.bn(h.reshape(-1, h.shape[-1])).view(h.shape))


class CellBNLinear(BNLinear, remat.nn.Cell):
    pass


class ConvBN(nn.Module):
    """A 3x3 Conv2d over the (H, W) grid of the T axis, a BatchNorm2d and an activation."""

    def __init__(self, d: int, hw: tuple[int, int], act: nn.Module) -> None:
        super().__init__()
        self.hw = hw
        self.conv, self.bn, self.act = nn.Conv2d(d, d, 3, padding=1), nn.BatchNorm2d(d), act

    def forward(self, x):
        b, _, d = x.shape
        h = x.transpose(1, 2).reshape(b, d, *self.hw)
        return self.act(self.bn(self.conv(h))).flatten(2).transpose(1, 2)


class CellConvBN(ConvBN, remat.nn.Cell):
    pass


class Residual(nn.Module):
    def __init__(self, inner: nn.Module, scale: float = 1.0) -> None:
        super().__init__()
        self.inner, self.scale = inner, scale

    def forward(self, x):
        r = self.inner(x)
        return x + (r * self.scale if self.scale != 1.0 else r)


class CellResidual(Residual, remat.nn.Cell):
    pass


class Concat(nn.Module):
    def __init__(self, d: int, act: nn.Module) -> None:
        super().__init__()
        self.fa, self.fb, self.act, self.fc = nn.Linear(d, d), nn.Linear(d, d), act, nn.Linear(2 * d, d)

    def forward(self, x):
        return self.fc(torch.cat([self.act(self.fa(x)), self.fb(x)], dim=-1))


class CellConcat(Concat, remat.nn.Cell):
    pass


class Prims(nn.Module):
    """remat.ops primitives: MatMul, BiasAdd, activations, Mul, Sigmoid, Softmax, Add."""

    def __init__(self, d: int, act: nn.Module, softmax: bool = False) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d) / math.sqrt(d))
        self.b = nn.Parameter(torch.randn(d) * 0.1)
        self.matmul, self.bias_add, self.act = ops.MatMul(transpose_b=True), ops.BiasAdd(), act
        self.mul, self.sig, self.add = ops.Mul(), ops.Sigmoid(), ops.Add()
        self.softmax = ops.Softmax(axis=-1) if softmax else None

    def forward(self, x):
        h = self.matmul(x, self.w)
        h = self.act(self.bias_add(h.reshape(-1, h.shape[-1]), self.b).reshape(x.shape))
        h = self.mul(h, self.sig(x))
        if self.softmax is not None:
            h = self.softmax(h)
        return self.add(h, x)


class CellPrims(Prims, remat.nn.Cell):
    pass


class Attention(nn.Module):
    def __init__(self, d: int, heads: int = 2) -> None:
        super().__init__()
        self.heads, self.qkv, self.proj = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.softmax = ops.Softmax(axis=-1)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (z.reshape(b, t, self.heads, -1).transpose(1, 2)
                   for z in self.qkv(x).chunk(3, dim=-1))
        a = self.softmax(q @ k.transpose(-1, -2) / math.sqrt(d // self.heads))
        return self.proj((a @ v).transpose(1, 2).reshape(b, t, d))


class CellAttention(Attention, remat.nn.Cell):
    pass


class TwoOut(nn.Module):
    """Returns a tuple: two results (``mode="two"``), or a result and its own input (``"pass"``)."""

    def __init__(self, d: int, act: nn.Module, mode: str) -> None:
        super().__init__()
        self.fc1, self.fc2, self.act, self.mode = nn.Linear(d, d), nn.Linear(d, d), act, mode

    def forward(self, x):
        if self.mode == "two":
            return self.fc1(x), self.act(self.fc2(x))
        return self.act(self.fc1(x)), x


class CellTwoOut(TwoOut, remat.nn.Cell):
    pass


class DropLinear(nn.Module):
    """Dropout first, then a Linear and an activation."""

    def __init__(self, d: int, act: nn.Module, p: float = 0.5) -> None:
        super().__init__()
        self.drop, self.fc, self.act = nn.Dropout(p), nn.Linear(d, d), act

    def forward(self, x):
        return self.act(self.fc(self.drop(x)))


class CellDropLinear(DropLinear, remat.nn.Cell):
    pass


class Preact(nn.Module):
    """An in-place ReLU on the block's own input (pre-activation style), then a Linear."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return self.fc(F.relu(x, inplace=True))


class Nest(nn.Module):
    """Sub-blocks run in sequence."""

    def __init__(self, *subs: nn.Module) -> None:
        super().__init__()
        self.subs = nn.ModuleList(subs)

    def forward(self, x):
        for sub in self.subs:
            x = sub(x)
        return x


class CellNest(Nest, remat.nn.Cell):
    pass


def _freeze(*params: nn.Parameter) -> None:
    for p in params:
        p.requires_grad_(False)


# --- the seeds --------------------------------------------------------------------------------


class Seed65(Program):
    """An MLP with a frozen weight, called twice; the second call (on another input) is
    wrapped; the first call's output feeds a keyword-argument cell with an in-place ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = MLP(4, 8, nn.SiLU())
        self.kw = CellLinearAct(4, nn.ReLU(inplace=True))
        _freeze(self.mlp.fc2.weight)

    def forward(self, x, y):
        h = self.call(0, self.mlp, x)
        a = self.call(1, self.kw, h, scale=2.0)
        b = self.call(2, self.mlp, y)
        return a, b


class Seed234(Program):
    """A cell nest (BatchNorm cell with a frozen weight, MLP) on an input that needs no
    gradient, its output changed in place (``add_``), then a dropout MLP cell."""

    def __init__(self) -> None:
        super().__init__()
        self.nest = CellNest(CellBNLinear(8, nn.GELU()), MLP(8, 16, ops.GeLU()))
        self.head = CellMLP(8, 16, nn.Tanh(), drop=0.5)
        _freeze(self.nest.subs[0].fc.weight, self.head.fc2.bias)

    def forward(self, x, y):
        h = self.call(0, self.nest, y).add_(0.25)
        return (self.call(1, self.head, h),)


class Seed309(Program):
    """A plain nest of Conv2d+BatchNorm, LayerNorm (frozen bias) and a Conv2d+BatchNorm cell,
    marked by type with ``remat.apply``; a ReLU MLP cell after it; a LayerNorm cell on the
    same input whose output is clamped in place."""

    def __init__(self) -> None:
        super().__init__()
        self.nest = Nest(ConvBN(6, (2, 3), nn.ReLU()), LNLinear(6, ops.GeLU()),
                         CellConvBN(6, (2, 3), nn.ReLU()))
        self.mlp = CellMLP(6, 12, nn.ReLU())
        self.ln = CellLNLinear(6, nn.GELU())
        _freeze(self.nest.subs[1].ln.bias)

    def forward(self, x):
        h = self.call(0, self.nest, x)
        a = self.call(1, self.mlp, h.flatten(1).unflatten(1, (6, 6)))
        b = self.call(2, self.ln, x).clamp_(-1.0, 1.0)
        return b, a


class Seed385(Program):
    """A residual around a LayerNorm block with dropout (frozen LayerNorm weight), called
    twice on the same input; the second call is wrapped and clamped in place; a concat
    block's output is changed in place through a transposed view."""

    def __init__(self) -> None:
        super().__init__()
        self.res = Residual(LNLinear(4, nn.SiLU(), drop=0.5))
        self.cat = Concat(4, nn.SiLU())
        _freeze(self.res.inner.ln.weight)

    def forward(self, x, y):
        a = self.call(0, self.res, y)
        c = self.call(1, self.cat, y)
        c.transpose(1, 2).mul_(-0.5)
        b = self.call(2, self.res, y).clamp_(-1.0, 1.0)
        return b, a, c


class Seed433(Program):
    """A pre-activation block (in-place ReLU on its own input, frozen weight) on the model
    input; a concat cell and a dropout block after it."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = Preact(6)
        self.cat = CellConcat(6, nn.Sigmoid())
        self.drop = DropLinear(6, nn.ReLU(), p=0.3)
        _freeze(self.pre.fc.weight, self.cat.fb.weight, self.cat.fb.bias)

    def forward(self, x):
        h = self.call(0, self.pre, x)
        return self.call(1, self.drop, h), self.call(2, self.cat, h)


class Seed561(Program):
    """A two-output cell (frozen bias) whose outputs are reshaped; a primitives cell and a
    Conv2d+BatchNorm cell on the second."""

    def __init__(self) -> None:
        super().__init__()
        self.two = CellTwoOut(4, nn.ReLU(), "two")
        self.prims = CellPrims(4, ops.GeLU(), softmax=True)
        self.conv = CellConvBN(4, (2, 3), nn.ReLU())
        _freeze(self.two.fc2.bias)

    def forward(self, x):
        a, b = self.call(0, self.two, x)
        a, b = a.reshape(2, -1).view(2, 6, 4), b.reshape(2, -1).view(2, 6, 4)
        h = self.call(1, self.prims, b).reshape(2, -1).view(2, 6, 4)
        return self.call(2, self.conv, h), a


class Seed718(Program):
    """A Conv2d+BatchNorm block called twice: wrapped on an input that needs no gradient,
    then plain on the second output (in-place ReLU) of a two-output block over ``x``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = ConvBN(4, (2, 2), nn.SiLU())
        self.attn = CellAttention(4)
        self.two = TwoOut(4, nn.ReLU(inplace=True), "two")
        _freeze(self.attn.qkv.weight)

    def forward(self, x, y):
        h = self.call(0, self.conv, y).reshape(3, -1).view(3, 4, 4)
        h = self.call(1, self.attn, h)
        a, b = self.call(2, self.two, x)
        return self.call(3, self.conv, b), h, a


class Seed759(Program):
    """Attention on an input that needs no gradient, marked with ``output_recompute``; a
    cell nest (LayerNorm cell, BatchNorm block) and an attention cell on the other input."""

    def __init__(self) -> None:
        super().__init__()
        self.nest = CellNest(CellLNLinear(6, nn.SiLU()), BNLinear(6, nn.Tanh()))
        self.attn = Attention(6)
        self.attn2 = CellAttention(6)

    def forward(self, x, y):
        h = self.call(0, self.nest, y)
        a = self.call(1, self.attn, x)
        return self.call(2, self.attn2, h), a


class Seed812(Program):
    """A residual (scale 0.5) around a Conv2d+BatchNorm cell, called twice: wrapped on the
    input, then plain on its own reshaped output; a Conv2d+BatchNorm cell in between."""

    def __init__(self) -> None:
        super().__init__()
        self.res = Residual(CellConvBN(8, (3, 3), nn.ReLU()), scale=0.5)
        self.conv = CellConvBN(8, (3, 3), nn.SiLU())

    def forward(self, x):
        h = self.call(0, self.res, x.flatten(1).unflatten(1, (9, 8)))
        h = h.reshape(3, -1).view(3, 9, 8)
        return self.call(2, self.res, h), self.call(1, self.conv, h)


class Seed825(Program):
    """A two-output block that passes its own input through as the second output; an MLP
    with a frozen bias and a concat cell after it."""

    def __init__(self) -> None:
        super().__init__()
        self.two = TwoOut(6, nn.Sigmoid(), "pass")
        self.mlp = MLP(6, 6, nn.Sigmoid())
        self.cat = CellConcat(6, nn.ReLU())
        _freeze(self.mlp.fc2.bias, self.cat.fb.weight)

    def forward(self, x):
        a, b = self.call(0, self.two, x)
        return self.call(2, self.cat, self.call(1, self.mlp, b)), a.reshape(2, -1).view(2, 9, 6)


class Seed873(Program):
    """A keyword-argument block (gate tensor, sign flag; frozen weight) and a dropout cell,
    both on the input that needs no gradient; the dropout cell's call is wrapped."""

    def __init__(self) -> None:
        super().__init__()
        self.kw = LinearAct(6, nn.Tanh())
        self.drop = CellDropLinear(6, ops.GeLU())
        _freeze(self.kw.fc.weight)

    def forward(self, x, y):
        a = self.call(0, self.kw, y, gate=x, negate=True)
        b = self.call(1, self.drop, y).transpose(1, 2)
        return b, a


class Seed875(Program):
    """A dropout MLP cell called twice: wrapped on the input, then plain on its own output,
    which is changed in place (``relu_``); a residual cell (``add_`` after) and a
    primitives cell follow."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = CellMLP(4, 4, nn.Sigmoid(), drop=0.5)
        self.res = CellResidual(Prims(4, nn.ReLU(), softmax=True), scale=0.5)
        self.prims = CellPrims(4, nn.Sigmoid())

    def forward(self, x):
        h = self.call(0, self.mlp, x)
        g = self.call(1, self.mlp, h).relu_()
        r = self.call(2, self.res, g).add_(0.25)
        return self.call(3, self.prims, h), r


@dataclass
class Case:
    model: type[Program]
    inputs: list  # (shape, requires_grad) of each input
    mark: Callable[[Program], object]
    wrap: dict[int, dict]  # call index -> remat.checkpoint options besides use_reentrant
    loss: str  # one letter per output, see _losses


NO_RNG = {"preserve_rng_state": False}
RNG = {"preserve_rng_state": True}

CASES = {
    65: Case(Seed65, [((3, 6, 4), False), ((3, 6, 4), False)],
             lambda m: remat.recompute_module(m.mlp, output_recompute=True), {2: NO_RNG}, "lw"),
    234: Case(Seed234, [((2, 6, 8), True), ((2, 6, 8), False)],
              lambda m: remat.recompute_module(m.nest, output_recompute=True), {0: NO_RNG}, "s"),
    309: Case(Seed309, [((3, 6, 6), False)],
              lambda m: remat.apply(m, "Nest", use_reentrant=True), {0: RNG}, "ls"),
    385: Case(Seed385, [((2, 9, 4), False), ((2, 9, 4), False)],
              lambda m: remat.recompute_module(m.res), {2: RNG}, "lts"),
    433: Case(Seed433, [((3, 4, 6), False)],
              lambda m: remat.recompute_module(m.pre, use_reentrant=True, preserve_rng_state=False),
              {0: RNG}, "ts"),
    561: Case(Seed561, [((2, 6, 4), False)],
              lambda m: m.two.recompute(output_recompute=True),
              {0: {"preserve_rng_state": False, "early_stop": False}}, "wl"),
    718: Case(Seed718, [((3, 4, 4), True), ((3, 4, 4), False)],
              lambda m: remat.recompute_module(m.conv, use_reentrant=True), {0: RNG}, "wsw"),
    759: Case(Seed759, [((3, 6, 6), False), ((3, 6, 6), True)],
              lambda m: remat.recompute_module(m.attn, use_reentrant=False, output_recompute=True,
                                               early_stop=False, preserve_rng_state=False),
              {1: RNG}, "ll"),
    812: Case(Seed812, [((3, 9, 8), False)],
              lambda m: remat.recompute_module(m.res, output_recompute=True,
                                               policy=remat.save_compute_intensive),
              {0: RNG}, "sw"),
    825: Case(Seed825, [((2, 9, 6), False)],
              lambda m: remat.recompute_module(m.two, output_recompute=True), {0: RNG}, "lw"),
    873: Case(Seed873, [((3, 6, 6), True), ((3, 6, 6), False)],
              lambda m: remat.recompute_module(m.drop, output_recompute=True,
                                               policy=remat.save_compute_intensive),
              {1: RNG}, "sl"),
    875: Case(Seed875, [((3, 4, 4), False)],
              lambda m: m.mlp.recompute(use_reentrant=True),
              {0: {"preserve_rng_state": True, "early_stop": False}}, "tl"),
}


@pytest.mark.parametrize("seed", list(CASES), ids=str)
def test_marked_module_called_through_reentrant_bound_method(seed):
    """Seed ``seed``'s structure (the class docstrings above) with its two marks: bitwise
    the unmarked model over two SGD steps."""
    case = CASES[seed]
    torch.manual_seed(seed)
    plain = case.model().train()
    inputs = [torch.randn(shape).requires_grad_(rg) for shape, rg in case.inputs]
    marked = copy.deepcopy(plain)
    case.mark(marked)
    marked.wrapped = dict(case.wrap)

    def loss(out):
        return _losses(out if isinstance(out, tuple) else (out,), case.loss)

    assert_bitwise_equal_named(_train(plain, inputs, loss), _train(marked, inputs, loss))


# --- the smallest form ----------------------------------------------------------------


def _call_form(blk: nn.Module, form: str) -> Callable:
    if form == "method":
        return blk.forward
    if form == "lambda":
        return lambda t: blk(t)
    if form == "partial":
        return functools.partial(blk.forward)
    return blk


@pytest.mark.parametrize("form", ["method", "lambda", "partial", "module"])
@pytest.mark.parametrize("mark", [{}, {"output_recompute": True}, {"use_reentrant": True}],
                         ids=["plain", "output_recompute", "use_reentrant"])
def test_marked_block_in_reentrant_checkpoint_gets_grads(mark, form):
    """A marked block wrapped in a reentrant checkpoint, on an input that needs no gradient:
    its parameters get the unmarked gradients (they were None through a bound method or a
    partial over one)."""
    torch.manual_seed(0)
    blk, head = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)), nn.Linear(8, 1)
    x = torch.randn(4, 8)
    head(blk(x)).sum().backward()
    want = [p.grad.clone() for p in [*blk.parameters(), *head.parameters()]]
    for p in [*blk.parameters(), *head.parameters()]:
        p.grad = None
    remat.recompute_module(blk, **mark)
    head(remat.checkpoint(_call_form(blk, form), x, use_reentrant=True)).sum().backward()
    got = [p.grad for p in [*blk.parameters(), *head.parameters()]]
    assert all(g is not None for g in got)
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
