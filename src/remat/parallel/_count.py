"""``remat.parallel.count_collectives``: the collectives a step issues, per phase (front end)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from remat._engine.collectives import defer_to_subclass, is_collective
from remat._engine.state import is_recomputing

#: ``c10d`` operators that issue communication (FSDP2's all-gather and reduce-scatter, DDP's all-reduce).
_C10D_ISSUING = frozenset({
    "allreduce_", "allreduce_coalesced_", "allgather_", "_allgather_base_", "allgather_coalesced_",
    "allgather_into_tensor_coalesced_", "reduce_scatter_", "_reduce_scatter_base_",
    "reduce_scatter_tensor_coalesced_", "alltoall_", "alltoall_base_", "broadcast_", "reduce_",
    "gather_", "scatter_", "send", "recv_", "barrier",
})


def _issues(func: Any) -> bool:
    if func.namespace == "c10d":
        return func._opname in _C10D_ISSUING
    return is_collective(func)


class CollectiveCounter(TorchDispatchMode):
    """Count the collectives issued while active, by phase and operator; see `count_collectives`."""

    def __init__(self) -> None:
        super().__init__()
        #: ``{phase: Counter({operator name: count})}`` for ``forward``, ``backward``, ``recompute``.
        self.by_phase: dict[str, Counter] = {"forward": Counter(), "backward": Counter(), "recompute": Counter()}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if defer_to_subclass(types):
            return NotImplemented
        if _issues(func):
            self.by_phase[_phase()][func._opname] += 1
        return func(*args, **(kwargs or {}))

    @property
    def forward(self) -> Counter:
        """Collectives issued outside backward."""
        return self.by_phase["forward"]

    @property
    def backward(self) -> Counter:
        """Collectives issued in backward, recomputation included."""
        return self.by_phase["backward"] + self.by_phase["recompute"]

    @property
    def recompute(self) -> Counter:
        """Collectives issued by recomputation (a part of `backward`)."""
        return self.by_phase["recompute"]

    def reset(self) -> None:
        """Start counting again from zero."""
        for counts in self.by_phase.values():
            counts.clear()


def _phase() -> str:
    if is_recomputing():
        return "recompute"
    if torch._C._current_graph_task_id() != -1:
        return "backward"
    return "forward"


def count_collectives() -> CollectiveCounter:
    """Count the collectives issued in the enclosed code, per phase and operator.

    Functional collectives (DTensor's ``all_reduce``, ``all_gather_into_tensor``,
    ...) and the ``c10d`` operators FSDP2 and DDP issue are counted, including
    those DTensor issues while it dispatches an operator. ``wait_tensor`` is not
    a collective.

    Returns:
        A `CollectiveCounter` to use as a context manager; read
        ``forward``, ``backward`` and ``recompute`` (``Counter`` objects keyed
        by operator name) after it.

    Examples:
        >>> import torch, remat
        >>> with remat.parallel.count_collectives() as counts:
        ...     torch.ones(2, requires_grad=True).sin().sum().backward()
        >>> sum(counts.forward.values()), sum(counts.backward.values())
        (0, 0)
    """
    return CollectiveCounter()
