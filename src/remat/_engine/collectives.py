"""Collectives inside a region: kept from forward, or issued again (engine).

NOTE [Kept collectives]
A region marked ``mp_comm_recompute=False`` keeps the results of the
collectives its forward issues (the ``_c10d_functional`` operators DTensor and
``torch.distributed._functional_collectives`` run: ``all_reduce``,
``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``all_to_all_single``,
their coalesced and in-place forms) and hands them to the recomputation
instead of issuing them again, so backward issues no collective that the
same model without recompute would not issue. With ``True`` (MindSpore's
default) the recomputation issues them again and keeps less.

While the region's forward runs, `Record` (a dispatch mode) appends
each collective's result to the frame's list, in order. Every re-run of the
region (the output pass of ``output_recompute`` and the run that rebuilds the
saved tensors, in every backward pass) runs under `Replay`, which
answers the n-th collective of the re-run with the n-th kept result, after
waiting for it. So a collective is issued once per step, however many times
the region re-runs; the kept results live as long as the region's saved
inputs (until its backward is done and the graph is freed).

The decision is a function of the mark and of the program only, so every rank
takes the same one: a re-run that issues another collective than forward did
raises `RecomputeError` on every rank alike. A kept result
written in place after forward (its version counter moved) is not handed
out: that collective is issued again, as every rank runs the same write.

A ``use_reentrant=True`` re-run hands its outputs only to the nested
backward, which never reads their values: a collective whose result is a
re-run output (a row-wise projection's all-reduce that ends a marked MLP) is
never waited there. The re-run keeps the results of the collectives it issues
(`replaying` with ``wait_issued``) and waits them after the nested
backward, so no collective is left unwaited (torch's work registry stays
empty; gloo would report "unwaited collective calls" at exit).

Ops on tensor subclasses (DTensor, ``AsyncCollectiveTensor``) are deferred
to the subclass (``NotImplemented``), so the modes also see the collectives
DTensor issues while it dispatches an operator.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass_type

from remat._engine.core import RegionCore
from remat._engine.errors import RecomputeError

NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd")
_NOT_COMMUNICATION = frozenset({"wait_tensor", "_wrap_tensor_autograd"})


def is_collective(func: Any) -> bool:
    """True for a functional collective operator (not ``wait_tensor``)."""
    return func.namespace in NAMESPACES and func._opname not in _NOT_COMMUNICATION


def defer_to_subclass(types: Any) -> bool:
    """True when an operator should go to a tensor subclass first (DTensor unwraps to local ops)."""
    return any(is_traceable_wrapper_subclass_type(t) for t in types)


class _Kept:
    __slots__ = ("func", "leaves", "spec", "versions")

    def __init__(self, func: Any, out: Any) -> None:
        self.func = func
        leaves, self.spec = pytree.tree_flatten(out)
        if func._schema.is_mutable:  # the result is the written argument: copy it
            leaves = [x.clone() if isinstance(x, torch.Tensor) else x for x in leaves]
        self.leaves = leaves
        self.versions = [x._version if isinstance(x, torch.Tensor) else None for x in leaves]

    def intact(self) -> bool:
        return all(
            not isinstance(x, torch.Tensor) or x._version == v for x, v in zip(self.leaves, self.versions)
        )


class Record(TorchDispatchMode):
    """Keep the result of every collective run while active (a region's forward)."""

    def __init__(self, kept: list) -> None:
        super().__init__()
        self.kept = kept

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if defer_to_subclass(types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        if is_collective(func):
            self.kept.append(_Kept(func, out))
        return out


class Issued(TorchDispatchMode):
    """Keep the results of the collectives a re-run issues, to wait them after it."""

    def __init__(self) -> None:
        super().__init__()
        self.results: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if defer_to_subclass(types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        if is_collective(func):
            self.results.append(out)
        return out

    def wait(self) -> None:
        """Wait every collective issued while active (a no-op for those already waited)."""
        results, self.results = self.results, []
        for x in pytree.tree_leaves(results):
            if isinstance(x, torch.Tensor):
                torch.ops._c10d_functional.wait_tensor(x)


class Replay(Issued):
    """Answer the collectives of a re-run with the results kept in forward."""

    def __init__(self, kept: list, name: str) -> None:
        super().__init__()
        self.kept, self.name = kept, name
        self.index = 0
        self.issued = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if defer_to_subclass(types):
            return NotImplemented
        kwargs = kwargs or {}
        if not is_collective(func):
            return func(*args, **kwargs)
        entry = self.kept[self.index] if self.index < len(self.kept) else None
        self.index += 1
        if entry is None or entry.func is not func:
            forward = entry.func if entry is not None else "no collective"
            raise RecomputeError(
                f"remat: region '{self.name}' (mp_comm_recompute=False): recomputation issued "
                f"collective #{self.index - 1} {func} where forward issued {forward}; the region "
                f"must issue the same collectives each time it runs (same branches on every rank)"
            )
        if not entry.intact():  # written in place since: every rank issues it again
            self.issued += 1
            out = func(*args, **kwargs)
            self.results.append(out)
            return out
        return self._hand_out(func, entry, args, kwargs)

    @staticmethod
    def _hand_out(func: Any, entry: _Kept, args: tuple, kwargs: dict) -> Any:
        leaves = []
        for x in entry.leaves:
            if isinstance(x, torch.Tensor):
                torch.ops._c10d_functional.wait_tensor(x)  # a no-op once forward waited
                x = x.detach()
            leaves.append(x)
        if func._schema.is_mutable:  # in-place forms: write the kept result into the target
            targets = [args[i] if i < len(args) else kwargs[a.name]
                       for i, a in enumerate(func._schema.arguments)
                       if a.alias_info is not None and a.alias_info.is_write]
            flat_targets = pytree.tree_leaves(targets)
            for target, x in zip(flat_targets, leaves):
                target.copy_(x)
            leaves = flat_targets[: len(leaves)]
        return pytree.tree_unflatten(leaves, entry.spec)


def recording(frame: RegionCore) -> contextlib.AbstractContextManager:
    """While a region's forward runs: keep its collectives' results if its mark asks to."""
    if frame.spec.mp_comm_recompute:
        return contextlib.nullcontext()
    frame.kept_collectives = []
    return Record(frame.kept_collectives)


def replaying(frame: RegionCore, wait_issued: bool = False) -> Any:
    """While a region re-runs: hand out the kept results instead of issuing collectives.

    With ``wait_issued`` (a reentrant re-run), return a mode in any case while a
    process group exists; call its ``wait()`` once the re-run's outputs are used.
    """
    kept = getattr(frame, "kept_collectives", None)
    if kept is not None:
        return Replay(kept, frame.name)
    if wait_issued and torch.distributed.is_available() and torch.distributed.is_initialized():
        return Issued()
    return contextlib.nullcontext()
