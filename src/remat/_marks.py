"""Marks on modules: ``recompute_module``, ``apply``, ``unmark`` (front end).

A mark is a :class:`~remat._spec.RegionSpec` stored on the module as
``module._remat_spec`` plus one forward pre-hook and one forward hook, both
module-level functions. So a mark changes no parameter name, is invisible to
``state_dict``, and survives ``copy.deepcopy``, ``model.to(...)`` and pickling.
While ``torch.compile`` traces the model the hooks step aside; the graph pass
reads ``_remat_spec`` instead.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch

from remat._engine import region as _region
from remat._errors import check_bool, check_keywords
from remat._policy import Policy
from remat._spec import RegionSpec
from remat.parallel._fsdp import apply_to_units

MARK_KEYWORDS = (
    "use_reentrant",
    "output_recompute",
    "early_stop",
    "mp_comm_recompute",
    "parallel_optimizer_comm_recompute",
    "policy",
    "preserve_rng_state",
)

_SPEC_ATTR = "_remat_spec"
_local = threading.local()


def mark_from_keywords(api: str, kwargs: dict, *, keep_outputs: bool) -> RegionSpec:
    """Validate mark keywords for ``api`` and build the region options."""
    check_keywords(api, kwargs, MARK_KEYWORDS)
    for key, value in kwargs.items():
        if key != "policy":
            check_bool(api, key, value)
    policy = kwargs.get("policy")
    if policy is not None and not isinstance(policy, Policy):
        raise TypeError(
            f"{api}: 'policy' must be a remat.Policy such as remat.save_compute_intensive, "
            f"got {type(policy).__name__}"
        )
    try:
        return RegionSpec(keep_outputs=keep_outputs, **kwargs)
    except (TypeError, ValueError) as err:
        raise type(err)(str(err).replace("remat.RegionSpec", api)) from None


def mark_of(module: torch.nn.Module) -> RegionSpec | None:
    """Return the recompute options marked on ``module``, or None when it is not marked.

    Example:
        >>> import torch, remat
        >>> fc = remat.recompute_module(torch.nn.Linear(2, 2))
        >>> remat.mark_of(fc).keep_outputs
        True
    """
    return module.__dict__.get(_SPEC_ATTR)


def set_mark(module: torch.nn.Module, spec: RegionSpec, *, api: str) -> None:
    """Mark ``module`` with ``spec``; a second mark must carry the same options."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"{api}: expected a torch.nn.Module, got {type(module).__name__}")
    old = mark_of(module)
    if old is not None and old != spec:
        raise ValueError(
            f"{api}: {type(module).__name__} is already marked with {_show(old)}, "
            f"which conflicts with {_show(spec)}; call remat.unmark(module) first"
        )
    if old is None:
        module.__dict__[_SPEC_ATTR] = spec
        module.register_forward_pre_hook(_enter_hook, with_kwargs=True)
        module.register_forward_hook(_exit_hook, with_kwargs=True, always_call=True)


def unmark_module(module: torch.nn.Module) -> bool:
    """Remove the mark of ``module`` only (not of its children); return whether it had one."""
    if module.__dict__.pop(_SPEC_ATTR, None) is None:
        return False
    for hooks, extra in (
        (module._forward_pre_hooks, (module._forward_pre_hooks_with_kwargs,)),
        (
            module._forward_hooks,
            (module._forward_hooks_with_kwargs, module._forward_hooks_always_called),
        ),
    ):
        for key in [k for k, fn in hooks.items() if fn in (_enter_hook, _exit_hook)]:
            del hooks[key]
            for table in extra:
                table.pop(key, None)
    return True


def _show(spec: RegionSpec) -> str:
    default = RegionSpec(keep_outputs=spec.keep_outputs)
    changed = [f"{k}={getattr(spec, k)!r}" for k in MARK_KEYWORDS if getattr(spec, k) != getattr(default, k)]
    return "(" + ", ".join(changed) + ")" if changed else "(default options)"


def recompute_module(module: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
    """Mark any ``torch.nn.Module`` as ``Cell.recompute()`` does, and return it.

    Every operator the module runs is recomputed in backward except its output
    operator, whose result is kept (with ``output_recompute=True``, not even that).

    Args:
        module: the module to mark (a ``Linear``, a Hugging Face block, ...).
        **kwargs: ``use_reentrant``, ``output_recompute``, ``early_stop``,
            ``policy``, ``preserve_rng_state``, ``mp_comm_recompute``,
            ``parallel_optimizer_comm_recompute`` as for ``Cell.recompute``.

    Returns:
        ``module`` itself, marked.

    Raises:
        TypeError: ``module`` is not a module, an unknown keyword, a non-bool flag.
        ValueError: ``module`` is already marked with other options.

    Example:
        >>> import torch, remat
        >>> mlp = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
        >>> _ = remat.recompute_module(mlp)
        >>> mlp(torch.randn(2, 8, requires_grad=True)).sum().backward()
    """
    api = "remat.recompute_module"
    if not isinstance(module, torch.nn.Module):
        raise TypeError(
            f"{api}: module must be a torch.nn.Module, got {type(module).__name__}; "
            f"for a function use remat.checkpoint or remat.recompute(..., use_reentrant=False)"
        )
    set_mark(module, mark_from_keywords(api, kwargs, keep_outputs=True), api=api)
    return module


Where = Callable[[str, torch.nn.Module], bool] | type | Iterable[type]


def apply(model: torch.nn.Module, where: Where, **kwargs: Any) -> list[str]:
    """Mark every submodule of ``model`` that ``where`` selects; return their names.

    Args:
        model: the model to walk (``model`` itself may be selected, under the name ``""``).
        where: a module type, a list of types, or a predicate ``(name, module) -> bool``.
        **kwargs: the options of :func:`recompute_module`.

    Returns:
        The qualified names of the modules marked, in ``named_modules`` order.

    Example:
        >>> import torch, remat
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
        >>> remat.apply(model, where=torch.nn.Linear)
        ['0', '2']
        >>> remat.unmark(model)
        ['0', '2']
    """
    api = "remat.apply"
    if isinstance(where, type) or (
        isinstance(where, (list, tuple, set, frozenset)) and all(isinstance(t, type) for t in where)
    ):
        types = (where,) if isinstance(where, type) else tuple(where)

        def select(name: str, module: torch.nn.Module) -> bool:
            return isinstance(module, types)
    elif callable(where):
        select = where
    else:
        raise TypeError(
            f"{api}: 'where' must be a module type, a list of types or a predicate "
            f"(name, module) -> bool, got {type(where).__name__}"
        )
    spec = mark_from_keywords(api, kwargs, keep_outputs=True)
    chosen = [(n, m) for n, m in model.named_modules() if select(n, m)]
    for name, module in chosen:  # check all before changing any
        old = mark_of(module)
        if old is not None and old != spec:
            raise ValueError(
                f"{api}: module '{name}' is already marked with {_show(old)}, which conflicts "
                f"with {_show(spec)}; call remat.unmark(model) first"
            )
    for _, module in chosen:
        set_mark(module, spec, api=api)
    return [n for n, _ in chosen]


def unmark(model: torch.nn.Module) -> list[str]:
    """Remove every recompute mark in ``model`` and its submodules; return their names.

    Example:
        >>> import torch, remat
        >>> fc = remat.recompute_module(torch.nn.Linear(2, 2))
        >>> remat.unmark(fc)
        ['']
    """
    return [n for n, m in model.named_modules() if unmark_module(m)]


def marked_modules(model: torch.nn.Module) -> dict[str, RegionSpec]:
    """Return ``{qualified name: options}`` of every marked module in ``model``.

    Example:
        >>> import torch, remat
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
        >>> _ = remat.apply(model, where=torch.nn.ReLU, output_recompute=True)
        >>> {name: spec.output_recompute for name, spec in remat.marked_modules(model).items()}
        {'1': True}
    """
    return {n: s for n, m in model.named_modules() if (s := mark_of(m)) is not None}


# --- the hooks -----------------------------------------------------------------


def _stack() -> list:
    if not hasattr(_local, "open"):
        _local.open = []
    return _local.open


def _enter_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    if torch.compiler.is_compiling():  # the graph pass reads the mark instead
        return
    spec = mark_of(module)
    if spec is None or _region.passes_through(module):
        _stack().append(None)
        return
    apply_to_units(module, spec)  # NOTE [Sharded parameters under a mark]
    stack = _stack()
    stack.append(None)  # the exit hook pops one entry even if opening fails
    stack[-1] = _region.open_region(module, args, kwargs, spec, name=type(module).__name__)
    return


def _exit_hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    if torch.compiler.is_compiling():
        return None
    stack = _stack()
    if not stack:
        return None
    handle = stack.pop()
    if handle is None:
        return None
    return _region.close_region(handle, output)
