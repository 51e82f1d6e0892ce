"""``use_reentrant=True``: a region as a custom ``autograd.Function`` (engine).

The forward ran without grad; the Function's backward re-runs the region with
grad and back-propagates through the re-run. Limits, each with a clear error:
tensors nested in containers, ``torch.autograd.grad`` through an opaque callable,
a second backward after the graph was freed, a closure tensor computed from the
region's own parameters, an argument read and then changed in place.

NOTE [Reentrant gradients]
Every gradient leaves the region through its Function, as from any other
operator: the tensors the region reaches besides its arguments (parameters of
the modules it reaches, tensors read through its closure; NOTE [What a region
reaches]) are inputs of the Function too, and its backward returns their
gradients (one ``torch.autograd.grad`` over the re-run) instead of
accumulating them itself. So ``torch.autograd.grad`` and ``backward(inputs=...)``
get them, DDP sees each parameter's gradient arrive once, and a closure that
reads a tensor the region also takes as an argument sends both contributions
on. Arguments are re-run as fresh leaves; under ``create_graph=True`` they are
re-run through :class:`_Boundary` instead, so the returned gradients stay
differentiable down to the real inputs (a gradient penalty), while the nested
``torch.autograd.grad`` still stops there. A tensor read through the closure
cannot be stopped at: if the nested backward runs on past it (it was computed
from the region's own parameters), the region is refused (:func:`_closure_stops`).

NOTE [Written arguments]
An argument the forward wrote in place is re-run from a copy of its new value
(the saved one is never written again) with the write dropped (NOTE [No double
state updates]), which is exact unless the region read it before writing it:
that is refused (:class:`_WrittenArguments`). When it requires grad the Function
marks it dirty and returns it, so its later readers back-propagate through the
region as they would through the in-place operator. Autograd lets a Function
that writes a view return nothing else, so for a view its base is marked and
returned instead (an extra input): the view's new value gets its slice of the
base's gradient, and the base gets the rest with that slice zeroed, as autograd's
``CopySlices`` does for an in-place operator on a view. Under
``create_graph=True`` the written argument's gradient must stay differentiable
down to its history before the write, which marking it dirty replaced: a
:class:`_Link` taken in forward keeps that history (without memory of its own),
and the re-run's argument is a :class:`_Boundary` over it (without it the second
backward ran into the region's own Function, endlessly).
The nested backward differentiates aliases of the parameters, not the parameters:
the re-run finds each reached module's parameter slots (taken in forward,
:func:`parameter_slots`) holding an alias, so a hook registered on a parameter
(``param.register_hook``) runs once, when the Function hands the gradient on,
and not also where the nested backward captures it. A parameter the re-run reads
other than through its module (a list of weights kept aside) is differentiated
as well, with its hooks silenced there (:func:`_hooks_off`).
Only an opaque callable (no reached tensors known) still accumulates parameter
gradients from its own backward, as torch's reentrant checkpoint does.
The gradients a region's re-run sends to one tensor are summed inside the
nested backward before the engine adds other consumers'; so a tensor read twice
or more inside a region and again outside it may differ from the unmarked model
by rounding (the terms summed in another order). Under ``create_graph=True`` the
part of the second backward that runs through the region's output reaches the
parameters through another re-run, a separate sum, with the same effect.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.utils import _pytree as pytree

from remat._engine import collectives as _collectives
from remat._engine import state as _state
from remat._engine.errors import RecomputeError
from remat._engine.modes import _UNANNOTATED, StateGuard, _allocates, _storage_key, _written_args
from remat._engine.reach import quiet


def apply(frame: Any, output: Any, tensors: list) -> Any:
    """Wrap a region's forward ``output`` in :class:`Reentrant`; return what the caller sees."""
    _settle_slots(frame)
    frame.dirty = [i for i in sorted(frame.written) if tensors[i].requires_grad]
    _written_targets(frame, tensors)
    if frame.dirty and torch.is_grad_enabled():  # NOTE [Written arguments]
        frame.links = {i: _Link.apply(tensors[i]) for i in frame.dirty}
    frame.pending = output
    bases = frame.bases
    frame.bases = None  # tensors the frame must not hold: the Function's outputs lead to it
    result = Reentrant.apply(frame, len(tensors), *tensors, *frame.params, *bases)
    frame.targets = None
    if not frame.n_targets:
        return result
    result = result[:len(result) - frame.n_targets]
    return result if isinstance(output, tuple) else result[0]


def _written_targets(frame: Any, tensors: list) -> None:
    """What the Function marks dirty for the arguments the forward wrote (NOTE [Written arguments]).

    An argument that is not a view is marked itself; for a view, its base is (autograd
    lets a Function that writes a view return nothing else): the base becomes an extra
    input of the Function (``frame.bases``) unless it is an argument too.
    """
    frame.targets, frame.target_of, frame.bases, frame.views = [], {}, [], {}
    for i in frame.dirty:
        x = tensors[i]
        target = x._base if x._is_view() else x
        if any(target is t for t in frame.targets) or (
                target is not x and any(target is t for t in tensors)):
            raise RecomputeError(
                f"remat: region '{frame.name}' (use_reentrant=True) changes in place argument {i}, "
                f"which shares memory with another argument it takes or changes; the reentrant "
                f"implementation cannot split their gradients; pass one of them, or use "
                f"use_reentrant=False"
            )
        frame.target_of[i] = len(frame.targets)
        frame.targets.append(target)
        if target is not x:
            frame.views[i] = (len(frame.bases), tuple(target.shape), target.stride(),
                              tuple(x.shape), x.stride(), x.storage_offset() - target.storage_offset())
            frame.bases.append(target)
    frame.n_targets, frame.n_bases = len(frame.targets), len(frame.bases)


class Reentrant(torch.autograd.Function):
    """``use_reentrant=True``: the forward ran without grad; backward re-runs the region.

    Its inputs: the region's tensor arguments, then the tensors it reaches
    (NOTE [Reentrant gradients]), then the bases of arguments it wrote that are views.
    Its outputs: the region's, then the arguments (or their bases) the forward wrote
    in place, marked dirty (NOTE [Written arguments]).
    """

    @staticmethod
    def forward(ctx: Any, frame: Any, n_inputs: int, *tensors: torch.Tensor) -> Any:
        ctx.frame, ctx.n_inputs = frame, n_inputs
        ctx.save_for_backward(*_without_history(frame, tensors[:n_inputs]))
        out, frame.pending = frame.pending, None
        outs = tuple(_not_a_view(o) for o in (out if isinstance(out, tuple) else (out,)))
        if frame.targets:
            ctx.mark_dirty(*frame.targets)
            return (*outs, *frame.targets)
        return outs if isinstance(out, tuple) else outs[0]

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        frame: Any = ctx.frame
        in_backward_call = torch.autograd._is_checkpoint_valid()
        if not in_backward_call and frame.opaque:
            raise RecomputeError(
                f"remat: region '{frame.name}' uses use_reentrant=True and remat cannot see which "
                f"parameters it uses, so it does not work with torch.autograd.grad or "
                f"backward(inputs=...); pass a module, or use use_reentrant=False. "
                f"Checkpointing is not compatible with .grad() or when an `inputs` parameter is "
                f"passed to .backward() (torch 2.13: When use_reentrant=True, "
                f"torch.utils.checkpoint is incompatible with .grad() or passing an `inputs` "
                f"parameter to .backward().)"
            )
        try:
            tensors = ctx.saved_tensors
        except RuntimeError as err:
            if "inplace" in str(err):
                raise  # torch's message names the true cause
            raise RecomputeError(
                f"remat: backward ran a second time through reentrant region '{frame.name}' after "
                f"its saved inputs were freed; pass retain_graph=True to the first backward, or "
                f"use use_reentrant=False (torch: Trying to backward through the graph a second "
                f"time, or directly access saved tensors after they have already been freed)"
            ) from err
        if frame.views:  # saved without their history (_without_history): they require grad
            tensors = tuple(x.detach().requires_grad_() if i in frame.views else x
                            for i, x in enumerate(tensors))
        with quiet(frame.quiet_norms):  # its inner backward reads the saved statistics
            if frame.opaque:
                return _accumulate(frame, tensors, grads)
            return _differentiate(frame, tensors, grads)


class _Boundary(torch.autograd.Function):
    """An argument of a re-run under ``create_graph=True``: the nested backward stops here.

    With ``value``, the argument's value is ``value`` and its gradient goes to ``x``
    (a :class:`_Link`: NOTE [Written arguments]).
    """

    @staticmethod
    def forward(ctx: Any, stop: list, x: torch.Tensor, value: torch.Tensor | None = None) -> torch.Tensor:
        ctx.stop = stop
        return x.view_as(x) if value is None else value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: Any, *_: Any) -> Any:
        return None, (None if ctx.stop[0] else grad), None


class _Link(torch.autograd.Function):
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


def _without_history(frame: Any, inputs: tuple) -> tuple:
    """The arguments to save, a written view's detached (NOTE [Written views are saved detached]).

    NOTE [Written views are saved detached]
    Marking a written view's base dirty gives the view a history that starts at
    the Function's own node. Saved as itself (an input, not an output), the view
    would keep that history, and so the node, alive: a reference cycle through
    the autograd graph that only the region's backward breaks (it frees the
    saved tensors). A region whose backward never runs (an unused output, or the
    re-run of a reentrant region inside an ``output_recompute`` region's
    recomputation) kept its whole graph, and the step's tensors, forever. The
    backward reads a written argument's value only (its history is the
    ``_Link``'s); a detached alias shares the view's version counter, so a later
    in-place change is still caught.
    """
    if not frame.views:
        return inputs
    return tuple(x.detach() if i in frame.views else x for i, x in enumerate(inputs))


def _not_a_view(x: Any) -> Any:
    """A view returned from a custom Function may not be changed in place; an alias may."""
    return x.detach() if isinstance(x, torch.Tensor) and x._is_view() else x


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
    pairs = [(o, g) for o, g in zip(outs, grads[:n]) if isinstance(o, torch.Tensor) and o.requires_grad]
    bases: list = [None] * frame.n_bases
    slices = []
    for i in frame.dirty:
        g = grads[n + frame.target_of[i]]
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


def _differentiate(frame: Any, tensors: tuple, grads: tuple) -> tuple:
    """NOTE [Reentrant gradients]: every gradient returned through the Function."""
    create_graph = torch.is_grad_enabled()
    stop = [True]
    wrts: list = []
    for i, x in enumerate(tensors):
        if not x.requires_grad:
            wrts.append(None)
        elif create_graph and i in frame.target_of:  # NOTE [Written arguments]
            wrts.append(_Boundary.apply(stop, frame.links[i], x.detach()))
        elif create_graph:
            wrts.append(_Boundary.apply(stop, x))
        else:
            wrts.append(x.detach().requires_grad_())
    feeds = [_feed(frame, i, x, w) for i, (x, w) in enumerate(zip(tensors, wrts))]
    # the aliases stay in place through the nested backward: a reentrant region nested in
    # this one re-runs there, and must find (and alias in turn) the tensors it took as inputs
    with _aliased_parameters(frame, create_graph, stop) as aliases:
        rerun, replay = _rerun(frame, feeds)
        outs, out_grads, bases = _pairs(frame, rerun, feeds, grads)
        # a parameter the re-run also read directly (not through its module: a list of
        # weights kept aside, say) is differentiated too
        direct = [p for p in frame.params if id(p) in aliases and p.is_leaf]
        if create_graph and direct:
            direct = _read_directly(outs, direct, frame.params)
        wrt = [w for w in wrts if w is not None] + [aliases.get(id(p), p) for p in frame.params]
        wrt += direct
        found: list = [None] * len(wrt)
        if outs and wrt:
            try:
                with _closure_stops(frame), _hooks_off(direct):
                    found = list(torch.autograd.grad(outs, wrt, out_grads, allow_unused=True,
                                                     create_graph=create_graph))
            finally:
                stop[0] = False
    _wait_issued(replay)
    if direct:
        extra = found[len(found) - len(direct):]
        del found[len(found) - len(direct):]
        at = {id(p): j for j, p in enumerate(direct)}
        base = len(found) - len(frame.params)
        for k, p in enumerate(frame.params):
            g = extra[at[id(p)]] if id(p) in at else None
            if g is not None:
                found[base + k] = g if found[base + k] is None else found[base + k] + g
    found.reverse()
    input_grads = [None if w is None else found.pop() for w in wrts]
    return (None, None, *input_grads, *reversed(found), *bases)


def _read_directly(outs: list, params: list, reached: list) -> list:
    """Those of ``params`` the re-run's graph reaches other than through their aliases.

    Under ``create_graph=True`` a parameter's alias leads to the parameter (through a
    stopped :class:`_Boundary`), so asking the nested backward for the parameter itself
    would call its gradient hooks with None; it is asked only when read directly.
    """
    ids = {id(p) for p in params}
    stops = {p.grad_fn for p in reached if p.grad_fn is not None}
    found: set[int] = set()
    seen: set = set()
    todo = [o.grad_fn for o in outs if o.grad_fn is not None]
    while todo:
        node = todo.pop()
        if node is None or node in seen or node in stops:
            continue
        seen.add(node)
        if type(node).__name__ == "_BoundaryBackward":
            continue
        variable = getattr(node, "variable", None)
        if variable is not None and id(variable) in ids:
            found.add(id(variable))
        todo.extend(next_node for next_node, _ in node.next_functions)
    return [p for p in params if id(p) in found]


def parameter_slots(modules: list, params: list) -> list:
    """Where the region's modules hold ``params``, taken in forward: (dict, name, tensor).

    The dict is a module's ``_parameters``, or its ``__dict__`` for a tensor it holds as
    a plain attribute (``self.memo = h``, read in ``forward``): the re-run reads the
    tensor the forward read, and its gradient goes back through the Function.

    NOTE [Reentrant gradients]: the backward re-runs the region with aliases in these
    slots. Taken when the region runs forward, so a region nested in another reentrant
    region (whose re-run sees the outer region's aliases) aliases the very tensors its
    Function took as inputs, whenever its backward runs. Parameters that are tensor
    subclasses (``DTensor`` under FSDP or tensor parallelism, whose wrappers swap
    parameters themselves) are left out.
    """
    wanted = {id(p) for p in params if type(p) in (torch.nn.Parameter, torch.Tensor)}
    slots: list = []
    seen: set[int] = set()
    todo = list(modules) if wanted else []
    while todo:
        module = todo.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        slots += [(module._parameters, name, p) for name, p in module._parameters.items()
                  if p is not None and id(p) in wanted]
        slots += [(module.__dict__, name, t) for name, t in module.__dict__.items()
                  if isinstance(t, torch.Tensor) and id(t) in wanted]
        todo.extend(m for m in module._modules.values() if m is not None)
    return slots


_MISSING = object()


def _settle_slots(frame: Any) -> None:
    """Drop the slots the forward itself filled anew (``self.memo = ...`` inside the region).

    The re-run fills them again; a tensor held as an attribute only there (a stale one
    from an earlier step, whose graph may be gone) is no input of the Function.
    """
    kept, changed = [], set()
    for slot, name, t in frame.slots:
        if slot.get(name, _MISSING) is t:
            kept.append((slot, name, t))
        elif not isinstance(t, torch.nn.Parameter):
            changed.add(id(t))
    changed -= {id(t) for _, _, t in kept}
    frame.slots = kept
    if changed:
        frame.params = [p for p in frame.params if id(p) not in changed]


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
def _aliased_parameters(frame: Any, create_graph: bool, stop: list) -> Any:
    """Re-run the region's modules with aliases of their parameters (NOTE [Reentrant gradients]).

    The nested ``torch.autograd.grad`` captures each gradient at the alias, so the
    parameter's own gradient hooks (``register_hook``) run once, when the Function
    returns the gradient to it, not also inside the nested backward. Under
    ``create_graph=True`` the alias is a :class:`_Boundary` over the parameter, so the
    returned gradient stays differentiable down to it. A parameter shared by several
    modules gets one alias; every slot is restored afterwards.
    """
    aliases: dict[int, torch.Tensor] = {}
    swapped: list = []
    try:
        for slot, name, p in frame.slots:
            alias = aliases.get(id(p))
            if alias is None:
                if create_graph:
                    alias = _Boundary.apply(stop, p)
                elif isinstance(p, torch.nn.Parameter):
                    alias = torch.nn.Parameter(p.detach(), requires_grad=True)
                else:
                    alias = p.detach().requires_grad_()
                aliases[id(p)] = alias
            swapped.append((slot, name, slot.get(name, _MISSING)))
            slot[name] = alias
        yield aliases
    finally:
        for slot, name, before in reversed(swapped):
            if before is _MISSING:
                slot.pop(name, None)
            else:
                slot[name] = before


def _accumulate(frame: Any, tensors: tuple, grads: tuple) -> tuple:
    """An opaque region in a ``backward`` call: parameters accumulate as torch's do."""
    leaves = [x.detach().requires_grad_(x.requires_grad) for x in tensors]
    feeds = [_feed(frame, i, x, x) for i, x in enumerate(leaves)]
    rerun, replay = _rerun(frame, feeds)
    outs, out_grads, bases = _pairs(frame, rerun, feeds, grads)
    if outs:
        torch.autograd.backward(outs, out_grads)
    _wait_issued(replay)
    return (None, None, *[x.grad if x.requires_grad else None for x in leaves], *bases)


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


def _rerun(frame: Any, inputs: list) -> tuple[tuple, Any]:
    """Re-run the region; return its outputs and the mode that saw its collectives."""
    leaves = list(frame.leaves)
    for slot, x in zip(frame.tensor_slots, inputs):
        leaves[slot] = x
    args, kwargs = frame.unflatten(leaves)
    frame.runs += 1
    if frame.written:
        guard: Any = _WrittenArguments(frame, inputs)
    else:
        guard = StateGuard() if frame.guard else contextlib.nullcontext()
    replay = _collectives.replaying(frame, wait_issued=True)  # NOTE [Kept collectives]
    with _state.recomputing(), frame.replay.context(), torch.enable_grad(), guard, replay:
        out = frame.fn(*args, **kwargs)
    return (out if isinstance(out, tuple) else (out,)), replay


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


def check_args(name: str, args: tuple, kwargs: dict) -> None:
    if kwargs:
        pass  # keyword arguments are saved like positional ones
    for position, arg in enumerate(args):
        if isinstance(arg, torch.Tensor):
            continue
        nested = [x for x in pytree.tree_leaves(arg) if isinstance(x, torch.Tensor) and x.requires_grad]
        if nested:
            raise TypeError(
                f"remat: region '{name}' (use_reentrant=True) got argument {position} of type "
                f"{type(arg).__name__} holding {len(nested)} tensor(s) that require grad; the "
                f"reentrant implementation cannot differentiate tensors inside lists, tuples or "
                f"dicts; pass them as separate arguments or use use_reentrant=False"
            )


def check_outputs(name: str, out: Any) -> None:
    outs = out if isinstance(out, tuple) else (out,)
    for position, item in enumerate(outs):
        if isinstance(item, torch.Tensor):
            continue
        if any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves(item)):
            raise TypeError(
                f"remat: region '{name}' (use_reentrant=True) returned output {position} of type "
                f"{type(item).__name__} holding tensors; the reentrant implementation cannot "
                f"differentiate tensors inside lists, tuples or dicts; return them directly "
                f"(a flat tuple) or use use_reentrant=False"
            )
