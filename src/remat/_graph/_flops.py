"""The FLOPs of an operator call, for the costs that rank recompute choices.

NOTE [Attention's FLOPs on the CPU]
``torch.utils.flop_counter`` counts the fused attentions of CUDA (flash, memory-efficient,
cuDNN) but not the one the CPU runs, ``_scaled_dot_product_flash_attention_for_cpu`` (and its
backward): a cost by FLOPs and bytes priced the CPU's attention by the bytes it moves alone.
On the issue-27 Llama (4 x 256 tokens, 8 heads of 32) that is 0.24 ms for an attention that
takes about 4 ms, so the planner's ranking took rebuilding two blocks' attentions for
cheaper than rebuilding one block's gate projection (3.9 ms); measured side by side, the
two plans take the same step (1.09x ``torch.compile``'s at its 0.8 budget, 16 interleaved
rounds), 7.4 and 6.4 ms over keeping both. The CPU's attention does the work of the fused
ones, on the same leading arguments (query, key, value; its backward's output gradient
first), so their formulas count it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch

_SAME_WORK = (  # an operator without a formula -> the fused operator whose formula counts it
    ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention"),
    ("_scaled_dot_product_flash_attention_for_cpu_backward", "_scaled_dot_product_flash_attention_backward"),
)

@functools.cache
def flop_formulas() -> Mapping[Any, Callable[..., int]]:
    """``torch.utils.flop_counter``'s formulas by operator packet, with the CPU's attention
    counted as the fused attention it matches (NOTE [Attention's FLOPs on the CPU]).

    Examples:
        >>> import torch
        >>> formulas = flop_formulas()
        >>> q = torch.randn(1, 2, 8, 4)
        >>> out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, q, q)
        >>> formulas[torch.ops.aten._scaled_dot_product_flash_attention_for_cpu](q, q, q, out_val=out)
        2048
    """
    from torch.utils.flop_counter import flop_registry

    table = dict(flop_registry)
    aten = torch.ops.aten
    for name, like in _SAME_WORK:
        packet, model = getattr(aten, name, None), getattr(aten, like, None)
        if packet is not None and model in flop_registry and packet not in flop_registry:
            table[packet] = flop_registry[model]
    return table
