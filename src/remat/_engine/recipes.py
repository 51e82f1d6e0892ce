"""Saved tensors rebuilt one at a time from the operators that made them (engine).

NOTE [Each saved tensor rebuilt on its own]
A ``use_reentrant=False`` region re-runs its code at the first unpack and rebuilds every
saved tensor backward will read; its backward then holds them all at once with its
gradients (NOTE [Re-runs in stages] in ``stages.py`` splits that into parts, each a pass
through the region's Python). torch.compile's partitioner instead places each recomputed
operator just before the backward operator that reads it: its backward holds one rebuilt
tensor at a time, and runs no Python of the model again.

A selective region marked with ``stages="each"`` does that in eager mode. Its forward's
policy mode notes each operator call: the operator, its arguments with every tensor
replaced by where it came from (an earlier call's output, at the version it had when made,
or a tensor from outside the region, held with its version), and the storages its outputs
use. An unpack of a saved tensor made by call ``c`` then runs again only the calls ``c``
depends on, in forward order, under ``no_grad``: a call whose output the policy kept is
handed back (unchanged since forward, as the re-run checks), an argument from outside is
read as the object forward read. The value is freed when backward is done with it, and
what several saved tensors share is run once per backward (NOTE [Replays share what they
both read]): a matrix product the policy did not keep runs once, as in the ordinary re-run.
More than `MAX_CALLS` calls for one tensor is the ordinary re-run's job.

What the dispatcher shows is all the replay knows, so a call is never replayed, and a saved
tensor that depends on it is rebuilt by the ordinary re-run instead, when:
- it is not a plain ``aten`` operator returning tensors, it writes memory (in place or
  ``out=``), or it drew random numbers in forward (NOTE [Random operators that drew
  nothing]);
- its output was detached in forward (``.data``, ``detach()``, ``numpy()``: its memory may
  be written where the dispatcher does not see), or an in-place operator wrote memory one
  of its outputs uses;
- it read an earlier output at another version than that output had when made, or one of
  a call it cannot plan (a kept output that is no longer handed back, whose own inputs the
  replay did not plan for);
- an outside tensor it reads has changed version since, or a kept output it reads changed
  in place or drew random numbers (NOTE [Kept random operators] in ``selective.py``);
- the forward recorded no usable flow (a tensor subclass, a backward inside the forward),
  had not returned, or made its tensors under another region's re-run.
The rebuilt tensor's shape, dtype and device are compared with the forward's (unless the
mark turned ``determinism_check`` off); a difference falls back to the re-run, which checks and refuses as always. The ordinary
re-run, whenever one runs, rebuilds what is still to come and hands that out first.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from remat._engine import dead as _dead
from remat._engine.modes import _written_args
from remat._engine.rng import drew, generator_states

_graph_task = torch._C._current_graph_task_id
from remat._engine.state import recomputing

#: the most calls one saved tensor's replay runs; a longer chain is the re-run's job
MAX_CALLS = 1024


class _Out:
    """An argument that is output ``pos`` of call ``call``."""

    __slots__ = ("call", "pos")

    def __init__(self, call: int, pos: int) -> None:
        self.call, self.pos = call, pos


class _Outside:
    """An argument from outside the region: the tensor forward read, at its version then."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.version = tensor, tensor._version


#: id of an operator -> (never replayed, writes what it reads, a view): learned once per operator
_STATIC: dict = {}


def _static(func: Any) -> tuple[bool, bool, bool, bool]:
    """(never replayed, writes what it reads, a view, random: replayed only where it drew nothing)."""
    found = _STATIC.get(id(func))  # an operator lives as long as torch: its id is its key
    if found is None:
        kind = _dead._kind(func)
        schema = func._schema
        writes = bool(_written_args(func)) or (kind == _dead._RUNS and schema.is_mutable)
        # NOTE [Random operators that drew nothing]: an aten operator returning tensors, seeded
        random = (kind == _dead._RUNS and not writes and func.namespace == "aten"
                  and torch.Tag.nondeterministic_seeded in func.tags and bool(schema.returns)
                  and all(type(r.type) is torch.TensorType for r in schema.returns))
        found = _STATIC[id(func)] = ((kind == _dead._RUNS and not random) or writes, writes,
                                     kind == _dead._VIEW, random)
    return found


class Recipes:
    """Per call of a selective forward: how to run it again (NOTE [Each saved tensor rebuilt
    on its own])."""

    __slots__ = ("bad", "base", "calls", "count", "made", "orders", "states", "storages", "task", "usable",
                 "views")

    def __init__(self) -> None:
        self.calls: dict[int, tuple] = {}  # call -> (func, args template, kwargs template, deps)
        self.bad: set[int] = set()  # calls never replayed
        #: id of an output -> (call, position, weak reference, version when made)
        self.made: dict[int, tuple] = {}
        self.storages: dict[int, list[int]] = {}  # storage -> the calls whose outputs use it
        #: NOTE [Views are found by their memory]: layout of a view call's output -> (call,
        #: position, weak reference to the tensor it views, version when made)
        self.views: dict[tuple, tuple] = {}
        self.orders: dict[int, list[int] | None] = {}  # call -> what its replay runs (`plan`)
        self.count = 0  # calls numbered so far
        self.base: torch.Tensor | None = None  # what the running view call views
        self.states: list | None = None  # the generators' states before the running random call
        self.task = _graph_task()
        self.usable = True

    def _find(self, t: torch.Tensor) -> tuple | None:
        """``(call, position, version when made)`` of the output ``t`` is, or None."""
        found = self.made.get(id(t))
        if found is not None and found[2]() is t:
            return found[0], found[1], found[3]
        if self.views and t._is_view():  # NOTE [Views are found by their memory]
            found = self.views.get(_view_key(t))
            if found is not None and found[2]() is not None:
                return found[0], found[1], found[3]
        return None

    def escaped(self, t: torch.Tensor) -> None:
        """Forward detached ``t``: the call that made it is never replayed."""
        found = self._find(t)
        if found is not None:
            self.bad.add(found[0])

    def before(self, func: Any, args: tuple, kwargs: dict) -> int:
        """Note a forward call about to run; return its number (-1 for a ``detach``, or once the
        recipes are unusable). A call that writes what it reads (in place, ``out=``, or as
        ``native_batch_norm`` writes the running statistics its schema does not say it writes)
        is never replayed, nor any call whose outputs use memory it wrote."""
        if _graph_task() != self.task:  # a backward inside the forward
            self.usable = False
            return -1
        if func is _dead.DETACH:
            self.escaped(args[0])
            return -1
        call = self.count
        self.count = call + 1
        bad, writes, is_view, random = _static(func)
        deps: list = []
        template = tuple([self._arg(a, deps) for a in args])
        kw = {k: self._arg(v, deps) for k, v in kwargs.items()} if kwargs else {}
        if not self.usable:  # NOTE [Tensors whose reads the mode does not see] in ``dead.py``
            return -1
        if writes:
            for t in _dead.tensors_of(args, kwargs):  # which of them it wrote: all, to be sure
                for c in self.storages.get(_storage(t), ()):
                    self.bad.add(c)
        if bad or None in deps:
            self.bad.add(call)
        else:
            self.calls[call] = (func, template, kw, deps)
        if random:  # NOTE [Random operators that drew nothing]
            own = any(isinstance(a, torch.Generator) for a in (*args, *kwargs.values()))
            self.states = None if own else generator_states((args, kwargs))
            if own:
                self.bad.add(call)
        # NOTE [Views are found by their memory]
        self.base = next((a for a in args if isinstance(a, torch.Tensor)), None) if is_view else None
        return call

    def after(self, call: int, out: Any) -> None:
        """Call ``call`` returned ``out``."""
        if self.states is not None:  # NOTE [Random operators that drew nothing]
            if drew(self.states, generator_states(out)):
                self.bad.add(call)
            self.states = None
        single = isinstance(out, torch.Tensor)
        outputs = (out,) if single else out if type(out) is tuple or type(out) is list else ()
        base, made, storages = self.base, self.made, self.storages
        self.base = None  # held only while its call runs
        for pos, t in enumerate(outputs):
            if single or isinstance(t, torch.Tensor):
                # the caller's view shares the version counter of what it views
                version = base._version if base is not None else t._version
                made[id(t)] = (call, pos, weakref.ref(t), version)
                key = _storage(t)
                found = storages.get(key)
                if found is None:
                    storages[key] = [call]
                else:
                    found.append(call)
                if base is not None:
                    self.views[_view_key(t)] = (call, pos, weakref.ref(base), version)

    def _arg(self, a: Any, deps: list) -> Any:
        if type(a) is torch.Tensor or isinstance(a, torch.Tensor):
            return self._ref(a, deps)
        if (type(a) is list or type(a) is tuple) and any(isinstance(b, torch.Tensor) for b in a):
            return type(a)(self._ref(b, deps) if isinstance(b, torch.Tensor) else b for b in a)
        return a

    def _ref(self, t: torch.Tensor, deps: list) -> Any:
        if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter and not _fake(t):
            self.usable = False  # a subclass runs operators the mode does not see
            return None
        found = self._find(t)
        if found is not None:
            call, pos, version = found
            deps.append(call if t._version == version else None)  # read at another version: bad
            return _Out(call, pos)
        return _Outside(t)

    def producer(self, x: torch.Tensor) -> tuple[int, int] | None:
        """``(call, position)`` of the output ``x`` is, at the version it was made at."""
        found = self._find(x)
        if found is None or x._version != found[2]:
            return None
        return found[0], found[1]

    def plan(self, target: int, handed: Any) -> list[int] | None:
        """The calls to run again, in forward order, to rebuild call ``target``'s outputs;
        ``handed(call)`` tells a kept output handed back. None when it cannot be replayed."""
        need: set[int] = set()
        stack = [target]
        while stack:
            c = stack.pop()
            if c in need:
                continue
            need.add(c)
            if handed(c):
                continue
            entry = self.calls.get(c)
            if entry is None or c in self.bad or len(need) > MAX_CALLS:
                return None
            stack.extend(entry[3])
        return sorted(need)

    def run(self, order: list[int], target: int, pos: int, kept: Any, shared: _Shared) -> torch.Tensor | None:
        """Run ``order`` again (``kept(call)``: a kept output handed back, None when it no
        longer is) and return output ``pos`` of ``target``; None when a kept output or an
        outside tensor changed since forward. What a later replay of this backward reads
        too stays in ``shared`` until then (NOTE [Replays share what they both read])."""
        values, memo, uses = {}, shared.memo, shared.uses
        try:
            with torch.no_grad(), recomputing(), _no_autocast():
                for c in order:
                    if c in memo:
                        values[c] = memo[c]
                        continue
                    entry = self.calls.get(c)
                    if (handed := kept(c)) is not None:
                        values[c] = handed
                        continue
                    if entry is None or c in self.bad or any(d not in values for d in entry[3]):
                        return None  # a kept output no longer handed back, its inputs not planned
                    func, template, kw, _ = entry
                    values[c] = func(*[_value(a, values) for a in template],
                                     **{k: _value(v, values) for k, v in kw.items()})
        except _Changed:
            return None
        for c in order:  # this replay is done with them
            left = uses.get(c, 0) - 1
            if left > 0:
                uses[c] = left
                if c not in memo:
                    memo[c] = values[c]
            else:
                uses.pop(c, None)
                memo.pop(c, None)
        out = values[target]
        return out if isinstance(out, torch.Tensor) else out[pos]


class _Shared:
    """NOTE [Replays share what they both read]
    Saved tensors often share the calls that make them: a normalized input saved by the
    query, key and value products, a SwiGLU's activation saved by its product and read by
    that product's output. Each replayed alone, the shared calls would run once per saved
    tensor. So the first replay of a backward counts, over the saved tensors still to be
    unpacked, how many replays read each call; a value a later replay reads is kept until
    that replay has run (torch.compile's partitioner likewise rebuilds a value once and
    frees it after its last use in backward), and whatever is left when the backward ends
    is let go then."""

    __slots__ = ("memo", "uses")

    def __init__(self, uses: dict[int, int]) -> None:
        self.memo: dict[int, Any] = {}
        self.uses = uses


def _value(a: Any, values: dict) -> Any:
    """The value of a recorded argument in a replay (no closure: a recursive one is a cycle
    that would hold every value until the collector runs)."""
    if type(a) is _Out:
        out = values[a.call]
        return out if isinstance(out, torch.Tensor) else out[a.pos]
    if type(a) is _Outside:
        if a.tensor._version != a.version:
            raise _Changed
        return a.tensor
    if type(a) is list or type(a) is tuple:
        return type(a)(_value(b, values) for b in a)
    return a


class _Changed(Exception):
    pass


def _view_key(t: torch.Tensor) -> tuple:
    """NOTE [Views are found by their memory]
    A view operator's output, as the policy mode sees it, is not the tensor the caller gets:
    autograd wraps it in a view of its own above the mode, so its identity is unknown to the
    forward's notes (a ``Linear``'s transposed weight, saved by its matrix product). It is
    found instead by its storage, offset, shape, strides and dtype, while the tensor it views
    is alive (the storage cannot be another's then): two views with the same layout of the
    same memory hold the same values, whichever call made them."""
    return (_storage(t), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


#: NOTE [Random operators that drew nothing]
#: An operator tagged ``nondeterministic_seeded`` may draw from a generator: run again, it would
#: draw other numbers. But attention is tagged so for its ``dropout_p`` and draws nothing at
#: 0, and refusing it sent every saved tensor that depends on an attention to the block's
#: re-run (the issue-27 Llama: a block not keeping its attention's output re-ran all its code,
#: where replaying the attention alone costs what its forward did). So a seeded call is
#: replayed when the default generators' states (the CPU's, and each CUDA device's among its
#: tensors: ``rng.generator_states``) are the same after it as before, as a kept random call's
#: draw is judged (NOTE [Kept random operators] in ``selective.py``), and never when it is
#: given a generator of its own.


def _fake(t: torch.Tensor) -> bool:
    """A fake tensor (the planner's estimates): it runs every operator itself, where the mode
    sees it, so replaying on fake tensors allocates what replaying on real ones does."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _storage(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):  # sparse, nested: no storage of their own
        return None


class _no_autocast:
    """Autocast off for every device while a replay runs: the recorded operators already
    carry the dtypes forward's autocast chose."""

    def __enter__(self) -> None:
        self.saved = [(d, torch.is_autocast_enabled(d)) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]
        for d, _ in self.saved:
            torch.set_autocast_enabled(d, False)

    def __exit__(self, *exc: object) -> None:
        for d, on in self.saved:
            torch.set_autocast_enabled(d, on)


def each(spec: Any, contexts: tuple | None) -> bool:
    """Whether a region rebuilds each saved tensor on its own (NOTE [Each saved tensor rebuilt
    on its own]): asked for with ``stages="each"``, selective; its forward then notes recipes."""
    from remat._engine.selective import ReplayMode

    if spec.stages != "each" or spec.output_recompute or contexts is None or type(contexts[1]) is not ReplayMode:
        return False
    contexts[0].each = True
    return True


def saved(frame: Any, x: torch.Tensor, holder: Any) -> tuple[int, int] | None:
    """The call and output position that made ``x``, which the region saves (in forward);
    a tensor no call of the region made (a parameter) is read back while it lives unchanged."""
    flow = frame.contexts[0].store.flow
    if flow is None or flow.recipes is None or not flow.recipes.usable:
        return None
    if flow.recipes._find(x) is None and holder.argument is None:  # as NOTE [Saved arguments are read back]
        holder.argument, holder.argument_version = weakref.ref(x), x._version
        return None
    return flow.recipes.producer(x)


def rebuild(frame: Any, holder: Any) -> torch.Tensor | None:
    """``holder``'s tensor, rebuilt from the calls that made it; None when the region's
    ordinary re-run must rebuild it (NOTE [Each saved tensor rebuilt on its own])."""
    store = frame.contexts[0].store
    flow = store.flow
    if frame.expired or not frame.closed or flow is None or not flow.recipes.usable or not store.finished:
        return None
    recipes, keys = flow.recipes, flow.keys

    def kept(c: int) -> Any:
        key = keys.get(c)
        if key is None or not store.hands_back(*key):
            return None
        entry = store.kept[key[0]][key[1]]
        if type(entry) is tuple and len(entry) == 2 and isinstance(entry[0], torch.Tensor):
            return entry[0].detach()
        return type(entry)(p[0].detach() for p in entry)  # a tuple or list of (tensor, version) pairs

    def handed(c: int) -> bool:
        return c in keys and store.hands_back(*keys[c])

    call, pos = holder.recipe
    order = recipes.orders.get(call, False)
    if order is False:
        order = recipes.orders[call] = recipes.plan(call, handed)
    if order is None:
        return None
    x = recipes.run(order, call, pos, kept, _shared(frame, recipes, handed))
    if x is not None and frame.metas and frame.metas[holder.index] != (tuple(x.shape), x.dtype, x.device):
        return None
    return x


def _shared(frame: Any, recipes: Recipes, handed: Any) -> _Shared:
    """This backward's `_Shared` for ``frame`` (NOTE [Replays share what they both read])."""
    gid = torch._C._current_graph_task_id()
    found = frame.replays.get(gid)
    if found is not None:
        return found
    uses: dict[int, int] = {}
    for ref in frame.holders:
        h = ref()
        if h is None or h.recipe is None or h.kept is not None:
            continue
        order = recipes.orders.get(h.recipe[0], False)
        if order is False:
            order = recipes.orders[h.recipe[0]] = recipes.plan(h.recipe[0], handed)
        for c in order or ():
            uses[c] = uses.get(c, 0) + 1
    found = frame.replays[gid] = _Shared(uses)
    if gid != -1:
        ref = weakref.ref(frame)
        torch.autograd.Variable._execution_engine.queue_callback(
            lambda: (f := ref()) is not None and f.replays.pop(gid, None))
    return found
