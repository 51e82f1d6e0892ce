"""What a module region's observed forward taught, reused while nothing it rests on changed (engine).

NOTE [Observed once, confirmed every call]
Watching a forward (`Observe`, a dispatch mode) costs
Python work on every operator, which on a launch-bound step of small tensors is
most of the step. What it learns about a module region is a few facts: the
region writes no tensor it neither made nor took (no state to replay), and, under
``use_reentrant=True``, every tensor it reads besides its arguments is a parameter
of its own modules. Those facts hold for the next call as long as the region runs
the same code on the same kind of inputs, so they are stored per module under a
key made of everything the code could branch on that remat can see:

- the region's options (`RegionSpec`) and autocast;
- its inputs' structure: each tensor argument's shape, dtype, device and
  ``requires_grad``, and every other argument (a plain value by value, any other object
  by type);
- its modules as the forward finds them (`ModuleState`):
  each module's identity, the identity of every attribute, parameter and buffer,
  and the number of hooks of each kind (and of the global module hooks).

A call whose key matches a stored observation, and whose modules are all the ones
observed (held by weak references, so an identity cannot be reused), runs without
the dispatch mode: a module that gains a parameter, a buffer, a hook, rebinds an
attribute (``self.prev = ...``) or gets another input structure is observed again.
A fact is still re-checked on every unwatched call: when the forward returns, the
versions of the modules' buffers and tensor attributes must be the ones it found
(a write the facts did not foresee is refused with a ``RecomputeError``, and the
region is watched from then on). A region that was seen writing state, or reading
a tensor that is not its argument or its modules' parameter, is watched on every
call: it pays for what it uses, and no other region does. What an unwatched call
cannot see is a tensor outside its modules (a global, a closure) that only a later
call's Python branch starts to write, or under ``use_reentrant=True`` to read: a
branch on a module attribute changes the key, one on a plain value held elsewhere
does not.

An unwatched reentrant region's re-run is not watched either: the forward that was
observed read only its modules' parameters, and the ones it read are the inputs of its
Function (a path to any other tensor would have been refused then, by the read check and
the graph check of NOTE [Observed reads]).

NOTE [Reads that vary]
Which parameters a reentrant region reads can change from call to call: a branch on a
random draw or on data (stochastic depth, an MoE layer that skips the experts no token
chose) reads one set in one call and another in the next. An input of the Function that
a call did not read gets no gradient, and autograd still calls its tensor hooks, with
None, where the unmarked model never calls them; a parameter read but not an input
would lose its gradient. So an unwatched call hands its Function exactly the parameters
the observed call read (`Facts.reads`, frozen ones too: one unfrozen later is an input
while it requires grad), never all its modules' parameters (a module's unused parameter
would get a hook call with None on every step), and:

- a forward that was seen reading a tensor's values on the host (``.item()``,
  ``bool(t)``, ``torch.where(mask)``'s data-dependent shape: `observe._HOST_READS`) may
  branch on them, so such a region is watched on every call: each call's Function gets
  the parameters that call read;
- where the reads still vary unseen (a branch on a Python value held outside the
  region's modules, or on values read by ``.tolist()`` or ``.numpy()``, which no
  operator runs; an item of a list attribute replaced), the re-run's graph is walked
  before its backward (``walk.reached_outside``, a few microseconds per block): any
  leaf it reaches that is not an input (one of the modules' other parameters, or a
  tensor held outside them: a global, a closure's) is differentiated too; one that gets
  a gradient was read without being an input, and a ``RecomputeError`` says so, and the
  region is watched on every call from then on (`watch_always`); a parameter the call
  did not read gets its hooks called with None, as an input without a gradient. Only a
  watched re-run tells the region's own leaves (T5's position bias) from the others, so
  a region whose observed re-run reached one of its own is watched on every call.
"""

from __future__ import annotations

import itertools
import operator
import weakref
from typing import Any

import torch

from remat._engine import tree as _tree
from remat._engine.errors import RecomputeError
from remat._engine.flat import Plain

_CAPACITY = 8  # observations kept per module (input shapes, train and eval, ...)


class Facts:
    """What one observed call of a module region found: its modules, how many operators
    took each tensor argument (NOTE [Per-use gradients] in ``per_use.py``) and, under
    ``use_reentrant=True``, the parameters it read (NOTE [Reads that vary])."""

    __slots__ = ("modules", "reads", "uses")

    def __init__(self, modules: list[torch.nn.Module], uses: tuple, reads: list = ()) -> None:
        self.modules = [weakref.ref(m) for m in modules]
        self.uses = uses
        self.reads = [weakref.ref(t) for t in reads]

    def alive(self) -> bool:
        return not any(map(operator.is_, map(_DEREF, (*self.modules, *self.reads)), itertools.repeat(None)))

    def read(self) -> list[torch.Tensor]:
        """The parameters the observed call read, in the order it read them."""
        return list(map(_DEREF, self.reads))


_DEREF = weakref.ref.__call__  # dereference in C
_NO_FACTS: dict = {}


def _table(frame: Any) -> dict:
    """The facts kept for the region's root module, in its cache (``tree.cached``: a copy or
    a pickle of the module starts without them)."""
    kept = _tree.cached(frame.module_state.root)
    if kept.facts is None:
        kept.facts = {}
    return kept.facts


_VALUES = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format)


def _leaf_key(x: Any) -> Any:
    """A plain value by value; any other object by its type, never the object itself (a key
    holding a cache whose tensors lead back to the module through autograd would keep the
    module alive for good: the store's values must not reach its keys)."""
    if isinstance(x, torch.Tensor):
        return None
    return (type(x), x) if isinstance(x, _VALUES) else type(x)


_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks", "_global_forward_hooks_always_called")


def _global_hooks() -> tuple:
    module = torch.nn.modules.module
    return tuple(map(len, _global_hook_dicts(module)))


_global_hook_dicts = operator.attrgetter(*_GLOBAL_HOOKS)


def _forward_hooked(modules: list[torch.nn.Module]) -> bool:
    hooks = torch.nn.modules.module
    return bool(hooks._global_forward_hooks) or any(m._forward_hooks for m in modules)


def key_of(frame: Any, arguments: list) -> tuple | None:
    """The key of a module region's call (NOTE [Observed once, confirmed every call]), or None."""
    state = frame.module_state
    if state.root is None or frame.spec.debug:  # a plain function: watched on every call
        return None
    inputs = tuple([(t.shape, t.dtype, t.device, t.requires_grad) for t in arguments])
    leaves = tuple(_leaf_key(x) for x in frame.leaves) if frame.treespec is not None else ()
    autocast = (torch.is_autocast_enabled(), torch.get_autocast_dtype("cpu")
                if torch.is_autocast_enabled() else None)
    structure = frame.treespec if type(frame.treespec) is Plain else str(frame.treespec)  # hashable
    return (frame.spec, state.fingerprint(), inputs, structure, leaves, autocast,
            _global_hooks())


def known(frame: Any, key: tuple | None) -> Facts | None:
    """What an earlier call with ``key`` found, when it found the region needs no watching."""
    if key is None:
        return None
    kept = frame.module_state.root.__dict__.get("_remat_snapshot")
    facts = (getattr(kept, "facts", None) or _NO_FACTS).get(key)  # None: watched on every call
    return facts if facts is not None and facts.alive() else None


def learn(frame: Any, key: tuple | None, observe: Any, outside: list = ()) -> None:
    """Store what an observed call found, when it lets the next calls run unwatched."""
    if key is None or observe.state or frame.module_state.written():
        return  # state to replay: watched on every call
    if outside:
        return  # NOTE [Tensors read from outside the module]: their versions, every call
    table = _table(frame)
    if key in table and table[key] is None:
        return  # its reads were seen to vary (`watch_always`)
    reads = []
    if frame.spec.use_reentrant:
        own = {id(p) for p in frame.module_state.parameters()}
        reads = [*observe.reads.values(), *observe.frozen.values()]  # a frozen one may thaw
        if any(id(t) not in own for t in reads):
            return  # it reads tensors other than its modules' parameters
        if _forward_hooked(frame.module_state.modules()):
            return  # a hook may capture on some calls only (NOTE [Escapes handed back by position])
        if observe.host_reads:
            return  # it may branch on its tensors' values (NOTE [Reads that vary])
    if len(table) >= _CAPACITY:
        table.pop(next(iter(table)))
    table[key] = Facts(frame.module_state.modules(), tuple(frame.uses), reads)


def watch_always(frame: Any, key: tuple | None) -> None:
    """Watch the region's calls with ``key`` from now on (NOTE [Reads that vary])."""
    if key is not None:
        _table(frame)[key] = None


def differentiates(frame: Any, facts: Facts) -> bool:
    """NOTE [Forwards with nothing to differentiate]
    A reentrant call whose Function would have no input that requires grad (its arguments
    do not, nor do the tensors its observed call read: a frozen block on data) has no
    backward: autograd never calls its Function's, so no re-run's graph is walked (NOTE
    [Reads that vary]) and a tensor that requires grad read unseen (a branch on a Python
    value outside its modules reads a global, another module's parameter) would lose its
    gradient, silently. Such a call is watched: what it reads that requires grad becomes an
    input of its Function, whose output then requires grad, as without the mark. Only those
    calls pay the watching (a frozen block marked on data, where recompute saves nothing); a
    call inside an outer region's re-run is watched alike, so the outer one finds the same
    Function in its forward and in its re-run. torch's reentrant checkpoint drops that
    gradient (its output does not require grad; it warns that no input does).
    """
    if any(x.requires_grad for x in frame.arguments):
        return True
    return any(t.requires_grad for t in facts.read())


def forget(frame: Any, key: tuple | None) -> None:
    _table(frame).pop(key, None)


def confirm(frame: Any, key: tuple | None) -> None:
    """An unwatched forward returned: the facts must still hold (no state was written)."""
    written = frame.module_state.written()
    if written:
        forget(frame, key)
        module, name, tensor = written[0]
        raise RecomputeError(
            f"remat: region '{frame.name}' changed {type(module).__name__}.{name} (shape "
            f"{list(tensor.shape)}) in place in a forward that earlier calls with the same inputs "
            f"and modules showed to write no state, so remat did not watch it and cannot replay "
            f"the write in recomputation; the region is watched from the next call on: run this "
            f"step again (its gradients would have been wrong)"
        )
