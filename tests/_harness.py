"""The tests' shared harness: models, runs with and without recompute, equality, two ranks."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F


def grads_of(model: torch.nn.Module, *inputs: torch.Tensor) -> list[torch.Tensor]:
    """Gradients of every parameter and every input that requires grad, in a fixed order."""
    out = [p.grad.clone() if p.grad is not None else None for p in model.parameters()]
    return out + [x.grad.clone() for x in inputs if x.requires_grad]


def step_grads(model: torch.nn.Module, forward: Callable, inputs: list[torch.Tensor],
               seed: int = 1) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Run forward+backward on a deep copy of ``model``; return its grads and the loss."""
    model = copy.deepcopy(model)
    xs = [x.detach().clone().requires_grad_(x.requires_grad) for x in inputs]
    torch.manual_seed(seed)
    loss = forward(model, *xs)
    loss.backward()
    return grads_of(model, *xs), loss.detach()


def assert_bitwise_equal(a: list, b: list) -> None:
    """``a`` and ``b`` hold as many tensors, equal bit for bit (``torch.equal``), ``None`` where
    the other is ``None``."""
    assert len(a) == len(b), f"{len(a)} tensors against {len(b)}"
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert (x is None) == (y is None), i
        if x is not None:
            assert torch.equal(x, y), f"tensor {i} differs: max abs diff {(x - y).abs().max()}"


def assert_close_within_tolerance(a: dict, b: dict, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """``a`` and ``b`` hold the same names, their tensors within ``rtol``/``atol``
    (``torch.testing.assert_close``): for compiled code, whose kernels may round differently."""
    assert a.keys() == b.keys()
    for name, value in a.items():
        torch.testing.assert_close(value, b[name], rtol=rtol, atol=atol, msg=name)


class TransformerBlock(torch.nn.Module):
    """Pre-LN attention (causal, SDPA) and a GELU MLP, with dropout."""

    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.fc1, self.fc2 = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, d)))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
