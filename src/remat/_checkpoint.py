"""``remat.checkpoint`` and ``checkpoint_sequential``: torch.utils.checkpoint on remat's engine.

Same signatures, defaults, warnings and errors as ``torch.utils.checkpoint`` in
torch 2.13, with one deliberate difference: recomputation does not update module
state a second time (BatchNorm running statistics, ``num_batches_tracked``, any
buffer written in place). See NOTE [No double state updates] in ``_engine/modes.py``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager as ContextManager
from typing import Any

import torch

from remat._engine import region as _region
from remat._errors import describe
from remat._spec import DETERMINISM_CHECKS, RegionSpec


def _noop_context_fn() -> tuple[ContextManager, ContextManager]:
    import contextlib

    return contextlib.nullcontext(), contextlib.nullcontext()


def _region_name(function: Callable) -> str:
    if isinstance(function, torch.nn.Module):
        return type(function).__name__
    return getattr(function, "__qualname__", None) or getattr(function, "__name__", "function")


def checkpoint(
    function: Callable,
    *args: Any,
    use_reentrant: bool | None = None,
    context_fn: Callable[[], tuple[ContextManager, ContextManager]] = _noop_context_fn,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    **kwargs: Any,
) -> Any:
    """Run ``function(*args, **kwargs)`` without keeping its activations; rebuild them in backward.

    A drop-in replacement for ``torch.utils.checkpoint.checkpoint``: change the
    import, nothing else. Unlike torch, recomputation does not update
    BatchNorm running statistics (or any buffer written in place) twice.

    Args:
        function: what to run (a module or any callable).
        *args: its positional arguments.
        use_reentrant: True: custom ``autograd.Function`` (``torch.autograd.grad`` only
            when the callable is not opaque, no tensors nested in containers, no keyword
            arguments); False: saved-tensor
            hooks. Must be passed explicitly (a warning, then True, as in torch).
        context_fn: returns the (forward, recomputation) context pair; accepts
            ``torch.utils.checkpoint.create_selective_checkpoint_contexts(...)`` and
            :func:`remat.policy_context`. Only with ``use_reentrant=False``.
        determinism_check: ``"default"`` (shape, dtype, device of rebuilt tensors
            checked) or ``"none"``.
        debug: record the operators run in forward and recomputation; print both
            if the check fails.
        early_stop: stop re-running once the last needed tensor is rebuilt.
        **kwargs: ``preserve_rng_state`` (default True) and keyword arguments of ``function``.

    Returns:
        What ``function`` returns.

    Raises:
        ValueError: keyword arguments, ``context_fn`` or ``debug`` with ``use_reentrant=True``;
            an unknown ``determinism_check``.
        TypeError: ``function`` is not callable.
        remat.RecomputeError: a rebuilt tensor differs from the saved one.

    Example:
        >>> import torch, remat
        >>> mlp = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
        >>> x = torch.randn(4, 8, requires_grad=True)
        >>> remat.checkpoint(mlp, x, use_reentrant=False).sum().backward()
    """
    if use_reentrant is None:
        warnings.warn(
            "remat.checkpoint: the use_reentrant parameter should be passed explicitly, as in "
            "torch.utils.checkpoint. use_reentrant=False is recommended; pass use_reentrant=True "
            "to keep the current default behavior.",
            stacklevel=2,
        )
        use_reentrant = True
    if not callable(function):
        raise TypeError(f"remat.checkpoint: function must be callable, got {describe(function)}")
    preserve = kwargs.pop("preserve_rng_state", True)
    if kwargs and use_reentrant:
        raise ValueError("Unexpected keyword arguments: " + ",".join(arg for arg in kwargs))
    if use_reentrant and (context_fn is not _noop_context_fn or debug is not False):
        raise ValueError(
            "Passing `context_fn` or `debug` is only supported when use_reentrant=False."
        )
    if determinism_check not in DETERMINISM_CHECKS:
        raise ValueError(
            f"determinism_check should be one of {list(DETERMINISM_CHECKS)}, "
            f"but got {determinism_check}"
        )
    if debug and context_fn is not _noop_context_fn:
        raise ValueError("debug=True is incompatible with non-default context_fn")
    spec = RegionSpec(
        use_reentrant=bool(use_reentrant),
        preserve_rng_state=bool(preserve),
        early_stop=bool(early_stop),
        determinism_check=determinism_check,
        debug=bool(debug),
    )
    contexts = None if context_fn is _noop_context_fn else context_fn
    return _region.run(function, args, kwargs, spec, name=_region_name(function), context_fn=contexts)


def checkpoint_sequential(
    functions: torch.nn.Sequential | Iterable[Callable],
    segments: int,
    input: torch.Tensor,
    use_reentrant: bool | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """Run ``functions`` in order, in ``segments`` checkpointed chunks (all but the last).

    Same signature and behaviour as ``torch.utils.checkpoint.checkpoint_sequential``.

    Args:
        functions: a ``torch.nn.Sequential`` or a list of modules or functions.
        segments: number of chunks.
        input: the tensor fed to the first function.
        use_reentrant: as for :func:`checkpoint` (warns if not passed).
        **kwargs: ``preserve_rng_state`` only.

    Returns:
        The output of the last function.

    Example:
        >>> import torch, remat
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(4)])
        >>> x = torch.randn(2, 4, requires_grad=True)
        >>> remat.checkpoint_sequential(model, 2, x, use_reentrant=False).sum().backward()
    """
    if use_reentrant is None:
        warnings.warn(
            "remat.checkpoint_sequential: the use_reentrant parameter should be passed "
            "explicitly, as in torch.utils.checkpoint. use_reentrant=False is recommended; "
            "pass use_reentrant=True to keep the current default behavior.",
            stacklevel=2,
        )
        use_reentrant = True
    preserve = kwargs.pop("preserve_rng_state", True)
    if kwargs:
        raise ValueError("Unexpected keyword arguments: " + ",".join(arg for arg in kwargs))
    if isinstance(functions, torch.nn.Sequential):
        functions = list(functions.children())
    functions = list(functions)

    def run_function(start: int, end: int) -> Callable:
        def forward(x: torch.Tensor) -> torch.Tensor:
            for j in range(start, end + 1):
                x = functions[j](x)
            return x

        forward.__qualname__ = f"checkpoint_sequential[{start}:{end + 1}]"
        return forward

    segment_size = len(functions) // segments
    end = -1
    for start in range(0, segment_size * (segments - 1), segment_size):
        end = start + segment_size - 1
        input = checkpoint(
            run_function(start, end), input, use_reentrant=use_reentrant, preserve_rng_state=preserve
        )
    return run_function(end + 1, len(functions) - 1)(input)
