"""The module state a region's forward found, and its re-run reads again (engine).

NOTE [Module state at the boundary]
A region that is a module (a marked module, ``remat.checkpoint(block, x)``, a bound
method or a ``functools.partial`` of one) reads more than its arguments: its
parameters and buffers, and whatever plain attributes its forward consults
(``self.prev``, a truncated-BPTT hidden state; a Transformer-XL memory; a step
counter; ``self.training``). Code often rebinds such an attribute in forward
(``self.prev = h.detach()``) or between forward and backward (the next call), so a
re-run that read the module as it is in backward would follow another path or read
another value: silently wrong gradients.

So when a module region opens, `ModuleState` keeps a shallow copy of the
``__dict__`` of every module of the region's tree (a region that is a plain function,
a lambda or a closure, keeps each module it calls, when it calls it) (the references only: a tensor
kept this way costs nothing while its owner still holds it, and its bytes once the
owner has moved on), and the versions of its buffers and plain tensor attributes.
A re-run first puts back every attribute rebound since (one that did not exist
then is removed), runs, then restores what was there when it began: it reads
exactly the attributes the forward read, and leaves the module as it found it (an
attribute the re-run rebinds, ``self.prev = ...`` or a counter ``self.calls += 1``,
is not rebound for the caller, as without the mark; a container it changes in
place, a list it appends to, is changed: count re-runs with ``remat.is_recomputing()``).
A buffer or tensor attribute changed in place since the forward returned (same
object, new version) no longer holds the value the forward left; unless the region's own state replay restores
it (NOTE [Observed writes] in ``observe.py``), the re-run is refused with a
``RecomputeError`` instead of reading the new value.

Parameters are swapped by parallel wrappers (FSDP re-registers its gathered parameters
around each forward and backward): the ``_parameters``, ``_buffers`` and ``_modules``
dictionaries are compared by content, and a parameter, buffer or child module replaced by
another object is put back for the re-run (a child swapped between forward and backward,
``block.act = nn.Tanh()``, re-ran as the new child, silently, before).

NOTE [Tensors read from outside the module]
A region reads tensors besides its arguments and its modules' parameters, buffers and
tensor attributes: a global table, a closure's tensor, an item of a list attribute (a
Transformer-XL memory kept as a list). One changed in place between the forward and the
re-run holds another value than the forward read; unmarked, autograd refuses the backward
where an operator saved it, and a re-run read the new value, silently. So a watched
forward keeps every tensor it read that is none of those (`ModuleState.outside`), with its
version, by weak reference (held by its owner, as the forward read it), and a re-run
whose such tensor moved is refused with a ``RecomputeError``; state the forward wrote is
replayed instead (NOTE [Observed writes]). A region that reads any is watched on every
call (NOTE [Observed once, confirmed every call] in ``facts.py``): each call's reads are
the ones checked. While a wrapper refills tensors in place (FSDP2, NOTE [Parameters changed
before backward]) they are not compared.

NOTE [Parameters changed before backward]
A parameter changed in place between a region's forward and its re-run (weight clipping
or an EMA update of a shared weight after the forward, a GAN's discriminator stepped
between the generator's forward and backward) holds another value than the forward
read. Unmarked, autograd refuses the backward of an operator that saved it ("modified
by an inplace operation"); a re-run would read the new value and train silently wrong.
So when the forward returns, the versions of the region's parameters are kept (one list,
`ModuleState.settle`), and a re-run whose parameter's version moved since is refused
with a ``RecomputeError`` before it runs; a version moved by re-runs alone is not a change
(NOTE [Versions a re-run moved] in ``replayed.py``). While an adapter says a wrapper refills
parameters in place (`add_refill_check`: FSDP2 gathers into the same parameters for
backward, a write that is not the user's), versions are not compared, as before.

NOTE [Parameters frozen before backward]
A parameter frozen or unfrozen between a region's forward and its backward (a GAN's
discriminator frozen right after its forward, a layer unfrozen mid-step) leaves the forward's
graph as it was: unmarked, the gradient is computed along it and ``AccumulateGrad`` drops
it when the parameter no longer requires grad (and a parameter unfrozen after the forward
has no edge in that graph at all). A re-run that read the new flag built another graph:
autograd saved other tensors (refused as a re-run that differs, where torch's checkpoint
refuses too), and the reentrant implementation differentiated a parameter that no longer
requires grad (torch's own error). So `settle` keeps each parameter's ``requires_grad``, a
re-run sets the forward's flags on the leaves whose flag moved and puts the caller's back
when it ends (`_Restored`), and the reentrant backward differentiates a leaf frozen since as
the forward's graph would (``reentrant_backward._grad``), so its hooks see the gradient and its
``AccumulateGrad`` drops it: gradients and hook calls are the unmarked model's.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from remat._engine import replayed as _replayed
from remat._engine.errors import RecomputeError
from remat._engine.observe import engine_copies
from remat._engine.tree import _DEREF, _STRIDE, _dicts, _Known, _tree  # noqa: F401 (tests patch them here)

_REGISTRIES = ("_parameters", "_buffers", "_modules")


def modules_of(fn: Callable) -> list[torch.nn.Module]:
    """The modules a region's callable runs: itself, a bound method's owner, a partial's."""
    while isinstance(fn, functools.partial):
        found = [a for a in fn.args if isinstance(a, torch.nn.Module)]
        if found:
            return found[:1]
        fn = fn.func
    if isinstance(fn, torch.nn.Module):
        return [fn]
    owner = getattr(fn, "__self__", None)
    return [owner] if isinstance(owner, torch.nn.Module) else []


class _Entry:
    """One module's attributes as the forward found them (shallow copies, held by the
    region's frame only) and the versions of its buffers and tensor attributes then."""

    __slots__ = ("attrs", "module", "registries", "versions")

    def __init__(self, module: torch.nn.Module, attrs: dict, parameters: dict, buffers: dict,
                 children: dict, tensor_names: list) -> None:
        """``attrs``, ``parameters``, ``buffers``, ``children``: copies of the module's dictionaries."""
        self.module, self.attrs, self.registries = module, attrs, (parameters, buffers, children)
        self.versions = [(k, t, t._version) for k, t in buffers.items() if t is not None] if buffers else []
        if tensor_names:
            self.versions += [(k, t, t._version) for k in tensor_names if type(t := attrs[k]) is torch.Tensor]

    def rebound(self) -> list[tuple[dict, str, Any]]:
        """``(dict, key, value now)`` for each entry rebound since the forward."""
        now = self.module.__dict__
        if (_same(now, self.attrs) and _same(now["_parameters"], self.registries[0])
                and _same(now["_buffers"], self.registries[1]) and _same(now["_modules"], self.registries[2])):
            return []  # the usual case, checked in C
        changed = []
        for key, value in self.attrs.items():
            if now.get(key, _ABSENT) is not value and not _own(key):
                changed.append((now, key, now.get(key, _ABSENT)))
        for key in now.keys() - self.attrs.keys():
            if not _own(key):
                changed.append((now, key, now[key]))
        for name, then in zip(_REGISTRIES, self.registries):
            registry = now[name]
            for key, value in then.items():
                if registry.get(key, _ABSENT) is not value:
                    changed.append((registry, key, registry.get(key, _ABSENT)))
            for key in registry.keys() - then.keys():
                changed.append((registry, key, registry[key]))
        return changed

    def value_then(self, where: dict, key: str) -> Any:
        if where is self.module.__dict__:
            return self.attrs.get(key, _ABSENT)
        return self.registries[_REGISTRIES.index(_registry_name(self.module, where))].get(key, _ABSENT)


def _same(now: dict, then: dict) -> bool:
    """Whether two dicts hold the same objects under the same keys.

    Dict equality compares values by identity first, in C; values that are not the
    same object fall to their ``==``, which for tensors may raise or compare values:
    an exception counts as a change, and equal values under a new object read alike.
    """
    try:
        return bool(now == then)
    except Exception:  # noqa: BLE001 - a value whose == is elementwise or refuses
        return False


def _own(key: str) -> bool:
    """The module's registries (compared by content) and remat's own bookkeeping (its marks)."""
    return key in _REGISTRIES or key.startswith("_remat_")


def _registry_name(module: torch.nn.Module, registry: dict) -> str:
    return next(name for name in _REGISTRIES if module.__dict__[name] is registry)


_ABSENT = object()
_VERSION = operator.attrgetter("_version")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")

#: adapters' checks that a wrapper refills parameters in place (NOTE [Parameters changed
#: before backward]); each returns True while it does
_REFILL_CHECKS: list[Callable[[], bool]] = []


def add_refill_check(check: Callable[[], bool]) -> None:
    """Register ``check``: while it returns True, parameters' versions are not compared."""
    _REFILL_CHECKS.append(check)


def _refilling() -> bool:
    """Whether a registered check says a wrapper refills parameters in place now."""
    for check in _REFILL_CHECKS:
        if check():
            return True
    return False


def _reorder(where: dict, keys: list) -> None:
    """Put the keys of ``where`` in the order of ``keys`` (those it has), the others after."""
    if list(where) != keys:
        known = set(keys)
        items = [(k, where[k]) for k in keys if k in where] + [(k, v) for k, v in where.items() if k not in known]
        where.clear()
        where.update(items)


def put(where: dict, key: str, value: Any) -> None:
    if value is _ABSENT:
        where.pop(key, None)
    else:
        where[key] = value


class ModuleState:
    """The attributes of a region's modules when its forward began (NOTE [Module state at the boundary]).

    Args:
        name: how errors name the region.
        roots: the region's modules (`modules_of`); their whole trees are kept.
    """

    __slots__ = ("_entries", "copies", "foreign", "forward_params", "keys", "made", "name", "overwritten",
                 "param_flags", "param_versions", "root", "seen", "sources", "tree", "versioned")

    def __init__(self, name: str, roots: list[torch.nn.Module]) -> None:
        self.name, self.root = name, roots[0] if roots else None
        self.overwritten: list[torch.Tensor] = []  # written by the forward, not as state
        self._entries: list[_Entry] = []  # made when first read (`entries`)
        self.made: list = []  # per tree kept: (modules, tensor names, first copy) of entries not made yet
        self.keys: list[int] = []  # of the trees kept (NOTE [Snapshots reused while nothing changed] in ``tree.py``)
        self.seen: set[int] | None = None  # the modules kept, once `add` needs them
        self.tree: _Known | None = None  # what is known of the one tree kept whole
        self.versioned: list[_Entry] = []  # the entries with buffers or tensor attributes
        self.sources: list[dict] = []  # each module's dictionaries (__dict__, parameters, buffers)
        self.copies: list[dict] = []  # and their copies, in the same order
        self.forward_params: list | None = None  # the parameters when the forward returned
        self.param_versions: list = []  # and their versions (NOTE [Parameters changed before backward])
        self.param_flags: list = []  # and whether each required grad (NOTE [Parameters frozen before backward])
        self.foreign: list = []  # NOTE [Tensors read from outside the module]
        for root in roots:
            self.add(root)

    def add(self, module: torch.nn.Module) -> None:
        """Keep ``module``'s tree as it is now (its modules not kept yet).

        Its dictionaries are copied now; the `_Entry` of each module is made when first
        read (`entries`), except for a module with buffers or tensor attributes, whose
        versions are read now."""
        if self.keys and id(module) in self._seen():
            return
        modules, dicts, known = _tree(module)
        names = known.tensor_names
        if self.keys:  # a region that is a plain function: the modules it calls
            keep = [i for i, m in enumerate(modules) if id(m) not in self._seen()]
            self.seen.update(id(modules[i]) for i in keep)
            whole = len(modules)
            modules = [modules[i] for i in keep]
            dicts = [dicts[k * whole + i] for k in range(_STRIDE) for i in keep]
            names = [names[i] for i in keep]
            self.tree = None
        else:  # the usual case: one tree, kept whole
            self.tree = known
        n = len(modules)
        sources = dicts[:4 * n]  # their attributes, parameters, buffers and children
        first = len(self.copies)
        self.sources += sources
        self.copies += map(dict.copy, sources)
        self.made.append((modules, names, first))
        if modules and (any(names) or any(dicts[2 * n:3 * n])):  # buffers or tensor attributes: versions now
            self.versioned += [entry for entry in self.entries[-len(modules):] if entry.versions]
        self.keys.append(known.key)

    @property
    def entries(self) -> list[_Entry]:
        """One `_Entry` per module kept, in order."""
        if self.made:
            made, self.made = self.made, []
            for modules, names, first in made:
                c = self.copies
                n = len(modules)
                self._entries += [_Entry(m, c[k], c[k + n], c[k + 2 * n], c[k + 3 * n], tensor_names)
                                  for m, tensor_names, k in zip(modules, names, range(first, first + n))]
        return self._entries

    def unchanged(self) -> bool:
        """Whether every module's attributes, parameters and buffers are the ones the forward
        found (compared in C: dictionaries of the same objects are equal; a value compared
        by its ``==`` counts as changed)."""
        try:
            return all(map(operator.eq, self.sources, self.copies))
        except Exception:  # noqa: BLE001 - a value whose == is elementwise or refuses
            return False

    def _seen(self) -> set[int]:
        if self.seen is None:
            self.seen = {id(entry.module) for entry in self.entries}
        return self.seen

    @contextlib.contextmanager
    def calls_watched(self) -> Iterator[None]:
        """A region that is a plain function (a lambda, a closure): the modules it calls.

        Each module is kept as the forward finds it when it is called (a global forward
        pre-hook, while the forward runs): the same state a re-run must find there.
        """
        thread = threading.get_ident()  # the hook is global: other threads' calls are not ours

        def seen(module: torch.nn.Module, args: Any) -> None:
            if threading.get_ident() == thread:
                self.add(module)

        handle = torch.nn.modules.module.register_module_forward_pre_hook(seen)
        try:
            yield
        finally:
            handle.remove()

    def modules(self) -> list[torch.nn.Module]:
        return [entry.module for entry in self.entries]

    def forward_parameters(self) -> list[torch.nn.Parameter]:
        """`parameters` as the forward returned (kept by `settle`)."""
        return self.forward_params if self.forward_params is not None else self.parameters()

    def parameters(self) -> list[torch.nn.Parameter]:
        """The parameters of the region's modules, each once, in module order."""
        if self.tree is not None:  # the entries hold them: alive
            return list(map(_DEREF, self.tree.parameters))
        seen: dict[int, torch.nn.Parameter] = {}
        for entry in self.entries:
            for p in entry.registries[0].values():
                if p is not None:
                    seen.setdefault(id(p), p)
        return list(seen.values())

    def fingerprint(self) -> tuple:
        """Identities of the modules, their attributes, parameters and buffers; hook counts.

        NOTE [Observed once, confirmed every call] in ``facts.py``.
        """
        return tuple(self.keys)

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is one of the modules' buffers or tensor attributes as the forward
        found them."""
        return any(t is held for entry in self.versioned for _, held, _ in entry.versions)

    def outside(self, read: list, state: list) -> list[torch.Tensor]:
        """The tensors of ``read`` that are not its modules' parameters, buffers or tensor
        attributes, nor state the forward wrote (NOTE [Tensors read from outside the module])."""
        own = {id(t) for t, _ in state}
        for entry in self.entries:
            own.update(map(id, entry.registries[0].values()))  # parameters
            own.update(id(t) for _, t, _ in entry.versions)  # buffers and tensor attributes
        return [t for t in read if id(t) not in own]

    def settle(self, state: list, outside: list = ()) -> None:
        """The forward returned: what it left in place is what a re-run must find.

        A buffer it overwrote without reading first (spectral norm's ``_u``, filled by an
        ``out=``) is not state to replay (NOTE [Observed writes]): the re-run writes it
        again before it reads it. But a later forward may have written it since, so its
        value is kept around each re-run (`restored`).
        """
        if self.versioned:  # buffers or tensor attributes
            replayed = {id(t) for t, _ in state}
            self.overwritten = [t for _, t in self._changed() if id(t) not in replayed]
            self._refresh()
        self.forward_params = self.parameters()
        self.param_flags = list(map(_REQUIRES_GRAD, self.forward_params))  # NOTE [Parameters frozen before backward]
        if not _refilling():  # NOTE [Parameters changed before backward]
            self.param_versions = list(map(_VERSION, self.forward_params))
            if outside:
                self.foreign = [(weakref.ref(t), tuple(t.shape), t._version) for t in outside]

    def _changed(self) -> list[tuple[_Entry, torch.Tensor]]:
        return [(entry, t) for entry in self.versioned for _, t, version in entry.versions
                if t._version != version]

    def _refresh(self) -> None:
        for entry in self.versioned:
            entry.versions = [(name, t, t._version) for name, t, _ in entry.versions]

    def written(self) -> list[tuple[torch.nn.Module, str, torch.Tensor]]:
        """The buffers and tensor attributes changed in place since the forward began."""
        return [(entry.module, name, t) for entry in self.versioned for name, t, version in entry.versions
                if t._version != version]

    def check_versions(self, replayed: list) -> list | None:
        """Refuse a re-run whose module tensors changed in place since the forward read them;
        return the parameters' versions now (None: not compared)."""
        if not self.param_versions:
            now = None
        elif (now := list(map(_VERSION, self.forward_params))) != self.param_versions:  # in C
            for param, version in zip(self.forward_params, self.param_versions):
                if param._version != version and not _replayed.reached(param, version):  # NOTE [Versions a re-run moved]
                    self._refuse_changed_parameter(param, version)
        for ref, shape, version in self.foreign:
            if (t := ref()) is not None and t._version != version:
                raise RecomputeError(
                    f"remat: region '{self.name}' cannot be re-run: a tensor it read that is neither "
                    f"its argument nor its modules' state (a global, a closure's, an item of a list "
                    f"attribute; shape {list(shape)}) was changed in place after its forward read it "
                    f"(version {version} then, {t._version} now), so the re-run would read another "
                    f"value and the gradients would be wrong; change it after backward, or out of "
                    f"place, or pass it to the region as an argument"
                )
        if not self.versioned:
            return now
        restored = {id(t) for t, _ in replayed} | {id(t) for t in self.overwritten}
        for entry in self.versioned:
            for name, t, version in entry.versions:
                if t._version != version and id(t) not in restored and t.untyped_storage().nbytes():
                    raise RecomputeError(
                        f"remat: region '{self.name}' cannot be re-run: "
                        f"{type(entry.module).__name__}.{name} (shape {list(t.shape)}) was changed "
                        f"in place after the region's forward read it (version {version} then, "
                        f"{t._version} now), so the re-run would read another value and the "
                        f"gradients would be wrong; change it out of place (rebind the attribute: "
                        f"the re-run reads the tensor the forward read), or after backward"
                    )
        return now

    def _refuse_changed_parameter(self, param: torch.Tensor, version: int) -> None:
        name = next((f"{type(e.module).__name__}.{k}" for e in self.entries
                     for k, v in e.registries[0].items() if v is param), "a parameter")
        raise RecomputeError(
            f"remat: region '{self.name}' cannot be re-run: its parameter {name} (shape "
            f"{list(param.shape)}) was changed in place after the region's forward read it "
            f"(version {version} then, {param._version} now), so the re-run would read another "
            f"value and the gradients would be wrong (unmarked, autograd refuses this backward "
            f"as 'modified by an inplace operation' wherever it saved the parameter); change the "
            f"parameter after backward, or out of place"
        )

    def restored(self, replayed: list) -> _Restored:
        """Run a re-run against the attributes the forward found; put back what is there now."""
        return _Restored(self, self.check_versions(replayed))


class _Restored:
    """`ModuleState.restored`: a class, not a generator (every re-run enters one); where
    nothing was rebound and nothing overwritten, it checks and puts back nothing more."""

    __slots__ = ("flipped", "kept", "orders", "state", "undo", "versions")

    def __init__(self, state: ModuleState, versions: list | None) -> None:
        self.state, self.undo, self.kept, self.orders, self.flipped = state, [], [], [], []
        self.versions = versions  # the parameters' when the re-run begins (NOTE [Versions a re-run moved])

    def __enter__(self) -> None:
        state = self.state
        for entry in () if state.unchanged() else state.entries:
            children = entry.module.__dict__["_modules"]
            rebound = entry.rebound()
            if any(where is children for where, _, _ in rebound):  # a container runs them in order
                self.orders.append((children, list(children)))
            for where, key, now in rebound:
                self.undo.append((where, key, now))
                put(where, key, entry.value_then(where, key))
            if self.orders and self.orders[-1][0] is children:
                _reorder(children, list(entry.registries[2]))
        if state.overwritten:
            with engine_copies():
                self.kept = [(t, t.detach().clone()) for t in state.overwritten if t.untyped_storage().nbytes()]
        flags = state.param_flags  # NOTE [Parameters frozen before backward]
        if flags and list(map(_REQUIRES_GRAD, state.forward_params)) != flags:  # in C
            self.flipped = [p for p, flag in zip(state.forward_params, flags, strict=True)
                            if p.requires_grad != flag and p.is_leaf]
            for p in self.flipped:
                p.requires_grad_(not p.requires_grad)

    def __exit__(self, *exc_info: object) -> None:
        state, undo = self.state, self.undo
        for p in self.flipped:  # as the caller left them
            p.requires_grad_(not p.requires_grad)
        for entry in () if not undo and state.unchanged() else state.entries:  # what the re-run rebound itself
            for where, key, _ in entry.rebound():
                if not any(w is where and k == key for w, k, _ in undo):
                    undo.append((where, key, entry.value_then(where, key)))
        for where, key, now in reversed(undo):
            put(where, key, now)
        for children, keys in reversed(self.orders):
            _reorder(children, keys)
        if self.kept:
            with engine_copies():
                for t, value in self.kept:
                    t.data.copy_(value)  # no version bump, as replayed state (NOTE [Observed writes])
        state._refresh()
        if self.versions is not None:  # NOTE [Versions a re-run moved] (replayed.py)
            now = list(map(_VERSION, state.forward_params))
            if now != self.versions:
                _replayed.note(state.forward_params, self.versions, now)
