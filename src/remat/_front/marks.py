"""Marks on modules: ``recompute_module``, ``apply``, ``unmark`` (front end).

A mark is a `RegionSpec` stored on the module as
``module._remat_spec`` plus a `MarkedForward` set as the module's
``forward`` attribute (NOTE [Hooks of a marked module]). So a mark changes no
parameter name, is invisible to ``state_dict``, and survives ``copy.deepcopy``,
``model.to(...)`` and pickling. While ``torch.compile`` traces the model the
wrapper steps aside; the graph pass reads ``_remat_spec`` instead.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import itertools
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from remat._engine import region as _region
from remat._engine import tree as _tree
from remat._front import compile_check as _compile_check
from remat._front.blocks import find_blocks
from remat._vocab.errors import check_bool, check_keywords
from remat._vocab.policy import Policy
from remat._vocab.spec import RegionSpec

MARK_KEYWORDS = (
    "use_reentrant",
    "output_recompute",
    "early_stop",
    "mp_comm_recompute",
    "parallel_optimizer_comm_recompute",
    "policy",
    "preserve_rng_state",
    "stages",
)

_SPEC_ATTR = "_remat_spec"
_LAST_ATTR = "_remat_last_mark"  # NOTE [A mark set again is the same mark]


def mark_from_keywords(api: str, kwargs: dict, *, keep_outputs: bool) -> RegionSpec:
    """Validate mark keywords for ``api`` and build the region options."""
    check_keywords(api, kwargs, MARK_KEYWORDS)
    for key, value in kwargs.items():
        if key not in ("policy", "stages"):
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

    Examples:
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
        spec, wrapper = _mark_again(module, spec)
        module.__dict__[_SPEC_ATTR] = spec
        module.__dict__["forward"] = wrapper


_MARKS_KEPT = 8  # marks a module remembers (NOTE [A mark set again is the same mark])


def _mark_again(module: torch.nn.Module, spec: RegionSpec) -> tuple[RegionSpec, MarkedForward]:
    """``(spec, forward)`` to set: the ones set before with equal options and the same inner
    forward, else new ones, remembered.

    NOTE [A mark set again is the same mark]
    A mark is remembered in the module's ``__dict__`` when it is set (the last
    `_MARKS_KEPT`, by options, in one dictionary whose contents no tree compares): marked
    again with equal options (a planner timing its options round after round, a switch
    turned off for evaluation and on again), the module gets the same objects back, so its
    tree is the one an earlier call saw and the facts learned then hold (NOTE [Trees seen
    before] in ``tree.py``) instead of every region being watched once more. The dictionary
    is made with the module's snapshot cache, before either key of the mark, so the module's
    keys keep one order, marked or not.
    """
    inner = module.__dict__.get("forward")
    kept = module.__dict__.get(_LAST_ATTR)
    if type(kept) is not dict:
        _tree.cached(module)  # its keys in one order, marked or not
        kept = module.__dict__[_LAST_ATTR] = {}
    found = kept.get(spec)
    if found is not None and found[1].inner is inner:
        return found
    if len(kept) >= _MARKS_KEPT:
        kept.pop(next(iter(kept)))
    kept[spec] = (spec, MarkedForward(module, inner))
    return kept[spec]


def unmark_module(module: torch.nn.Module) -> bool:
    """Remove the mark of ``module`` only (not of its children); return whether it had one
    (NOTE [A mark set again is the same mark]: `_mark_again`)."""
    spec = module.__dict__.pop(_SPEC_ATTR, None)
    if spec is None:
        return False
    wrapper = module.__dict__.get("forward")
    if isinstance(wrapper, MarkedForward):
        if wrapper.inner is None:
            del module.__dict__["forward"]
        else:
            module.__dict__["forward"] = wrapper.inner
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
            ``policy``, ``stages``, ``preserve_rng_state``, ``mp_comm_recompute``,
            ``parallel_optimizer_comm_recompute`` as for ``Cell.recompute``.

    Returns:
        ``module`` itself, marked.

    Raises:
        TypeError: ``module`` is not a module, an unknown keyword, a non-bool flag.
        ValueError: ``module`` is already marked with other options; ``stages`` is neither a
            positive int nor ``"each"``, or is not 1 without a ``policy`` or with
            ``output_recompute``.

    Examples:
        >>> import torch, remat
        >>> mlp = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
        >>> _ = remat.recompute_module(mlp)
        >>> mlp(torch.randn(2, 8, requires_grad=True)).sum().backward()
        >>> # a selective mark whose backward rebuilds the block two parts at a time
        >>> block = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
        >>> _ = remat.recompute_module(block, policy=remat.save_compute_intensive, stages=2)
        >>> block(torch.randn(2, 8, requires_grad=True)).sum().backward()
        >>> # one whose backward rebuilds each saved tensor on its own, running none of its code
        >>> block = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
        >>> _ = remat.recompute_module(block, policy=remat.save_compute_intensive, stages="each")
        >>> block(torch.randn(2, 8, requires_grad=True)).sum().backward()
    """
    api = "remat.recompute_module"
    if not isinstance(module, torch.nn.Module):
        raise TypeError(
            f"{api}: module must be a torch.nn.Module, got {type(module).__name__}; "
            f"for a function use remat.checkpoint or remat.recompute(..., use_reentrant=False)"
        )
    set_mark(module, mark_from_keywords(api, kwargs, keep_outputs=True), api=api)
    return module


Where = str | Callable[[str, torch.nn.Module], bool] | type | Iterable[type] | Iterable[str]


def _selector(api: str, where: Where) -> Callable[[str, torch.nn.Module], bool] | None:
    """The predicate ``where`` stands for; None for ``"blocks"`` (NOTE [Finding blocks])."""
    if isinstance(where, str):
        where = [where]
    if isinstance(where, type):
        where = [where]
    if isinstance(where, (list, tuple, set, frozenset)) and where:
        items = list(where)
        if all(isinstance(t, type) for t in items):
            types = tuple(items)
            return lambda name, module: isinstance(module, types)
        if all(isinstance(t, str) for t in items):
            if "blocks" in items:
                if len(items) > 1:
                    raise ValueError(f"{api}: where='blocks' cannot be combined with other names, "
                                     f"got {items}; call remat.apply once for each")
                return None
            return lambda name, module: any(_matches(p, name, module) for p in items)
    elif callable(where):
        return where
    raise TypeError(
        f"{api}: 'where' must be 'blocks', a class name or glob (e.g. 'GPT2Block', '*.mlp'), "
        f"a module type, a list of those, or a predicate (name, module) -> bool, "
        f"got {type(where).__name__} {where!r}"
    )


def _matches(pattern: str, name: str, module: torch.nn.Module) -> bool:
    """A class name (or a glob over class names) or a glob over qualified module names."""
    return fnmatch.fnmatchcase(type(module).__name__, pattern) or (
        bool(name) and fnmatch.fnmatchcase(name, pattern)
    )


def apply(model: torch.nn.Module, where: Where = "blocks", *, every: int = 1,
          **kwargs: Any) -> list[str]:
    """Mark every submodule of ``model`` that ``where`` selects; return their names.

    Args:
        model: the model to walk (``model`` itself may be selected, under the name ``""``).
        where: ``"blocks"`` (default: the model's repeated block, found as NOTE
            [Finding blocks] says: Hugging Face decoder/encoder layers, timm and
            torchvision blocks, a ``ModuleList`` of identical modules), a class name or
            glob over class or module names (``"GPT2Block"``, ``"*Block"``, ``"h.*"``),
            a module type, a list of types or names, or a predicate ``(name, module) -> bool``.
        every: mark only every ``every``-th selected module (the 1st, the ``every+1``-th,
            ...), as Hugging Face's ``every_n_layers``; 1 marks all.
        **kwargs: the options of `recompute_module`.

    Returns:
        The qualified names of the modules marked, in ``named_modules`` order.

    Raises:
        TypeError: ``where`` of an unknown kind, ``every`` not an int, a bad option.
        ValueError: nothing matches ``where``, ``every < 1``, or a module is marked
            with other options already (nothing is marked then).

    Examples:
        >>> import torch, remat
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
        >>> remat.apply(model, where=torch.nn.Linear)
        ['0', '2']
        >>> remat.unmark(model)
        ['0', '2']
        >>> remat.apply(model, where="ReLU")
        ['1']
        >>> _ = remat.unmark(model)
        >>> stack = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(4))
        >>> remat.apply(stack, every=2)
        ['0', '2']
    """
    api = "remat.apply"
    select = _selector(api, where)
    if isinstance(every, bool) or not isinstance(every, int):
        raise TypeError(f"{api}: 'every' must be an int, got {type(every).__name__}")
    if every < 1:
        raise ValueError(f"{api}: 'every' must be at least 1 (1 marks every module), got {every}")
    spec = mark_from_keywords(api, kwargs, keep_outputs=True)
    if select is None:
        chosen = find_blocks(model)
        if not chosen:
            raise ValueError(
                f"{api}: where='blocks' found no repeated block in {type(model).__name__} (no "
                f"Hugging Face layer, no ModuleList or Sequential of identical modules); pass "
                f"the block's class name, e.g. where='MyBlock', or a predicate"
            )
    else:
        chosen = [(n, m) for n, m in model.named_modules() if select(n, m)]
        if not chosen and (isinstance(where, str) or (
                isinstance(where, (list, tuple)) and all(isinstance(w, str) for w in where))):
            raise ValueError(
                f"{api}: where={where!r} matches no module class or name in "
                f"{type(model).__name__}; class names look like "
                f"{sorted({type(m).__name__ for m in model.modules()})[:8]}"
            )
    chosen = chosen[::every]
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

    Examples:
        >>> import torch, remat
        >>> fc = remat.recompute_module(torch.nn.Linear(2, 2))
        >>> remat.unmark(fc)
        ['']
    """
    return [n for n, m in model.named_modules() if unmark_module(m)]


def marked_modules(model: torch.nn.Module) -> dict[str, RegionSpec]:
    """Return ``{qualified name: options}`` of every marked module in ``model``.

    Examples:
        >>> import torch, remat
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
        >>> _ = remat.apply(model, where=torch.nn.ReLU, output_recompute=True)
        >>> {name: spec.output_recompute for name, spec in remat.marked_modules(model).items()}
        {'1': True}
    """
    return {n: s for n, m in model.named_modules() if (s := mark_of(m)) is not None}


# --- the region around forward ---------------------------------------------------
#
# NOTE [Hooks of a marked module]
# The region of a marked module covers its ``forward`` only: the mark sets a
# `MarkedForward` as the module's ``forward`` attribute, which torch calls
# after every forward pre-hook and before every forward hook. So hooks (a pre-hook
# rewriting the input, ``torch.nn.utils.prune``'s mask, the old ``weight_norm``, a
# forward hook counting calls) run once, outside the region, whenever they were
# registered. Recomputation does not call the module again (that would run every
# hook a second time, and a pre-hook on an input it already rewrote): it calls
# ``forward`` on the arguments forward got, so forward runs exactly as the first
# run saw it. Code inside ``forward`` that wants to know can ask
# ``remat.is_recomputing()``.


# NOTE [Call guards]
# An adapter for a library whose modules carry state across calls (Hugging Face's
# key/value cache, ``_front/hf.py``) registers a guard with `add_call_guard`. Before a
# marked module's region starts, each guard may return new ``(args, kwargs)`` for the
# region to record, in which an argument may be a `PerRun`: each run of the
# region (forward, then each recomputation) calls its ``take()`` for the value that run
# gets. An adapter for a library that wraps modules (FSDP2's units, ``parallel/_fsdp.py``)
# registers a run context with `add_run_context` instead: each run of a marked
# module's forward (forward and every recomputation) runs inside ``context(module, spec)``,
# or as it is when that returns None (the library has nothing to do: none of its modules
# exists in this process). So the mark's core knows no library, and no library is imported
# by it.

CallGuard = Callable[[torch.nn.Module, tuple, dict], "tuple[tuple, dict] | None"]
RunContext = Callable[[torch.nn.Module, RegionSpec], "contextlib.AbstractContextManager | None"]
_CALL_GUARDS: list[CallGuard] = []
_RUN_CONTEXTS: list[RunContext] = []


def add_run_context(context: RunContext) -> None:
    """Register ``context(module, spec)``, entered around each run of a marked module (NOTE [Call guards])."""
    if context not in _RUN_CONTEXTS:
        _RUN_CONTEXTS.append(context)


class PerRun:
    """An argument of a marked module's region that each run takes afresh (NOTE [Call guards])."""

    __slots__ = ()

    def take(self) -> Any:
        """The value this run of the region gets."""
        raise NotImplementedError


_PER_RUN = itertools.repeat(PerRun)  # `isinstance(a, PerRun)` over the arguments, in C


def add_call_guard(guard: CallGuard) -> None:
    """Register ``guard(module, args, kwargs) -> (args, kwargs) | None`` (NOTE [Call guards])."""
    if guard not in _CALL_GUARDS:
        _CALL_GUARDS.append(guard)


def _taken(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    if not any(map(isinstance, args, _PER_RUN)) and not (kwargs and any(map(isinstance, kwargs.values(), _PER_RUN))):
        return args, kwargs
    return (
        tuple(a.take() if isinstance(a, PerRun) else a for a in args),
        {k: v.take() if isinstance(v, PerRun) else v for k, v in kwargs.items()},
    )


class MarkedForward:
    """The ``forward`` of a marked module: runs the class's forward as a region.

    NOTE [A mark holds its module weakly]
    The module holds its mark (``module.forward``), so a mark that held its module would
    make a reference cycle: a marked model dropped by its user (a copy for evaluation, a
    planner's trial copy, a model replaced by the next one loaded) kept its parameters and
    their memory until Python's cyclic collector next ran its oldest generation, which in a
    process of a million objects can be thousands of steps away; unmarked, they are freed
    at once. So the mark holds a weak reference to its module, and a region's callable (a
    partial of the module: the engine sees the module in it) is made at each call; the
    module is alive whenever its mark is called, since the caller holds it.

    Args:
        module: the marked module.
        inner: an instance-level ``forward`` that was set before the mark, or None.
    """

    __slots__ = ("_remat_module", "inner")  # a name Dynamo's module paths can drop (_graph)

    def __init__(self, module: torch.nn.Module, inner: Callable | None) -> None:
        self._remat_module, self.inner = weakref.ref(module), inner

    @property
    def module(self) -> torch.nn.Module:
        """The marked module."""
        return self._alive()

    @property
    def __self__(self) -> torch.nn.Module:
        """The module, as a bound method's owner: a region over ``module.forward`` sees it."""
        return self._alive()

    def _alive(self) -> torch.nn.Module:
        module = self._remat_module()
        if module is None:
            raise ReferenceError(
                "remat: the forward of a marked module was called after its module was freed (the "
                "mark holds its module weakly, so that a model dropped is freed: NOTE [A mark holds "
                "its module weakly]); keep a reference to the module, not only to its forward"
            )
        return module

    def plain(self) -> Callable:
        """The forward the mark wraps.

        The class's function with the module bound by a partial, not ``__get__``: dynamo reads
        ``type(m).forward.__get__(m)`` as ``m.forward``, which is this mark, so a compiled
        forward that broke its graph inside a marked module called the mark again, forever."""
        module = self._alive()
        return self.inner if self.inner is not None else functools.partial(type(module).forward, module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self._remat_module()
        if module is None:
            self._alive()  # raises
        if torch.compiler.is_compiling():  # the graph pass reads the mark instead
            _compile_check.note_traced()
            return self.plain()(*args, **kwargs)
        spec = mark_of(module)
        if spec is None:
            return self.plain()(*args, **kwargs)
        for guard in _CALL_GUARDS:  # NOTE [Call guards]
            guarded = guard(module, args, kwargs)
            if guarded is not None:
                args, kwargs = guarded
        # what the region runs: a partial, the engine sees the module
        return _region.run(functools.partial(_replay, module), args, kwargs, spec, name=type(module).__name__)

    def __reduce__(self) -> tuple:
        return (MarkedForward, (self.module, self.inner))


def _replay(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """What a marked module's region runs, in forward and in recomputation: its plain forward."""
    args, kwargs = _taken(args, kwargs)
    marked = module.__dict__.get("forward")
    if isinstance(marked, MarkedForward) and marked.inner is not None:
        forward = marked.inner
    else:  # the class's forward, called on the module (the same as `MarkedForward.plain`)
        forward = functools.partial(type(module).forward, module)
    if not _RUN_CONTEXTS or (spec := mark_of(module)) is None:
        return forward(*args, **kwargs)
    contexts = []
    for context in _RUN_CONTEXTS:
        c = context(module, spec)
        if c is not None:
            contexts.append(c)
    if not contexts:
        return forward(*args, **kwargs)
    with contextlib.ExitStack() as stack:  # NOTE [Call guards]
        for context in contexts:
            stack.enter_context(context)
        return forward(*args, **kwargs)
