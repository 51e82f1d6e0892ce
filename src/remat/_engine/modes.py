"""Dispatch modes the engine runs a recomputation under (engine).

NOTE [No double state updates]
Re-running a region runs its in-place writes a second time: BatchNorm would
fold the batch statistics into ``running_mean`` twice and count
``num_batches_tracked`` twice (``torch.utils.checkpoint`` and MindSpore both
do). remat replays the state a region writes instead (NOTE [Observed writes] in
``observe.py``). A reentrant region that wrote its own argument re-runs under
`StateGuard`, which lets an operator write only to tensors the
recomputation itself created. A write to any other tensor (a
buffer, a region input) is dropped: a pure in-place or ``out=`` operator is
skipped and returns its target unchanged; an operator that also computes new
outputs (``_native_batch_norm_legit``) writes into a throw-away copy. The
forward already made the update; the recomputation only rebuilds values.

NOTE [Debug traces]
With ``debug=True`` a region records the operators its forward and its
recomputation run (`OpTrace`); a determinism failure prints both.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def storage_of(t: Any) -> int | None:
    """The storage key of ``t``; None for a non-tensor, a sparse tensor or a wrapper
    subclass (``DTensor``) that has no storage of its own."""
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
        return None
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


def _unannotated_writers() -> dict:
    """Operators that update running statistics without saying so in their schema."""
    table = {}
    for name in ("native_batch_norm", "cudnn_batch_norm", "miopen_batch_norm"):
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None:
            table[packet.default] = [(3, "running_mean"), (4, "running_var")]
    return table


def _written_args(func: Any) -> list[tuple[int, str]]:
    """Return ``(position, name)`` of the arguments ``func`` writes to."""
    cached = _WRITES.get(func)
    if cached is None and func in _UNANNOTATED:
        cached = _WRITES[func] = _UNANNOTATED[func]
    if cached is None:
        cached = [
            (i, a.name)
            for i, a in enumerate(func._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write
        ]
        _WRITES[func] = cached
    return cached


_WRITES: dict = {}
_UNANNOTATED = _unannotated_writers()


def _allocates(func: Any) -> bool:
    """True when no output of ``func`` aliases an input, by its schema."""
    cached = _ALLOCATES.get(func)
    if cached is None:
        cached = _ALLOCATES[func] = all(r.alias_info is None for r in func._schema.returns)
    return cached


_ALLOCATES: dict = {}


def _returns_alias_writes(func: Any) -> bool:
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and r.alias_info.is_write for r in returns)


class StateGuard(TorchDispatchMode):
    """Drop writes to tensors that existed before the recomputation began.

    See NOTE [No double state updates].
    """

    def __init__(self) -> None:
        super().__init__()
        self.fresh: set[int] = set()
        self.dropped = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        writes = _written_args(func) if func._schema.is_mutable or func in _UNANNOTATED else ()
        if writes:
            stale = self._stale_targets(func, writes, args, kwargs)
            if stale:
                self.dropped += 1
                if _returns_alias_writes(func):
                    out = [self._arg(func, i, name, args, kwargs) for i, name in writes]
                    return out[0] if len(func._schema.returns) == 1 else tuple(out)
                args, kwargs = self._with_copies(func, stale, args, kwargs)
        out = func(*args, **kwargs)
        if _allocates(func):  # views and in-place results alias older storage
            for leaf in pytree.tree_leaves(out):
                if isinstance(leaf, torch.Tensor):
                    self.fresh.add(_storage_key(leaf))
        return out

    @staticmethod
    def _arg(func, i: int, name: str, args: tuple, kwargs: dict) -> Any:
        return args[i] if i < len(args) else kwargs.get(name)

    def _stale_targets(self, func, writes, args, kwargs) -> list[tuple[int, str]]:
        stale = []
        for i, name in writes:
            target = self._arg(func, i, name, args, kwargs)
            if isinstance(target, torch.Tensor) and _storage_key(target) not in self.fresh:
                stale.append((i, name))
        return stale

    def _with_copies(self, func, stale, args, kwargs) -> tuple[tuple, dict]:
        """Throw-away copies of the stale targets, made outside every mode below this one.

        The copies are the guard's, not the region's operators: a ``context_fn``'s
        mode under the guard (a selective-recompute policy, torch's SAC) counts the
        region's calls by index and never saw them in forward (issue 17).
        """
        args, kwargs = list(args), dict(kwargs)
        with _disable_current_modes():
            for i, name in stale:
                if i < len(args):
                    args[i] = args[i].clone()
                else:
                    kwargs[name] = kwargs[name].clone()
        return tuple(args), kwargs


def _describe(func: Any, args: tuple, out: Any) -> str:
    def show(x: Any) -> str:
        if isinstance(x, torch.Tensor):
            return f"{str(x.dtype).replace('torch.', '')}{list(x.shape)}"
        return type(x).__name__ if isinstance(x, (list, tuple, dict)) else repr(x)

    shown_in = ", ".join(show(a) for a in args)
    leaves = [show(x) for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]
    return f"{func}({shown_in}) -> {', '.join(leaves) or 'None'}"


class OpTrace(TorchDispatchMode):
    """Record every operator run, one line each. See NOTE [Debug traces]."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []
        self.last_op: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.last_op = str(func)
        self.lines.append(_describe(func, args, out))
        return out

    def render(self) -> str:
        return "\n".join(f"  {i:4d}  {line}" for i, line in enumerate(self.lines)) or "  (none)"
