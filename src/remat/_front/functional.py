"""``remat.recompute(block, *args, ...)``: MindSpore's functional recompute (front end)."""

from __future__ import annotations

from typing import Any

import torch

from remat._engine import region as _region
from remat._vocab.errors import check_bool, describe
from remat._vocab.spec import RegionSpec
from remat.ops import Primitive


def recompute(block: Any, *args: Any, use_reentrant: bool = True, output_recompute: bool = False,
              **kwargs: Any) -> Any:
    """Run ``block(*args, **kwargs)`` without keeping its activations; rebuild them in backward.

    MindSpore's ``mindspore.recompute``. With ``output_recompute=True`` the
    block's output is not kept either, and adjacent blocks called this way
    merge: the first block's output is never kept and is rebuilt right before
    the second block's recomputation.

    Args:
        block: a ``torch.nn.Module`` (a ``remat.nn.Cell`` or any module); any
            callable when ``use_reentrant=False`` or ``output_recompute=True``.
        *args: positional arguments of ``block``.
        use_reentrant: True: a custom ``autograd.Function`` that does not
            differentiate argument tensors inside lists or tuples (an error says
            so; outputs of any structure carry their gradients); False:
            saved-tensor hooks, which do.
        output_recompute: do not keep the output either (always saved-tensor hooks).
        **kwargs: keyword arguments of ``block``.

    Returns:
        What ``block`` returns.

    Raises:
        TypeError: ``block`` is not a module while ``use_reentrant=True``; a
            keyword that must be a bool is not.

    Examples:
        >>> import torch, remat
        >>> conv = torch.nn.Conv2d(2, 2, 2, bias=False)
        >>> x = torch.ones(2, 2, 2, 2, requires_grad=True)
        >>> y = remat.recompute(conv, x)
        >>> y.sum().backward()
    """
    api = "remat.recompute"
    check_bool(api, "use_reentrant", use_reentrant)
    check_bool(api, "output_recompute", output_recompute)
    if output_recompute:
        use_reentrant = False
    if use_reentrant and isinstance(block, Primitive):
        raise TypeError(
            f"{api}: block must be a Cell (a torch.nn.Module with operators inside) when "
            f"use_reentrant=True, got primitive {type(block).__name__}; mark the primitive with "
            f"{type(block).__name__}().recompute(), or pass use_reentrant=False"
        )
    if use_reentrant and not isinstance(block, torch.nn.Module):
        raise TypeError(
            f"{api}: block must be a torch.nn.Module (a remat.nn.Cell or any module) when "
            f"use_reentrant=True, got {describe(block)}; wrap it in a Cell, or pass "
            f"use_reentrant=False or output_recompute=True"
        )
    if not callable(block):
        raise TypeError(f"{api}: block must be callable, got {describe(block)}")
    spec = RegionSpec(use_reentrant=use_reentrant, output_recompute=output_recompute)
    name = type(block).__name__ if isinstance(block, torch.nn.Module) else describe(block)
    return _region.run(block, args, kwargs, spec, name=name)
