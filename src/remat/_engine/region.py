"""The recompute engine: regions whose saved tensors are rebuilt in backward.

NOTE [Regions]
A region is a callable run with its arguments. While it runs forward, every
tensor it saves for backward is replaced by a `Holder` (``rebuilt.py``) and dropped; its
inputs are saved once, through whatever saved-tensor hooks are outside it (so a
region nested in another keeps nothing the outer one drops). In backward, the
first unpack of a holder re-runs the region once, under the forward's random
and autocast state, and every holder still alive gets its tensor back.

The saved-tensor hooks implementation (``use_reentrant=False``) is in
``hooked.py`` (NOTE [Early stop], [Backward inside a region's forward], [Graph
tasks], [Inputs come back as themselves], [Keep outputs], [Regions that write
their inputs], [Output pass]); the custom ``autograd.Function`` one
(``use_reentrant=True``), which runs the forward without grad and the whole
region again inside its backward, in ``reentrant.py``. What both share is in
``core.py``; what a region reads and writes is watched as it runs (``observe.py``).
NOTE [Output recompute] (``outputs.py``) says how a region's outputs are not kept
either.
"""


from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch

from remat._engine import collectives as _collectives
from remat._engine import escapes as _escapes
from remat._engine import facts as _facts
from remat._engine import flags as _flags
from remat._engine import lean as _lean
from remat._engine import outputs as _outputs
from remat._engine import reentrant as _reentrant
from remat._engine import structure as _structure
from remat._engine.core import Contexts, RegionCore
from remat._engine.errors import RecomputeError
from remat._engine.hooked import ForwardHooks, HookedFrame
from remat._engine.observe import Observe, restore_state
from remat._engine.selective import policy_context
from remat._engine.state import is_recomputing, rerun_keeps_graph
from remat._vocab.policy import save_all
from remat._vocab.spec import RegionSpec


class _Handle:
    """An open region: what close_region needs to finish it, and what to call forward with."""

    def __init__(self, frame: RegionCore | None, stack: Contexts, args: tuple, kwargs: dict,
                 observe: Observe | None = None) -> None:
        self.frame, self.stack, self.args, self.kwargs = frame, stack, args, kwargs
        self.observe = observe
        self.exc = sys.exc_info()[1]


def _contexts(spec: RegionSpec, context_fn: Callable | None) -> tuple | None:
    if spec.policy is not None:
        return policy_context(spec.policy)()
    if context_fn is not None:
        return tuple(context_fn())
    return None


def open_region(fn: Callable, args: tuple, kwargs: dict, spec: RegionSpec, *, name: str,
                context_fn: Callable | None = None, frame: Any = None) -> _Handle:
    """Start a region around the forward of ``fn(*args, **kwargs)``; finish it with `close_region`.

    Args:
        fn: what recomputation re-runs (a module, called through its hooks, or a function).
        args, kwargs: its arguments.
        spec: the region's options.
        name: how errors name the region.
        context_fn: returns the (forward, recomputation) context pair, as in torch.
        frame: the reentrant frame the lean path made and could not use (NOTE [Lean
            reentrant calls] in ``lean.py``), or None.

    Returns:
        A handle for `close_region`; call the forward with its ``args`` and ``kwargs``.
    """
    _outputs.pop_hook()
    stack = Contexts()
    if not torch.is_grad_enabled() or spec.policy == save_all:
        return _Handle(None, stack, args, kwargs)
    _refuse_functorch(name)
    spec = _flags.resolve(spec)  # NOTE [Global switches]
    contexts = _contexts(spec, context_fn)
    if spec.use_reentrant:
        _structure.check_args(name, args, kwargs)
        if frame is None:
            frame = _reentrant.ReentrantFrame(fn, args, kwargs, spec, name, contexts)
        args, kwargs = frame.call_with(frame.aliases)  # NOTE [Observed reads]
        flowing = [a for a, x in zip(frame.aliases, frame.arguments) if x.requires_grad]
        observe = _observer(frame, frame.aliases, reads=True, flowing=flowing)
    else:
        frame = HookedFrame(fn, args, kwargs, spec, name, contexts)
        _expires_with_this_backward(frame)
        observe = _observer(frame, [t for t, _ in frame.input_versions], reads=False)
        if observe is not None:
            frame.state = observe.state  # filled as the forward runs (NOTE [Observed writes])
    try:
        if not frame.spec.mp_comm_recompute:
            stack.enter_context(_collectives.recording(frame))  # NOTE [Kept collectives]
        if frame.module_state.root is None:  # NOTE [Module state at the boundary]
            stack.enter_context(frame.module_state.calls_watched())
        if spec.use_reentrant:
            stack.enter_context(torch.no_grad())
            if observe is not None:
                stack.enter_context(observe)
        else:
            stack.enter_context(ForwardHooks(frame))
            if observe is not None:
                stack.enter_context(observe)  # below the region's own modes: it copies state
            if frame.contexts is not None:
                stack.enter_context(frame.contexts[0])
            if frame.trace is not None:
                stack.enter_context(frame.trace)
    except BaseException:
        stack.close()
        raise
    return _Handle(frame, stack, args, kwargs, observe)


def _expires_with_this_backward(frame: HookedFrame) -> None:
    """NOTE [Regions made inside a re-run]
    A marked module inside a marked region runs its mark again in the outer region's
    re-run, which opens a region of its own: it serves the backward of the tensors that
    re-run rebuilt, and ends with that backward. Its copies of its modules' attributes
    (NOTE [Module state at the boundary]) may hold a list a hook appends outputs to, and
    the re-run's output in that list leads back to the region through autograd: a cycle
    Python's collector cannot free once the module rebinds the list, which kept every
    step's tensors alive. So when that backward ends (a final callback queued as the
    region opens), the region lets go of its copies (`HookedFrame.expire`); a later
    backward that still reaches it (through the re-run's output a hook kept) is refused
    with a ``RecomputeError``. A backward with ``create_graph=True`` keeps what the re-run
    built (a gradient penalty differentiates it again): its regions stay as they are.
    """
    if is_recomputing() and not rerun_keeps_graph() and torch._C._current_graph_task_id() != -1:
        torch.autograd.Variable._execution_engine.queue_callback(frame.expire)


def _refuse_functorch(name: str) -> None:
    """A region cannot run under ``torch.func`` transforms: refuse it before it runs.

    Its ``autograd.Function`` (either implementation) has no ``setup_context``, which
    functorch needs; torch's checkpoint fails there too (saved-tensor hooks, or the same
    Function error). The transform's own gradients need no recompute region.
    """
    if torch._C._functorch.peek_interpreter_stack() is None:
        return
    raise RecomputeError(
        f"remat: region '{name}' runs under a torch.func transform (grad, vjp, jacrev, "
        f"hessian, vmap), which cannot run a recompute region (torch.utils.checkpoint cannot "
        f"either: 'torch.func transforms don't yet support saved tensor hooks'); apply the "
        f"transform to the unmarked model (remat.unmark(model), or a copy without marks), or "
        f"differentiate with torch.autograd.grad, which remat supports"
    )


def close_region(handle: _Handle, output: Any) -> Any:
    """Finish a region opened by `open_region`; return what the caller should see.

    When the forward raised (this is called from an always-call module hook),
    the region's hooks and contexts are popped and ``None`` is returned.
    """
    error = sys.exc_info()[1]
    if error is not None and error is not handle.exc:
        _abandon(handle, type(error), error, error.__traceback__)
        return None
    handle.stack.close()
    frame = handle.frame
    if frame is None:
        return output
    observe = handle.observe
    if observe is None:  # NOTE [Observed once, confirmed every call]
        frame.watched = False
        try:
            _facts.confirm(frame, frame.facts_key)
        except RecomputeError:
            frame.abandon()
            raise
    if frame.spec.use_reentrant:
        return _close_reentrant(frame, observe, output)
    outside = _outside(frame, observe)
    if observe is not None:
        _facts.learn(frame, frame.facts_key, observe, outside)
    frame.module_state.settle(observe.state if observe is not None else [], outside)
    return frame.close(output)


def _outside(frame: Any, observe: Observe | None) -> list:
    """NOTE [Tensors read from outside the module]: what a watched forward read besides its
    arguments and its modules' state (none when unwatched: its facts say so)."""
    if observe is None or not observe.seen:
        return []
    read = [t for ref in observe.seen.values() if (t := ref()) is not None]
    return frame.module_state.outside(read, observe.state)


def _close_reentrant(frame: Any, observe: Observe | None, output: Any) -> Any:
    """Finish a reentrant region: its output flattened (NOTE [Outputs of any structure] in
    ``structure.py``), its escapes found, then its Function; return what the caller sees.

    An output that cannot be flattened is refused before anything else, with the state
    the forward wrote put back."""
    structure = None
    if not isinstance(output, torch.Tensor):  # the common case pays one check
        try:
            structure = _structure.outputs_of(frame.name, output)
        except TypeError:
            if observe is not None:
                restore_state(observe.state)
            frame.abandon()
            raise
    escaped, picks = [], None
    if observe is not None:
        frame.uses = tuple(observe.uses.get(id(a), 0) for a in frame.aliases)
        escaped, picks = _escapes.find(frame, observe, output)
    outside = _outside(frame, observe)  # after the escapes: it holds what it finds
    if observe is not None and not escaped and picks is None:
        _facts.learn(frame, frame.facts_key, observe, outside)
    state = observe.state if observe is not None else []
    frame.module_state.settle(state, outside)
    # NOTE [Reads that vary]: unwatched, the parameters the observed call read
    reads = frame.known.read() if observe is None else list(observe.reads.values())
    if structure is None:
        return _reentrant.close(frame, reads, state, output, escaped, picks)
    frame.structure = structure
    return structure.rebuild(_reentrant.close(frame, reads, state, structure.tensors, escaped, picks))


def _observer(frame: RegionCore, arguments: list, reads: bool, flowing: list | None = None
              ) -> Observe | None:
    """The mode that watches the forward; None when earlier calls showed it needs no watching."""
    facts = _facts.known(frame, frame.facts_key)  # NOTE [Observed once, confirmed every call]
    if facts is not None and (not reads or _facts.differentiates(frame, facts)):  # NOTE [Forwards
        frame.uses, frame.known = facts.uses, facts  # with nothing to differentiate] (facts.py)
        return None
    return Observe(frame.name, arguments, reads=reads, flowing=flowing)


def run(fn: Callable, args: tuple, kwargs: dict, spec: RegionSpec, *, name: str,
        context_fn: Callable | None = None) -> Any:
    """Run ``fn(*args, **kwargs)`` as a region with options ``spec``; return its output."""
    if torch.compiler.is_compiling():
        try:
            from remat._engine.trace_marks import run_marked
        except ImportError:
            return fn(*args, **kwargs)
        return run_marked(fn, args, kwargs, spec)
    fn, kwargs = _keywords_as_arguments(fn, kwargs)
    frame = None
    if _lean.plain(spec, context_fn):  # NOTE [Lean reentrant calls] (lean.py)
        frame, lean = _lean.open_frame(fn, args, kwargs, spec, name)
        if lean:
            return _run_lean(frame)
    handle = open_region(fn, args, kwargs, spec, name=name, context_fn=context_fn, frame=frame)
    try:
        output = fn(*handle.args, **handle.kwargs)
    except BaseException as err:
        _abandon(handle, *sys.exc_info())
        _explain_reentrant_error(handle, err)
        raise
    return close_region(handle, output)


def _keywords_as_arguments(fn: Callable, kwargs: dict) -> tuple[Callable, dict]:
    """NOTE [Keywords bound in a partial]
    Hugging Face's layers call their checkpoint function as ``func(partial(layer.__call__,
    **kwargs), hidden_states)``: the attention mask, the rotary embeddings and the positions
    are bound in the partial, so the region read them from outside its arguments and modules
    (NOTE [Tensors read from outside the module] in ``boundary.py``) and was watched on every
    call, paying the dispatch mode on every operator of every step. Such keywords are the
    call's own arguments: a partial's keywords that hold a tensor (or a container, which may)
    are passed as keyword arguments of the region instead, as the partial would pass them
    (``{**partial.keywords, **kwargs}``), so they are saved, versioned and keyed like any
    argument; the partial keeps its positional arguments (the layer, where it is one).
    """
    if type(fn) is not functools.partial or not fn.keywords:
        return fn, kwargs
    if not any(isinstance(v, (torch.Tensor, tuple, list, dict)) for v in fn.keywords.values()):
        return fn, kwargs
    return functools.partial(fn.func, *fn.args), {**fn.keywords, **kwargs}


def _run_lean(frame: Any) -> Any:
    """NOTE [Lean reentrant calls]: the forward on the arguments' aliases, without grad."""
    args, kwargs = frame.call_with(frame.aliases)  # NOTE [Observed reads]
    try:
        torch._C._set_grad_enabled(False)  # on: `lean.plain` saw it (a context object is a few Python calls more)
        try:
            output = frame.fn(*args, **kwargs)
        finally:
            torch._C._set_grad_enabled(True)
    except BaseException as err:
        frame.abandon()
        _explain_reentrant_error(_Handle(frame, Contexts(), (), {}), err)
        raise
    result = _lean.close(frame, output)
    return _close_reentrant(frame, None, output) if result is None else result


def _explain_reentrant_error(handle: _Handle, err: BaseException) -> None:
    """A reentrant forward that needs its tensors' graph fails in torch's words: say why.

    The reentrant implementation runs forward without grad (NOTE [Reentrant gradients] in
    ``reentrant.py``), so ``torch.autograd.grad`` inside it (a force field's ``-dE/dx``)
    finds nothing to differentiate, and a hook registered on a tensor it computes
    (``h.register_hook``, ``h.retain_grad()``) has no gradient to see; torch's reentrant
    checkpoint fails alike. The state the forward wrote so far is put back first.
    """
    frame = handle.frame
    if frame is None or not frame.spec.use_reentrant or not isinstance(err, RuntimeError):
        return
    text = str(err)
    if "does not require grad" in text:
        what = "differentiates inside its forward (torch.autograd.grad or backward on a tensor it computes"
    elif "register a hook on a tensor that doesn't require grad" in text or "can't retain_grad" in text:
        what = "registers a hook on a tensor it computes (register_hook or retain_grad"
    else:
        return
    if handle.observe is not None:
        restore_state(handle.observe.state)
    raise RecomputeError(
        f"remat: region '{frame.name}' (use_reentrant=True) {what}: {err}); the reentrant "
        f"implementation runs forward without grad, as torch's reentrant checkpoint does; use "
        f"use_reentrant=False, which supports it"
    ) from err


def _abandon(handle: _Handle, *exc_info: Any) -> None:
    """The forward raised: pop the region's hooks and modes, and let go of what it holds.

    A frame holds tensors its forward saved until it closes (NOTE [Regions that write
    their inputs]); those tensors' graphs lead back to the frame through its hooks, a
    cycle through the autograd graph that Python's collector cannot break.
    """
    try:
        handle.stack.__exit__(*exc_info)
    finally:
        if handle.frame is not None:
            handle.frame.abandon()
