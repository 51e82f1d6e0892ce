"""The FLOPs that rank recompute choices count the CPU's attention (NOTE [Attention's FLOPs on
the CPU] in ``remat/_graph/_flops.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from remat._graph.internal import flop_formulas
from remat.planner._ops import Roofline


class _Attentions(TorchDispatchMode):
    """Each attention operator the dispatcher runs, with its FLOPs by remat's formulas."""

    def __init__(self) -> None:
        super().__init__()
        self.found: dict[str, float] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if "attention" in func.__name__:
            formula = flop_formulas().get(func._overloadpacket)
            self.found[func.__name__] = None if formula is None else formula(*args, **(kwargs or {}), out_val=out)
        return out


def _math_flops(q, k, v, causal: bool) -> tuple[int, int]:
    """FLOPs of attention written as products, forward and backward (torch's counter)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    with FlopCounterMode(display=False) as forward:
        scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
        if causal:
            scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
        out = torch.softmax(scores, -1) @ v
    with FlopCounterMode(display=False) as backward:
        out.sum().backward()
    return forward.get_total_flops(), backward.get_total_flops()


@pytest.mark.parametrize("causal", [False, True])
def test_the_cpu_attention_is_counted_as_its_products(causal):
    q, k, v = (torch.randn(2, 4, 16, 8, requires_grad=True) for _ in range(3))
    with _Attentions() as seen:
        F.scaled_dot_product_attention(q, k, v, is_causal=causal).sum().backward()
    assert len(seen.found) == 2 and None not in seen.found.values(), seen.found  # forward and backward
    (forward, backward), (math_forward, math_backward) = seen.found.values(), _math_flops(q, k, v, causal)
    assert forward == math_forward  # two products, as torch counts the fused attentions
    assert backward == math_backward * 5 // 4  # a fused backward computes the scores again: five products


def test_the_roofline_prices_the_cpu_attention_by_its_flops_and_its_bytes():
    # before: bytes only, a twentieth of the attention's time on the issue-27 Llama
    q = torch.randn(4, 8, 256, 32)
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    out = op(q, q, q, 0.0, True)
    moved = 4 * q.numel() * 4 + out[1].numel() * 4  # q, k, v read; out and logsumexp written
    roofline = Roofline(throughput=1e9, bandwidth=1e9)
    flops = 4 * 4 * 8 * 256 * 256 * 32
    assert roofline.cost(op, (q, q, q, 0.0, True), {}, out) == pytest.approx((flops + moved) / 1e9)
