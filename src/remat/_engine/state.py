"""Thread-local engine state that tools may read (layer 2).

Examples:
    >>> from remat._engine.state import is_recomputing
    >>> is_recomputing()
    False
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch


class _Thread(threading.local):
    """This thread's engine state: re-run depth and count, whether each running re-run's
    backward keeps its graph, the allocation listeners (one thread-local read per use)."""

    def __init__(self) -> None:
        self.depth = 0
        self.runs = 0
        self.kept: list[bool] = []
        self.listeners: list = []


_local = _Thread()


def is_recomputing() -> bool:
    """Return True while remat is re-running a region to rebuild saved tensors.

    Examples:
        >>> import torch, remat
        >>> seen = []
        >>> def block(x):
        ...     seen.append(remat.is_recomputing())
        ...     return x.sin()
        >>> x = torch.ones(2, requires_grad=True)
        >>> remat.checkpoint(block, x, use_reentrant=False).sum().backward()
        >>> seen
        [False, True]
    """
    return _local.depth > 0


def recompute_depth() -> int:
    """Return how many re-runs enclose the running code in this thread (0 outside any)."""
    return _local.depth


def recompute_count() -> int:
    """Return how many region re-runs have started in this thread (a counter for tests)."""
    return _local.runs


class _Recomputing:
    """The enclosed code is a recomputation (a class, not a generator: entered by every re-run)."""

    __slots__ = ()

    def __enter__(self) -> None:
        state = _local
        state.depth += 1
        state.runs += 1
        state.kept.append(torch.is_grad_enabled())  # entered before the re-run enables grad

    def __exit__(self, *exc_info: object) -> None:
        state = _local
        state.depth -= 1
        state.kept.pop()


def rerun_keeps_graph() -> bool:
    """Whether the innermost running re-run serves a backward that keeps its graph
    (``create_graph=True``: what the re-run builds outlives that backward)."""
    kept = _local.kept
    return bool(kept and kept[-1])


_RECOMPUTING = _Recomputing()


def recomputing() -> _Recomputing:
    """Mark the enclosed code as a recomputation (used by the engine)."""
    return _RECOMPUTING


def note_allocation(tensor: object) -> None:
    """Tell the memory tools about a tensor the engine made outside the dispatcher.

    The random-state snapshots a region keeps (``torch.get_rng_state()``) are
    allocated without an operator, so a dispatch mode never sees them; the
    trackers listening here (``remat.memory.track``) count them while they live.
    """
    listeners = _local.listeners
    if listeners:  # none but while a tracker listens
        for listener in list(listeners):
            listener(tensor)


@contextlib.contextmanager
def listening_to_allocations(listener: object) -> Iterator[None]:
    """Call ``listener(tensor)`` for each `note_allocation` in this thread while active."""
    listeners = _local.listeners
    listeners.append(listener)
    try:
        yield
    finally:
        listeners.remove(listener)
