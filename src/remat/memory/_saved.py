"""``saved_bytes``: the bytes of storage autograd holds for backward after a forward."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode


class _NewStorages(TorchDispatchMode):
    """Remember (weakly) every storage an operator allocates (not views of older ones)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[int, tuple[weakref.ref, int]] = {}
        self.older: dict[int, weakref.ref] = {}

    @staticmethod
    def _live(table: dict, key: int) -> bool:
        entry = table.get(key)
        ref = entry[0] if isinstance(entry, tuple) else entry
        return ref is not None and ref() is not None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(getattr(t, "__tensor_flatten__", None) is not None for t in types):
            return NotImplemented  # a DTensor runs local operators: count its local shard
        for t in pytree.tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and not t.is_meta:  # a re-run's placeholder holds nothing
                storage = t.untyped_storage()
                key = storage._cdata
                if not self._live(self.seen, key) and not self._live(self.older, key):
                    self.older[key] = weakref.ref(storage)
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_meta:  # a re-run's placeholder holds nothing
                storage = t.untyped_storage()
                key = storage._cdata
                if not self._live(self.seen, key) and not self._live(self.older, key):
                    self.seen[key] = (weakref.ref(storage), storage.nbytes())
        return out


def saved_bytes(step: Callable[[], Any]) -> int:
    """Return the bytes of tensor storage that ``step()`` leaves alive for backward.

    Runs ``step()`` (typically a forward pass returning the loss) and counts,
    once per storage, the bytes of every storage an operator allocated during
    it that is still alive once it has returned, except the storages of the
    tensors it returns. What is left is what autograd (and remat) keep for backward.
    The random-state snapshots remat's regions keep are made without an operator
    and are not counted here (``remat.memory.track`` counts them).

    Args:
        step: a function of no arguments; its return value is held while counting.

    Returns:
        The number of bytes.

    Examples:
        >>> import torch, remat
        >>> w = torch.randn(256, 256, requires_grad=True)
        >>> x = torch.randn(64, 256)
        >>> remat.memory.saved_bytes(lambda: torch.relu(x @ w).sum())  # the relu output, 64*256*4
        65536
    """
    with _NewStorages() as mode:
        out = step()
    returned = {
        t.untyped_storage()._cdata for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)
    }
    total = 0
    for key, (ref, nbytes) in mode.seen.items():
        storage = ref()
        if storage is not None and key not in returned:
            total += nbytes
    del out
    return total
