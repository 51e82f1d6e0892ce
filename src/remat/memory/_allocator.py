"""The CPU allocator's own view of a step, from ``torch.profiler``'s allocation events (tools).

``remat.memory.track`` counts tensors; this reads what the allocator did, so the two
can be checked against each other (per rank, under ``torch.distributed`` too).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def allocator_peak(step: Callable[[], Any]) -> int:
    """The CPU allocator's peak over ``step``, from the profiler's allocation events.

    Counts what the step's thread allocates, freed by whichever thread frees it. The
    profiler does not record every free made on gloo's worker thread (which releases
    a collective's tensors when it drops the work): a block allocated again at an
    address still counted as live was freed before, and is uncounted then.

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

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
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
    late: dict = {}
    for _, thread, ptr, size in sorted(events):
        if size > 0:
            if ptr in mine:  # freed before, its free not recorded (yet)
                live -= mine.pop(ptr)
                late[ptr] = late.get(ptr, 0) + 1
            if thread == main:
                mine[ptr] = size
                live += size
        elif late.get(ptr):
            late[ptr] -= 1
        elif ptr in mine:
            live -= mine.pop(ptr)
        elif thread == main:  # allocated before the step
            live += size
        peak = max(peak, live)
    return peak
