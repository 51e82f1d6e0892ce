"""Compiled configurations for benchmarks: remat's graph pass against ``torch.compile`` (front end).

The benchmark prepares a model (marks, or ``torch.utils.checkpoint`` wrappers
on the same blocks: only the benchmark calls ``torch.utils.checkpoint``), then
asks here for its compiled step. ``remat.memory.track`` is a
``TorchDispatchMode``, under which Dynamo runs frames eagerly; compiled steps
are measured with `allocation_peak`, from the allocator's own events.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from remat._graph._compile import compile as remat_compile

#: ``compiler`` values of `compile_configuration`.
COMPILERS = ("remat", "torch")


def compile_configuration(
    model: torch.nn.Module, compiler: str, *, backend: str = "aot_eager"
) -> Callable[..., Any]:
    """Compile an already configured model: ``"remat"`` honours its marks, ``"torch"`` its checkpoints.

    Args:
        model: the model, marked (for ``"remat"``) or with blocks wrapped in
            ``torch.utils.checkpoint`` (for ``"torch"``); compile a fresh copy per
            configuration, as compiled code is cached per model.
        compiler: ``"remat"``: [`remat.compile`][remat.compile] (remat's partitioner: marked
            nodes copied into backward, nothing else recomputed); ``"torch"``:
            ``torch.compile`` (its min-cut partitioner, which honours
            ``torch.utils.checkpoint`` regions and may recompute cheap operators).
        backend: ``"aot_eager"`` or ``"inductor"``.

    Returns:
        The compiled model (call it as the model).

    Raises:
        ValueError: an unknown ``compiler``.

    Examples:
        >>> import torch
        >>> from remat._graph._compare import compile_configuration
        >>> net = torch.nn.Linear(4, 2)
        >>> compile_configuration(net, "remat")(torch.ones(1, 4)).shape
        torch.Size([1, 2])
    """
    if compiler == "remat":
        return remat_compile(model, backend=backend)
    if compiler == "torch":
        return torch.compile(model, backend=backend)
    raise ValueError(
        f"remat compile_configuration: compiler must be one of {COMPILERS}, got {compiler!r}"
    )


def allocation_peak(step: Callable[[], Any]) -> int:
    """Run ``step()`` once; return the peak bytes allocated above the start, compiled code included.

    Reads the allocator's events through ``torch.profiler`` (``profile_memory``),
    so it sees every allocation of compiled graphs, on CPU and CUDA alike.

    Args:
        step: a training step (forward, loss, backward).

    Returns:
        The largest increase of allocated bytes during ``step``.

    Examples:
        >>> import torch
        >>> from remat._graph._compare import allocation_peak
        >>> allocation_peak(lambda: torch.ones(1024).sum()) >= 4096
        True
    """
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities, profile_memory=True) as prof:
        step()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak
