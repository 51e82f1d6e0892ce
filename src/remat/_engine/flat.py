"""A region's arguments flattened without ``pytree`` where they are plain (engine).

NOTE [Plain arguments flattened directly]
A region is called with its arguments flattened into leaves (``RegionCore``), and its
re-run with the leaves put back. ``torch.utils._pytree`` does both for any structure, at a
cost that shows on every call of a small region: a Hugging Face layer's keywords (the
mask, the positions, the rotary ``(cos, sin)`` pair) took about 13 us to flatten, 6 us to
rebuild (twice a step) and 5 us to name their structure for the facts' key. Most calls
pass tensors, plain values and one level of tuples, lists or a dict of keywords: those are
flattened here, into the leaves and in the order ``pytree`` gives (positional arguments,
then keyword values in their order, each tuple or list opened in place), with a `Plain`
structure that is hashable (the facts' key holds it as it is) and rebuilds the call. A
value of a type ``pytree`` opens otherwise (a named tuple, a nested dict, a registered
class) sends the whole call to ``pytree``, as before.
"""

from __future__ import annotations

from typing import Any

from torch.utils import _pytree as pytree

_OPENED = (tuple, list)


class Plain(tuple):
    """The structure of a plain call: ``(kinds of the positional arguments, keyword names,
    kinds of the keyword values)``; a kind is None for a leaf, else ``(type, length)``."""

    __slots__ = ()

    def unflatten(self, leaves: list) -> tuple[tuple, dict]:
        """``(args, kwargs)`` with ``leaves`` in their places."""
        kinds, names, kw_kinds = self
        it = iter(leaves)
        args = tuple(next(it) if kind is None else _opened(kind, it) for kind in kinds)
        if not names:
            return args, {}
        return args, {name: next(it) if kind is None else _opened(kind, it) for name, kind in zip(names, kw_kinds)}


def _opened(kind: tuple, it: Any) -> Any:
    container, n = kind
    items = [next(it) for _ in range(n)]
    return tuple(items) if container is tuple else items


def _kind(value: Any, leaves: list) -> Any:
    """Append ``value``'s leaves; its kind, or False where ``pytree`` must flatten the call."""
    t = type(value)
    if t in _OPENED:
        for item in value:
            if type(item) in _OPENED or _node(item):
                return False
        leaves += value
        return (t, len(value))
    if _node(value):
        return False
    leaves.append(value)
    return None


def _node(value: Any) -> bool:
    """Whether ``pytree`` opens ``value`` (a registered container, a named tuple)."""
    t = type(value)
    return t in pytree.SUPPORTED_NODES or (isinstance(value, tuple) and hasattr(value, "_fields"))


def flatten(args: tuple, kwargs: dict) -> tuple[list, Any]:
    """``(leaves, structure)`` of a call, as ``pytree.tree_flatten((args, kwargs))`` gives its
    leaves; the structure a `Plain` where it could be read directly, else pytree's."""
    if type(kwargs) is dict:
        leaves: list = []
        kinds = [_kind(a, leaves) for a in args]
        if False not in kinds:
            kw_kinds = [_kind(v, leaves) for v in kwargs.values()]
            if False not in kw_kinds:
                return leaves, Plain((tuple(kinds), tuple(kwargs), tuple(kw_kinds)))
    return pytree.tree_flatten((args, kwargs))
