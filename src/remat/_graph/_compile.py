"""``remat.compile``, kept light: ``import remat`` must not import Dynamo (front end).

The backend and the pass (``_backend``, ``_partition``) import Dynamo and
AOTAutograd, which take seconds to load; they are imported on the first call.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable
from typing import Any

import torch

Compiled = torch.nn.Module | Callable[..., Any]


def compile(
    model_or_fn: Compiled,
    *,
    backend: str = "aot_eager",
    save_graphs: str | None = None,
    fullgraph: bool = False,
    dynamic: bool | None = None,
) -> Compiled:
    """``torch.compile`` with remat's recompute pass on the joint graph: the marks as set.

    The graph pass behind [`remat.compile`][remat.compile] (which adds planning for a budget, one
    layer up, and documents the arguments): marked forward operators are not saved for
    backward, their copies run in backward before the gradients that need them, and what no
    mark covers is partitioned by torch's min-cut, as ``torch.compile`` partitions it (NOTE
    [Unmarked operators under the min-cut] in ``_partition.py``).

    Args:
        model_or_fn, backend, save_graphs, fullgraph, dynamic: as for [`remat.compile`][remat.compile].

    Returns:
        The compiled module or function. Its ``remat_reports`` attribute lists one
        report per compiled graph (copied nodes, saved activation bytes, dump files).

    Raises:
        ValueError: an unknown ``backend``.
        TypeError: ``model_or_fn`` is not callable.

    Examples:
        >>> import torch, remat
        >>> from remat._graph._compile import compile as graph_compile
        >>> relu = torch.nn.ReLU()
        >>> _ = remat.recompute_module(relu, output_recompute=True)
        >>> graph_compile(relu)(torch.randn(3, requires_grad=True)).sum().backward()
    """
    if not callable(model_or_fn):
        raise TypeError(
            f"remat.compile: expected a torch.nn.Module or a function, got "
            f"{type(model_or_fn).__name__}; pass the model or the training-step function"
        )
    from remat._graph._backend import RematBackend

    graph_mode = RematBackend(backend, save_graphs=save_graphs, roots=[model_or_fn])
    compiled = torch.compile(model_or_fn, backend=graph_mode, fullgraph=fullgraph, dynamic=dynamic)
    name = type(model_or_fn).__name__ if isinstance(model_or_fn, torch.nn.Module) else getattr(
        model_or_fn, "__qualname__", "the function")
    if isinstance(model_or_fn, torch.nn.Module):
        object.__setattr__(compiled, "remat_reports", graph_mode.reports)
        handle = compiled.register_forward_hook(lambda *_: _check_compiled(graph_mode, name, handle))
        return compiled

    checked = []

    @functools.wraps(model_or_fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        graph_mode.note_inputs(args, kwargs)
        out = compiled(*args, **kwargs)
        if not checked:
            checked.append(True)
            _check_compiled(graph_mode, name, None)
        return out

    run.remat_reports = graph_mode.reports  # type: ignore[attr-defined]
    return run


def _check_compiled(graph_mode: Any, name: str, handle: Any) -> None:
    """After the first call: warn when Dynamo ran it without compiling a graph (remat's pass
    never ran; the marks still applied, eagerly, so results are exact but not compiled)."""
    if handle is not None:
        handle.remove()
    if not graph_mode.reports:
        import warnings

        warnings.warn(
            f"remat.compile: torch.compile ran {name} without compiling a graph (Dynamo's "
            f"recompile limit for its code may be reached, or every frame was skipped), so "
            f"remat's graph pass did not run; its marks applied eagerly (gradients are exact). "
            f"Call torch.compiler.reset() before compiling again, or raise "
            f"torch._dynamo.config.recompile_limit", RuntimeWarning, stacklevel=3)


_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def compile_cached(fn: Callable[..., Any], *, save_graphs: str | None = None) -> Callable[..., Any]:
    """Return ``remat.compile(fn, save_graphs=...)``, compiled once per function and dump folder.

    For callers that receive the same function on every step (``remat.ms.grad``
    in ``GRAPH_MODE``): the compiled function, and Dynamo's cache with it, is
    kept as long as ``fn`` (or the object of a bound method) lives.

    Args:
        fn: a function, a bound method or a module.
        save_graphs: a folder for the dumps, or None.

    Returns:
        The compiled callable (the same object for the same ``fn`` and folder).

    Examples:
        >>> import torch
        >>> from remat._graph._compile import compile_cached
        >>> def f(x):
        ...     return (x * 2).sum()
        >>> compile_cached(f) is compile_cached(f)
        True
    """
    owner, func = (fn.__self__, fn.__func__) if inspect.ismethod(fn) else (fn, None)
    per_owner = _cache.setdefault(owner, {})
    key = (func, save_graphs)
    if key not in per_owner:
        per_owner[key] = compile(fn, save_graphs=save_graphs)
    return per_owner[key]
