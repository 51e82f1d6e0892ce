"""The CPU allocator's own view of a step, from ``torch.profiler``'s allocation events (tools).

``remat.memory.track`` counts tensors; this reads what the allocator did, so the two
can be checked against each other (per rank, under ``torch.distributed`` too).

NOTE [Frees on gloo's worker thread]
The profiler records the allocations and frees made on the thread that runs the
step, and no other (``profile_all_threads`` records operators on every thread but
no memory). A gloo collective's work holds its result tensor until gloo's worker
thread drops the work, which it does a little after completing it, racing with
the step's thread: when the step drops the result first (an all-reduce added
into the residual stream and gone a few operators later), the worker's drop frees
the block and the profiler never sees that free, so the block would count as
alive to the end of the step. While measuring, :func:`allocator_peak` therefore
lets the worker go first: after each ``wait_tensor`` it polls the result's
reference count (``Tensor._use_count``) and yields the processor until the work's
references are gone (at most a few milliseconds). Nothing is computed differently;
the step only runs a little slower.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SETTLE_S = 0.005  # longest wait for gloo's worker to drop a finished work


class _LetWorkersRelease(TorchDispatchMode):
    """After each ``wait_tensor`` on a CPU tensor, wait (briefly) until no work holds it."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(getattr(t, "__tensor_flatten__", None) is not None for t in types):
            return NotImplemented  # a DTensor or AsyncCollectiveTensor: see its local operators
        out = func(*args, **(kwargs or {}))
        if func._opname == "wait_tensor" and isinstance(out, torch.Tensor) and out.device.type == "cpu":
            _settle(out)
        return out


def _settle(tensor: torch.Tensor) -> None:
    # NOTE [Frees on gloo's worker thread]: a finished work still held by the worker
    # adds references to its tensors; they go all at once when the worker drops it.
    # A result no work holds any more is referenced by Python and this frame only
    # (at most 3); a count above that falls within microseconds to milliseconds.
    deadline = time.perf_counter() + SETTLE_S
    while tensor._use_count() > 3 and time.perf_counter() < deadline:
        time.sleep(0)


def allocator_peak(step: Callable[[], Any]) -> int:
    """The CPU allocator's peak over ``step``, from the profiler's allocation events.

    Counts what the step's thread allocates, freed by whichever thread frees it
    (NOTE [Frees on gloo's worker thread]: under gloo, each collective's work is
    left to be dropped by gloo's worker before the step goes on, so its frees are
    made, and recorded, on the step's thread).

    Args:
        step: what to measure (a training step).

    Returns:
        The largest increase of bytes allocated by the calling thread during ``step``.

    Example:
        >>> import torch, remat
        >>> remat.memory.allocator_peak(lambda: torch.ones(1024).sum()) >= 4096
        True
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, _LetWorkersRelease():
        step()
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
