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

NOTE [Snapshots reused while nothing changed]
Walking a module tree and learning each module's tensors and key at every call is
Python work per module per step. So each module keeps what its last region call learned
(`_Known`, in ``__dict__['_remat_snapshot']``, which a deep copy or a pickle of
the module leaves empty): the keys and identities of its ``__dict__``, ``_parameters``,
``_buffers`` and ``_modules`` and its hook counts, weak references to its tensors and
children, the names of its tensor attributes; a root keeps its tree's list. A call
reuses them while the dictionaries hold the same keys and the very same objects
(compared as tuples of ids, in C) and every tensor seen is still alive (so no id was
reused), and learns them anew otherwise. The cache holds no object: what a region's
re-run needs (the shallow copies, the versions) is taken at every call and held by its
frame only, so a value the module let go of is freed as without remat. A key is a
serial number never reused, so the facts' keys (NOTE [Observed once, confirmed every
call] in ``facts.py``) hold no object either.

Parameters are left to autograd and the parallel wrappers that swap them (FSDP
re-registers its gathered parameters around each forward and backward): the
``_parameters``, ``_buffers`` and ``_modules`` dictionaries are compared by
content, and only a parameter or buffer replaced by another object is put back.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import operator
import threading
import weakref
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


class _Known:
    """What the cache keeps of one module's dictionaries: their keys and identities, weak
    references to their tensors and child modules, the names of its tensor attributes; no
    object (NOTE [Snapshots reused while nothing changed])."""

    __slots__ = ("children", "ids", "key", "refs", "tensor_names")
    _serial = 0

    def __init__(self, d: dict) -> None:
        self.ids = _identities(d)
        self.tensor_names = [k for k, v in d.items() if type(v) is torch.Tensor]
        tensors = (*d["_parameters"].values(), *d["_buffers"].values(), *(d[k] for k in self.tensor_names))
        self.refs = [weakref.ref(t) for t in tensors if t is not None]
        self.children = [weakref.ref(c) for c in d["_modules"].values() if c is not None]
        _Known._serial += 1
        self.key = _Known._serial  # never reused, unlike an id

    def current(self, d: dict) -> bool:
        """Whether the dictionaries still hold exactly these objects: the same identities
        (in C), and every tensor still the one seen (alive: its id not reused)."""
        return _identities(d) == self.ids and not any(map(operator.is_, map(_DEREF, self.refs), _NONE))


_DEREF = weakref.ref.__call__  # dereference in C
_NONE = itertools.repeat(None)  # compared by identity (``in`` would call a tensor's __eq__)


def _identities(d: dict) -> tuple:
    """The keys and the identities of the values of a module's ``__dict__`` and its
    registries, and its hook counts: equal only while they hold the very same objects."""
    p, b, m = d["_parameters"], d["_buffers"], d["_modules"]
    return (*d, *map(id, d.values()), len(p), *p, *map(id, p.values()), len(b), *b,
            *map(id, b.values()), len(m), *m, *map(id, m.values()),
            len(d.get("_forward_hooks", ())), len(d.get("_forward_pre_hooks", ())),
            len(d.get("_backward_hooks", ())), len(d.get("_backward_pre_hooks", ())))


class _Cached:
    """What a module's last region call learned of it and of its tree, kept in its
    ``__dict__`` (NOTE [Snapshots reused while nothing changed]); a copy or a pickle of
    the module starts without it."""

    __slots__ = ("known", "tree")

    def __init__(self) -> None:
        self.known: _Known | None = None
        self.tree: list[tuple[weakref.ref, _Known]] | None = None  # root.modules(), in order

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


def _known(module: torch.nn.Module) -> _Known:
    """What is known of the module: the cached facts while current, else learned anew."""
    cached = _cached(module)
    found = cached.known
    if found is None or not found.current(module.__dict__):
        found = cached.known = _Known(module.__dict__)
    return found


def _tree(root: torch.nn.Module) -> list[tuple[torch.nn.Module, _Known]]:
    """``root.modules()`` with what is known of each: the last call's list while every
    module in it is alive and current, else walked again through the children."""
    cached = _cached(root)
    if cached.tree is not None:  # `_Known.current` inlined: this runs for every module of every call
        tree = []
        for ref, known in cached.tree:
            m = ref()
            if (m is None or _identities(m.__dict__) != known.ids
                    or any(map(operator.is_, map(_DEREF, known.refs), _NONE))):
                break
            tree.append((m, known))
        else:
            return tree
    tree, seen, stack = [], set(), [root]
    while stack:  # pre-order, as module.modules()
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        known = _known(m)
        tree.append((m, known))
        stack.extend(c for ref in reversed(known.children) if (c := ref()) is not None)
    cached.tree = [(weakref.ref(m), known) for m, known in tree]
    return tree


class _Entry:
    """One module's attributes as the forward found them (shallow copies, held by the
    region's frame only) and the versions of its buffers and tensor attributes then."""

    __slots__ = ("attrs", "key", "module", "registries", "versions")

    def __init__(self, module: torch.nn.Module, known: _Known) -> None:
        d = module.__dict__
        self.module, self.attrs, self.key = module, d.copy(), known.key
        self.registries = (d["_parameters"].copy(), d["_buffers"].copy())
        self.versions = [(k, t, t._version) for k, t in self.registries[1].items() if t is not None]
        self.versions += [(k, t, t._version) for k in known.tensor_names if type(t := d[k]) is torch.Tensor]

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
        roots: the region's modules (`modules_of`); their whole trees are kept.
    """

    __slots__ = ("entries", "name", "overwritten", "root", "seen")

    def __init__(self, name: str, roots: list[torch.nn.Module]) -> None:
        self.name, self.root = name, roots[0] if roots else None
        self.overwritten: list[torch.Tensor] = []  # written by the forward, not as state
        self.entries: list[_Entry] = []
        self.seen: set[int] = set()
        if len(roots) == 1:
            self.entries = [_Entry(m, known) for m, known in _tree(roots[0])]
            self.seen = {id(entry.module) for entry in self.entries}
            return
        for root in roots:
            self.add(root)

    def add(self, module: torch.nn.Module) -> None:
        """Keep ``module``'s tree as it is now (its modules not kept yet)."""
        if id(module) in self.seen:
            return
        for m, known in _tree(module):
            if id(m) not in self.seen:
                self.seen.add(id(m))
                self.entries.append(_Entry(m, known))

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
        return tuple(entry.key for entry in self.entries)

    def settle(self, state: list) -> None:
        """The forward returned: what it left in place is what a re-run must find.

        A buffer it overwrote without reading first (spectral norm's ``_u``, filled by an
        ``out=``) is not state to replay (NOTE [Observed writes]): the re-run writes it
        again before it reads it. But a later forward may have written it since, so its
        value is kept around each re-run (`restored`).
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

    def restored(self, replayed: list) -> _Restored:
        """Run a re-run against the attributes the forward found; put back what is there now."""
        self.check_versions(replayed)
        return _Restored(self)


class _Restored:
    """`ModuleState.restored`: a class, not a generator (every re-run enters one); where
    nothing was rebound and nothing overwritten, it checks and puts back nothing more."""

    __slots__ = ("kept", "state", "undo")

    def __init__(self, state: ModuleState) -> None:
        self.state, self.undo, self.kept = state, [], []

    def __enter__(self) -> None:
        state = self.state
        for entry in state.entries:
            for where, key, now in entry.rebound():
                self.undo.append((where, key, now))
                put(where, key, entry.value_then(where, key))
        if state.overwritten:
            with engine_copies():
                self.kept = [(t, t.detach().clone()) for t in state.overwritten if t.untyped_storage().nbytes()]

    def __exit__(self, *exc_info: object) -> None:
        state, undo = self.state, self.undo
        for entry in state.entries:  # what the re-run rebound itself
            for where, key, _ in entry.rebound():
                if not any(w is where and k == key for w, k, _ in undo):
                    undo.append((where, key, entry.value_then(where, key)))
        for where, key, now in reversed(undo):
            put(where, key, now)
        if self.kept:
            with engine_copies():
                for t, value in self.kept:
                    t.data.copy_(value)  # no version bump, as replayed state (NOTE [Observed writes])
        state._refresh()
