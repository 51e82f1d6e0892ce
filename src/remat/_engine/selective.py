"""Selective recompute: keep the outputs a policy chooses, rebuild the rest (engine).

In forward, :class:`SaveMode` runs every operator and stores the outputs of
those the policy saves. In recomputation, :class:`ReplayMode` hands the stored
outputs back instead of running those operators again, and runs the others.
The same pair works as the ``context_fn`` of :func:`remat.checkpoint`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from remat._errors import RecomputeError
from remat._policy import Policy

# Operators that never hold a value worth keeping: aliases and bookkeeping.
_PASS_THROUGH = {
    torch.ops.aten.detach.default,
    torch.ops.aten.alias.default,
    torch.ops.aten.lift_fresh.default,
    torch.ops.aten.lift_fresh_copy.default,
    torch.ops.prim.device.default,
    torch.ops.aten.sym_size.int,
    torch.ops.aten.sym_stride.int,
    torch.ops.aten.sym_numel.default,
    torch.ops.aten.sym_storage_offset.default,
}


def _keeps(policy: Policy, func: Any) -> bool:
    if func in _PASS_THROUGH or func._schema.is_mutable or func.is_view:
        return False
    return policy.saves(func._schema.name)


class _Store:
    """Outputs kept in forward, indexed by operator and call number."""

    def __init__(self) -> None:
        self.kept: dict[Any, dict[int, Any]] = defaultdict(dict)
        self.count: dict[Any, int] = {}  # calls seen in forward, per operator


class SaveMode(TorchDispatchMode):
    """Forward half: run each operator, keep the outputs ``policy`` saves."""

    def __init__(self, policy: Policy, store: _Store) -> None:
        super().__init__()
        self.policy, self.store = policy, store
        self.calls: dict[Any, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if _keeps(self.policy, func):
            index = self.calls[func]
            self.calls[func] += 1
            self.store.count[func] = index + 1
            self.store.kept[func][index] = pytree.tree_map_only(
                torch.Tensor, lambda t: (_alias(t), t._version), out
            )
        return out


class ReplayMode(TorchDispatchMode):
    """Recompute half: return kept outputs, run every other operator."""

    def __init__(self, policy: Policy, store: _Store) -> None:
        super().__init__()
        self.policy, self.store = policy, store
        self.calls: dict[Any, int] = defaultdict(int)

    def __enter__(self):
        self.calls.clear()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not _keeps(self.policy, func):
            return func(*args, **(kwargs or {}))
        index = self.calls[func]
        self.calls[func] += 1
        kept = self.store.kept.get(func, {})
        if index not in kept:
            if index < self.store.count.get(func, 0):  # handed back to an earlier backward
                return func(*args, **(kwargs or {}))
            raise RecomputeError(
                f"remat selective recompute: {func} call #{index} ran in recomputation but "
                f"not in forward (policy {self.policy!r}); the region is not deterministic"
            )
        entry = kept.pop(index)  # handed back once; a later backward rebuilds it
        stored = [t for t in pytree.tree_leaves(entry, is_leaf=_is_pair) if _is_pair(t)]
        if any(t._version != version for t, version in stored):
            return func(*args, **(kwargs or {}))  # changed in place after forward: rebuild it
        # a fresh alias: autograd attaches the recomputation's graph to it, not to the store
        return pytree.tree_map(lambda p: _alias(p[0]) if _is_pair(p) else p, entry, is_leaf=_is_pair)


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A detached alias of ``t`` that shares its version counter.

    Under a dispatch mode the ADInplaceOrView key is excluded, so a plain
    ``detach()`` would get a version counter of its own and in-place changes to
    ``t`` would go unseen.
    """
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
        return t.detach()


def _is_pair(x: Any) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], torch.Tensor)


def policy_context(policy: Policy) -> Callable[[], tuple[SaveMode, ReplayMode]]:
    """Return a ``context_fn`` for :func:`remat.checkpoint` that applies ``policy``.

    Args:
        policy: which operator outputs to keep, e.g. :data:`remat.save_compute_intensive`.

    Returns:
        A function returning the (forward, recomputation) context pair, as
        ``torch.utils.checkpoint.create_selective_checkpoint_contexts`` does.

    Example:
        >>> import torch, remat
        >>> fc = torch.nn.Linear(8, 8)
        >>> x = torch.randn(4, 8, requires_grad=True)
        >>> y = remat.checkpoint(lambda t: torch.relu(fc(t)), x, use_reentrant=False,
        ...                      context_fn=remat.policy_context(remat.save_compute_intensive))
        >>> y.sum().backward()
    """
    if not isinstance(policy, Policy):
        raise TypeError(
            f"remat.policy_context: policy must be a remat.Policy such as "
            f"remat.save_compute_intensive, got {type(policy).__name__}"
        )

    def context_fn() -> tuple[SaveMode, ReplayMode]:
        store = _Store()
        return SaveMode(policy, store), ReplayMode(policy, store)

    context_fn.policy = policy  # type: ignore[attr-defined]
    return context_fn
