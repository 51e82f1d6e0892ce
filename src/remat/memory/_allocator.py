"""The CPU allocator's own view of a step, from ``torch.profiler``'s allocation events (tools).

``remat.memory.track`` counts tensors; this reads what the allocator did, so the two
can be checked against each other (per rank, under ``torch.distributed`` too).

NOTE [Frees on gloo's worker thread]
The profiler records the allocations and frees made on the thread that runs the
step, and no other (``profile_all_threads`` records operators on every thread but
no memory). A gloo collective's work holds its tensors until gloo's worker thread
drops the work, which it does a little after completing it, racing with the
step's thread: when the step has dropped the tensor first (an all-reduce result
added into the residual stream and gone a few operators later; the clone of its
input a reduce-scatter scatters from), the worker's drop frees the block and the
profiler never sees that free, so the block would count as alive to the end of
the step. While measuring, `allocator_peak` therefore lets the worker go
first: after a ``wait_tensor`` it yields the processor (at most 50
milliseconds, on a busy machine) until the work's references to the result are gone. And it keeps a
reference to each tensor a work may still hold last (a functional collective's
result once waited; the clone a c10d reduce-scatter copies its result out of),
dropped on the step's thread, before the next operator, once nothing else holds
it (no other C++ reference, ``Tensor._use_count() == 1``, and no other Python
reference; a work's callback may hold one): the free is made there, and
recorded. Nothing is computed differently. Some frees still happen on gloo's
threads now and then (objects a work's callbacks hold), so a step's figure can
only read high: compare the least of a few steps (``tests/test_parallel.py``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SETTLE_S = 0.05  # the longest wait for gloo's worker to drop a finished work (a busy machine)
_REDUCE_SCATTERS = frozenset({"_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_"})


class _LetWorkersRelease(TorchDispatchMode):
    """NOTE [Frees on gloo's worker thread]: free a collective's tensors on this thread."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list[torch.Tensor] = []
        self.scattered_into: set[int] = set()  # storages c10d reduce-scatters write

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(getattr(t, "__tensor_flatten__", None) is not None for t in types):
            return NotImplemented  # a DTensor or AsyncCollectiveTensor: see its local operators
        if self.held:
            self.release()
        out = func(*args, **(kwargs or {}))
        name = func._opname
        if name == "wait_tensor" and _on_cpu(out):
            _let_the_worker_go_first(out)
            self.held.append(out)
        elif func.namespace == "c10d" and name in _REDUCE_SCATTERS:
            outputs = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            self.scattered_into.update(t.untyped_storage()._cdata for t in outputs if _on_cpu(t))
        elif name == "copy_" and self.scattered_into and _copies_out_of_a_work(args, self.scattered_into):
            source = args[1]  # a view of the clone the reduce-scatter scattered from
            self.held.append(source._base if source._base is not None else source)
        return out

    def release(self, everything: bool = False) -> None:
        """Drop the tensors nothing but this mode holds (all of them with ``everything``)."""
        if everything:
            self.held = []
            self.scattered_into.clear()
        else:
            kept = []
            for t in self.held:
                # another C++ holder (a work), or a Python reference beyond the list's, the
                # loop's and getrefcount's own (a work's callback may hold one too)
                if t._use_count() > 1 or sys.getrefcount(t) > 3:
                    kept.append(t)
            self.held = kept


def _let_the_worker_go_first(result: torch.Tensor) -> None:
    # A waited result no work holds any more has at most 3 C++ references here (its
    # Python object and the dispatcher's); a finished work still held by gloo's worker
    # adds its own, dropped within microseconds to milliseconds: wait for that, briefly.
    deadline = time.perf_counter() + SETTLE_S
    while result._use_count() > 3 and time.perf_counter() < deadline:
        time.sleep(0)


def _copies_out_of_a_work(args: tuple, scattered_into: set[int]) -> bool:
    target, source = args[0], args[1]
    return _on_cpu(target) and _on_cpu(source) and target.untyped_storage()._cdata in scattered_into


def _on_cpu(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "cpu"


def allocator_peak(step: Callable[[], Any]) -> int:
    """The CPU allocator's peak over ``step``, from the profiler's allocation events.

    Counts what the step's thread allocates, freed by whichever thread frees it
    (NOTE [Frees on gloo's worker thread]: under gloo, a tensor a collective's work
    may hold last is freed on the step's thread, where the profiler records it).

    Args:
        step: what to measure (a training step).

    Returns:
        The largest increase of bytes allocated by the calling thread during ``step``.

    Examples:
        >>> import torch, remat
        >>> remat.memory.allocator_peak(lambda: torch.ones(1024).sum()) >= 4096
        True
    """
    from torch.profiler import ProfilerActivity, profile

    releasing = _LetWorkersRelease()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        try:
            with releasing:
                step()
        finally:
            releasing.release(everything=True)
    events, threads = [], {}

    def walk(node) -> None:
        kind, fields = node.typed
        if kind == torch._C._profiler._EventType.Allocation:
            events.append((node.start_time_ns, node.start_tid, fields.ptr, fields.alloc_size))
        for child in node.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        threads[root.start_tid] = threads.get(root.start_tid, 0) + 1
        walk(root)
    main = max(threads, key=threads.get)
    live = peak = 0
    mine: dict = {}
    for _, thread, ptr, size in sorted(events):
        if size > 0:
            if ptr in mine:  # allocated again: its free was not recorded (made off the step's thread)
                live -= mine.pop(ptr)
            if thread == main:
                mine[ptr] = size
                live += size
        elif ptr in mine:
            live -= mine.pop(ptr)
        elif thread == main:  # allocated before the step
            live += size
        peak = max(peak, live)
    return peak
