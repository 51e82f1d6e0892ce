"""Buffers gloo allocates inside its collective operators, below the dispatcher (layer 4: tools).

NOTE [Collective temporaries]
Gloo (the CPU back end) allocates buffers inside its collective operators,
below the dispatcher, so no mode sees them. The tracker applies a rule for
each, checked against the CPU allocator's events (``tests/test_parallel.py``):

======================================= =================== ===========================
operator seen                            buffer              alive
======================================= =================== ===========================
``c10d._allgather_base_``                output's bytes      while the operator runs
``c10d.allgather_into_tensor_           inputs x first      while the operator runs
coalesced_``                             input's bytes
``_c10d_functional.all_gather_into_     input's bytes       while the operator runs
tensor``
``_c10d_functional.all_gather_into_     output's bytes      while the operator runs
tensor_out``
``_c10d_functional.all_gather_into_     inputs x first      while the operator runs
tensor_coalesced``                       input's bytes
``c10d._reduce_scatter_base_``,          a clone of each     until the work is done
``c10d.reduce_scatter_tensor_            input
coalesced_``
``_c10d_functional.reduce_scatter_      a clone of each     until ``wait_tensor`` on
tensor`` (and ``_coalesced``)           input               every output
======================================= =================== ===========================

(Gloo's coalesced all-gather makes a flat tensor shaped like its list of output
chunks, as many rows as inputs of the first input's size; its reduce-scatter
clones every input and scatters from the clones when its work is waited.)

A reduce-scatter's clone of its input is handed back to the dispatcher when
its work is waited (its result is copied out): the tracker recognises it
then, as the first unknown storage of that size, and counts it until it
dies. The gloo worker thread also holds a copy of an all-gather's output
while it runs the collective; that thread's allocations are not the step's
and are not counted (nor by the allocator figure the tests compare with,
which follows the step's thread). A fake process group (a fake run) hands no
clone back: on fake tensors the reduce-scatter's buffer is released when the
operator returns, which is when a real synchronous reduce-scatter (FSDP2's)
releases it, as its call waits the work at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


@dataclass
class _Waits:
    """The buffers a functional reduce-scatter holds until each of its outputs is waited."""

    records: list[Any]  # the tracker's records of the buffers
    outputs: set[int]


def _temporary(func: Any, args: tuple, kwargs: Any) -> tuple[list[int], str] | None:
    """``(bytes of each buffer, lifetime)`` gloo allocates inside ``func`` (NOTE [Collective temporaries])."""
    name = func._opname
    first = args[0] if args else None
    tensors = list(first) if isinstance(first, (list, tuple)) else [first]
    if len(args) > 1 and func.namespace == "c10d" and isinstance(args[1], (list, tuple)):
        tensors = list(args[1])  # (outputs, inputs, ...): look at the inputs
    if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
        return None
    if tensors[0].device.type != "cpu" or is_traceable_wrapper_subclass(tensors[0]):
        return None
    if func.namespace == "c10d":
        if name == "_allgather_base_":  # (output, input, group, ...)
            return [_nbytes(args[0])], "operator"
        if name == "allgather_into_tensor_coalesced_":  # (outputs, inputs, group, ...)
            return [len(tensors) * _nbytes(tensors[0])], "operator"
        if name == "_reduce_scatter_base_":  # (output, input, group, ...)
            return [_nbytes(args[1])], "work"
        if name == "reduce_scatter_tensor_coalesced_":  # (outputs, inputs, group, ...)
            return [_nbytes(t) for t in tensors], "work"
        return None
    if name == "all_gather_into_tensor":  # (input, group_size, group_name)
        return [_nbytes(first)], "operator"
    if name == "all_gather_into_tensor_out":  # (input, group_size, group_name, *, out)
        return [_nbytes((kwargs or {}).get("out"))], "operator"
    if name == "all_gather_into_tensor_coalesced":  # (inputs, group_size, group_name)
        return [len(tensors) * _nbytes(tensors[0])], "operator"
    if name in ("reduce_scatter_tensor", "reduce_scatter_tensor_coalesced"):  # (input(s), op, ...)
        return [_nbytes(t) for t in tensors], "wait"
    return None


def look_away_from_sharding_propagation(count: Any) -> list[tuple[Any, str, Any]]:
    """Make DTensor's sharding propagation call ``count(1)`` on entry and ``count(-1)`` on
    exit, so a dispatch mode can tell its operators (fake tensors of global shape, made to
    learn output shapes: neither this rank's memory nor its work) from the step's. Returns
    the ``(owner, name, original)`` patches to restore; none when DTensor is not in use."""
    import sys

    module = sys.modules.get("torch.distributed.tensor._sharding_prop")
    name = "_propagate_tensor_meta_non_cached"
    original = getattr(getattr(module, "ShardingPropagator", None), name, None)
    if original is None:
        return []

    def propagate(propagator: Any, *args: Any, **kwargs: Any) -> Any:
        count(1)
        try:
            return original(propagator, *args, **kwargs)
        finally:
            count(-1)

    setattr(module.ShardingPropagator, name, propagate)
    return [(module.ShardingPropagator, name, original)]
