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

So when a module region opens, :class:`ModuleState` keeps a shallow copy of the
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

NOTE [Snapshots reused while nothing changed]
Copying every module's dictionaries at every call is Python work per module per step.
So each module keeps its latest :class:`_Snapshot` (in ``__dict__['_remat_snapshot']``,
which a deep copy or a pickle of the module leaves empty); a call reuses it when the
module's ``__dict__``, ``_parameters``, ``_buffers`` and ``_modules`` hold the same
keys and the very same objects (compared as tuples of ids, in C) and its hook counts
are unchanged, and takes a new one otherwise. A snapshot is immutable; each call
records the versions of its buffers and tensor attributes afresh. A snapshot's key is
a serial number never reused, so the facts' keys (NOTE [Observed once, confirmed every
call] in ``facts.py``) hold no object.

Parameters are left to autograd and the parallel wrappers that swap them (FSDP
re-registers its gathered parameters around each forward and backward): the
``_parameters``, ``_buffers`` and ``_modules`` dictionaries are compared by
content, and only a parameter or buffer replaced by another object is put back.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from remat._engine.errors import RecomputeError
from remat._engine.observe import engine_copies

_REGISTRIES = ("_parameters", "_buffers")


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


class _Snapshot:
    """One module's dictionaries as a forward found them: shared by every call that finds
    them holding the same objects (NOTE [Snapshots reused while nothing changed])."""

    __slots__ = ("attrs", "children", "ids", "key", "module", "params", "registries", "tensors")
    _serial = 0

    def __init__(self, module: torch.nn.Module) -> None:
        d = module.__dict__
        self.module, self.attrs = module, d.copy()
        self.registries = (d["_parameters"].copy(), d["_buffers"].copy())
        self.children = d["_modules"].copy()
        self.ids = _identities(d)
        self.tensors = [(k, t) for k, t in self.registries[1].items() if t is not None]
        self.tensors += [(k, t) for k, t in self.attrs.items() if type(t) is torch.Tensor]
        self.params = [p for p in self.registries[0].values() if p is not None]
        _Snapshot._serial += 1
        self.key = _Snapshot._serial  # never reused, unlike an id

    def current(self) -> bool:
        """Whether the module's dictionaries still hold exactly these objects (in C)."""
        return _identities(self.module.__dict__) == self.ids


def _identities(d: dict) -> tuple:
    """The keys and the identities of the values of a module's ``__dict__`` and its
    registries, and its hook counts: equal only while they hold the very same objects."""
    p, b, m = d["_parameters"], d["_buffers"], d["_modules"]
    return (*d, *map(id, d.values()), len(p), *p, *map(id, p.values()), len(b), *b,
            *map(id, b.values()), len(m), *m, *map(id, m.values()),
            len(d.get("_forward_hooks", ())), len(d.get("_forward_pre_hooks", ())),
            len(d.get("_backward_hooks", ())), len(d.get("_backward_pre_hooks", ())))


class _Cached:
    """The latest snapshot of a module, kept in its ``__dict__`` (NOTE [Snapshots reused
    while nothing changed]); a copy or a pickle of the module starts without one."""

    __slots__ = ("params", "snapshot", "tree")

    def __init__(self) -> None:
        self.snapshot: _Snapshot | None = None
        self.tree: list[_Snapshot] | None = None  # the module's tree, as the last call found it
        self.params: list[torch.nn.Parameter] = []  # the tree's parameters, each once

    def __deepcopy__(self, memo: dict) -> _Cached:
        return _Cached()

    def __copy__(self) -> _Cached:
        return _Cached()

    def __reduce__(self) -> tuple:
        return (type(None), ())


def _cached(module: torch.nn.Module) -> _Cached:
    d = module.__dict__
    cached = d.get("_remat_snapshot")
    if type(cached) is not _Cached:
        cached = d["_remat_snapshot"] = _Cached()
    return cached


def snapshot(module: torch.nn.Module) -> _Snapshot:
    """The module's snapshot: the cached one while it is current, else a new one."""
    cached = _cached(module)
    found = cached.snapshot
    if found is None or not found.current():
        found = cached.snapshot = _Snapshot(module)
    return found


def _tree(root: torch.nn.Module) -> list[_Snapshot]:
    """The snapshots of ``root``'s modules in ``root.modules()`` order: the last call's
    list while every one of them is current, else walked again through the children."""
    cached = _cached(root)
    tree = cached.tree
    if tree is not None and all(snap.current() for snap in tree):
        return tree
    tree, seen, stack = [], set(), [root]
    while stack:  # pre-order, as module.modules(), through the snapshots' children
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        snap = snapshot(m)
        tree.append(snap)
        stack.extend(c for c in reversed(snap.children.values()) if c is not None)
    cached.tree = tree
    cached.params = list({id(p): p for snap in tree for p in snap.params}.values())
    return tree


class _Entry:
    """One module's attributes as the forward found them (a snapshot) and the versions of
    its buffers and tensor attributes then."""

    __slots__ = ("attrs", "module", "registries", "snapshot", "versions")

    def __init__(self, snap: _Snapshot) -> None:
        self.snapshot, self.module, self.attrs, self.registries = snap, snap.module, snap.attrs, snap.registries
        self.versions = [(k, t, t._version) for k, t in snap.tensors]

    def rebound(self) -> list[tuple[dict, str, Any]]:
        """``(dict, key, value now)`` for each entry rebound since the forward."""
        now = self.module.__dict__
        if (_same(now, self.attrs) and _same(now["_parameters"], self.registries[0])
                and _same(now["_buffers"], self.registries[1])):
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


def put(where: dict, key: str, value: Any) -> None:
    if value is _ABSENT:
        where.pop(key, None)
    else:
        where[key] = value


class ModuleState:
    """The attributes of a region's modules when its forward began (NOTE [Module state at the boundary]).

    Args:
        name: how errors name the region.
        roots: the region's modules (:func:`modules_of`); their whole trees are kept.
    """

    __slots__ = ("entries", "name", "overwritten", "params", "root", "seen")

    def __init__(self, name: str, roots: list[torch.nn.Module]) -> None:
        self.name, self.root = name, roots[0] if roots else None
        self.overwritten: list[torch.Tensor] = []  # written by the forward, not as state
        self.entries: list[_Entry] = []
        self.seen: set[int] = set()
        self.params: list | None = None  # a single tree's, cached with it
        if len(roots) == 1:
            self.entries = [_Entry(snap) for snap in _tree(roots[0])]
            self.seen = {id(entry.module) for entry in self.entries}
            self.params = _cached(roots[0]).params
            return
        for root in roots:
            self.add(root)

    def add(self, module: torch.nn.Module) -> None:
        """Keep ``module``'s tree as it is now (its modules not kept yet)."""
        if id(module) in self.seen:
            return
        self.params = None
        for snap in _tree(module):
            if id(snap.module) not in self.seen:
                self.seen.add(id(snap.module))
                self.entries.append(_Entry(snap))

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

    def parameters(self) -> list[torch.nn.Parameter]:
        """The parameters of the region's modules, each once, in module order."""
        if self.params is not None:
            return list(self.params)
        seen: dict[int, torch.nn.Parameter] = {}
        for entry in self.entries:
            for p in entry.snapshot.params:
                seen.setdefault(id(p), p)
        return list(seen.values())

    def fingerprint(self) -> tuple:
        """Identities of the modules, their attributes, parameters and buffers; hook counts.

        NOTE [Observed once, confirmed every call] in ``facts.py``.
        """
        return tuple(entry.snapshot.key for entry in self.entries)

    def settle(self, state: list) -> None:
        """The forward returned: what it left in place is what a re-run must find.

        A buffer it overwrote without reading first (spectral norm's ``_u``, filled by an
        ``out=``) is not state to replay (NOTE [Observed writes]): the re-run writes it
        again before it reads it. But a later forward may have written it since, so its
        value is kept around each re-run (:meth:`restored`).
        """
        replayed = {id(t) for t, _ in state}
        self.overwritten = [t for _, t in self._changed() if id(t) not in replayed]
        self._refresh()

    def _changed(self) -> list[tuple[_Entry, torch.Tensor]]:
        return [(entry, t) for entry in self.entries for _, t, version in entry.versions
                if t._version != version]

    def _refresh(self) -> None:
        for entry in self.entries:
            if entry.versions:
                entry.versions = [(name, t, t._version) for name, t, _ in entry.versions]

    def written(self) -> list[tuple[torch.nn.Module, str, torch.Tensor]]:
        """The buffers and tensor attributes changed in place since the forward began."""
        return [(entry.module, name, t) for entry in self.entries for name, t, version in entry.versions
                if t._version != version]

    def check_versions(self, replayed: list) -> None:
        """Refuse a re-run whose module tensors changed in place since the forward read them."""
        restored = {id(t) for t, _ in replayed} | {id(t) for t in self.overwritten}
        for entry in self.entries:
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

    @contextlib.contextmanager
    def restored(self, replayed: list) -> Iterator[None]:
        """Run a re-run against the attributes the forward found; put back what is there now."""
        self.check_versions(replayed)
        undo = []
        for entry in self.entries:
            for where, key, now in entry.rebound():
                undo.append((where, key, now))
                put(where, key, entry.value_then(where, key))
        kept = []
        if self.overwritten:
            with engine_copies():
                kept = [(t, t.detach().clone()) for t in self.overwritten if t.untyped_storage().nbytes()]
        try:
            yield
        finally:
            for entry in self.entries:  # what the re-run rebound itself
                for where, key, _ in entry.rebound():
                    if not any(w is where and k == key for w, k, _ in undo):
                        undo.append((where, key, entry.value_then(where, key)))
            for where, key, now in reversed(undo):
                put(where, key, now)
            if kept:
                with engine_copies():
                    for t, value in kept:
                        t.data.copy_(value)  # no version bump, as replayed state (NOTE [Observed writes])
            self._refresh()
