"""What a reentrant region may take and return: tensors it can differentiate (engine).

The ``autograd.Function`` of a ``use_reentrant=True`` region differentiates its tensor
arguments and outputs only. A tensor argument nested in a container cannot pass through
it: `check_args` refuses such arguments up front. An output of any structure is
flattened to its tensors and put back together around the Function (`Outputs`, NOTE
[Outputs of any structure]); one holding tensors where neither pytree nor a dataclass's
fields reach is refused. `tensors_held` finds the tensors an object holds (``@dataclass``
fields, attributes, slots) for the escape check too (NOTE [Tensors that escape a
reentrant region] in ``observe.py``).
"""

from __future__ import annotations

import copy
import dataclasses
import weakref
from typing import Any

import torch
from torch.utils import _pytree as pytree

from remat._engine.errors import RecomputeError


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


def outputs_of(name: str, output: Any) -> Outputs | None:
    """``output`` flattened to its tensors (NOTE [Outputs of any structure]); None when the
    Function returns it as it is: a tuple of tensors and of values that hold none (a single
    tensor is never passed here: the caller checks that first, to keep its cost)."""
    items = output if isinstance(output, tuple) else (output,)
    for item in items:
        if not isinstance(item, torch.Tensor) and tensors_held(item):
            return Outputs(name, output)
    return None


class Outputs:
    """A region's output as its distinct tensors, and how to put it back together.

    NOTE [Outputs of any structure]
    A reentrant region's ``autograd.Function`` returns tensors, or a tuple of them; a
    region may return any structure. The output is flattened: lists, tuples, dicts, named
    tuples and every type registered with ``torch.utils._pytree`` (Hugging Face's
    ``ModelOutput`` is) are opened by pytree, and a ``@dataclass`` that pytree leaves whole
    is opened through its fields, a few levels down. Its distinct tensors (a tensor found
    twice is one output, handed back in both places) are the region's outputs, run through
    the flat machinery as a tuple; the caller gets the structure back with the Function's
    outputs in place: containers rebuilt by pytree, a dataclass as a shallow copy whose
    fields are set with ``object.__setattr__`` (a frozen one, and ``init=False`` fields,
    without running ``__init__`` or ``__post_init__`` again), every other value as it was.
    In backward the re-run's output is flattened alike and must have the forward's
    structure (the same pytree specs, dataclass types and tensor places), or the region is
    refused with a ``RecomputeError``. An object that holds tensors where neither opens it
    (a plain object's attributes, a dataclass's attribute that is not a field, a dataclass
    that is also a container pytree does not open, whose items a copy would leave stale)
    is refused with a ``TypeError`` when the forward returns, before its escapes are
    looked for or its facts stored, with the state it wrote put back. The
    structure kept for backward holds no tensor and no object of the output: the
    Function's outputs lead back to the frame through autograd.
    """

    __slots__ = ("_tree", "firsts", "index", "shape", "tensors")

    def __init__(self, name: str, output: Any) -> None:
        leaves: list[torch.Tensor] = []
        self._tree = _walk(output, _DEPTH, leaves)
        _refuse_hidden(name, self._tree)
        self.shape = _shape(self._tree)
        first: dict[int, int] = {}  # a tensor -> where it is found first
        for j, t in enumerate(leaves):
            first.setdefault(id(t), j)
        self.firsts = list(first.values())
        number = {key: k for k, key in enumerate(first)}
        self.index = [number[id(t)] for t in leaves]  # each leaf's distinct tensor
        self.tensors = tuple(leaves[j] for j in self.firsts)

    def rebuild(self, results: tuple) -> Any:
        """The output's structure with ``results`` (one per distinct tensor) in place;
        lets go of the output."""
        tree, self._tree, self.tensors = self._tree, None, ()
        return _rebuilt(tree, iter([results[k] for k in self.index]))

    def of_rerun(self, name: str, output: Any) -> tuple:
        """The re-run's counterparts of the forward's distinct tensors, in the same order."""
        leaves: list[torch.Tensor] = []
        tree = _walk(output, _DEPTH, leaves)
        if _shape(tree) != self.shape:
            raise RecomputeError(
                f"remat: region '{name}' (use_reentrant=True): its re-run in backward returned "
                f"an output of another structure than its forward ({len(leaves)} tensor(s) in "
                f"{_described(_shape(tree))}, against {len(self.index)} in {_described(self.shape)}), so "
                f"remat cannot pair the output gradients with the re-run's tensors (NOTE "
                f"[Outputs of any structure]); make the region return the same structure each "
                f"time (no branch on state that changes between forward and backward), or use "
                f"use_reentrant=False"
            )
        return tuple(leaves[j] for j in self.firsts)


_DEPTH = 5  # dataclasses opened inside dataclasses, as `tensors_held` looks
_TENSOR = "tensor"  # a tensor's place in a flattened output


class _Fields:
    """A dataclass opened through its fields: the object, the fields it has, their values' tree."""

    __slots__ = ("names", "obj", "tree")

    def __init__(self, obj: Any, names: tuple, tree: tuple) -> None:
        self.obj, self.names, self.tree = obj, names, tree


def _walk(item: Any, depth: int, leaves: list) -> tuple:
    """``(pytree spec, parts)`` of ``item``, its tensors appended to ``leaves`` in order."""
    values, spec = pytree.tree_flatten(item)
    parts: list = []
    for x in values:
        if isinstance(x, torch.Tensor):
            leaves.append(x)
            x = _TENSOR
        elif depth and _opened(x):
            names = tuple(f.name for f in dataclasses.fields(x) if hasattr(x, f.name))
            n = len(leaves)
            tree = _walk([getattr(x, f) for f in names], depth - 1, leaves)
            x = _Fields(x, names, tree) if len(leaves) > n else x  # no tensor: kept whole
        parts.append(x)
    return spec, parts


def _opened(x: Any) -> bool:
    """Whether ``x`` is a dataclass instance opened through its fields: not one that is a
    container pytree does not open too (its items, which a copy would not update, may hold
    the fields' tensors), which is refused."""
    return (dataclasses.is_dataclass(x) and not isinstance(x, type)
            and not isinstance(x, (dict, list, tuple, set)))


def _shape(tree: tuple) -> tuple:
    """What a re-run's output must match: specs, dataclass types and fields, tensor places."""
    spec, parts = tree
    return spec, tuple(p if p is _TENSOR else (type(p.obj), p.names, _shape(p.tree))
                       if type(p) is _Fields else None for p in parts)


def _rebuilt(tree: tuple, new: Any) -> Any:
    spec, parts = tree
    values = []
    for p in parts:
        if p is _TENSOR:
            p = next(new)
        elif type(p) is _Fields:
            fields, p = p, copy.copy(p.obj)
            for name, value in zip(fields.names, _rebuilt(fields.tree, new), strict=True):
                object.__setattr__(p, name, value)
        values.append(p)
    return pytree.tree_unflatten(values, spec)


def _refuse_hidden(name: str, tree: tuple) -> None:
    """Refuse tensors an output holds where the flattening does not reach."""
    for p in tree[1]:
        if p is _TENSOR:
            continue
        if type(p) is _Fields:
            _refuse_hidden(name, p.tree)
            others = {k: v for k, v in getattr(p.obj, "__dict__", {}).items() if k not in p.names}
            held, what = tensors_held(others), p.obj
        else:
            held, what = tensors_held(p), p
        if held:
            raise TypeError(
                f"remat: region '{name}' (use_reentrant=True) returned an object of type "
                f"{type(what).__name__} holding {len(held)} tensor(s) where remat cannot put "
                f"its outputs back (an attribute that is not a dataclass field, or a container "
                f"type pytree does not open); the reentrant implementation differentiates "
                f"tensors in lists, tuples, dicts, named tuples, dataclass fields and types "
                f"registered with torch.utils._pytree only; return them in one of those, "
                f"register the type (torch.utils._pytree.register_pytree_node), or use "
                f"use_reentrant=False"
            )


def _described(shape: tuple) -> str:
    """The outermost type of an output's `_shape`."""
    spec, parts = shape
    if getattr(spec, "type", None) is not None:
        return f"a {spec.type.__name__}"
    part = parts[0] if parts else None
    return "a tensor" if part is _TENSOR else f"a {part[0].__name__}" if part else "a value"
