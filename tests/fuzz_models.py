"""A seeded generator of random small models and random recompute marks (for tests/test_fuzz.py).

A *case* is one integer seed. From it :func:`make_case` draws a model description
(stages of blocks, the wiring between them, tied and frozen parameters, the input)
and a *plan* of marks (cell marks, ``recompute_module``, ``remat.apply``, primitive
marks, functional ``remat.recompute`` and ``remat.checkpoint`` call sites, policies,
nesting). :func:`run_case` builds the model twice from the same seed, marks the
second copy, trains both in lockstep and compares every number with ``torch.equal``.

Grow it by adding entries to the tables: ``BLOCKS`` (layer kinds), ``WIRES`` (what
happens between blocks), ``MARKS`` (mark kinds), ``POLICIES`` and ``CONTEXTS``.

Reproduce one case::

    PYTHONPATH=src python -m tests.fuzz_models 1234          # run it, print the verdict
    PYTHONPATH=src python -m tests.fuzz_models 1234 --show   # print the model and the plan

``KNOWN_BROKEN`` (at the end) may name classes of failures the engine is known to get
wrong while their fix is pending.
"""

from __future__ import annotations

import contextlib
import copy
import fnmatch
import functools
import gc
import random
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import remat
from remat import ops
from remat._engine import dead as _dead
from remat._front.blocks import find_blocks

D = 8  # feature width of every block


# --- blocks ---------------------------------------------------------------------
# Every block maps (X, Y, D) -> (X, Y, D) (or two in a structure for "tuple_out"), and works on the
# last dimension only, so the wiring may transpose the first two between blocks.


class Block(remat.nn.Cell):
    """Base of the fuzz blocks: a Cell, so ``.recompute()`` marks it."""

    kind = "block"
    tuple_out = False
    inplace_after: tuple[str, ...] = ()  # children whose output the block changes in place


def _act(name: str) -> nn.Module:
    return {
        "relu_inplace": lambda: nn.ReLU(inplace=True),
        "relu": nn.ReLU,
        "gelu": nn.GELU,
        "tanh": nn.Tanh,
        "op_relu": ops.ReLU,
        "op_gelu": ops.GeLU,
        "op_tanh": ops.Tanh,
        "op_sigmoid": ops.Sigmoid,
    }[name]()


ACTS = ("relu_inplace", "relu", "gelu", "tanh", "op_relu", "op_gelu", "op_tanh", "op_sigmoid")


class Linear(Block):
    kind = "linear"

    def __init__(self, p: dict) -> None:
        super().__init__()
        # without a bias, a 3-D input runs mm then _unsafe_view, an alias with a version counter
        # of its own (NOTE [Aliases with a version of their own])
        self.fc = nn.Linear(D, D, bias=p.get("bias", True))

    def forward(self, x):
        return self.fc(x)


class LinearAct(Block):
    kind = "linear_act"

    def __init__(self, p: dict) -> None:
        super().__init__()
        self.fc, self.act = nn.Linear(D, D), _act(p["act"])
        if p["act"] == "relu_inplace":
            self.inplace_after = ("fc",)

    def forward(self, x):
        return self.act(self.fc(x))


class MLP(Block):
    kind = "mlp"

    def __init__(self, p: dict) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(D, 2 * D), _act(p["act"]), nn.Linear(2 * D, D)
        if p["act"] == "relu_inplace":
            self.inplace_after = ("fc1",)
        self.compiled = False  # the door of a torch.compile'd function inside (desc["compiled"])

    def forward(self, x):
        if self.compiled:
            return _compiled_mlp()(x, self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias)
        return self.fc2(self.act(self.fc1(x)))


def _mlp_core(x, w1, b1, w2, b2):
    h = nn.functional.linear(x, w1, b1)
    return nn.functional.linear(nn.functional.gelu(h) * torch.sigmoid(h), w2, b2)


_COMPILED: list = []


def _compiled_mlp() -> Callable:
    """The MLP's computation compiled by ``torch.compile`` (``aot_eager``): code the user
    compiled, inside a region (NOTE [Compiled code inside a region] in ``observe.py``); one
    function for every case, so each guard set compiles once per process."""
    if not _COMPILED:
        import torch._dynamo
        import torch._functorch.config

        torch._dynamo.config.recompile_limit = 64  # shapes, grad modes, frozen weights
        torch._functorch.config.donated_buffer = False  # cases backward twice, or with create_graph
        _COMPILED.append(torch.compile(_mlp_core, backend="aot_eager"))
    return _COMPILED[0]


class Conv(Block):
    """Conv1d over the middle dimension, a batch norm after it or not: transposes in, a
    transposed view out (a wire may change that view in place: NOTE [Views changed after
    the region] in ``_engine/reentrant.py``)."""

    kind = "conv"

    def __init__(self, p: dict) -> None:
        super().__init__()
        self.conv = nn.Conv1d(D, D, 3, padding=1, bias=p["bias"])
        self.norm = nn.BatchNorm1d(D) if p.get("norm") else nn.Identity()

    def forward(self, x):
        return self.norm(self.conv(x.transpose(1, 2))).transpose(1, 2)


class Norm(Block):
    """BatchNorm1d (training mode, running statistics) or LayerNorm, then a Linear."""

    kind = "norm"

    def __init__(self, p: dict) -> None:
        super().__init__()
        self.batch = p["batch"]
        self.norm = nn.BatchNorm1d(D) if self.batch else nn.LayerNorm(D)
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        if self.batch:
            return self.fc(self.norm(x.transpose(1, 2)).transpose(1, 2))
        return self.fc(self.norm(x))


class Drop(Block):
    kind = "dropout"

    def __init__(self, p: dict) -> None:
        super().__init__()
        self.fc, self.drop = nn.Linear(D, D), nn.Dropout(0.3)
        self.fused = p.get("fused", False)

    def forward(self, x):
        if self.fused:  # two draws of the fused operator CUDA's dropout runs (NOTE [Kept random operators])
            a = torch.native_dropout(self.fc(x), 0.3, self.training)[0]
            return torch.native_dropout(a.sin(), 0.3, self.training)[0]
        return self.drop(self.fc(x))


class Stochastic(Block):
    """A draw of torch's generator decides what runs (stochastic depth, a random branch): on
    the host (``.item()``, a graph break under torch.compile) or on the device (``torch.where``)."""

    kind = "stochastic"

    def __init__(self, p: dict) -> None:
        super().__init__()
        self.fc, self.left, self.right = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
        self.host = p.get("host", True)

    def forward(self, x):
        if self.host:
            if torch.rand(()).item() < 0.5:  # the residual branch taken
                x = x + torch.tanh(self.fc(x))
            return (self.left if torch.randint(0, 2, ()).item() else self.right)(x)
        take = torch.rand(()) < 0.5
        x = torch.where(take, x + torch.tanh(self.fc(x)), x)
        return torch.where(torch.rand(()) < 0.5, self.left(x), self.right(x))


class GradHook(Block):
    """Clips its activation's gradient with a hook registered in forward (or keeps it,
    ``retain_grad``): refused under ``use_reentrant=True``, as in torch's reentrant checkpoint."""

    kind = "grad_hook"

    def __init__(self, p: dict) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.retain = p.get("retain", False)

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        if self.retain:
            h.retain_grad()
        else:
            h.register_hook(_clip)
        return x + h


def _clip(grad: torch.Tensor) -> torch.Tensor:
    return grad.clamp(-0.05, 0.05)


class Residual(Block):
    kind = "residual"

    def __init__(self, p: dict) -> None:
        super().__init__()
        self.act, self.fc = _act(p["act"]), nn.Linear(D, D)

    def forward(self, x):
        return x + self.fc(self.act(x.clone() if isinstance(self.act, nn.ReLU) and self.act.inplace else x))


class Concat(Block):
    kind = "concat"

    def __init__(self, p: dict) -> None:
        super().__init__()
        self.a, self.b, self.fc = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(2 * D, D)

    def forward(self, x):
        return self.fc(torch.cat([self.a(x), torch.tanh(self.b(x))], dim=-1))


@dataclass
class PairOut:
    first: torch.Tensor
    second: torch.Tensor


# How a "tuple_out" block packs its two outputs, and how its stage unpacks them (NOTE
# [Outputs of any structure]): name -> (pack, unpack).
PACKS: dict[str, tuple[Callable, Callable]] = {
    "tuple": (lambda a, c: (a, c), lambda out: out),
    "dataclass": (PairOut, lambda out: (out.first, out.second)),
    "dict": (lambda a, c: {"a": a, "rest": [c], "n": 1}, lambda out: (out["a"], out["rest"][0])),
}


class TupleOut(Block):
    """Two outputs, in a tuple, a dataclass or a dict holding a list (``pack``); with
    ``pass`` the second is the block's own input, passed through (a caller may change it
    in place: NOTE [Arguments returned as outputs])."""

    kind = "tuple_out"
    tuple_out = True

    def __init__(self, p: dict) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.p_pass = p.get("pass", False)
        self.pack = p.get("pack", "tuple")

    leaf_view = False  # desc["leaf_view"]: the block returns a view of its parameter instead

    def forward(self, x):
        if "leaf" in self._parameters:  # the door desc["leaf_out"]: NOTE [Tensors returned as they were]
            return PACKS[self.pack][0](self.fc(x), self.leaf[:] if self.leaf_view else self.leaf)
        if self.p_pass == "view":  # a view of the input: NOTE [Views of an argument changed after the region]
            return PACKS[self.pack][0](self.fc(x), x.view_as(x))
        return PACKS[self.pack][0](self.fc(x), (x if self.p_pass else torch.sin(x)))



class Keywords(Block):
    """Keyword, non-tensor and optional tensor arguments."""

    kind = "keywords"

    def __init__(self, p: dict) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x, gate=None, *, scale: float = 1.0, mode: str = "plain", pair=None):
        y = self.fc(x) * scale
        if gate is not None:
            y = y + gate
        if pair is not None:  # a tuple of a tensor and a plain value (a rotary pair's shape)
            y = y * pair[1] + pair[0]
        return torch.tanh(y) if mode == "tanh" else y


class Skip(Block):
    """Two tensor inputs: the previous output and an earlier one (two consumers)."""

    kind = "skip"

    def __init__(self, p: dict) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x, skip):
        return self.fc(x) * torch.sigmoid(skip)


class Cross(Block):
    """Cross-attention's pattern: a memory (the stage's input) read twice, for keys and
    values, by every cross block of the stage (NOTE [Per-use gradients])."""

    kind = "cross"

    def __init__(self, p: dict) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x, memory):
        return x + torch.tanh(self.q(x) * self.k(memory)) * self.v(memory)


class Shared(Block):
    """One Linear applied twice (shared parameters inside a block)."""

    kind = "shared"

    def __init__(self, p: dict) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        return self.fc(torch.tanh(self.fc(x)))


class InplaceInput(Block):
    """Changes its own input in place before using it."""

    kind = "inplace_input"

    def __init__(self, p: dict) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        x.mul_(0.5)
        return self.fc(x)


class Closure(Block):
    """Reads a non-leaf tensor through an attribute (a closure) as well as its argument."""

    kind = "closure"
    memo: torch.Tensor | None = None  # set by the stage before each call

    def __init__(self, p: dict) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        return self.fc(x) * self.memo


class InplaceInputLate(Block):
    """Reads its input, writes it in place, reads it again."""

    kind = "inplace_input_late"

    def __init__(self, p: dict) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        a = torch.exp(x)  # saves its result, not x
        x.mul_(0.5)
        return self.fc(a * 0.1 + x)


class SelfAttention(Block):
    """``nn.MultiheadAttention(h, h, h)``: one tensor in three slots (``q is k`` matters)."""

    kind = "self_attention"

    def __init__(self, p: dict) -> None:
        super().__init__()
        self.norm, self.attn = nn.LayerNorm(D), nn.MultiheadAttention(D, 2, batch_first=True)

    def forward(self, x):
        h = self.norm(x)
        return x + self.attn(h, h, h, need_weights=False)[0]


class HFLayer(Block):
    """A Hugging Face layer (``GradientCheckpointingLayer``) inside a block, called with a
    fresh key/value cache it writes in training when ``cache`` is drawn (issue 17)."""

    kind = "hf_layer"

    def __init__(self, p: dict) -> None:
        super().__init__()
        from transformers import GPT2Config
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        config = GPT2Config(n_embd=D, n_head=2, n_layer=1, resid_pdrop=0.0, attn_pdrop=0.0,
                            embd_pdrop=0.0)
        config._attn_implementation = "eager"
        self.config, self.cache = config, p["cache"]
        self.layer = GPT2Block(config, layer_idx=0)

    def forward(self, x):
        if not self.cache:
            return self.layer(x)
        from transformers import DynamicCache

        return self.layer(x, DynamicCache(config=self.config), use_cache=True)


class Stateful(Block):
    """Truncated-BPTT state: a tensor carried to the next call in an attribute (issue 25)."""

    kind = "stateful"

    def __init__(self, p: dict) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(D, D), nn.Linear(D, D)
        self.prev = None if p["none"] else torch.zeros(())

    def forward(self, x):
        h = torch.tanh(self.fc(x) + (0 if self.prev is None else self.prev))
        self.prev = h.detach().mean()  # read by the next call, rebound after this one
        return self.out(h)


class ParamWrite(Block):
    """A forward that writes its own parameter through a detached alias, as an embedding's
    ``max_norm`` renormalizes its weight (NOTE [Observed writes]): written once per forward,
    never again by a re-run, in every mode."""

    kind = "param_write"

    def __init__(self, p: dict) -> None:
        super().__init__()
        self.fc, self.scale = nn.Linear(D, D), p["scale"]
        self.writes = 0  # forwards outside recomputation: a judged error comes after them

    def forward(self, x):
        if isinstance(self.fc.weight, nn.Parameter):  # not under functional_call or torch.func
            self.fc.weight.detach().mul_(self.scale)
            if not remat.is_recomputing():
                self.writes += 1
        return torch.tanh(self.fc(x))


def _own_writes(model: nn.Module) -> dict[str, tuple[ParamWrite, int]]:
    """The `ParamWrite` blocks and their writes so far (what a step's own forwards change)."""
    return {n: (m, m.writes) for n, m in model.named_modules() if isinstance(m, ParamWrite)}


class SideLoss(Block):
    """A loss that leaves the block by a side channel: an attribute, or a child's forward hook
    (a router's load-balancing loss); the stage adds it to the output (issue 25)."""

    kind = "side_loss"

    def __init__(self, p: dict) -> None:
        super().__init__()
        self.fc, self.channel = nn.Linear(D, D), p["channel"]
        self.aux = None
        if self.channel == "hook":
            self.fc.register_forward_hook(_capture)

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        if self.channel == "attribute":
            self.aux = h.pow(2).mean()
        return x + h

    def side(self) -> torch.Tensor:
        if self.channel == "attribute":
            return self.aux
        return self.fc.captured.pop().pow(2).mean()


def _capture(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
    """A forward hook inside a region runs again in its re-run, as with torch's checkpoint
    (docs/sections/torch.md): a re-run whose stage pops outside the region leaves its
    capture in the list, the model's own reference (cleared before the leak check)."""
    module.__dict__.setdefault("captured", []).append(output)


class InnerGrad(Block):
    """A gradient inside forward (a force field's -dE/dz), under torch.enable_grad (issue 25)."""

    kind = "inner_grad"

    def __init__(self, p: dict) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        with torch.enable_grad():
            z = h.detach().requires_grad_()
            (dz,) = torch.autograd.grad(torch.sin(z).pow(2).sum(), z, create_graph=True)
        return h + 0.1 * dz


class Moe(Block):
    """A mixture of experts: a router picks the top 2 of 3 experts per token (routing that
    depends on the data, replayed exactly or not at all); its logits leave by a forward hook
    on the router, and the stage adds a load-balancing loss from them (Mixtral's door)."""

    kind = "moe"

    def __init__(self, p: dict) -> None:
        super().__init__()
        self.router = nn.Linear(D, 3)
        self.experts = nn.ModuleList(nn.Linear(D, D) for _ in range(3))
        self.router.register_forward_hook(_capture)

    def forward(self, x):
        weights, chosen = torch.softmax(self.router(x), dim=-1).topk(2, dim=-1)
        out = torch.zeros_like(x)
        for k in range(2):
            for e, expert in enumerate(self.experts):
                mask = (chosen[..., k] == e).unsqueeze(-1).to(x.dtype)
                out = out + mask * weights[..., k:k + 1] * expert(x)
        return x + out

    def side(self) -> torch.Tensor:
        probs = torch.softmax(self.router.captured.pop(), dim=-1)
        return 0.1 * probs.mean(dim=tuple(range(probs.dim() - 1))).pow(2).sum()


class Lora(Block):
    """A frozen base layer with a trainable low-rank adapter (LoRA without
    enable_input_require_grads): the region's input may require no grad at all."""

    kind = "lora"

    def __init__(self, p: dict) -> None:
        super().__init__()
        self.base = nn.Linear(D, D)
        self.base.requires_grad_(False)
        self.down, self.up = nn.Linear(D, 2, bias=False), nn.Linear(2, D, bias=False)

    def forward(self, x):
        return x + torch.tanh(self.base(x) + self.up(self.down(x)))


def _has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class BlockKind:
    """A layer kind: its class, how often it is drawn, and its random parameters."""

    cls: type
    weight: float
    params: Callable[[random.Random], dict] = lambda r: {}


BLOCKS: dict[str, BlockKind] = {
    "linear": BlockKind(Linear, 1.0, lambda r: {"bias": r.random() < 0.6}),
    "linear_act": BlockKind(LinearAct, 2.0, lambda r: {"act": r.choice(ACTS)}),
    "mlp": BlockKind(MLP, 1.5, lambda r: {"act": r.choice(ACTS)}),
    "conv": BlockKind(Conv, 1.0, lambda r: {"bias": r.random() < 0.7, "norm": r.random() < 0.4}),
    "norm": BlockKind(Norm, 1.5, lambda r: {"batch": r.random() < 0.5}),
    "dropout": BlockKind(Drop, 0.7, lambda r: {"fused": r.random() < 0.5}),
    "residual": BlockKind(Residual, 1.0, lambda r: {"act": r.choice(ACTS)}),
    "stochastic": BlockKind(Stochastic, 0.5, lambda r: {"host": r.random() < 0.6}),
    "grad_hook": BlockKind(GradHook, 0.3, lambda r: {"retain": r.random() < 0.3}),
    "concat": BlockKind(Concat, 0.7),
    "tuple_out": BlockKind(TupleOut, 0.8, lambda r: {"combine": r.choice(("add", "mul", "first", "relu_second")),
                                                     "pass": r.choice((False, False, False, True, "view")),
                                                     "pack": r.choice(("tuple", "tuple", "dataclass", "dict"))}),
    "keywords": BlockKind(Keywords, 0.8, lambda r: {
        "scale": r.choice((0.5, 2.0)), "mode": r.choice(("plain", "tanh")), "gate": r.random() < 0.5}),
    "skip": BlockKind(Skip, 0.8),
    "cross": BlockKind(Cross, 0.6),
    "shared": BlockKind(Shared, 0.6),
    "inplace_input": BlockKind(InplaceInput, 0.3),
    "inplace_input_late": BlockKind(InplaceInputLate, 0.2),
    "closure": BlockKind(Closure, 0.5),
    "self_attention": BlockKind(SelfAttention, 0.5),
    "stateful": BlockKind(Stateful, 0.5, lambda r: {"none": r.random() < 0.5}),
    "side_loss": BlockKind(SideLoss, 0.5, lambda r: {"channel": r.choice(("attribute", "hook"))}),
    "inner_grad": BlockKind(InnerGrad, 0.3),
    "moe": BlockKind(Moe, 0.4),
    "lora": BlockKind(Lora, 0.4),
    "param_write": BlockKind(ParamWrite, 0.3, lambda r: {"scale": r.choice((0.999, 1.001))}),
}
if _has_transformers():
    BLOCKS["hf_layer"] = BlockKind(HFLayer, 0.4, lambda r: {"cache": r.random() < 0.5})


def _wire_view(h):
    return h.reshape(-1, D).view(h.shape)


# What runs between blocks, outside them: name -> (function, weight, changes in place).
WIRES: dict[str, tuple[Callable, float, bool]] = {
    "none": (lambda h: h, 4.0, False),
    "transpose": (lambda h: h.transpose(0, 1), 1.0, False),
    "view": (_wire_view, 0.7, False),
    "relu_": (lambda h: torch.relu_(h), 0.8, True),
    "mul_": (lambda h: h.mul_(1.5), 0.8, True),
    "clone": (lambda h: h.clone(), 0.3, False),
}


# How a stage merges a "tuple_out" block's two outputs.
COMBINE: dict[str, Callable] = {"add": lambda a, c: a + c, "mul": lambda a, c: a * c, "first": lambda a, c: a,
                                "relu_second": lambda a, c: a + c.relu_()}  # c may be the block's input


# --- the model ------------------------------------------------------------------


def call(module: nn.Module, mode: tuple | None, args: tuple, kwargs: dict) -> Any:
    """Call ``module`` plainly, or through the functional mark ``mode`` = (api, options)."""
    if mode is None:
        return module(*args, **kwargs)
    api, opts = mode
    opts = dict(opts)
    if "context" in opts:
        opts["context_fn"] = CONTEXTS[opts.pop("context")]()
    form = opts.pop("form", "module")
    fn = _form(module, form)
    if form == "partial" and kwargs:  # Hugging Face's call: the keywords bound in the partial
        fn, kwargs = functools.partial(module, **kwargs), {}
    if api == "recompute":
        return remat.recompute(fn, *args, **opts, **kwargs)
    if api == "checkpoint":
        return remat.checkpoint(fn, *args, **opts, **kwargs)
    raise AssertionError(api)


FORMS = ("module", "bound", "lambda", "partial")


def _form(module: nn.Module, form: str) -> Callable:
    """The callable a functional mark wraps: the module, its bound ``forward``, a lambda or a
    ``functools.partial`` over it (``remat.recompute`` takes modules only: it gets the module).
    A bound ``forward`` skips the module's own hooks, so a hooked module is called whole."""
    if form == "bound" and not (module._forward_hooks or module._forward_pre_hooks):
        return module.forward
    if form == "lambda":
        return lambda *a, **k: module(*a, **k)
    if form == "partial":
        return functools.partial(module)
    return module


class Stage(remat.nn.Cell):
    """Blocks in sequence, with wiring between them; a Cell, so it may be marked (nesting)."""

    def __init__(self, blocks: list[dict]) -> None:
        super().__init__()
        self.desc = blocks
        self.blocks = nn.ModuleList(BLOCKS[b["kind"]].cls(b["p"]) for b in blocks)
        self.calls: dict[int, tuple] = {}  # functional marks, by block index

    def forward(self, h):
        outs = [h]
        for i, (block, b) in enumerate(zip(self.blocks, self.desc, strict=True)):
            args, kwargs = (h,), {}
            if b["kind"] == "skip":
                skip = outs[b["p"]["from"] % len(outs)]
                args = (h, skip if skip.shape == h.shape else skip.transpose(0, 1))
            elif b["kind"] == "cross":
                args = (h, outs[0] if outs[0].shape == h.shape else outs[0].transpose(0, 1))
            elif b["kind"] == "keywords":
                p = b["p"]
                kwargs = {"scale": p["scale"], "mode": p["mode"]}
                if p["gate"]:
                    kwargs["gate"] = torch.cos(h)
                if p["mode"] == "tanh":  # no new draw: the seeds keep their models
                    kwargs["pair"] = (torch.sin(h), 0.5)
            elif b["kind"] == "closure":
                block.memo = torch.sigmoid(h)
            out = call(block, self.calls.get(i), args, kwargs)
            if block.tuple_out:
                out = COMBINE[b["p"]["combine"]](*PACKS[b["p"].get("pack", "tuple")][1](out))
            if b["kind"] in ("side_loss", "moe"):
                out = out + block.side()  # the side channel reaches the loss outside the region
            h = WIRES[b["wire"]][0](out)
            outs.append(h)
        return h


class FuzzNet(nn.Module):
    """Stages in sequence and a head; returns the head's output and the first stage's output."""

    def __init__(self, desc: dict) -> None:
        super().__init__()
        self.stages = nn.ModuleList(Stage(blocks) for blocks in desc["stages"])
        self.head = nn.Linear(D, D)
        self.calls: dict[int, tuple] = {}  # functional marks, by stage index

    def forward(self, x):
        h, first = x, None
        for i, stage in enumerate(self.stages):
            h = call(stage, self.calls.get(i), (h,), {})
            if first is None:
                first = h
        return self.head(h), first


def build(desc: dict) -> FuzzNet:
    """Build the model of ``desc`` (parameters drawn from ``desc['seed']``), unmarked."""
    torch.manual_seed(desc["seed"])
    model = FuzzNet(desc)
    for src, dst, attr in desc["tie"]:
        setattr(model.get_submodule(dst), attr, getattr(model.get_submodule(src), attr))
    for path in desc["frozen"]:
        model.get_submodule(path).requires_grad_(False)
    for path in desc.get("pre_hooks", []):  # rewrites the block's input (run once, marked or not)
        model.get_submodule(path).register_forward_pre_hook(_halve_input)
    for path in desc.get("forward_hooks", []):  # rewrites the block's output
        model.get_submodule(path).register_forward_hook(_scale_output)
    if desc.get("outside"):  # drawn last (`make_case`): its parameter comes after the others
        model.outside_weight = nn.Parameter(torch.randn(D))
        model.outside_box = _OutsideBox(model.outside_weight)
        reader = model.get_submodule(desc["outside"])
        reader.__class__, reader.box = _OutsideLinear, model.outside_box
    if desc.get("compiled"):  # drawn after it (`make_case`)
        model.get_submodule(desc["compiled"]).compiled = True
    if desc.get("leaf_out"):  # drawn after it: a parameter the block returns, unread
        model.get_submodule(desc["leaf_out"]).leaf = nn.Parameter(torch.full((D,), 0.5))
        model.get_submodule(desc["leaf_out"]).leaf_view = desc.get("leaf_view", False)
    return model


class _OutsideBox:
    """A tensor reached through a plain object, not a module's state, read (`_OutsideLinear`)
    only once ``on`` (a Python flag no module holds) is switched on between the steps: no
    module, argument or hook that remat compares changes (NOTE [Reads that vary])."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.on = tensor, False


class _OutsideLinear(nn.Linear):
    """A linear layer whose forward reads its box's tensor while the box is on."""

    def forward(self, x):
        out = super().forward(x)
        return out * self.box.tensor if self.box.on else out


def _halve_input(module: nn.Module, args: tuple) -> tuple:
    return (args[0] * 0.5, *args[1:])


def _scale_output(module: nn.Module, args: tuple, output: Any) -> Any:
    return output * 1.5 if isinstance(output, torch.Tensor) else None


# --- marks ----------------------------------------------------------------------

POLICIES: dict[str, remat.Policy] = {
    "save_compute_intensive": remat.save_compute_intensive,
    "save_all": remat.save_all,
    "recompute_all": remat.recompute_all,
    "save_only_mm": remat.save_only("aten::mm", "aten::addmm"),
    # per call (what remat.plan's per-operator options set): some matrix products kept
    "save_calls": remat.save_calls("aten::mm#0", "aten::addmm#1", "aten::bmm#0"),
    # per call, cheap operators among them (what a min-cut option keeps: a residual sum, a
    # norm's scale, an activation; operators that have in-place forms, which the eager engine
    # and the graph pass count apart when a region uses them)
    "save_calls_pointwise": remat.save_calls("aten::add#0", "aten::add#2", "aten::mul#1", "aten::relu#0",
                                             "aten::gelu#0", "aten::rsqrt#0", "aten::mm#1"),
    # per call, a random operator kept and the next one rebuilt (NOTE [Kept random operators])
    "save_calls_random": remat.save_calls("aten::native_dropout#0", "aten::addmm#0"),
}

#: drawn for a whole case, last (`Case.cut`): policies that keep what cheap operators make
#: of products (an activation that saves its output, a residual sum, a softmax), so the
#: products before them are dead in the re-run (NOTE [Dead operators in a selective re-run])
CUT_POLICIES: dict[str, remat.Policy] = {
    "save_calls_cut": remat.save_calls("aten::relu#0", "aten::tanh#0", "aten::sigmoid#0", "aten::add#0",
                                       "aten::add#1", "aten::_softmax#0", "aten::relu#1", "aten::tanh#1"),
    "save_calls_cut_late": remat.save_calls("aten::add#1", "aten::add#2", "aten::relu#1", "aten::tanh#1",
                                            "aten::gelu#1", "aten::mul#2"),
}


def _torch_selective() -> Any:
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts([torch.ops.aten.mm.default, torch.ops.aten.addmm.default])


CONTEXTS: dict[str, Callable[[], Any]] = {
    "save_compute_intensive": lambda: remat.policy_context(remat.save_compute_intensive),
    "save_all": lambda: remat.policy_context(remat.save_all),
    "save_calls": lambda: remat.policy_context(remat.save_calls("aten::mm#1", "aten::addmm#0")),
    "save_calls_random": lambda: remat.policy_context(remat.save_calls("aten::native_dropout#0")),
    "torch_selective": lambda: _torch_selective,
}


def _options(r: random.Random, *, policy: bool = True) -> dict:
    opts: dict = {}
    if r.random() < 0.3:
        opts["use_reentrant"] = True
    elif r.random() < 0.35:
        opts["output_recompute"] = True
    if "use_reentrant" not in opts and policy and r.random() < 0.25:
        opts["policy"] = r.choice(sorted(POLICIES))
    return opts


def _mark_options(opts: dict) -> dict:
    out = dict(opts)
    if "policy" in out:
        out["policy"] = {**POLICIES, **CUT_POLICIES}[out["policy"]]
    return out


def _apply_cell(model, mark):
    model.get_submodule(mark["path"]).recompute(**_mark_options(mark["opts"]))


def _apply_module(model, mark):
    remat.recompute_module(model.get_submodule(mark["path"]), **_mark_options(mark["opts"]))


def _apply_type(model, mark):
    types = {"Linear": nn.Linear, "ReLU": nn.ReLU, "GELU": nn.GELU, "LayerNorm": nn.LayerNorm,
             "BatchNorm1d": nn.BatchNorm1d, "Conv1d": nn.Conv1d, "Tanh": nn.Tanh}
    remat.apply(model, where=types[mark["type"]], **_mark_options(mark["opts"]))


def _apply_primitive(model, mark):
    model.get_submodule(mark["path"]).recompute()


def _apply_call(model, mark):
    owner_path, index = mark["path"].rsplit(".", 1)
    owner = model.get_submodule(owner_path.removesuffix(".blocks")) if owner_path != "stages" else model
    owner.calls[int(index)] = (mark["api"], mark["opts"])


@dataclass(frozen=True)
class MarkKind:
    """A mark kind: how to draw one (``draw(rng, modules) -> mark or None``) and apply it."""

    weight: float
    draw: Callable[[random.Random, dict], dict | None]
    apply: Callable[[nn.Module, dict], None]


def _blocks_and_stages(modules: dict) -> list[str]:
    return [n for n, m in modules.items() if isinstance(m, (Block, Stage))]


def _draw_cell(r, modules):
    return {"kind": "cell", "path": r.choice(_blocks_and_stages(modules)), "opts": _options(r)}


def _draw_module(r, modules):
    names = [n for n, m in modules.items() if n and not isinstance(m, (ops.Primitive, nn.ModuleList))]
    return {"kind": "module", "path": r.choice(names), "opts": _options(r)}


def _draw_type(r, modules):
    present = sorted({type(m).__name__ for m in modules.values()}
                     & {"Linear", "ReLU", "GELU", "LayerNorm", "BatchNorm1d", "Conv1d", "Tanh"})
    kind = r.choice(present)
    opts = _options(r, policy=False)
    if kind in ("ReLU", "GELU", "Tanh") and r.random() < 0.7:  # the README's primitive recipe
        opts = {"output_recompute": True}
    return {"kind": "type", "type": kind, "opts": opts}


def _draw_primitive(r, modules):
    names = [n for n, m in modules.items() if isinstance(m, ops.Primitive)]
    return {"kind": "primitive", "path": r.choice(names)} if names else None


def _draw_call(r, modules, path=None):
    path = path or r.choice(_blocks_and_stages(modules))
    if r.random() < 0.5:
        api, opts = "checkpoint", {"use_reentrant": r.random() < 0.4}
        if not opts["use_reentrant"] and r.random() < 0.3:
            opts["context"] = r.choice(sorted(CONTEXTS))
        opts["form"] = r.choice(FORMS)
    else:
        api, opts = "recompute", {"use_reentrant": r.random() < 0.5}
        if not opts["use_reentrant"] and r.random() < 0.4:
            opts["output_recompute"] = True
    if api == "checkpoint" and r.random() < 0.25:
        opts["early_stop"] = False
    return {"kind": "call", "api": api, "path": path, "opts": opts}


def _draw_marked_call(r, modules):
    """A block that carries a mark and whose call is also wrapped, in any form (issue 17)."""
    path = r.choice(_blocks_and_stages(modules))
    mark = {"kind": r.choice(("cell", "module")), "path": path, "opts": _options(r)}
    return {"kind": "marked_call", "mark": mark, "call": _draw_call(r, modules, path)}


def _apply_marked_call(model, mark):
    MARKS[mark["mark"]["kind"]].apply(model, mark["mark"])
    _apply_call(model, mark["call"])


def _draw_chain(r, modules):
    """Adjacent blocks of one stage, all output_recompute (MindSpore's merged regions)."""
    stages = sorted({n.rsplit(".blocks.", 1)[0] for n, m in modules.items() if isinstance(m, Block)})
    stage = r.choice(stages)
    blocks = sorted(n for n, m in modules.items() if isinstance(m, Block) and n.startswith(stage + ".blocks."))
    use = r.choice(("cell", "recompute"))
    return {"kind": "chain", "paths": blocks, "use": use}


def _apply_chain(model, mark):
    for path in mark["paths"]:
        if mark["use"] == "cell":
            model.get_submodule(path).recompute(output_recompute=True)
        else:
            _apply_call(model, {"path": path, "api": "recompute", "opts": {"output_recompute": True}})


def _draw_blocks(r, modules):
    """``remat.apply(model, where="blocks", every=N)``, when the model has repeated blocks."""
    found = [n for n, _ in find_blocks(modules[""])]
    if not found:
        return None
    return {"kind": "blocks", "paths": found, "every": r.choice((1, 2)), "opts": _options(r)}


def _apply_blocks(model, mark):
    remat.apply(model, where="blocks", every=mark["every"], **_mark_options(mark["opts"]))


def _draw_name(r, modules):
    """``remat.apply(model, where=<a block class name, or a glob over paths>)``."""
    blocks = {n: m for n, m in modules.items() if isinstance(m, Block)}
    if r.random() < 0.5:
        where = type(r.choice(sorted(blocks.items()))[1]).__name__
        paths = [n for n, m in blocks.items() if type(m).__name__ == where]
    else:
        where = f"stages.*.blocks.{r.randrange(2)}"
        paths = [n for n in blocks if fnmatch.fnmatchcase(n, where)]
    if not paths:
        return None
    return {"kind": "name", "where": where, "paths": paths, "opts": _options(r)}


def _apply_name(model, mark):
    remat.apply(model, where=mark["where"], **_mark_options(mark["opts"]))


MARKS: dict[str, MarkKind] = {
    "cell": MarkKind(3.0, _draw_cell, _apply_cell),
    "module": MarkKind(1.5, _draw_module, _apply_module),
    "type": MarkKind(1.0, _draw_type, _apply_type),
    "primitive": MarkKind(1.0, _draw_primitive, _apply_primitive),
    "call": MarkKind(2.5, _draw_call, _apply_call),
    "chain": MarkKind(0.7, _draw_chain, _apply_chain),
    "blocks": MarkKind(1.0, _draw_blocks, _apply_blocks),
    "name": MarkKind(0.8, _draw_name, _apply_name),
    "marked_call": MarkKind(1.5, _draw_marked_call, _apply_marked_call),
}


def apply_plan(model: FuzzNet, plan: list[dict]) -> None:
    """Apply the marks of ``plan`` to ``model`` in order."""
    for mark in plan:
        MARKS[mark["kind"]].apply(model, mark)


# --- cases ----------------------------------------------------------------------


@dataclass
class Case:
    seed: int
    desc: dict
    plan: list[dict]
    compiled: bool = False
    x_requires_grad: bool = True
    x_shape: tuple = (2, 3, D)
    optimizer: str = "sgd"
    retain_twice: bool = False
    grad_check: bool = False
    penalty: bool = False
    func_check: bool = False  # torch.func.grad over the model (refused with marks, before any work)
    rebind_captures: bool = False  # a hook's capture list dropped without emptying it
    #: the model changed between two steps, alike on both sides (`CHANGES`): what a region
    #: learned of its modules in the first step must not be trusted in the second
    change: dict | None = None
    #: a parameter changed in place between the first step's forward and its backward
    edit_before_backward: str | None = None
    #: the training steps' forwards run under a saved-tensor hook of the user's (as CPU
    #: offload would be), on both sides: regions then save their arguments through it
    #: (NOTE [Inputs held directly] in ``hooked.py``) and keep their outputs
    outer_hooks: bool = False
    #: every policy of the case's marks is one of `CUT_POLICIES` (drawn last)
    cut: str | None = None
    #: a parameter frozen or unfrozen between the first step's forward and its backward, its
    #: flag put back after it (NOTE [Parameters frozen before backward]; drawn after `cut`)
    freeze_before_backward: str | None = None
    #: a step on weights computed from the parameters, through ``torch.func.functional_call``
    #: (meta-learning's fast weights: every weight a region reads has a history; drawn last)
    fast_weights: bool = False

    @property
    def reentrant(self) -> bool:
        marks = [x for m in self.plan for x in ([m["mark"], m["call"]] if "mark" in m else [m])]
        return any(m["opts"].get("use_reentrant") for m in marks if "opts" in m)

    def show(self) -> str:
        lines = [(f"case {self.seed}: x{list(self.x_shape)} requires_grad={self.x_requires_grad} "
                  f"opt={self.optimizer} retain_twice={self.retain_twice} grad={self.grad_check} "
                  f"penalty={self.penalty} func={self.func_check} rebind={self.rebind_captures} "
                  f"compiled={self.compiled}" + (f" change={self.change}" if self.change else "")
                  + (f" edit={self.edit_before_backward}" if self.edit_before_backward else "")
                  + (" outer_hooks" if self.outer_hooks else "")
                  + (f" cut={self.cut}" if self.cut else "")
                  + (f" freeze={self.freeze_before_backward}" if self.freeze_before_backward else "")
                  + (" fast_weights" if self.fast_weights else ""))]
        for i, stage in enumerate(self.desc["stages"]):
            for j, b in enumerate(stage):
                lines.append(f"  stages.{i}.blocks.{j}: {b['kind']} {b['p']} wire={b['wire']}")
        lines.append(f"  tie={self.desc['tie']} frozen={self.desc['frozen']}"
                     + (f" outside={self.desc['outside']}" if self.desc.get("outside") else "")
                     + (f" compiled_mlp={self.desc['compiled']}" if self.desc.get("compiled") else "")
                     + (f" leaf_out={self.desc['leaf_out']}" if self.desc.get("leaf_out") else "")
                     + (" leaf_view" if self.desc.get("leaf_view") else ""))
        lines += [f"  mark {m}" for m in self.plan]
        return "\n".join(lines)


def _pick(r: random.Random, table: dict, weight: Callable) -> str:
    names = sorted(table)
    return r.choices(names, weights=[weight(table[n]) for n in names])[0]


def draw_desc(r: random.Random, seed: int) -> dict:
    stages = []
    for _ in range(r.choice((1, 1, 2, 2, 3))):
        blocks = []
        for j in range(r.choice((1, 2, 2, 3))):
            kind = _pick(r, BLOCKS, lambda k: k.weight)
            p = BLOCKS[kind].params(r)
            if kind == "skip":
                p["from"] = r.randrange(j + 1)
            if kind.startswith("inplace_input") and not stages and j == 0:
                kind, p = "linear", {}  # the model's input may be a leaf that requires grad
            blocks.append({"kind": kind, "p": p, "wire": _pick(r, WIRES, lambda w: w[1])})
        stages.append(blocks)
    desc = {"seed": seed, "stages": stages, "tie": [], "frozen": []}
    fcs = [f"stages.{i}.blocks.{j}" for i, s in enumerate(stages) for j, b in enumerate(s)
           if b["kind"] in ("linear", "linear_act", "dropout", "keywords", "skip", "shared", "closure")]
    if len(fcs) >= 2 and r.random() < 0.25:
        a, b = sorted(r.sample(fcs, 2))
        desc["tie"].append((a, b, "fc"))
    norms = {}
    for i, s in enumerate(stages):
        for j, b in enumerate(s):
            if b["kind"] == "norm":
                norms.setdefault(b["p"]["batch"], []).append(f"stages.{i}.blocks.{j}")
    for group in norms.values():
        if len(group) >= 2 and r.random() < 0.5:
            desc["tie"].append((group[0], group[1], "norm"))  # one norm used twice
    if r.random() < 0.25:
        desc["frozen"].append("stages.0.blocks.0")
    for i, s in enumerate(stages):
        for j in range(len(s)):
            if r.random() < 0.1:
                desc["frozen"].append(f"stages.{i}.blocks.{j}")
    blocks = [f"stages.{i}.blocks.{j}" for i, s in enumerate(stages) for j in range(len(s))]
    desc["pre_hooks"] = [b for b in blocks if r.random() < 0.1]
    desc["forward_hooks"] = [b for b in blocks if r.random() < 0.1]
    return desc


def make_case(seed: int, *, compiled: bool = False) -> Case:
    """Draw case ``seed`` (the same seed always gives the same case)."""
    r = random.Random(seed)
    desc = draw_desc(r, seed)
    case = Case(seed, desc, [], compiled=compiled)
    case.x_requires_grad = r.random() < 0.6
    case.x_shape = r.choice(((2, 3, D), (3, 2, D)))
    case.optimizer = r.choice(("sgd", "adamw"))
    case.retain_twice = r.random() < 0.3
    case.grad_check = r.random() < 0.3
    case.penalty = r.random() < 0.1
    modules = dict(build(desc).named_modules())
    marked: set[int] = set()  # ids: a tied module has two paths
    typed: set[str] = set()
    called: set[str] = set()
    kinds = sorted((_pick(r, MARKS, lambda k: k.weight) for _ in range(r.choice((1, 1, 2, 2, 3, 4)))),
                   key=lambda k: k != "type")  # a type mark first, so other marks avoid its modules
    for kind in kinds:
        mark = MARKS[kind].draw(r, modules)
        if mark is not None and kind == "marked_call":
            mark["path"] = mark["mark"]["path"]
        if mark is None or any(id(modules[p]) in marked for p in mark.get("paths", [mark.get("path")]) if p):
            continue
        if kind == "type" and any(m["kind"] == "type" for m in case.plan):
            continue
        if kind == "module" and type(modules[mark["path"]]).__name__ in typed:
            continue  # would conflict with the type mark: a documented ValueError, a wasted case
        if kind == "type":
            typed.add(mark["type"])
        if compiled and kind == "call" and mark["opts"].get("context"):
            continue
        at_call_sites = kind in ("call", "marked_call") or (kind == "chain" and mark["use"] == "recompute")
        sites = mark.get("paths", [mark.get("path")])
        if at_call_sites and any(p in called for p in sites):
            continue  # one functional mark per call site
        if at_call_sites:
            called.update(sites)
        if kind not in ("call", "chain") or mark.get("use") == "cell":
            marked.update(id(modules[p]) for p in mark.get("paths", [mark.get("path")]) if p)
        case.plan.append(mark)
    case.func_check = r.random() < 0.05
    case.rebind_captures = r.random() < 0.5
    if r.random() < 0.25:
        kind = r.choice(sorted(CHANGES))
        paths = [n for n, m in modules.items() if n and CHANGES[kind][0](m)]
        if paths:
            case.change = {"kind": kind, "path": r.choice(sorted(paths))}
    if r.random() < 0.05 and not compiled:  # compiled: autograd refuses it (docs/graph.md, Limits)
        params = sorted(n for n, p in build(desc).named_parameters() if p.requires_grad)
        if params:
            case.edit_before_backward = r.choice(params)
    case.outer_hooks = not compiled and r.random() < 0.2  # drawn last: earlier seeds keep their cases
    if not compiled and r.random() < 0.4:  # drawn after it: the cases before keep theirs
        case.cut = r.choice(sorted(CUT_POLICIES))
        for mark in case.plan:  # every mark that takes a policy gets it
            m = mark.get("mark", mark)
            if m["kind"] in ("cell", "module", "blocks", "name") and not m["opts"].get("use_reentrant"):
                m["opts"]["policy"] = case.cut
    if not compiled and r.random() < 0.1:  # drawn after it: the cases before keep theirs
        params = sorted(n for n, _ in build(desc).named_parameters())
        if params:
            case.freeze_before_backward = r.choice(params)
    # drawn after it: the cases before keep theirs; not with a module registered under two
    # names, which torch's functional_call leaves holding the fast weights (torch 2.13)
    case.fast_weights = r.random() < 0.1 and not compiled and not desc["tie"]
    # drawn after it: the cases before keep theirs
    if not compiled and r.random() < 0.15:
        readers = sorted(n for n, m in modules.items()
                         if type(m) is nn.Linear and m.out_features == D and n.startswith("stages."))
        if readers:
            desc["outside"] = r.choice(readers)
    # drawn after it: the cases before keep theirs; a compiled function inside an MLP block
    # (not under remat.compile, which compiles the whole model; not with a gradient penalty,
    # which aot_autograd refuses; not with the torch.func phase: torch.func over the compiled
    # function left torch.compile's caches so that a later case's region saw a saved weight's
    # version move inside its own re-run, refused with a RecomputeError, session 25)
    if not compiled and r.random() < 0.15 and not case.penalty and not case.func_check:
        mlps = sorted(n for n, m in modules.items() if type(m) is MLP)
        if mlps:
            desc["compiled"] = r.choice(mlps)
    # drawn after it: a tuple_out block that returns a parameter it does not read (NOTE
    # [Tensors returned as they were]; not with relu_second, which writes it in place)
    if r.random() < 0.15:
        leafy = sorted(n for n, m in modules.items() if type(m) is TupleOut and not m.p_pass
                       and _combine_of(desc, n) != "relu_second")
        if leafy:
            desc["leaf_out"] = r.choice(leafy)
            # a view of it the block makes (``pos[:n]``): made without grad in a reentrant
            # forward, it has no history, and handed out as itself it lost the gradient. Not
            # where the caller drops that output ("first"): a parameter a reentrant region reads
            # whose gradient reaches no loss gets its hooks called with None (documented limit,
            # tests/test_leaves_returned.py)
            view = r.random() < 0.5
            desc["leaf_view"] = view and _combine_of(desc, desc["leaf_out"]) != "first"
    # drawn after it: selective marks re-run in stages (NOTE [Re-runs in stages]) or rebuild
    # each saved tensor on its own (NOTE [Each saved tensor rebuilt on its own])
    if not compiled and r.random() < 0.3:
        stages = r.choice((2, 3, "each"))
        for mark in case.plan:
            m = mark.get("mark", mark)
            if m["kind"] in ("cell", "module", "blocks", "name") and "policy" in m["opts"] \
                    and not m["opts"].get("output_recompute"):
                m["opts"]["stages"] = stages
    return case


def _combine_of(desc: dict, path: str) -> str | None:
    """The ``combine`` parameter of the block at ``path`` (``stages.i.blocks.j``)."""
    _, i, _, j = path.split(".")
    return desc["stages"][int(i)][int(j)]["p"].get("combine")


# --- the model changed between steps ---------------------------------------------------


def _halve_output(module: nn.Module, args: tuple, output: Any) -> Any:
    return output * 0.5 if isinstance(output, torch.Tensor) and output.is_floating_point() else None


def _halve_input(module: nn.Module, args: tuple) -> tuple:
    return tuple(a * 0.5 if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)


def _rebind_parameters(module: nn.Module) -> None:
    """Each parameter of ``module`` replaced by a new one of the same value (a new object)."""
    for name, param in list(module.named_parameters(recurse=False)):
        setattr(module, name, nn.Parameter(param.detach().clone(), requires_grad=param.requires_grad))


def _parameter_to_buffer(module: nn.Module) -> None:
    """A parameter moved to the buffers under its own name (the same keys, other sizes)."""
    name, param = next(iter(module.named_parameters(recurse=False)))
    del module._parameters[name]
    module.register_buffer(name, param.detach().clone())


def _toggle_frozen(module: nn.Module) -> None:
    """Freeze the module's parameters, or unfreeze them if they are frozen (fine-tuning)."""
    for param in module.parameters(recurse=False):
        param.requires_grad_(not param.requires_grad)


def _has_parameters(module: nn.Module) -> bool:
    return next(module.parameters(recurse=False), None) is not None


def _leaf(module: nn.Module) -> bool:
    return next(module.children(), None) is None and _has_parameters(module)


def _add_forward_hook(module: nn.Module) -> None:
    module.register_forward_hook(_halve_output)


def _add_pre_hook(module: nn.Module) -> None:
    module.register_forward_pre_hook(_halve_input)


def _marked_again(module: nn.Module) -> None:
    """Every mark in ``module``'s tree taken off and set again with the same options (a switch
    turned off for evaluation and on again): the same marks (NOTE [A mark set again is the
    same mark]), whose regions may run on the facts learned in the first step."""
    from remat._front.marks import set_mark, unmark_module

    for m in module.modules():
        spec = remat.mark_of(m)
        if spec is not None:
            unmark_module(m)
            set_mark(m, spec, api="fuzz")


#: kind -> (which modules it can change, how): applied between the first step and the second
CHANGES: dict[str, tuple[Callable[[nn.Module], bool], Callable[[nn.Module], None]]] = {
    "forward_hook": (_leaf, _add_forward_hook),
    "pre_hook": (_leaf, _add_pre_hook),
    "new_parameters": (_has_parameters, _rebind_parameters),
    "parameter_to_buffer": (_leaf, _parameter_to_buffer),
    "new_buffer": (_leaf, lambda m: m.register_buffer("_fuzz_extra", torch.ones(1))),
    "new_attribute": (_leaf, lambda m: setattr(m, "fuzz_note", 1.5)),
    "toggle_frozen": (_has_parameters, _toggle_frozen),
    "marked_again": (lambda m: next(m.children(), None) is not None, _marked_again),
}


# --- running and comparing --------------------------------------------------------

#: Errors the README documents as unsupported: (type, message pattern, README reference).
DOCUMENTED_ERRORS: list[tuple[type, str, str]] = [
    (TypeError, r"use_reentrant=True\) got argument .* tensors? .*inside lists",
     "Limits of use_reentrant=True: tensors nested in lists, tuples or dicts"),
    (TypeError, r"use_reentrant=True\) returned an object of type .* holding .* tensors? where remat cannot",
     "Limits of use_reentrant=True: outputs holding tensors where pytree and dataclass fields do not reach"),
    (remat.RecomputeError, (r"\(use_reentrant=True\): its recomputation (reads|reaches) a tensor "
                            r"that requires grad .* which its forward did not read"),
     "Limits of use_reentrant=True: a re-run that reads other tensors than its forward"),
    (remat.RecomputeError, r"changes in place .* a tensor that requires grad and that it neither",
     "Limits: a region changing in place a tensor that requires grad it did not take"),
    (ValueError, r"^Unexpected keyword arguments", "use_reentrant=True: no keyword arguments (torch's)"),
    (ValueError, r"Passing `context_fn` or `debug` is only supported when use_reentrant=False",
     "Limits of use_reentrant=True: no context_fn"),
    # documented in the README once the fixes of issue 10 landed (main, d412b05):
    (remat.RecomputeError, r"\(use_reentrant=True\) reads its argument .* and then changes it in place",
     "Limits of use_reentrant=True: a region that reads its own argument and then changes it in place"),
    (remat.RecomputeError, r"\(use_reentrant=True\) changes in place argument .* which shares memory",
     "Limits of use_reentrant=True: changing in place an argument sharing memory with another"),
    (remat.RecomputeError, r"reads a tensor through its closure that was computed from other tensors",
     "Limits of use_reentrant=True: a tensor read through the closure computed from the region's parameters"),
    (remat.RecomputeError, r"cannot be re-run: its parameter .* was changed in place after the region's forward",
     "A parameter changed in place before backward is refused, not re-read"),
    (remat.RecomputeError, r"cannot be re-run: one of its inputs was changed in place after the region ran",
     "A region's input changed in place after the region ran: a RecomputeError in backward"),
    (remat.RecomputeError, r"changed one of its inputs in place after it had saved .* tensor",
     "A region that changes its own input in place after saving a temporary: a RecomputeError"),
    (remat.RecomputeError, r"\(use_reentrant=True\): a tensor it computes .* leaves it through",
     "Limits of use_reentrant=True: a tensor that leaves a region by a side channel"),
    (remat.RecomputeError, r"\(use_reentrant=True\) differentiates inside its forward",
     "Limits of use_reentrant=True: gradients inside a region's forward"),
    (remat.RecomputeError, r"\(use_reentrant=True\) registers a hook on a tensor it computes",
     "Limits of use_reentrant=True: a hook on a tensor the forward computes"),
    (remat.RecomputeError, r"runs under a torch.func transform",
     "torch.func transforms over a marked model: a RecomputeError before the region runs"),
    (remat.RecomputeError, (r"\(use_reentrant=True\) read a tensor that requires grad .* that an "
                            r"earlier call with the same inputs and modules did not read"),
     ("Reads that vary: a reentrant call reading a tensor its observed call did not is refused in "
      "backward, then watched")),
]

#: A case may use this much more memory than when it started (bytes); past it, allocation
#: fails and the case is a crash, instead of a runaway recursion taking the machine down.
MEMORY_CAP = 8 << 30


@contextlib.contextmanager
def _memory_cap(extra: int):
    """Cap the address space at what the process uses now plus ``extra`` (POSIX only)."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    try:
        with open("/proc/self/statm") as f:
            used = int(f.read().split()[0]) * resource.getpagesize()
    except OSError:  # pragma: no cover - no /proc
        yield
        return
    cap = used + extra if hard == resource.RLIM_INFINITY else min(used + extra, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))

#: Reentrant regions sum their gradient contributions before the engine adds other
#: consumers' (issue 10), so gradients may differ in the last bits: the only tolerance.
REENTRANT_RTOL, REENTRANT_ATOL = 1e-5, 1e-6


@dataclass
class Result:
    """How a case ended: ``ok``, ``documented`` (an allowed typed error), ``invalid`` (the
    unmarked model itself fails), ``mismatch`` (a silent wrong number), ``crash`` (an error
    plain PyTorch does not raise), ``leak`` (engine state left behind)."""

    seed: int
    verdict: str
    detail: str = ""
    tolerated: int = 0  # comparisons that needed the reentrant tolerance
    known: str | None = None  # the KNOWN_BROKEN class, when one matches


class _Mismatch(Exception):
    pass


def _hooks_top():
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def _engine_lists() -> dict[str, list | dict]:
    """remat's private per-thread and global bookkeeping that must be empty between steps.

    Looked up by name, so the harness keeps working while the engine's internals move.
    """
    from remat._engine import outputs, state
    from remat._front import marks as _marks

    found = {}
    for label, owner, name in (("open mark region(s)", _marks, "_stack"),
                               ("recomputation(s) still marked running", state, "recomputing_fns")):
        getter = getattr(owner, name, None)
        if callable(getter):
            found[label] = getter()
    registry = getattr(outputs, "_registry", None)
    if isinstance(registry, dict):
        found["output_recompute output(s) still registered"] = registry
    return found


def _engine_clean() -> str:
    """'' when remat left no state behind, else what it left."""
    left = []
    if _hooks_top() is not None or any(_engine_lists().values()):
        gc.collect()  # outputs that died in a reference cycle release the hook here
    if _hooks_top() is not None:
        left.append("a saved-tensor hook is still pushed")
    left += [f"{len(items)} {label}" for label, items in _engine_lists().items() if items]
    if remat.is_recomputing():
        left.append("remat.is_recomputing() is still True")
    return "; ".join(left)


def _reset_engine() -> None:
    """Leave nothing of one case to the next, whatever the case left behind."""
    while _hooks_top() is not None:
        torch._C._autograd._pop_saved_tensors_default_hooks()
    for items in _engine_lists().values():
        items.clear()


def _count(counts: dict, name: str, grad: torch.Tensor | None) -> None:
    counts[name] += 1 if grad is not None else 1000  # a None counts loudly


class _Side:
    """One model (the baseline or the marked copy), its optimizer and its input."""

    def __init__(self, case: Case, model: FuzzNet, compiled: bool) -> None:
        self.case, self.model = case, model
        self.fn = remat.compile(model, backend="aot_eager") if compiled else model
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW if case.optimizer == "adamw" else torch.optim.SGD
        self.opt = opt(params, lr=0.1) if params else None
        g = torch.Generator().manual_seed(case.seed)
        self.x = torch.randn(case.x_shape, generator=g).requires_grad_(case.x_requires_grad)
        self.hook_calls = {n: 0 for n, p in model.named_parameters() if p.requires_grad}
        for n, p in model.named_parameters():
            if p.requires_grad:  # DDP's reducer relies on one call per backward, with a gradient
                # the hook holds the counts, not the side: a parameter's hooks are not seen by
                # the collector, so a hook holding the side kept both models alive after a case
                p.register_hook(functools.partial(_count, self.hook_calls, n))

    def hooks(self) -> list:
        """How often each parameter's gradient hook ran since the last call (then reset)."""
        calls = torch.tensor(list(self.hook_calls.values()))
        for name in self.hook_calls:
            self.hook_calls[name] = 0
        return [("gradient hook calls per parameter", calls)]

    def forward(self, phase: int):
        torch.manual_seed(self.case.seed * 7 + phase)
        out, first = self.fn(self.x)
        loss = out.square().mean() + 0.1 * first.mean()
        return loss, out

    def grads(self) -> list:
        return [("grad " + n, p.grad) for n, p in self.model.named_parameters()] + [("grad x", self.x.grad)]

    def state(self) -> list:
        return ([("param " + n, p) for n, p in self.model.named_parameters()]
                + [("buffer " + n, b) for n, b in self.model.named_buffers()])


class _OuterHooks(torch.autograd.graph.saved_tensors_hooks):
    """A user's saved-tensor hook that checks versions as autograd does (a detached alias:
    an output kept as itself would be a reference cycle through its own node)."""

    def __init__(self) -> None:
        super().__init__(lambda x: (x.detach(), x._version), _OuterHooks._unpack)

    @staticmethod
    def _unpack(packed: tuple) -> torch.Tensor:
        x, version = packed
        if x._version != version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: is at version {x._version}; expected version {version} instead")
        return x


def _phases(case: Case) -> list[tuple[str, Callable]]:
    """The steps both sides run, each returning named tensors to compare."""

    def train(phase: int, retain: bool):
        def step(side: _Side):
            if side.opt is not None:
                side.opt.zero_grad(set_to_none=True)
            side.x.grad = None
            with _OuterHooks() if case.outer_hooks else contextlib.nullcontext():
                loss, out = side.forward(phase)
            found = [("loss", loss), ("output", out)]
            if case.edit_before_backward and phase == 1:  # NOTE [Parameters changed before backward]
                with torch.no_grad():
                    side.model.get_parameter(case.edit_before_backward).mul_(0.5)
                side.edited = True
            frozen = (side.model.get_parameter(case.freeze_before_backward)
                      if case.freeze_before_backward and phase == 1 else None)
            if frozen is not None:  # NOTE [Parameters frozen before backward]
                frozen.requires_grad_(not frozen.requires_grad)
            try:
                if loss.requires_grad:
                    loss.backward(retain_graph=retain)
                    if retain:
                        found += [(n + " (first backward)", g) for n, g in side.grads()]
                        loss.backward()
            finally:
                if frozen is not None:
                    frozen.requires_grad_(not frozen.requires_grad)
            return found + side.grads() + side.hooks()
        return step

    def update(side: _Side):
        if side.opt is not None:
            side.opt.step()
        return side.state()

    def grad(side: _Side):
        loss, _ = side.forward(3)
        wrt = [p for p in side.model.parameters() if p.requires_grad] + ([side.x] if side.x.requires_grad else [])
        if not loss.requires_grad or not wrt:
            return [("loss", loss)]
        side.hooks()
        found = torch.autograd.grad(loss, wrt, allow_unused=True)
        return [("loss", loss)] + [(f"autograd.grad #{i}", g) for i, g in enumerate(found)] + side.hooks()

    def penalty(side: _Side):
        if not side.x.requires_grad:
            return []
        side.model.zero_grad(set_to_none=True)
        loss, _ = side.forward(4)
        if not loss.requires_grad:
            return []
        (gx,) = torch.autograd.grad(loss, side.x, create_graph=True)
        found = [("penalty grad x", gx)]
        if gx.requires_grad:
            gx.square().sum().backward()
        return found + [(n, g) for n, g in side.grads() if n != "grad x"] + side.hooks()

    def func_grad(side: _Side):
        """``torch.func.grad`` of the loss over the parameters (a model with marks refuses it)."""
        params = {n: p.detach() for n, p in side.model.named_parameters()}

        def loss_of(params):
            torch.manual_seed(side.case.seed * 7 + 5)
            out, first = torch.func.functional_call(side.fn, params, (side.x.detach(),))
            return out.square().mean() + 0.1 * first.mean()

        found = torch.func.grad(loss_of)(params)
        return [("torch.func.grad " + n, g) for n, g in found.items()]

    def fast_weights(side: _Side):
        """A step on weights one function away from the parameters (fast weights)."""
        side.model.zero_grad(set_to_none=True)
        side.x.grad = None
        fast = {n: p * 1.5 + 0.01 if p.requires_grad else p for n, p in side.model.named_parameters()}
        torch.manual_seed(side.case.seed * 7 + 6)
        out, first = torch.func.functional_call(side.model, fast, (side.x,))
        loss = out.square().mean() + 0.1 * first.mean()
        if loss.requires_grad:
            loss.backward()
        return [("fast-weights loss", loss)] + side.grads() + side.hooks()

    def change(side: _Side):
        """The model changed alike on both sides between two steps (`CHANGES`)."""
        CHANGES[case.change["kind"]][1](side.model.get_submodule(case.change["path"]))
        return [(n, p) for n, p in side.model.named_parameters()]

    def outside_on(side: _Side):
        """The tensor held outside the modules is read from now on (`_OutsideBox`)."""
        side.model.outside_box.on = True
        return []

    phases = [("step 1", train(1, case.retain_twice)), ("step 1 update", update)]
    if case.desc.get("outside"):
        phases.append(("a tensor outside the modules read from now on", outside_on))
    if case.change:
        phases.append((f"changed between steps: {case.change['kind']}", change))
    phases += [("step 2", train(2, False)), ("step 2 update", update)]
    if case.grad_check:
        phases.append(("autograd.grad", grad))
    if case.penalty:
        phases.append(("gradient penalty", penalty))
    if case.func_check and not case.compiled:
        phases.append(("torch.func.grad", func_grad))
    if case.fast_weights:
        phases.append(("fast weights", fast_weights))
    return phases


def _compare(phase: str, base: list, marked: list, tolerant: bool, hooks: list) -> int:
    """Raise _Mismatch at the first difference; return how many needed the tolerance.

    A difference in gradient-hook calls is appended to ``hooks`` instead, so the case goes
    on comparing numbers (the caller reports it at the end).
    """
    if [n for n, _ in base] != [n for n, _ in marked]:
        raise _Mismatch(f"{phase}: different results {[n for n, _ in base]} vs {[n for n, _ in marked]}")
    tolerated = 0
    for (name, a), (_, b) in zip(base, marked, strict=True):
        if (a is None) != (b is None):
            raise _Mismatch(f"{phase}: {name}: {'None' if a is None else 'tensor'} vs "
                            f"{'None' if b is None else 'tensor'}")
        if a is None or torch.equal(a, b):
            continue
        if name.startswith("gradient hook calls"):
            hooks.append(f"{phase}: {name}: {a.tolist()} vs {b.tolist()} (1000: called with None)")
            continue
        if (tolerant and a.shape == b.shape and "grad" in name
                and torch.allclose(a, b, rtol=REENTRANT_RTOL, atol=REENTRANT_ATOL)):
            tolerated += 1
            continue
        diff = (a.float() - b.float()).abs().max().item() if a.shape == b.shape else f"shapes {a.shape} {b.shape}"
        raise _Mismatch(f"{phase}: {name} differs (max abs diff {diff})")
    return tolerated


def _snapshot(side: _Side) -> list:
    return [t.detach().clone() for _, t in side.state()]


def _unchanged(side: _Side, snap: list) -> str:
    """'' when a phase that raised left the parameters as they were and grad mode on.

    Buffers are not compared: layers that ran before the failing region (a BatchNorm
    in training) update theirs, as they would before any error in plain PyTorch.
    """
    changed = [n for (n, t), s in zip(side.state(), snap, strict=True) if n.startswith("param") and not torch.equal(t, s)]
    if changed:
        return f"parameters changed before the error: {changed[:3]}"
    if not torch.is_grad_enabled():
        return "grad mode left off"
    return ""


def _documented(err: BaseException) -> str | None:
    for typ, pattern, where in DOCUMENTED_ERRORS:
        if isinstance(err, typ) and re.search(pattern, str(err)):
            return where
    return None


def _resync(base: _Side, marked: _Side) -> None:
    """After a tolerated reentrant difference, start the next phase from the baseline's state."""
    with torch.no_grad():
        for (_, a), (_, b) in zip(base.state() + base.grads(), marked.state() + marked.grads(), strict=True):
            if a is not None:
                b.copy_(a)
    if base.opt is not None:
        marked.opt.load_state_dict(copy.deepcopy(base.opt.state_dict()))


def run_case(case: Case) -> Result:
    """Run ``case``: baseline and marked model in lockstep; compare everything. Every policy
    region records its flow, so every dead call is skipped (NOTE [Flows recorded where they
    pay] in ``remat/_engine/dead.py``)."""
    with _memory_cap(MEMORY_CAP), _dead.recorded_everywhere():
        return _run_case(case)


def _run_case(case: Case) -> Result:
    _reset_engine()
    if case.compiled:
        torch._dynamo.reset()  # compiled code is cached per code object, shared by all cases
    tolerated, hooks = 0, []
    try:
        torch.manual_seed(0)
        base = _Side(case, build(case.desc), case.compiled)
        model = build(case.desc)
        for mark in case.plan:
            snap = _snapshot_model(model)
            try:
                apply_plan(model, [mark])
            except (TypeError, ValueError) as err:  # documented: each marking API names them
                if not _same_snapshot(_snapshot_model(model), snap):
                    return Result(case.seed, "crash", f"marking failed after changing the model: {err!r}")
                return Result(case.seed, "documented", f"marking: {type(err).__name__}: {err}")
        marked = _Side(case, model, case.compiled)
        for phase, step in _phases(case):
            try:
                expected = step(base)
            except Exception as err:  # noqa: BLE001 - the unmarked model fails: not a remat case
                return Result(case.seed, "invalid", f"{phase}: baseline raised {type(err).__name__}: {err}")
            if any(isinstance(t, torch.Tensor) and t.is_floating_point() and not torch.isfinite(t).all()
                   for _, t in expected):  # diverged (a NaN is never equal to itself)
                return Result(case.seed, "invalid", f"{phase}: the unmarked model's results are not finite")
            snap = _snapshot(marked)
            writes = _own_writes(marked.model)
            failure = None
            try:
                got = step(marked)
            except Exception as err:  # noqa: BLE001 - every error is judged below
                failure = (_documented(err), type(err).__name__, str(err).splitlines()[0] if str(err) else "")
            if failure is not None and phase == "step 1" and getattr(marked, "edited", False):  # its own change
                names = [n for n, _ in marked.state()]
                snap[names.index("param " + case.edit_before_backward)].mul_(0.5)
            if failure is not None:  # what the forwards wrote themselves, as unmarked
                names = [n for n, _ in marked.state()]
                for name, (block, before) in writes.items():
                    for _ in range(block.writes - before):
                        snap[names.index(f"param {name}.fc.weight")].mul_(block.scale)
            if failure is not None:  # judged once the error (and the frames it holds) is gone
                where, name, first = failure
                if where is None:
                    return Result(case.seed, "crash", f"{phase}: {name}: {first}")
                # what the model itself still holds of a step (a hook's capture) keeps that
                # step's outputs, and their registry entries, alive: dropped first, as below
                _drop_captures(marked.model, case)
                changed = _unchanged(marked, snap) or _engine_clean()
                if changed:
                    return Result(case.seed, "crash", f"{phase}: documented error ({where}) but {changed}")
                return Result(case.seed, "documented", f"{phase}: {where}")
            try:
                n = _compare(phase, expected, got, case.reentrant, hooks)
            except _Mismatch as err:
                return Result(case.seed, "mismatch", str(err))
            if n:
                tolerated += n
                _resync(base, marked)
            del expected, got
        _drop_captures(marked.model, case)
        left = _engine_clean()
        if left:
            return Result(case.seed, "leak", left, tolerated)
        if hooks:
            return Result(case.seed, "mismatch", hooks[0], tolerated)
        return Result(case.seed, "ok", "", tolerated)
    finally:
        _reset_engine()


def _drop_captures(model: nn.Module, case: Case) -> None:
    """Drop the model's own references to a step's tensors (a memo, a hook's captures)."""
    for m in model.modules():
        if isinstance(m, Closure):
            m.memo = None
        if "captured" in m.__dict__:
            if case.rebind_captures:  # dropped without emptying: freed with what it holds
                m.captured = []
            else:
                m.__dict__["captured"].clear()  # emptied in place


def _snapshot_model(model: nn.Module) -> tuple:
    """What marking may not change when it fails: state, hooks, marks, RNG."""
    return ([(k, v.clone()) for k, v in model.state_dict().items()],
            [(n, len(m._forward_hooks), len(m._forward_pre_hooks), remat.mark_of(m))
             for n, m in model.named_modules()], torch.get_rng_state())


def _same_snapshot(a: tuple, b: tuple) -> bool:
    (sa, ha, ra), (sb, hb, rb) = a, b
    return (ha == hb and torch.equal(ra, rb) and [k for k, _ in sa] == [k for k, _ in sb]
            and all(torch.equal(x, y) for (_, x), (_, y) in zip(sa, sb, strict=True)))


# --- the known-broken list (issue 10's classes) ---------------------------------------


@dataclass(frozen=True)
class Region:
    """One marked region of a case, as the plan describes it."""

    path: str
    api: str  # "cell", "module", "type", "primitive", "recompute", "checkpoint"
    reentrant: bool
    output_recompute: bool
    selective: bool  # a policy or a context_fn


def regions(case: Case, model: nn.Module) -> list[Region]:
    """The regions of ``case``'s plan, a type mark expanded to the modules it selects."""
    found = []
    for mark in case.plan:
        opts = mark.get("opts", {})
        reentrant, out = bool(opts.get("use_reentrant")), bool(opts.get("output_recompute"))
        selective = "policy" in opts or "context" in opts
        if mark["kind"] == "type":
            for name, m in model.named_modules():
                if type(m).__name__ == mark["type"]:
                    found.append(Region(name, "type", reentrant, out, selective))
        elif mark["kind"] == "primitive":
            found.append(Region(mark["path"], "primitive", False, True, False))
        elif mark["kind"] == "call":
            found.append(Region(mark["path"], mark["api"], reentrant, out, selective))
        elif mark["kind"] == "marked_call":
            found += regions(Case(case.seed, case.desc, [mark["mark"], mark["call"]]), model)
        elif mark["kind"] == "chain":
            api = "cell" if mark["use"] == "cell" else "recompute"
            found += [Region(p, api, False, True, False) for p in mark["paths"]]
        else:  # a mark on one module, or on several (``blocks``, ``name``: their paths)
            found += [Region(p, mark["kind"], reentrant, out, selective)
                      for p in mark.get("paths", [mark.get("path")])]
    return found


#: (class, the failure verdicts it explains, predicate(case, regions, result)): failures the
#: engine is known to get wrong, counted and reported instead of failed. Empty: every issue-10
#: class and every class this fuzzer found is fixed (or refused with a documented error). Add
#: an entry only with an open issue, and delete it when the fix lands.
KNOWN_BROKEN: list[tuple[str, tuple[str, ...], Callable]] = [
]


def known_broken(case: Case, result: Result) -> str | None:
    """Return the classes that explain ``result`` (a failure of ``case``), "+"-joined, else None.

    Several classes may match one case (say a reentrant region that is also nested); all
    are named, so a case stays excused until the fixes of all of them have landed.
    """
    if not KNOWN_BROKEN:
        return None
    regs = regions(case, build(case.desc))
    found = [number for number, verdicts, predicate in KNOWN_BROKEN
             if result.verdict in verdicts and predicate(case, regs, result)]
    return "+".join(found) or None


def _failure_key(result: Result) -> str:
    """What a failure is, without its numbers: the phase and the tensor or the error's words."""
    return re.sub(r"\(max abs diff .*\)|\[.*|:\s*$", "", result.detail)[:100]


def shrink(case: Case, result: Result) -> tuple[Case, Result]:
    """Drop marks one at a time while the case still fails the same way; return the smallest."""
    for i in reversed(range(len(case.plan))):
        smaller = copy.deepcopy(case)
        del smaller.plan[i]
        got = run_case(smaller)
        if got.verdict == result.verdict and _failure_key(got) == _failure_key(result):
            case, result = smaller, got
    return case, result


def main(argv: list[str]) -> None:
    seeds = [int(a) for a in argv if not a.startswith("-")]
    for seed in seeds:
        case = make_case(seed, compiled="--compile" in argv)
        if "--show" in argv:
            print(case.show())
        result = run_case(case)
        result.known = known_broken(case, result) if result.verdict in ("mismatch", "crash", "leak") else None
        print(f"{seed}: {result.verdict} {result.detail} known={result.known} tolerated={result.tolerated}")
        if "--shrink" in argv and result.verdict in ("mismatch", "crash", "leak"):
            case, result = shrink(case, result)
            print("shrunk:", case.show(), sep="\n")
            print(f"  -> {result.verdict} {result.detail}")


if __name__ == "__main__":
    main(sys.argv[1:])
