"""What a region's root module knows of its module tree between calls (engine).

NOTE [Snapshots reused while nothing changed]
Walking a module tree and learning each module's tensors at every call is Python
work per module per step. So a region's root module keeps what its last region call
learned of its tree (`_Known`, in ``__dict__['_remat_snapshot']``, which a deep copy
or a pickle of the module leaves empty): weak references to the modules in order and
to their tensors, the names of each module's tensor attributes, and, over every
module's ``__dict__``, ``_parameters``, ``_buffers``, ``_modules`` and hook
dictionaries at once, their keys, the identities of their values and their sizes. A
call reuses them while those three tuples, built and compared in C over the whole
tree, are equal and every tensor seen is still alive (so no id was reused), and
walks the tree anew otherwise. The cache holds no object: what a region's re-run
needs (the shallow copies, the versions) is taken at every call and held by its
frame only, so a value the module let go of is freed as without remat. A tree's key
is a serial number never reused, so the facts' keys (NOTE [Observed once, confirmed
every call] in ``facts.py``) hold no object either.

NOTE [Trees seen before]
A tree can go back to a state it had: a planner or a user marks a block, unmarks it and
marks it again with the same options (the mark is then the same objects: NOTE [A mark set
again is the same mark] in ``marks.py``), or toggles a child's mark between two phases.
A new serial would make every fact learned in that state unknown again, and the next call
of every region in it would be watched: a planner timing its options in interleaved rounds
timed that observation in every round, which the user's loop, whose marks stay, never pays
(it predicted +31% for a plan that measured +27% in the loop). So a cache also keeps, for
the last `_EARLIER` trees it replaced, the tuple `_identities` compares, mapped to their
`_Known`: a tree walked anew whose tuple is one of them, every tensor of that `_Known` still
alive, holds exactly the objects it held then, and gets that `_Known` and its serial back.
This is the check `_Known.current` makes, over a longer time: a value that cannot be held
by a weak reference (an int) compares by identity, as it does from one call to the next.
The lookup costs a hash of the tuple, only when the tree was walked anew.
"""

from __future__ import annotations

import itertools
import operator
import weakref
from collections.abc import Callable

import torch


class _Known:
    """What the cache keeps of a module tree: the keys and identities of every module's
    ``__dict__`` and registries (hook dictionaries included) and their sizes, weak
    references to the modules and their tensors, the names of each module's tensor
    attributes; no object (NOTE [Snapshots reused while nothing changed])."""

    __slots__ = ("getters", "hooks", "ids", "key", "keys", "modules", "parameters", "refs", "sizes",
                 "tensor_names")
    _serial = 0

    def __init__(self, modules: list[torch.nn.Module], dicts: list[dict]) -> None:
        self.modules = [weakref.ref(m) for m in modules]
        #: per module, its ``__dict__``'s values under the keys compared by identity
        n = len(modules)
        self.getters = [_getter(tuple(k for k in d if k not in _REGISTRIES)) for d in dicts[:n]]
        self.sizes, self.keys, self.hooks, self.ids = _identities(dicts, self.getters)
        self.tensor_names = [[k for k, v in m.__dict__.items() if type(v) is torch.Tensor] for m in modules]
        tensors = [t for d in dicts[n:2 * n] for t in d.values()]  # parameters
        self.parameters = [weakref.ref(p) for p in {id(p): p for p in tensors if p is not None}.values()]
        tensors += [t for d in dicts[2 * n:3 * n] for t in d.values()]  # buffers
        tensors += [m.__dict__[k] for m, names in zip(modules, self.tensor_names) for k in names]
        self.refs = [weakref.ref(t) for t in tensors if t is not None]
        _Known._serial += 1
        self.key = _Known._serial  # never reused, unlike an id

    def current(self) -> tuple[list, list] | None:
        """``(modules, their dictionaries)`` while they hold exactly the objects seen: the
        same keys, identities and sizes (compared in C), every tensor still the one seen
        (alive: its id not reused); None otherwise."""
        modules = list(map(_DEREF, self.modules))
        if any(map(operator.is_, modules, _NONE)):
            return None
        dicts = _dicts(modules)
        try:
            found = _identities(dicts, self.getters)
        except KeyError:  # an attribute was removed
            return None
        if found != (self.sizes, self.keys, self.hooks, self.ids) or any(map(operator.is_, map(_DEREF, self.refs), _NONE)):
            return None
        return modules, dicts


_DEREF = weakref.ref.__call__  # dereference in C
_NONE = itertools.repeat(None)  # compared by identity (``in`` would call a tensor's __eq__)
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_STRIDE = 4 + len(_HOOKS)  # dictionaries per module in `_dicts`
_DICT = operator.attrgetter("__dict__")
_EMPTY: dict = {}
_REGISTRY_VALUES = operator.itemgetter("_parameters", "_buffers", "_modules", *_HOOKS)


def _dicts(modules: list[torch.nn.Module]) -> list[dict]:
    """The modules' dictionaries, kind by kind: every module's ``__dict__``, then every
    module's parameters, buffers, children and each of its hook dictionaries (``_STRIDE``
    kinds of ``len(modules)``; read in C, a module without a hook dictionary gets an empty
    one)."""
    attrs = list(map(_DICT, modules))
    try:
        registries = list(map(_REGISTRY_VALUES, attrs))
    except KeyError:
        registries = [(d["_parameters"], d["_buffers"], d["_modules"], *(d.get(k, _EMPTY) for k in _HOOKS))
                      for d in attrs]
    return [*attrs, *itertools.chain.from_iterable(zip(*registries))] if attrs else []


#: what ``nn.Module.__init__`` binds to the dictionaries and sets it fills in place: never
#: rebound by a model; their contents that a forward reads are compared themselves
_REGISTRIES = frozenset((
    "_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", *_HOOKS,
    "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs",
    "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks", "_remat_snapshot"))


def _identities(dicts: list[dict], getters: list[Callable[[dict], tuple]]) -> tuple:
    """What `_Known` compares: the sizes of every module's dictionaries; the keys of its
    ``__dict__``, parameters, buffers and children, and of its hook dictionaries that are not
    empty (a hook registered or removed adds or changes a key; a hook's key is never reused);
    the identities of its parameters, buffers and children and of its attributes
    (``getters``: per module, its ``__dict__``'s values under the keys seen but the
    registries themselves, whose contents are compared instead; a key gone raises
    ``KeyError``). Equal only while they hold the very same objects.

    Each identity is a new int: comparing the registries' own identities cost more than the
    rest, and the hook dictionaries (``OrderedDict``, nearly always empty) are walked only
    when they hold a hook (`filter`, in C)."""
    n = len(getters)
    modules, registries = dicts[:n], dicts[n:4 * n]
    hooked = list(filter(None, dicts[4 * n:]))
    values = itertools.chain(itertools.chain.from_iterable(map(dict.values, registries)),
                             itertools.chain.from_iterable(map(operator.call, getters, modules)))
    return (tuple(map(len, dicts)), tuple(itertools.chain.from_iterable(modules + registries)),
            tuple(itertools.chain.from_iterable(hooked)), tuple(map(id, values)))


def _getter(keys: tuple) -> Callable[[dict], tuple]:
    """``d -> tuple(d[k] for k in keys)``, in C where ``operator.itemgetter`` returns a tuple."""
    if len(keys) >= 2:
        return operator.itemgetter(*keys)
    return lambda d: tuple(d[k] for k in keys)


class _Cached:
    """What a module's last region call learned of its tree, kept in its ``__dict__``
    (NOTE [Snapshots reused while nothing changed]); a copy or a pickle of the module
    starts without it."""

    __slots__ = ("earlier", "facts", "tree")

    def __init__(self) -> None:
        self.tree: _Known | None = None
        self.earlier: dict[tuple, _Known] = {}  # NOTE [Trees seen before]
        self.facts: dict | None = None  # NOTE [Observed once, confirmed every call] (facts.py)

    def __deepcopy__(self, memo: dict) -> _Cached:
        return _Cached()

    def __copy__(self) -> _Cached:
        return _Cached()

    def __reduce__(self) -> tuple:
        return (type(None), ())


def cached(root: torch.nn.Module) -> _Cached:
    """What ``root``'s region calls keep in its ``__dict__`` (made on first use)."""
    found = root.__dict__.get("_remat_snapshot")
    if type(found) is not _Cached:
        found = root.__dict__["_remat_snapshot"] = _Cached()
    return found


def _tree(root: torch.nn.Module) -> tuple[list, list, _Known]:
    """``root.modules()``, their dictionaries (`_dicts`) and what is known of them: the
    last call's while every module in it is alive and current, else walked again."""
    kept = cached(root)
    known = kept.tree
    if known is not None and (found := known.current()) is not None:
        return found[0], found[1], known
    modules, seen, stack = [], set(), [root]
    while stack:  # pre-order, as module.modules()
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        modules.append(m)
        stack.extend(c for c in reversed(m.__dict__["_modules"].values()) if c is not None)
    dicts = _dicts(modules)
    new = _Known(modules, dicts)
    kept.tree = _seen_before(kept, new)
    return modules, dicts, kept.tree


_EARLIER = 8  # trees a cache remembers besides its current one (NOTE [Trees seen before])


def _seen_before(kept: _Cached, new: _Known) -> _Known:
    """The `_Known` of an earlier state ``new`` is the same as, or ``new``; the one replaced
    is remembered (NOTE [Trees seen before])."""
    earlier = kept.earlier
    if kept.tree is not None:
        old = kept.tree
        earlier[(old.sizes, old.keys, old.hooks, old.ids)] = old
        if len(earlier) > _EARLIER:
            earlier.pop(next(iter(earlier)))
    found = earlier.pop((new.sizes, new.keys, new.hooks, new.ids), None)
    if found is not None and not any(map(operator.is_, map(_DEREF, found.refs), _NONE)) \
            and not any(map(operator.is_, map(_DEREF, found.modules), _NONE)):
        return found
    return new
