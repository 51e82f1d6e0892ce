"""The storages an operator's operands hold, on this rank (layer 4: tools; NOTE [Memory per
rank] in ``_tracker.py``)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves


def _key(storage: torch.UntypedStorage) -> int:
    return storage._cdata


def _operands(*objs: Any) -> list:
    """The leaves of an operator's arguments or results, as ``tree_leaves`` gives them (in order),
    without its cost: ATen arguments nest only in tuples, lists and the keyword dict."""
    leaves: list = []
    todo = list(reversed(objs))
    while todo:
        obj = todo.pop()
        if isinstance(obj, (tuple, list)):
            todo.extend(reversed(obj))
        elif isinstance(obj, dict):
            todo.extend(reversed(list(obj.values())))
        else:
            leaves.append(obj)
    return leaves


_PLAIN = (torch.Tensor, FakeTensor)


def _storages(leaves: Iterable[Any], fake_ok: bool = True) -> Iterator[torch.UntypedStorage]:
    for leaf in leaves:
        if type(leaf) not in _PLAIN and is_traceable_wrapper_subclass(leaf):  # a DTensor counts by its local shard
            inner, _ = leaf.__tensor_flatten__()
            yield from _storages([getattr(leaf, name) for name in inner], fake_ok)
            continue
        if not fake_ok and isinstance(leaf, torch.Tensor) and (
                isinstance(leaf, torch._subclasses.fake_tensor.FakeTensor) or leaf.is_meta):
            continue  # a real run's meta tensors (a skipped call's placeholder) hold no memory
        if isinstance(leaf, torch.Tensor) and leaf.layout == torch.strided:
            try:
                yield leaf.untyped_storage()
            except (RuntimeError, NotImplementedError):  # tensors without storage
                continue


def local_storages(leaves: Iterable[Any]) -> list[torch.UntypedStorage]:
    """The storages of the tensors among ``leaves`` on this rank (a DTensor: its local shard's)."""
    return list(_storages(leaves))


def local_nbytes(t: torch.Tensor) -> int:
    """Bytes of ``t`` on this rank: a DTensor counts by its local shard (NOTE [Memory per rank])."""
    if is_traceable_wrapper_subclass(t):
        inner, _ = t.__tensor_flatten__()
        return sum(local_nbytes(getattr(t, name)) for name in inner)
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _tensors_of(obj: Any) -> list[torch.Tensor]:
    if obj is None:
        return []
    if isinstance(obj, torch.nn.Module):
        return [*obj.parameters(), *obj.buffers(), *(p.grad for p in obj.parameters() if p.grad is not None)]
    if isinstance(obj, torch.optim.Optimizer):
        return [t for state in obj.state.values() for t in tree_leaves(state)]
    return [t for t in tree_leaves(obj) if isinstance(t, torch.Tensor)]
