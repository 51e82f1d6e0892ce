"""``use_reentrant=True``: a region as a custom ``autograd.Function`` (engine).

The forward ran without grad; the Function's backward re-runs the region with
grad and back-propagates through the re-run. Its output may have any structure (NOTE
[Outputs of any structure] in ``structure.py``). Limits, each with a clear error:
tensor arguments nested in containers, a second backward after the graph was freed, a closure tensor computed from the
region's own parameters, an argument read and then changed in place.

NOTE [Reentrant gradients]
Every gradient leaves the region through its Function, as from any other
operator: the tensors the region reads besides its arguments (parameters,
tensors read through its closure, module attributes: NOTE [Observed reads] in
``observe.py``) are inputs of the Function too, and its backward returns their
gradients (one ``torch.autograd.grad`` over the re-run) instead of accumulating
them itself. So ``torch.autograd.grad`` and ``backward(inputs=...)`` get them,
DDP sees each parameter's gradient arrive once, and a closure that reads a
tensor the region also takes as an argument sends both contributions on.
Arguments are re-run as fresh leaves; under ``create_graph=True`` they are
re-run through `_Boundary` instead, so the returned gradients stay
differentiable down to the real inputs (a gradient penalty), while the nested
``torch.autograd.grad`` still stops there. A tensor read through the closure
cannot be stopped at: if the nested backward runs on past it (it was computed
from the region's own parameters), the region is refused (`reentrant_backward._closure_stops`).
Before the nested backward the re-run's graph is walked (``walk.reached_outside``):
a path to a tensor that is not an input of the Function is refused, never lost.
The gradient hooks of the tensors read (``param.register_hook``) are silenced
while the nested backward captures their gradients (`_hooks_off`): they run
once, when the Function hands the gradient on.

NOTE [Written arguments]
An argument the forward wrote in place is re-run from a copy of its new value
(the saved one is never written again) with the write dropped (NOTE [No double
state updates]), which is exact unless the region read it before writing it:
that is refused (`_WrittenArguments`). When it requires grad the Function
marks it dirty and returns it, so its later readers back-propagate through the
region as they would through the in-place operator. Autograd lets a Function
that writes a view return nothing else, so for a view its base is marked and
returned instead (an extra input): the view's new value gets its slice of the
base's gradient, and the base gets the rest with that slice zeroed, as autograd's
``CopySlices`` does for an in-place operator on a view. Under
``create_graph=True`` the written argument's gradient must stay differentiable
down to its history before the write, which marking it dirty replaced: a
`_Link` taken in forward keeps that history (without memory of its own),
and the re-run's argument is a `_Boundary` over it (without it the second
backward ran into the region's own Function, endlessly).
The gradients a region's re-run sends to one tensor are summed inside the
nested backward before the engine adds other consumers'; so a tensor read twice
or more inside a region and again outside it may differ from the unmarked model
by rounding (the terms summed in another order). Under ``create_graph=True`` the
part of the second backward that runs through the region's output reaches the
parameters through another re-run, a separate sum, with the same effect.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import torch

from remat._engine import aliases as _aliases
from remat._engine import boundary as _boundary
from remat._engine import per_use as _per_use
from remat._engine import refusal as _refusal
from remat._engine.core import _PLAIN, RegionCore
from remat._engine.errors import RecomputeError
from remat._engine.modes import storage_of
from remat._engine.observe import Substitute, substituted
from remat._engine.reentrant_backward import Link, differentiate

_NOTHING: Any = MappingProxyType({})  # an empty mapping no call changes
_FINISHED = _boundary.ModuleState("", [])  # what a finished frame holds instead of its modules' state


class ReentrantFrame(RegionCore):
    """A region run as a custom ``autograd.Function`` (``use_reentrant=True``).

    Its forward runs without grad on `aliases` of the arguments (NOTE
    [Observed reads]); `close` hands the output to `Reentrant`.
    """

    # what most calls leave as it is: read from the class until a call sets its own
    # (each is rebound, never changed in place, where a call sets it)
    written: Any = frozenset()  # arguments the forward changed in place
    state: Any = ()  # NOTE [Observed writes]
    pending: Any = None  # the output, until the Function returns it
    structure: Any = None  # NOTE [Outputs of any structure] (structure.py)
    # NOTE [Written arguments]
    dirty: Any = ()
    links: Any = _NOTHING
    targets: list | None = None
    target_of: Any = _NOTHING
    bases: list | None = None
    views: Any = _NOTHING
    n_targets = n_bases = 0
    copied: Any = _NOTHING  # NOTE [Arguments returned as outputs]
    passthrough: Any = _NOTHING  # output position -> the argument it is
    returned: Any = frozenset()  # storages of the outputs
    escaped: Any = ()  # attributes handed out as outputs
    picks: Any = None  # other escapes handed out as outputs (escapes.Picks)
    released = False  # let go of its module after its first backward
    extra: Any = ()  # NOTE [Per-use gradients]: (argument, more inputs)
    lean = False  # NOTE [Lean reentrant calls] (lean.py)
    n_held = 0  # the last outputs: escaped tensors given their history in place (escapes.Picks)

    def __init__(self, fn: Any, args: tuple, kwargs: dict, spec: Any, name: str,
                 contexts: tuple | None) -> None:
        super().__init__(fn, args, kwargs, spec, name, contexts)
        arguments = self.arguments
        if len(arguments) == 1:  # the usual case
            x = arguments[0]
            self.aliases = [x.detach() if x.requires_grad else x]
            self.same_as = _NOTHING
        else:
            made: dict[int, torch.Tensor] = {}  # NOTE [Arguments that are one tensor] (hooked.py)
            self.aliases = [made.setdefault(id(x), x.detach() if x.requires_grad else x) for x in arguments]
            first: dict[int, int] = {}
            same_as = {i: first.setdefault(id(x), i) for i, x in enumerate(arguments)}
            self.same_as = {i: j for i, j in same_as.items() if i != j}
        self.versions = [x._version for x in arguments]
        self.params: list[torch.Tensor] = []  # the tensors it read besides its arguments
        self.shared: set[int] = set()  # arguments a later region took too

    def abandon(self) -> None:
        super().abandon()
        self.aliases, self.pending, self.params = [], None, []

    def release(self) -> None:
        """Let go of the module: an attribute holding one of the Function's outputs leads
        back here through autograd, a cycle Python's collector cannot free."""
        self.released = True
        self.finish()

    def finish(self) -> None:
        """The graph was freed: nothing re-runs the region again, so let go of what a re-run
        needs. Its copies of the modules' attributes may hold a list a hook appended the
        region's output to: that output leads back here through autograd, a cycle Python's
        collector cannot free once the module drops the list (NOTE [Module state at the
        boundary])."""
        self.fn, self.escaped, self.picks, self.params, self.state = None, (), None, [], ()
        self.module_state = _FINISHED  # nothing re-runs it: an empty state, shared


def close(frame: ReentrantFrame, reads: list, state: list, output: Any, escaped: list = (),
          picks: Any = None) -> Any:
    """Finish a reentrant region's forward: what it read and wrote, then the Function.

    ``reads``: the tensors it read besides its arguments (NOTE [Observed reads]; its
    modules' parameters when it ran unwatched: NOTE [Observed once, confirmed every
    call]); ``state``: what it wrote (NOTE [Observed writes]); ``escaped``: ``(dict,
    key, tensor)`` for each attribute the forward bound to a tensor that would carry a
    gradient (NOTE [Tensors that escape a reentrant region] in ``observe.py``); ``picks``:
    where the other escaped tensors were made (NOTE [Escapes handed back by position]).

    NOTE [Tensors returned as they were]
    A region may return a tensor that requires grad and that its operators did not compute:
    one of its parameters (a block that hands its position embedding to the next one), a
    fast weight computed before the region (MAML), a tensor read from outside, or a leaf
    it makes itself (T5 marks its position bias as requiring grad). A reentrant forward
    runs without grad, so such a tensor has no history or a history older than the region
    (its node's sequence number is below the frame's first: autograd numbers nodes as it
    makes them). Returned from the Function, autograd gave that very tensor the Function's
    node as its history: a parameter stopped being a leaf, and the first backward
    re-entered the Function from inside its own re-run, forever (torch's reentrant
    checkpoint hangs the same way). Unmarked, the caller gets the tensor itself and its
    gradient flows into its own history; so here it is handed out as itself, outside the
    Function, like an argument returned as itself, and the re-run's own value of it is not
    differentiated. A view the forward made of a tensor that requires grad (``self.e[1]``,
    a position table's slice, a parameter's transpose) has no history either, made without
    grad, yet reports ``requires_grad`` as its base does: handed out as itself, the gradient
    sent to it reached no one, the parameter's was lost, silently (torch's reentrant
    checkpoint trains it). Such a view is the region's own output: it goes through the
    Function, whose re-run makes it again with its history. One its modules held when the
    forward began (an attribute set without grad before the call) is handed out as itself,
    as unmarked; one held elsewhere (a global, a closure's) comes back from the re-run
    without history, its gradient lost, so that backward is refused
    (`reentrant_backward._pairs`).

    A buffer or a tensor attribute of its modules that does not require grad (a scale, a
    mask) is handed out as itself too. Returned from the Function, autograd gave that very
    tensor the Function's node as its history, as it did a parameter: the module's buffer
    was changed, and the re-run, which returns it, re-entered the Function without end (a
    hang; torch's reentrant checkpoint hangs the same way). One held elsewhere (a global
    constant), which the forward cannot tell from one it made, leaves the Function as an
    alias (NOTE [Outputs returned as aliases]): the global keeps no history.
    """
    if escaped or picks is not None:
        return _with_escaped(frame, reads, state, output, escaped, picks)
    frame.params = [t for t in reads if t.requires_grad]
    frame.state = state
    tensors, aliases = frame.arguments, frame.aliases
    frame.arguments, frame.aliases = [], []  # the Function saves them
    frame.written = {i for i, (x, v) in enumerate(zip(tensors, frame.versions)) if x._version != v}
    outs = output if isinstance(output, tuple) else (output,)
    frame.returned = {storage_of(o) for o in outs} - {None}  # NOTE [Arguments returned as outputs]
    frame.passthrough = {  # NOTE [Arguments returned as outputs]
        j: i for j, o in enumerate(outs) for i, (x, a) in enumerate(zip(tensors, aliases))
        if isinstance(o, torch.Tensor) and (o is x or o is a) and i not in frame.written}
    as_they_were = {j: o for j, o in enumerate(outs)  # NOTE [Tensors returned as they were]
                    if j not in frame.passthrough and (
                        (frame.returned_as_it_was(o) and not _view_made_here(frame, o))
                        or (type(o) in _PLAIN and frame.module_state.holds(o)))}
    if not frame.passthrough and not as_they_were:
        return apply(frame, output, tensors)
    handed = {j: tensors[i] for j, i in frame.passthrough.items()} | as_they_were
    frame.passthrough.update(dict.fromkeys(as_they_were, -1))  # backward reads the positions only
    kept = tuple(o for j, o in enumerate(outs) if j not in handed)
    result = iter(apply(frame, kept, tensors) if kept or frame.written else ())
    whole = tuple(handed[j] if j in handed else next(result) for j in range(len(outs)))
    return _like(output, whole) if isinstance(output, tuple) else whole[0]


def _view_made_here(frame: ReentrantFrame, o: torch.Tensor) -> bool:
    """Whether output ``o`` is a view without history that the forward made (NOTE [Tensors
    returned as they were]): not one its modules held when it began."""
    return o._is_view() and o.grad_fn is None and not frame.module_state.holds(o)


def _with_escaped(frame: ReentrantFrame, reads: list, state: list, output: Any, escaped: list,
                  picks: Any) -> Any:
    """Escaped tensors become outputs of the Function, and the attributes its outputs.

    NOTE [Tensors that escape a reentrant region]: ``self.aux = h.pow(2).mean()`` carries
    a gradient as without the mark; the re-run hands back its own value of the attribute
    beside the region's outputs (`_rerun`). A tensor held elsewhere (a hook's
    capture) is returned itself and gets its history in place (NOTE [Escapes handed back
    by position] in ``escapes.py``).
    """
    single = not isinstance(output, tuple)
    outs = (output,) if single else tuple(output)
    frame.escaped = [(where, key) for where, key, _ in escaped]
    held = picks.take() if picks is not None else []
    frame.picks, frame.n_held = picks, len(held)
    result = close(frame, reads, state, (*outs, *(t for _, _, t in escaped), *held))
    for (where, key, _), value in zip(escaped, result[len(outs):], strict=False):
        where[key] = value
    if any(value is not t for t, value in zip(held, result[len(outs) + len(escaped):], strict=True)):
        raise RecomputeError(f"remat: region '{frame.name}': an escaped tensor was not given its "
                             f"history in place (NOTE [Escapes handed back by position])")
    result = tuple(result[:len(outs)])
    return result[0] if single else _like(output, result)


def _like(output: tuple, items: tuple) -> tuple:
    """``items`` in the tuple type the region returned (a ``NamedTuple`` stays one)."""
    return type(output)._make(items) if hasattr(type(output), "_make") else items


def apply(frame: ReentrantFrame, output: Any, tensors: list) -> Any:
    """Wrap a region's forward ``output`` in `Reentrant`; return what the caller sees."""
    frame.dirty = [i for i in sorted(frame.written) if tensors[i].requires_grad]
    _written_targets(frame, tensors)
    if frame.dirty and torch.is_grad_enabled():  # NOTE [Written arguments]
        frame.links = {i: Link.apply(tensors[i]) for i in frame.dirty}
    frame.pending = output
    bases = frame.bases
    frame.bases = None  # tensors the frame must not hold: the Function's outputs lead to it
    inputs = [*tensors, *frame.params, *bases, *_per_use.extra_inputs(frame, tensors)]
    if Substitute.active:
        inputs = substituted(inputs)
    result = Reentrant.apply(frame, len(tensors), *inputs)
    frame.targets = None
    if not frame.n_targets:
        return _like(output, result) if isinstance(output, tuple) else result
    result = result[:len(result) - frame.n_targets]
    return _like(output, result) if isinstance(output, tuple) else result[0]


def _written_targets(frame: ReentrantFrame, tensors: list) -> None:
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
    (NOTE [Reentrant gradients]), then the bases of arguments it wrote that are views,
    then the arguments read more than once again (NOTE [Per-use gradients]).
    Its outputs: the region's, then the arguments (or their bases) the forward wrote
    in place, marked dirty (NOTE [Written arguments]).
    """

    @staticmethod
    def forward(ctx: Any, frame: ReentrantFrame, n_inputs: int, *tensors: torch.Tensor) -> Any:
        ctx.frame, ctx.n_inputs = frame, n_inputs
        ctx.set_materialize_grads(False)  # NOTE [Outputs without a gradient]
        out, frame.pending = frame.pending, None
        if frame.lean:  # NOTE [Lean reentrant calls] (lean.py): one plain tensor, nothing written
            ctx.save_for_backward(*tensors[:n_inputs])
            ctx.views = ctx.argument_views = ()
            return out.detach()  # NOTE [Outputs returned as aliases]
        outs = (out if isinstance(out, tuple) else (out,))
        ctx.save_for_backward(*_aliases.without_history(frame, _aliases.returned_copied(frame, tensors[:n_inputs])))
        views = [(i, o.stride()) for i, o in enumerate(outs) if isinstance(o, torch.Tensor) and o._is_view()]
        mine = len(outs) - frame.n_held  # the held ones get their history in place
        outs = (*map(_aliases.alias, outs[:mine]), *outs[mine:])
        ctx.views = [(i, stride, outs[i].detach(), outs[i]._version) for i, stride in views]
        ctx.argument_views = _aliases.argument_views(frame, ctx.views, tensors[:n_inputs])
        if frame.targets:
            ctx.mark_dirty(*frame.targets)
            return (*outs, *frame.targets)
        return outs if isinstance(out, tuple) else outs[0]

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        try:
            return _backward(ctx, grads)
        except RecomputeError:
            _refusal.refused()  # NOTE [Backward refused] in refusal.py
            raise


def _backward(ctx: Any, grads: tuple) -> Any:
    """`Reentrant.backward`: re-run the region and differentiate it.

    NOTE [Outputs without a gradient]
    An output the caller drops (a block's second result, unused) gets no gradient. A custom
    Function's backward is handed zeros for it by default, so the re-run was differentiated
    against zeros, and every parameter reached only from that output got a gradient of
    zeros where the unmarked model leaves ``.grad`` None: an optimizer then moved it (weight
    decay, momentum), silently (torch's reentrant checkpoint does the same). So the
    Function takes such gradients as None and differentiates the re-run only through the
    outputs that got one; a backward that got none re-runs nothing. A parameter reached
    only from a dropped output is still an input of the Function: it gets None, and autograd
    calls its tensor hooks with None, where the unmarked model never calls them.
    """
    frame: ReentrantFrame = ctx.frame
    if all(g is None for g in grads) and not frame.released:
        if not torch._C._autograd._get_current_graph_task_keep_graph():
            _let_go(frame)
        return (None,) * len(ctx.needs_input_grad)
    if frame.released:
        raise RecomputeError(
            f"remat: backward ran a second time through reentrant region '{frame.name}', whose "
            f"forward bound a tensor that carries a gradient to an attribute of its module; the "
            f"region let go of its module after its first backward (NOTE [Tensors that escape a "
            f"reentrant region]); use use_reentrant=False for a second backward"
        )
    for i, alias, version in ctx.argument_views:  # NOTE [Views of an argument changed after the region]
        if alias._version != version:
            raise RecomputeError(
                f"remat: region '{frame.name}' (use_reentrant=True) returned a view of its "
                f"argument as output {i}, and that memory was changed in place after the region "
                f"(through the output, the argument or another view of it); the reentrant "
                f"implementation hands the view out as an output of its own Function, so the "
                f"change is missing from the argument's history and the gradients would be "
                f"wrong; clone that output before changing it, or use use_reentrant=False"
            )
    tensors = _saved_inputs(ctx, frame)
    if frame.views or frame.copied:  # saved detached: they require grad as they did
        tensors = tuple(x.detach().requires_grad_(frame.copied.get(i, True))
                        if i in frame.views or i in frame.copied else x
                        for i, x in enumerate(tensors))
    keep = torch._C._autograd._get_current_graph_task_keep_graph()
    found = differentiate(frame, tensors, _aliases.as_written_views(ctx, grads))
    if not keep:  # a graph not kept cannot run the region again: break the cycles
        _let_go(frame)
    return found


def _let_go(frame: ReentrantFrame) -> None:
    """The graph was not kept: let go of what a re-run needs (the module too, where an
    attribute holds an escaped output: NOTE [Tensors that escape a reentrant region])."""
    if frame.escaped or frame.picks:
        frame.release()
    else:
        frame.finish()


def _saved_inputs(ctx: Any, frame: ReentrantFrame) -> tuple:
    """The inputs the forward saved; refused when changed in place since, or freed."""
    try:
        return ctx.saved_tensors
    except RuntimeError as err:
        if "inplace" in str(err):
            raise RecomputeError(
                f"remat: region '{frame.name}' (use_reentrant=True) cannot be re-run: one of "
                f"its inputs was changed in place after the region ran ({err}). A region is "
                f"rebuilt from its inputs in backward; change the input out of place, or "
                f"clone it first"
            ) from err
        raise RecomputeError(
            f"remat: backward ran a second time through reentrant region '{frame.name}' after "
            f"its saved inputs were freed; pass retain_graph=True to the first backward, or "
            f"use use_reentrant=False (torch: Trying to backward through the graph a second "
            f"time, or directly access saved tensors after they have already been freed)"
        ) from err
