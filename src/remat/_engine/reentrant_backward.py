"""The backward of a ``use_reentrant=True`` region: its re-run and nested differentiation (engine).

NOTE [Reentrant gradients], NOTE [Written arguments] and NOTE [torch's reentrant
checkpoint inside a reentrant region] (``reentrant.py``, and `differentiate`
below) say what this code obeys. `Reentrant`'s backward calls
`differentiate`, which re-runs the region (`_rerun`) on fresh leaves or
`Boundary` nodes and returns every gradient the Function owes.
"""

from __future__ import annotations

import contextlib
import operator
from typing import Any

import torch
from torch.utils import _pytree as pytree

from remat._engine import collectives as _collectives
from remat._engine import facts as _facts
from remat._engine import nested as _nested
from remat._engine import per_use as _per_use
from remat._engine import state as _state
from remat._engine.core import Contexts
from remat._engine.errors import RecomputeError
from remat._engine.escapes import Pick
from remat._engine.modes import _UNANNOTATED, StateGuard, _allocates, _storage_key, _written_args
from remat._engine.observe import CheckReads, Substitute, replayed_state
from remat._engine.walk import reached_outside, refuse_lost

_GRAD_FN = operator.attrgetter("grad_fn")
_BACKWARD_HOOKS = operator.attrgetter("_backward_hooks")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_set_grad_enabled = torch._C._set_grad_enabled


class Boundary(torch.autograd.Function):
    """An argument of a re-run under ``create_graph=True``: the nested backward stops here.

    With ``value``, the argument's value is ``value`` and its gradient goes to ``x``
    (a `Link`: NOTE [Written arguments]).
    """

    @staticmethod
    def forward(ctx: Any, stop: list, x: torch.Tensor, value: torch.Tensor | None = None) -> torch.Tensor:
        ctx.stop = stop
        return x.view_as(x) if value is None else value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: Any, *_: Any) -> Any:
        return None, (None if ctx.stop[0] else grad), None


class Link(torch.autograd.Function):
    """Holds a written argument's history as it was before the write (NOTE [Written arguments]).

    Its output has the argument's shape and no memory of its own (an expanded
    scalar); a gradient sent to it goes to the argument's history.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros(()).expand(x.shape)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        return grad


def _feed(frame: Any, i: int, x: torch.Tensor, wrt: torch.Tensor | None) -> torch.Tensor:
    feed = wrt if wrt is not None else x.detach()
    if i not in frame.written:
        return feed
    with torch.enable_grad():  # a copy the re-run may write to; gradients pass through it
        return feed.clone()


def _pairs(frame: Any, outs: tuple, feeds: list, grads: tuple) -> tuple[list, list, list]:
    """The re-run's outputs and the gradients they get; the gradients of the written bases.

    NOTE [Written arguments]: a written view's new value gets its slice of its base's
    gradient; the base itself gets the rest (the slice zeroed: the region overwrote it).
    """
    n = len(grads) - frame.n_targets
    pairs = [(o, g) for o, g in zip(outs, grads[:n])  # NOTE [Outputs without a gradient] (reentrant.py)
             if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
    for o, g in pairs:
        if o.grad_fn is None and g is not None and not any(o is f for f in feeds):
            raise RecomputeError(  # NOTE [Tensors returned as they were] (reentrant.py)
                f"remat: region '{frame.name}' (use_reentrant=True) returned a view made without "
                f"grad before its forward (shape {list(o.shape)}), whose gradient would be lost: "
                f"the re-run hands back that view without history; make the view inside the "
                f"region, return its base, or use use_reentrant=False"
            )
    bases: list = [None] * frame.n_bases
    slices = []
    for i in frame.dirty:
        g = grads[n + frame.target_of[i]]
        if g is None:  # its later readers sent nothing back
            continue
        if i in frame.views:
            k, base_shape, base_stride, shape, stride, offset = frame.views[i]
            whole = g.new_empty_strided(base_shape, base_stride)
            whole.copy_(g)  # as autograd's CopySlices does
            part = whole.as_strided(shape, stride, offset)
            g = part.clone()
            slices.append(part)
            bases[k] = whole
        if feeds[i].requires_grad:
            pairs.append((feeds[i], g))
    for part in slices:
        part.zero_()
    return [o for o, _ in pairs], [g for _, g in pairs], bases


def differentiate(frame: Any, tensors: tuple, grads: tuple) -> tuple:
    """NOTE [Reentrant gradients]: every gradient returned through the Function.

    NOTE [torch's reentrant checkpoint inside a reentrant region]
    torch's reentrant checkpoint refuses to be differentiated by ``torch.autograd.grad``
    (``_is_checkpoint_valid``), which the nested backward is; Hugging Face's own switch
    left on under ``remat.apply(..., use_reentrant=True)`` puts one inside every region.
    Then the region is re-run again and differentiated by a plain ``backward``, whose
    gradients are collected from the tensors differentiated (their ``.grad`` is set
    aside and put back) and returned through the Function as before.
    """
    try:
        if frame.lean and _lean_now(frame):
            return _lean(frame, tensors, grads)
        return _differentiate_once(frame, tensors, grads, accumulate=False)
    except RuntimeError as err:
        if "incompatible with .grad()" not in str(err):
            raise
    return _differentiate_once(frame, tensors, grads, accumulate=True)


def _lean_now(frame: Any) -> bool:
    """Whether a lean frame's backward may still skip the generic one (NOTE [Lean reentrant
    calls] in ``lean.py``): no second-order graph, no later region took its argument, its
    parameters are leaves without hooks, no process group whose collectives a re-run waits."""
    if torch.is_grad_enabled() or frame.shared:
        return False
    if any(map(_GRAD_FN, frame.params)) or any(map(_BACKWARD_HOOKS, frame.params)):  # in C
        return False
    if not all(map(_REQUIRES_GRAD, frame.params)):  # NOTE [Parameters frozen before backward]
        return False
    return not (torch.distributed.is_available() and torch.distributed.is_initialized())


def _lean(frame: Any, tensors: tuple, grads: tuple) -> tuple:
    """The backward of a lean frame: the generic one's steps for a plain call, without the
    contexts it does not need (NOTE [Lean reentrant calls] in ``lean.py``)."""
    wrts = [x.detach().requires_grad_() if x.requires_grad else None for x in tensors]
    feeds = [x.detach() if w is None else w for x, w in zip(tensors, wrts)]
    frame.runs += 1
    args, kwargs = frame.call_with(feeds)
    with _state.recomputing(), frame.module_state_restored(()), frame.replay.context():
        _set_grad_enabled(True)  # off: `_lean_now` saw it (a context object is a few Python calls more)
        try:
            out = frame.fn(*args, **kwargs)
        finally:
            _set_grad_enabled(False)
    if type(out) is not torch.Tensor:
        raise RecomputeError(
            f"remat: region '{frame.name}' (use_reentrant=True): its re-run in backward returned "
            f"{type(out).__name__} where its forward returned a tensor, so remat cannot pair the "
            f"output gradient with the re-run; make the region return the same structure each "
            f"time (no branch on state that changes between forward and backward), or use "
            f"use_reentrant=False"
        )
    wrt = [w for w in wrts if w is not None] + frame.params
    found: list = [None] * len(wrt)
    if out.requires_grad and wrt:
        outside = reached_outside([out], wrt)  # NOTE [Reads that vary]
        if outside:
            found = list(_nested.grad((out,), wrt + outside, grads[:1]))
            _refuse_unforeseen(frame, outside, found[len(wrt):])
            del found[len(wrt):]
        else:
            found = list(_nested.grad((out,), wrt, grads[:1]))  # NOTE [The nested backward called directly]
    n = len(wrt) - len(frame.params)  # the arguments' gradients, then the parameters'
    taken = iter(found[:n])
    input_grads = [None if w is None else next(taken) for w in wrts]
    extra = _per_use.per_input(frame, input_grads, None)
    return (None, None, *input_grads, *found[n:], *extra)


def _accumulated(outs: list, wrt: list, out_grads: list, create_graph: bool) -> list:
    """The gradients of ``wrt`` by a plain backward (NOTE [torch's reentrant checkpoint
    inside a reentrant region]); their ``.grad`` comes back as it was."""
    before = [w.grad for w in wrt]
    for w in wrt:
        if w.grad_fn is not None:
            w.retain_grad()
        w.grad = None
    try:
        torch.autograd.backward(outs, out_grads, create_graph=create_graph)
        return [w.grad for w in wrt]
    finally:
        for w, g in zip(wrt, before):
            w.grad = g


def _differentiate_once(frame: Any, tensors: tuple, grads: tuple, accumulate: bool) -> tuple:
    create_graph = torch.is_grad_enabled()
    stop = [True]
    wrts: list = []
    for i, x in enumerate(tensors):
        if not x.requires_grad or i in frame.same_as:  # a repeated argument: fed once, below
            wrts.append(None)
        elif create_graph and i in frame.target_of:  # NOTE [Written arguments]
            wrts.append(Boundary.apply(stop, frame.links[i], x.detach()))
        elif create_graph:
            wrts.append(Boundary.apply(stop, x))
        else:
            wrts.append(x.detach().requires_grad_())
    feeds = [_feed(frame, i, x, w) for i, (x, w) in enumerate(zip(tensors, wrts))]
    for i, j in frame.same_as.items():  # NOTE [Arguments that are one tensor] (hooked.py)
        feeds[i] = feeds[j]
    # NOTE [Observed reads]: the nested backward stops at an alias of each non-leaf read
    nonleaf = [p for p in frame.params if p.grad_fn is not None]
    aliases = {id(p): Boundary.apply(stop, p) if create_graph else p.detach().requires_grad_()
               for p in nonleaf}
    allowed = [t for t in (*feeds, *wrts, *frame.params, *aliases.values()) if t is not None]
    rerun, replay, made = _rerun(frame, feeds, aliases, allowed)
    if frame.passthrough:  # NOTE [Arguments returned as outputs]: not outputs of the Function
        rerun = tuple(o for j, o in enumerate(rerun) if j not in frame.passthrough)
    outs, out_grads, bases = _pairs(frame, rerun, feeds, grads)
    wrt = [w for w in wrts if w is not None] + frame.params + list(aliases.values())
    found: list = [None] * len(wrt)
    sent = None
    if outs and wrt:
        # unwatched: the tensors the observed call read are in wrt; any other leaf the
        # re-run reaches is differentiated too, to refuse one this call read (NOTE [Reads
        # that vary])
        made_reached: list = []
        outside = reached_outside(outs, wrt, made, made_reached)
        if made_reached and frame.watched:  # its own leaves, which only a watched re-run tells apart
            _facts.watch_always(frame, frame.facts_key)
        hooked = [p for p in frame.params if p._backward_hooks]
        if frame.shared and not accumulate:
            sent = _per_use.hook_edges(frame, outs, wrts)
        try:
            with Contexts() as stack:
                if nonleaf:
                    stack.enter_context(_closure_stops(frame))
                if hooked:
                    stack.enter_context(_hooks_off(hooked))
                everything = wrt + outside
                found = (_accumulated(outs, everything, out_grads, create_graph) if accumulate else
                         _grad(outs, everything, out_grads, create_graph))
        finally:
            stop[0] = False
        if frame.watched:
            refuse_lost(frame.name, outside, found[len(wrt):])
        else:
            _refuse_unforeseen(frame, outside, found[len(wrt):])
        found = found[:len(wrt)]
    _wait_issued(replay)
    if nonleaf:  # each alias's gradient goes to the tensor it stands for
        alias_grads = found[len(found) - len(nonleaf):]
        del found[len(found) - len(nonleaf):]
        first = len(found) - len(frame.params)  # where the parameters' gradients begin
        at = {id(q): j for j, q in enumerate(frame.params)}
        for p, g in zip(nonleaf, alias_grads, strict=True):
            if g is not None:
                k = first + at[id(p)]
                found[k] = g if found[k] is None else found[k] + g
    found.reverse()
    input_grads = [None if w is None else found.pop() for w in wrts]
    extra = _per_use.per_input(frame, input_grads, sent)
    return (None, None, *input_grads, *reversed(found), *bases, *extra)


def _grad(outs: list, wrt: list, out_grads: list, create_graph: bool) -> list:
    """``torch.autograd.grad`` of ``outs`` by ``wrt``; a leaf frozen since the forward is
    differentiated as the forward's graph would be (NOTE [Parameters frozen before backward] in
    ``boundary.py``): its gradient goes on through the Function to its hooks, and its
    ``AccumulateGrad`` drops it, as without the mark."""
    frozen = [t for t in wrt if not t.requires_grad and t.is_leaf]
    for t in frozen:
        t.requires_grad_(True)
    try:
        return list(_nested.grad(outs, wrt, out_grads, create_graph))  # NOTE [The nested backward called directly]
    finally:
        for t in frozen:
            t.requires_grad_(False)


def _refuse_unforeseen(frame: Any, unread: list, grads: list) -> None:
    """An unwatched call read a tensor the observed call did not: watch the region on
    every call from now on, and refuse this backward (NOTE [Reads that vary])."""
    read = [t for t, g in zip(unread, grads, strict=True) if g is not None]
    if not read:
        return
    _facts.watch_always(frame, frame.facts_key)
    raise RecomputeError(
        f"remat: region '{frame.name}' (use_reentrant=True) read a tensor that requires grad "
        f"(shape {list(read[0].shape)}: a parameter, or a tensor held outside its modules: a "
        f"global, a closure's, an item of a list attribute) that an earlier call with the same "
        f"inputs and modules did not read, so remat did not watch this call and did not make "
        f"that tensor an input of the region: its gradient would be lost. The region branches "
        f"on something remat cannot see (a Python value held outside its modules, or values "
        f"read with .tolist() or .numpy()); it is watched on every call from the next one on: "
        f"run this step again (torch's reentrant checkpoint accumulates that gradient into "
        f"the tensor's .grad itself, which torch.autograd.grad cannot get)"
    )


@contextlib.contextmanager
def _hooks_off(params: list) -> Any:
    """Silence the gradient hooks of ``params`` while the nested backward captures there.

    Their gradient goes back through the Function, where the hooks run (once).
    """
    saved = []
    for p in params:
        hooks = p._backward_hooks
        if hooks:
            saved.append((hooks, list(hooks.items())))
            hooks.clear()
    try:
        yield
    finally:
        for hooks, items in saved:
            hooks.update(items)


@contextlib.contextmanager
def _closure_stops(frame: Any) -> Any:
    """Refuse a nested backward that would run on past a tensor read through the closure.

    Its gradient goes back through the Function; running on from it as well would
    count the part it sends to the region's other reached tensors twice.
    """
    def refuse(grad_outputs: Any) -> None:
        raise RecomputeError(
            f"remat: region '{frame.name}' (use_reentrant=True) reads a tensor through its "
            f"closure that was computed from other tensors the region reaches (its parameters); "
            f"the reentrant implementation cannot split their gradients; read that tensor through "
            f"an argument only, or use use_reentrant=False"
        )

    handles = [p.grad_fn.register_prehook(refuse) for p in frame.params if p.grad_fn is not None]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _rerun(frame: Any, inputs: list, aliases: dict, allowed: list
           ) -> tuple[tuple, Any, set]:
    """Re-run the region; return its outputs and the mode that saw its collectives.

    ``aliases`` stand for the non-leaf tensors the forward read; a read of a tensor
    that requires grad outside ``allowed`` is refused (NOTE [Observed reads]).
    """
    args, kwargs = frame.call_with(inputs)
    frame.runs += 1
    replay = _collectives.replaying(frame, wait_issued=True)  # NOTE [Kept collectives]
    # an unwatched forward read its modules' parameters only, all of them inputs; the
    # re-run reads the modules as the forward found them (NOTE [Observed once, confirmed
    # every call]); a gradient reaching any other tensor is still refused
    check = CheckReads(frame.name, allowed) if frame.watched else None
    pick = Pick(frame.name, frame.picks) if frame.picks is not None else None
    with Contexts() as stack:  # only the contexts this re-run needs
        stack.enter_context(_state.recomputing())
        stack.enter_context(frame.module_state_restored(frame.state))
        if frame.state:
            stack.enter_context(replayed_state(frame.state))
        stack.enter_context(frame.replay.context())
        stack.enter_context(torch.enable_grad())
        for context in (_WrittenArguments(frame, inputs) if frame.written else None, replay,
                        Substitute(aliases) if aliases else None, check, pick):
            if context is not None:
                stack.enter_context(context)
        out = frame.fn(*args, **kwargs)
        if frame.structure is not None:  # NOTE [Outputs of any structure] (structure.py)
            out = frame.structure.of_rerun(frame.name, out)
        if frame.escaped or pick is not None:  # NOTE [Tensors that escape a reentrant
            out = (*(out if isinstance(out, tuple) else (out,)),  # region]: the re-run's values
                   *(w[k] for w, k in frame.escaped), *(pick.taken() if pick is not None else ()))
    made = check.produced if check is not None else set()
    return (out if isinstance(out, tuple) else (out,)), replay, made


def _wait_issued(replay: Any) -> None:
    """Wait the collectives the re-run issued: the nested backward never reads its outputs.

    NOTE [Kept collectives]; without this a re-run output that is an all-reduce's
    result stays unwaited.
    """
    if isinstance(replay, _collectives.Issued):
        replay.wait()


class _WrittenArguments(StateGuard):
    """The state guard, refusing a re-run that reads an argument before writing it.

    The forward changed those arguments in place, so the re-run starts from their
    new values and the guard drops the writes (NOTE [No double state updates]):
    exact only when nothing read an argument before its last write.
    """

    def __init__(self, frame: Any, feeds: list) -> None:
        super().__init__()
        self.name = frame.name
        self.watched = {_storage_key(feeds[i]): i for i in frame.written}
        self.read: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        seen = {_storage_key(t) for t in pytree.tree_leaves((args, kwargs))
                if isinstance(t, torch.Tensor) and _storage_key(t) in self.watched}
        if seen:
            writes = _written_args(func) if func._schema.is_mutable or func in _UNANNOTATED else ()
            targets = {_storage_key(t) for i, name in writes
                       if isinstance(t := StateGuard._arg(func, i, name, args, kwargs), torch.Tensor)}
            for key in targets & seen:
                if self.watched[key] in self.read:
                    raise RecomputeError(
                        f"remat: region '{self.name}' (use_reentrant=True) reads its argument "
                        f"{self.watched[key]} and then changes it in place ({func}); the forward "
                        f"already changed it, so the re-run cannot see the value it read; change "
                        f"a copy instead (x = x.clone()), or change it outside the region"
                    )
            if targets or _allocates(func):  # a view reads nothing
                self.read |= {self.watched[key] for key in seen - targets}
        return super().__torch_dispatch__(func, types, args, kwargs)


