"""Process-wide switches every region honours, remat's and torch's (engine).

NOTE [Global switches]
``torch.utils.checkpoint`` has two process-wide context managers,
``set_checkpoint_early_stop`` and ``set_checkpoint_debug_enabled``, and one
grouping of backward calls, ``GraphExecGroup``. remat has its own of each, with
torch's signatures, and honours torch's too, so code that wraps a model in
torch's context managers keeps its meaning when its checkpoints become remat
regions. remat reads torch's switches; it never calls torch's checkpoint.

- Early stop and debug are read when a region's forward runs (as in torch: the
  context need not be active in backward). remat's setting wins over torch's,
  and either wins over the region's own ``early_stop``/``debug`` option. Both
  apply to saved-tensor-hook regions only (``use_reentrant=False``); torch's
  reentrant checkpoint ignores them too.
- A `GraphExecGroup` is the group torch's autograd records for the
  thread, so torch's and remat's groups are one and the same: they cannot nest
  in each other, and a region under either re-runs once per group instead of
  once per backward call (NOTE [Graph tasks] in ``hooked.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Self

import torch
import torch.utils.checkpoint as _torch_checkpoint

from remat._vocab.errors import check_bool
from remat._vocab.spec import RegionSpec

_early_stop: bool | None = None
_debug: bool | None = None


@contextlib.contextmanager
def set_checkpoint_early_stop(enable: bool) -> Iterator[None]:
    """Turn early stop on or off for every region whose forward runs inside.

    Same as ``torch.utils.checkpoint.set_checkpoint_early_stop`` (and remat
    honours that one too). With early stop, a region's re-run stops as soon as
    the last tensor backward still needs is rebuilt; without it, the region
    re-runs to its end, and saving more tensors than in forward is an error.

    Args:
        enable: True to stop early (the default of every region), False to re-run whole.

    Raises:
        TypeError: ``enable`` is not a bool.

    Examples:
        >>> import torch, remat
        >>> runs = []
        >>> def block(x):
        ...     runs.append(remat.is_recomputing())
        ...     return x.sin().cos()
        >>> x = torch.ones(3, requires_grad=True)
        >>> with remat.set_checkpoint_early_stop(False):
        ...     y = remat.checkpoint(block, x, use_reentrant=False)
        >>> y.sum().backward()
        >>> runs
        [False, True]
    """
    global _early_stop
    check_bool("remat.set_checkpoint_early_stop", "enable", enable)
    previous, _early_stop = _early_stop, enable
    try:
        yield
    finally:
        _early_stop = previous


@contextlib.contextmanager
def set_checkpoint_debug_enabled(enabled: bool | None) -> Iterator[None]:
    """Turn debug traces on or off for every region whose forward runs inside.

    Same as ``torch.utils.checkpoint.set_checkpoint_debug_enabled`` (and remat
    honours that one too). With debug on, a region records the operators its
    forward and its recomputation run, and a mismatch error prints both.

    Args:
        enabled: True or False to override every region's ``debug`` option;
            None to defer to each region's own option.

    Raises:
        TypeError: ``enabled`` is neither a bool nor None.

    Examples:
        >>> import torch, remat
        >>> calls = []
        >>> def block(x):
        ...     calls.append(1)
        ...     return x.sin() if len(calls) == 1 else x[:2].sin()  # not what forward saved
        >>> x = torch.ones(3, requires_grad=True)
        >>> with remat.set_checkpoint_debug_enabled(True):
        ...     y = remat.checkpoint(block, x, use_reentrant=False)
        >>> try:
        ...     y.sum().backward()
        ... except remat.CheckpointError as error:
        ...     print("Operators run in recomputation" in str(error))
        True
    """
    global _debug
    if enabled is not None:
        check_bool("remat.set_checkpoint_debug_enabled", "enabled", enabled)
    previous, _debug = _debug, enabled
    try:
        yield
    finally:
        _debug = previous


def resolve(spec: RegionSpec) -> RegionSpec:
    """Return ``spec`` with the global switches applied (NOTE [Global switches])."""
    if spec.use_reentrant:
        return spec
    early_stop = _early_stop if _early_stop is not None else getattr(
        _torch_checkpoint, "_enable_checkpoint_early_stop", None)
    debug = _debug if _debug is not None else getattr(_torch_checkpoint, "_checkpoint_debug_enabled", None)
    if early_stop is None and debug is None:  # the usual case: no switch set
        return spec
    changes: dict[str, Any] = {}
    if early_stop is not None and early_stop != spec.early_stop:
        changes["early_stop"] = bool(early_stop)
    if debug is not None and debug != spec.debug:
        changes["debug"] = bool(debug)
    return spec.replace(**changes) if changes else spec


def current_group() -> object | None:
    """The `GraphExecGroup` (remat's or torch's) this thread is in, or None."""
    return torch._C._get_graph_exec_group()


class GraphExecGroup:
    """Backward calls inside one group re-run each region at most once.

    Same as ``torch.utils.checkpoint.GraphExecGroup``, and interchangeable with
    it: both set the one group torch's autograd keeps per thread. Without a
    group, every backward call (``backward``, ``torch.autograd.grad``) that
    needs a region re-runs it. Inside one, the calls share one re-run, so they
    must cover separate parts of the graph: two calls that need the same saved
    tensor raise `remat.CheckpointError`. Groups do not nest. Like
    torch's, it affects ``use_reentrant=False`` regions only.

    Raises:
        RuntimeError: entered inside another group (remat's or torch's).

    Examples:
        >>> import torch, remat
        >>> runs = []
        >>> def block(x):
        ...     runs.append(remat.is_recomputing())
        ...     y = x.sin().cos()
        ...     return y, y.sin().cos()
        >>> x = torch.ones(3, requires_grad=True)
        >>> y, z = remat.checkpoint(block, x, use_reentrant=False)
        >>> with remat.GraphExecGroup():
        ...     gy, = torch.autograd.grad(z.sum(), y, retain_graph=True)
        ...     gx, = torch.autograd.grad(y, x, gy + 1)
        >>> runs
        [False, True]
    """

    def __enter__(self) -> Self:
        if current_group() is not None:
            raise RuntimeError(
                f"remat.GraphExecGroup: GraphExecGroup contexts cannot be nested. Already inside "
                f"group {current_group()}; leave it first"
            )
        torch._C._set_graph_exec_group(self)
        return self

    def __exit__(self, *exc: object) -> None:
        torch._C._set_graph_exec_group(None)
