"""What a reentrant region may take and return: tensors it can differentiate (engine).

The ``autograd.Function`` of a ``use_reentrant=True`` region differentiates its tensor
arguments and outputs only; a tensor nested in a container cannot pass through it.
These checks refuse such arguments and outputs up front, and find the tensors an
object holds (``@dataclass`` fields, attributes, slots) for the escape check (NOTE
[Tensors that escape a reentrant region] in ``observe.py``).
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch
from torch.utils import _pytree as pytree


def check_args(name: str, args: tuple, kwargs: dict) -> None:
    if kwargs:
        pass  # keyword arguments are saved like positional ones
    for position, arg in enumerate(args):
        if isinstance(arg, torch.Tensor):
            continue
        nested = [x for x in pytree.tree_leaves(arg) if isinstance(x, torch.Tensor) and x.requires_grad]
        if nested:
            raise TypeError(
                f"remat: region '{name}' (use_reentrant=True) got argument {position} of type "
                f"{type(arg).__name__} holding {len(nested)} tensor(s) that require grad; the "
                f"reentrant implementation cannot differentiate tensors inside lists, tuples or "
                f"dicts; pass them as separate arguments or use use_reentrant=False"
            )


def tensors_held(item: Any, depth: int = 5) -> list[torch.Tensor]:
    """The tensors ``item`` holds: in a pytree container, or in the fields of an object
    pytree does not open (a ``@dataclass``, a plain object's attributes), a few levels down."""
    found = []
    for x in pytree.tree_leaves(item):
        if isinstance(x, weakref.ref):  # an object held weakly (a cache a layer writes to)
            x = x()
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif depth and not isinstance(x, (type, torch.nn.Module)):
            if dataclasses.is_dataclass(x):
                fields = [getattr(x, f.name) for f in dataclasses.fields(x)]
            else:  # attributes, and slots (remat's own per-run arguments have them)
                fields = [*getattr(x, "__dict__", {}).values(),
                          *(getattr(x, name, None) for cls in type(x).__mro__
                            for name in _slots(cls))]
            found += tensors_held(fields, depth - 1) if fields else []
    return found


def _slots(cls: type) -> tuple:
    slots = cls.__dict__.get("__slots__", ())
    return (slots,) if isinstance(slots, str) else tuple(n for n in slots if n != "__weakref__")


def check_outputs(name: str, out: Any) -> None:
    outs = out if isinstance(out, tuple) else (out,)
    for position, item in enumerate(outs):
        if isinstance(item, torch.Tensor):
            continue
        if tensors_held(item):
            raise TypeError(
                f"remat: region '{name}' (use_reentrant=True) returned output {position} of type "
                f"{type(item).__name__} holding tensors; the reentrant implementation cannot "
                f"differentiate tensors inside lists, tuples, dicts or dataclasses; return them directly "
                f"(a flat tuple) or use use_reentrant=False"
            )
