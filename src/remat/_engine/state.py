"""Thread-local engine state that tools may read (layer 2).

Example:
    >>> from remat._engine.state import is_recomputing
    >>> is_recomputing()
    False
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_local = threading.local()


def is_recomputing() -> bool:
    """Return True while remat is re-running a region to rebuild saved tensors.

    Example:
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
    return getattr(_local, "recompute_depth", 0) > 0


def recompute_count() -> int:
    """Return how many region re-runs have started in this thread (a counter for tests)."""
    return getattr(_local, "recompute_runs", 0)


@contextlib.contextmanager
def recomputing() -> Iterator[None]:
    """Mark the enclosed code as a recomputation (used by the engine)."""
    _local.recompute_depth = getattr(_local, "recompute_depth", 0) + 1
    _local.recompute_runs = getattr(_local, "recompute_runs", 0) + 1
    try:
        yield
    finally:
        _local.recompute_depth -= 1
