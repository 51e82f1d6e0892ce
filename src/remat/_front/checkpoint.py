"""``remat.checkpoint`` and ``checkpoint_sequential``: torch.utils.checkpoint on remat's engine.

Same signatures, defaults, warnings and errors as ``torch.utils.checkpoint`` in
torch 2.13, with one deliberate difference: recomputation does not update module
state a second time (BatchNorm running statistics, ``num_batches_tracked``, any
buffer written in place). See NOTE [No double state updates] in ``_engine/modes.py``.

Every other public name of ``torch.utils.checkpoint`` is here or in
``_front/checkpoint_selective.py`` too (``remat`` re-exports them), so changing the import is
enough: the global switches (NOTE [Global switches] in ``_engine/flags.py``),
``CheckpointFunction``, ``noop_context_fn`` and the small helpers
``detach_variable``, ``check_backward_validity``, ``get_device_states``,
``set_device_states`` and ``DefaultDeviceType``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager as ContextManager
from typing import Any

import torch
import torch.utils.checkpoint as _torch_checkpoint

from remat._engine import flags as _flags
from remat._engine import region as _region
from remat._engine.flags import (
    GraphExecGroup,
    set_checkpoint_debug_enabled,
    set_checkpoint_early_stop,
)
from remat._engine.rng import DefaultDeviceType
from remat._front import checkpoint_selective as _selective
from remat._vocab.errors import check_bool, describe
from remat._vocab.spec import DETERMINISM_CHECKS, RegionSpec

__all__ = [
    "CheckpointFunction",
    "DefaultDeviceType",
    "GraphExecGroup",
    "check_backward_validity",
    "checkpoint",
    "checkpoint_sequential",
    "detach_variable",
    "get_device_states",
    "noop_context_fn",
    "set_checkpoint_debug_enabled",
    "set_checkpoint_early_stop",
    "set_device_states",
]


def noop_context_fn() -> tuple[ContextManager, ContextManager]:
    """The default ``context_fn`` of `checkpoint`: two contexts that do nothing.

    torch's ``noop_context_fn`` counts as the default too.

    Examples:
        >>> import remat
        >>> forward, recompute = remat.noop_context_fn()
        >>> with forward, recompute:
        ...     pass
    """
    import contextlib

    return contextlib.nullcontext(), contextlib.nullcontext()


_noop_context_fn = noop_context_fn
_DEFAULT_CONTEXT_FNS = (noop_context_fn, _torch_checkpoint.noop_context_fn)


_SPECS: dict[tuple, RegionSpec] = {}


def _spec(use_reentrant: bool, preserve: bool, early_stop: bool, determinism_check: str, debug: bool) -> RegionSpec:
    """The region options of a call, made once per combination (a spec is frozen; making and
    validating one cost a launch-bound block's call a few microseconds). Traced by dynamo, a
    spec is made as it is written: dynamo folds it into a constant, and warns on a cache."""
    key = (use_reentrant, preserve, early_stop, determinism_check, debug)
    compiling = torch.compiler.is_compiling()
    spec = None if compiling else _SPECS.get(key)
    if spec is None:
        spec = RegionSpec(use_reentrant=use_reentrant, preserve_rng_state=preserve, early_stop=early_stop,
                          determinism_check=determinism_check, debug=debug)
        if not compiling:
            _SPECS[key] = spec
    return spec


def _region_name(function: Callable) -> str:
    if isinstance(function, torch.nn.Module):
        return type(function).__name__
    return getattr(function, "__qualname__", None) or getattr(function, "__name__", "function")


def checkpoint(
    function: Callable,
    *args: Any,
    use_reentrant: bool | None = None,
    context_fn: Callable[[], tuple[ContextManager, ContextManager]] = noop_context_fn,
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
            `remat.policy_context`. Only with ``use_reentrant=False``.
        determinism_check: ``"default"`` (shape, dtype, device of rebuilt tensors
            checked) or ``"none"``.
        debug: record the operators run in forward and recomputation; print both
            if the check fails. `set_checkpoint_debug_enabled` (remat's or
            torch's) overrides it.
        early_stop: stop re-running once the last needed tensor is rebuilt.
            `set_checkpoint_early_stop` (remat's or torch's) overrides it.
        **kwargs: ``preserve_rng_state`` (default True) and keyword arguments of ``function``.

    Returns:
        What ``function`` returns.

    Raises:
        ValueError: keyword arguments, ``context_fn`` or ``debug`` with ``use_reentrant=True``;
            an unknown ``determinism_check``.
        TypeError: ``function`` or ``context_fn`` is not callable; ``use_reentrant``,
            ``preserve_rng_state``, ``debug`` or ``early_stop`` is not a bool.
        remat.CheckpointError: a rebuilt tensor differs from the saved one (also a
            ``torch.utils.checkpoint.CheckpointError``; the message has torch's key sentence).

    Examples:
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
    for name, value in (("use_reentrant", use_reentrant), ("preserve_rng_state", preserve),
                        ("debug", debug), ("early_stop", early_stop)):
        check_bool("remat.checkpoint", name, value)
    if not callable(context_fn):
        raise TypeError(f"remat.checkpoint: context_fn must be callable, got {describe(context_fn)}")
    if kwargs and use_reentrant:
        raise ValueError("Unexpected keyword arguments: " + ",".join(arg for arg in kwargs))
    default_context = context_fn in _DEFAULT_CONTEXT_FNS
    if use_reentrant and (not default_context or debug is not False):
        raise ValueError(
            "Passing `context_fn` or `debug` is only supported when use_reentrant=False."
        )
    if determinism_check not in DETERMINISM_CHECKS:
        raise ValueError(
            f"determinism_check should be one of {list(DETERMINISM_CHECKS)}, "
            f"but got {determinism_check}"
        )
    if not use_reentrant and _flags.resolve(_spec(False, True, True, "default", bool(debug))).debug and not default_context:
        raise ValueError(
            "remat.checkpoint: debug=True is incompatible with non-default context_fn (debug "
            "is on through the argument or set_checkpoint_debug_enabled(True)); turn one off"
        )
    spec = _spec(bool(use_reentrant), bool(preserve), bool(early_stop), determinism_check, bool(debug))
    contexts = None if default_context else _selective.adopt_torch_contexts(context_fn)
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
        use_reentrant: as for `checkpoint` (warns if not passed).
        **kwargs: ``preserve_rng_state`` only.

    Returns:
        The output of the last function.

    Examples:
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
    check_bool("remat.checkpoint_sequential", "use_reentrant", use_reentrant)
    check_bool("remat.checkpoint_sequential", "preserve_rng_state", preserve)
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


class CheckpointFunction:
    """torch's reentrant checkpoint ``Function``, as a remat ``use_reentrant=True`` region.

    Older code calls ``CheckpointFunction.apply(run_function, preserve_rng_state,
    *args)`` directly; this class takes the same call.

    Examples:
        >>> import torch, remat
        >>> layer = torch.nn.Linear(4, 4)
        >>> x = torch.randn(2, 4, requires_grad=True)
        >>> remat.CheckpointFunction.apply(layer, True, x).sum().backward()
    """

    @staticmethod
    def apply(run_function: Callable, preserve_rng_state: bool, *args: Any) -> Any:
        """Run ``run_function(*args)`` as a reentrant region; see `checkpoint`."""
        return checkpoint(run_function, *args, use_reentrant=True,
                          preserve_rng_state=preserve_rng_state)


def detach_variable(inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    """Detach every tensor of a tuple, keeping its ``requires_grad``; other items pass through.

    Same as ``torch.utils.checkpoint.detach_variable``.

    Raises:
        RuntimeError: ``inputs`` is not a tuple (torch's error).

    Examples:
        >>> import torch, remat
        >>> x = torch.ones(2, requires_grad=True) * 2
        >>> d, n = remat.detach_variable((x, 3))
        >>> d.requires_grad, d.grad_fn is None, n
        (True, True, 3)
    """
    if not isinstance(inputs, tuple):
        raise RuntimeError(  # noqa: TRY004 - torch's type, so existing handlers still match
            f"remat.detach_variable: Only tuple of tensors is supported. Got Unsupported input "
            f"type: {type(inputs).__name__}"
        )
    return tuple(
        x.detach().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x
        for x in inputs
    )


def check_backward_validity(inputs: Iterable[Any]) -> None:
    """Warn when no tensor of ``inputs`` requires grad (gradients would be None).

    Same as ``torch.utils.checkpoint.check_backward_validity``.

    Examples:
        >>> import warnings, torch, remat
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     remat.check_backward_validity([torch.ones(2)])
        >>> "None of the inputs have requires_grad=True" in str(caught[0].message)
        True
    """
    if not any(x.requires_grad for x in inputs if isinstance(x, torch.Tensor)):
        warnings.warn(
            "None of the inputs have requires_grad=True. Gradients will be None", stacklevel=2
        )


def get_device_states(*args: Any) -> tuple[list[int], list[torch.Tensor]]:
    """Return the accelerator indices of the tensors in ``args`` and their random states.

    Same as ``torch.utils.checkpoint.get_device_states``; CPU and meta tensors
    have no device state, so CPU-only arguments give two empty lists.

    Examples:
        >>> import torch, remat
        >>> remat.get_device_states(torch.ones(2), [torch.zeros(1)])
        ([], [])
    """
    from torch.utils import _pytree as pytree

    leaves = [x for x in pytree.tree_leaves(args) if isinstance(x, torch.Tensor)]
    devices = [x.get_device() for x in leaves if x.device.type not in ("cpu", "meta")]
    kinds = [x.device.type for x in leaves if x.device.type not in ("cpu", "meta")]
    if not devices:
        return [], []
    module = torch.get_device_module("cuda" if "cuda" in kinds else kinds[0])
    states = []
    for index in devices:
        with module.device(index):
            states.append(module.get_rng_state())
    return devices, states


def set_device_states(devices: list[int], states: list[torch.Tensor], *,
                      device_type: str | None = None) -> None:
    """Set the random state of each accelerator in ``devices`` (from `get_device_states`).

    Same as ``torch.utils.checkpoint.set_device_states``.

    Args:
        devices: device indices.
        states: their random states, in the same order.
        device_type: the accelerator type; default `DefaultDeviceType.get_device_type`.

    Examples:
        >>> import torch, remat
        >>> remat.set_device_states(*remat.get_device_states(torch.ones(2)))
    """
    device_type = device_type or DefaultDeviceType.get_device_type()
    if device_type == "meta" or not devices:
        return
    module = torch.get_device_module(device_type)
    for index, state in zip(devices, states):
        with module.device(index):
            module.set_rng_state(state)
