"""The recompute engine: regions whose saved tensors are rebuilt in backward.

NOTE [Regions]
A region is a callable run with its arguments. While it runs forward, every
tensor it saves for backward is replaced by a :class:`_Holder` and dropped; its
inputs are saved once, through whatever saved-tensor hooks are outside it (so a
region nested in another keeps nothing the outer one drops). In backward, the
first unpack of a holder re-runs the region once, under the forward's random
and autocast state, and every holder still alive gets its tensor back.

NOTE [Early stop]
Re-running stops as soon as the last holder still needed is rebuilt: holders
that autograd already freed, and holders kept in forward, are not waited for.

NOTE [Graph tasks]
Each backward call (``backward``, ``torch.autograd.grad``) is a graph task with
its own id. A region re-runs once per graph task that needs it, so
``backward(retain_graph=True)`` twice rebuilds twice and both are exact. A
rebuilt tensor is dropped as soon as it is unpacked.

NOTE [Keep outputs]
``Cell.recompute`` keeps the result of the cell's output operator. When the
region closes, a holder whose tensor shares storage with one of the region's
outputs (alive anyway) keeps the tensor instead of waiting for a rebuild.

Two implementations share all of this: saved-tensor hooks (``use_reentrant=
False``) and a custom ``autograd.Function`` (``use_reentrant=True``), which
runs the forward without grad and the whole region again inside its backward.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import types
import uuid
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from remat import _outputs, _rng, _state
from remat._errors import RecomputeError
from remat._modes import OpTrace, StateGuard
from remat._policy import save_all
from remat._selective import policy_context
from remat._spec import RegionSpec

_local = threading.local()


def _recomputing_fns() -> list:
    if not hasattr(_local, "fns"):
        _local.fns = []
    return _local.fns


def passes_through(module: Any) -> bool:
    """Return True when ``module`` is being re-run by its own region (its hooks stay quiet)."""
    fns = _recomputing_fns()
    return bool(fns) and fns[-1] is module


def _graph_task() -> int:
    gid = torch._C._current_graph_task_id()
    return gid if gid != -1 else uuid.uuid4().int


def _meta(x: torch.Tensor) -> tuple:
    return (tuple(x.shape), x.dtype, x.device)


def _show_meta(meta: tuple) -> str:
    shape, dtype, device = meta
    return f"shape {list(shape)}, {str(dtype).replace('torch.', '')}, {device}"


def _reachable(fn: Any, args: Any, limit: int = 2000) -> tuple[list, list] | None:
    """The modules and tensors ``fn`` can reach, or None when ``fn`` is opaque.

    NOTE [What a region reaches]: followed are ``fn`` itself, a bound method's
    ``__self__``, a function's closure, defaults and the globals it names,
    ``functools.partial`` arguments, and lists, tuples and dicts of those. The
    state guard (NOTE [Guard only when needed]) and the reentrant region's
    parameter inputs use it. A callable object that is not a module, or a walk
    longer than ``limit``, is opaque.
    """
    modules, tensors, seen = [], [], set()
    todo = [fn, *pytree.tree_leaves(args)]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if len(seen) > limit:
            return None
        if isinstance(obj, torch.nn.Module):
            modules.append(obj)
        elif isinstance(obj, torch.Tensor):
            tensors.append(obj)
        elif isinstance(obj, (list, tuple)):
            todo.extend(obj)
        elif isinstance(obj, dict):
            todo.extend(obj.values())
        elif isinstance(obj, functools.partial):
            todo.extend([obj.func, *obj.args, *obj.keywords.values()])
        elif isinstance(obj, types.MethodType):
            todo.extend([obj.__self__, obj.__func__])
        elif isinstance(obj, types.FunctionType):
            todo.extend(c.cell_contents for c in obj.__closure__ or () if _filled(c))
            todo.extend(obj.__defaults__ or ())
            todo.extend((obj.__kwdefaults__ or {}).values())
            names = obj.__code__.co_names
            todo.extend(obj.__globals__[n] for n in names if n in obj.__globals__)
        elif obj is fn:
            return None
    return modules, tensors


def _filled(cell: Any) -> bool:
    try:
        _ = cell.cell_contents
    except ValueError:
        return False
    return True


def _state_tensors(reached: tuple[list, list], inputs: list) -> list:
    """Buffers of the reached modules, reached tensors and inputs, with their versions.

    Parameters are left out: autograd refuses in-place writes to them under grad.
    """
    modules, tensors = reached
    found, todo = list(tensors) + inputs, list(modules)
    while todo:
        module = todo.pop()
        found.extend(b for b in module._buffers.values() if b is not None)
        todo.extend(m for m in module._modules.values() if m is not None)
    return [(t, t._version) for t in found]


def _parameters(reached: tuple[list, list] | None, inputs: list) -> list:
    """Leaf tensors requiring grad that ``fn`` reaches and that are not inputs already."""
    if reached is None:
        return []
    modules, tensors = reached
    taken = {id(t) for t in inputs}
    out = []
    for t in [p for m in modules for p in m.parameters()] + tensors:
        if t.requires_grad and t.is_leaf and id(t) not in taken:
            taken.add(id(t))
            out.append(t)
    return out


def _norms_writing_only(modules: list, written: list) -> list:
    """The batch norms in ``modules`` if their running statistics are all that was written.

    NOTE [Quiet batch norms]: BatchNorm in training mode normalizes with the
    batch's statistics; its running statistics are only written, never read.
    If they are the only state the forward wrote, the re-run writes them as
    usual and their values are put back afterwards (a copy of a few numbers
    per channel), instead of running every operator under the state guard.
    """
    if not written:
        return []
    norms, todo = [], list(modules)
    while todo:
        module = todo.pop()
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            norms.append(module)
        todo.extend(m for m in module._modules.values() if m is not None)
    stats = {id(b) for m in norms if m.training and m.track_running_stats
             for b in (m.running_mean, m.running_var, m.num_batches_tracked) if b is not None}
    if not all(id(t) in stats for t in written):
        return []
    return [m for m in norms if m.training and m.track_running_stats]


@contextlib.contextmanager
def _quiet(norms: list) -> Any:
    """Put the running statistics of ``norms`` back as they were. See NOTE [Quiet batch norms]."""
    stats = [b for m in norms for b in (m.running_mean, m.running_var, m.num_batches_tracked)
             if b is not None]
    before = [b.clone() for b in stats]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, value in zip(stats, before):
                b.copy_(value)


class _Stop(Exception):
    """Raised inside a re-run once the last needed tensor is rebuilt (NOTE [Early stop])."""


class _Holder:
    __slots__ = ("__weakref__", "index", "kept", "out_of", "probe", "rebuilt", "saved_by")

    def __init__(self, index: int) -> None:
        self.index = index
        self.kept: torch.Tensor | None = None
        self.rebuilt: dict[int, torch.Tensor] = {}
        self.probe: weakref.ref | None = None
        self.out_of: tuple | None = None  # (output index, layout) when it is an output
        self.saved_by: str | None = None


class _SaveInputs(torch.autograd.Function):
    """Saves a region's tensor inputs through the saved-tensor hooks around the region."""

    @staticmethod
    def forward(ctx: Any, dummy: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*tensors)
        return dummy.new_empty((0,))

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> None:  # pragma: no cover - never differentiated
        raise AssertionError("remat internal error: the input saver was differentiated")


class _Frame:
    """One forward run of a region, and what it needs to re-run it."""

    def __init__(self, fn: Callable, args: tuple, kwargs: dict, spec: RegionSpec, name: str,
                 contexts: tuple | None) -> None:
        self.fn, self.spec, self.name = fn, spec, name
        self.contexts = contexts
        if not kwargs and all(isinstance(a, torch.Tensor) for a in args):
            leaves, self.treespec = list(args), None  # the common case, without pytree
        else:
            leaves, self.treespec = pytree.tree_flatten((args, kwargs))
        self.tensor_slots = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        self.leaves = [None if isinstance(x, torch.Tensor) else x for x in leaves]
        tensors = [leaves[i] for i in self.tensor_slots]
        self.replay = _rng.capture(tensors, spec.preserve_rng_state)
        reached = _reachable(fn, tensors if self.treespec is None else (args, kwargs))
        self.watch = _state_tensors(reached, tensors) if reached is not None else None
        self.modules = reached[0] if reached is not None else []
        self.guard = True
        self.quiet_norms: list = []
        self.holders: list[weakref.ref] = []
        self.metas: list[tuple] = []
        self.out_refs: list[weakref.ref] = []
        self.rebuilt_outputs: dict[int, list] = {}
        self.cached_inputs: dict[int, tuple] = {}
        self.stored: set[int] = set()
        self.counter: dict[int, int] = {}
        self.runs = 0
        self.trace: OpTrace | None = OpTrace() if spec.debug else None
        self.recompute_trace: OpTrace | None = None
        self.saver: torch.Tensor | None = None
        self.pending: Any = None
        if spec.use_reentrant:
            self.pending_inputs = tensors  # handed to _Reentrant.apply, which saves them
            self.params = _parameters(reached, tensors)
            self.opaque = reached is None
        else:
            self._save_inputs(tensors)

    # -- inputs ----------------------------------------------------------------
    def _save_inputs(self, tensors: list) -> None:
        if tensors:
            dummy = torch.empty((0,), requires_grad=True)
            self.saver = _SaveInputs.apply(dummy, *tensors)

    def inputs(self) -> tuple[tuple, dict]:
        leaves = list(self.leaves)
        saved = self.saver.grad_fn.saved_tensors if self.saver is not None else ()
        for slot, x in zip(self.tensor_slots, saved):
            leaves[slot] = x
        return self.unflatten(leaves)

    def unflatten(self, leaves: list) -> tuple[tuple, dict]:
        if self.treespec is None:
            return tuple(leaves), {}
        return pytree.tree_unflatten(leaves, self.treespec)

    # -- forward packing ---------------------------------------------------------
    def pack(self, x: torch.Tensor) -> _Holder:
        holder = _Holder(len(self.holders))
        self.holders.append(weakref.ref(holder))
        if self.spec.determinism_check == "default":
            self.metas.append(_meta(x))
        if self.spec.keep_outputs or self.spec.output_recompute:
            holder.probe = weakref.ref(x)
        if self.trace is not None:
            holder.saved_by = self.trace.last_op
        return holder

    def keep_outputs(self, flat_outputs: list) -> None:
        """NOTE [Keep outputs]: holders whose tensor shares storage with an output keep it."""
        keys = {t.untyped_storage()._cdata for t in flat_outputs if isinstance(t, torch.Tensor)}
        for ref in self.holders:
            holder = ref()
            if holder is None or holder.probe is None:
                continue
            x, holder.probe = holder.probe(), None
            if x is not None and x.untyped_storage()._cdata in keys:
                holder.kept = x.detach()

    def note_outputs(self, flat_outputs: list) -> None:
        """NOTE [Output pass]: remember which saved tensors are (views of) outputs."""
        where = {t.untyped_storage()._cdata: j for j, t in enumerate(flat_outputs)
                 if isinstance(t, torch.Tensor)}
        for ref in self.holders:
            holder = ref()
            if holder is None or holder.probe is None:
                continue
            x, holder.probe = holder.probe(), None
            j = where.get(x.untyped_storage()._cdata) if x is not None else None
            if j is not None and x.dtype == flat_outputs[j].dtype:
                holder.out_of = (j, (tuple(x.shape), x.stride(), x.storage_offset()))

    def add_output_ref(self, ref: _outputs.OutputRef) -> None:
        self.out_refs.append(weakref.ref(ref))

    # -- backward ------------------------------------------------------------------
    def unpack(self, holder: _Holder) -> torch.Tensor:
        if holder.kept is not None:
            return holder.kept
        gid = _graph_task()
        if gid not in holder.rebuilt:
            if gid in self.stored:
                raise RecomputeError(
                    f"remat: region '{self.name}': saved tensor #{holder.index} was unpacked twice "
                    f"in one backward; unpack each saved tensor once (ctx.saved_tensors once)"
                )
            self.recompute(gid)
        return holder.rebuilt.pop(gid)

    def rebuild_output(self, index: int, ref: _outputs.OutputRef) -> torch.Tensor:
        """NOTE [Output pass]: rebuild an output for a consumer, keeping nothing else."""
        gid = _graph_task()
        ref.done.add(gid)
        if gid not in self.rebuilt_outputs:
            self.recompute(gid, store=False)
        outputs = self.rebuilt_outputs[gid]
        if not self._refs_pending(gid):
            del self.rebuilt_outputs[gid]
        return outputs[index]

    def _refs_pending(self, gid: int) -> bool:
        return any((r := ref()) is not None and gid not in r.done for ref in self.out_refs)

    def _last_needed(self, gid: int | None = None) -> int:
        alive = [
            h.index for r in self.holders
            if (h := r()) is not None and h.kept is None and gid not in h.rebuilt
        ]
        return max(alive) if alive else -1

    def recompute(self, gid: int, store: bool = True) -> None:
        """Re-run the region for graph task ``gid``.

        NOTE [Output pass]: a consumer that needs an output of an
        ``output_recompute`` region (the next region's recomputation) gets it
        from a run that stores no saved tensor (``store=False``); the inputs it
        used are held for the later run that rebuilds the saved tensors, when
        this region's own backward comes. So a chain of marked regions is never
        rebuilt all at once: backward holds one region's tensors at a time and
        the chain's boundary outputs, as a chain of plain regions would.
        """
        need_outputs = not store or self._refs_pending(gid)
        stop_at = self._last_needed(gid) if self.spec.early_stop and not need_outputs else None
        self.counter[gid] = 0
        self.runs += 1
        if store:
            self.stored.add(gid)
            args, kwargs = self.cached_inputs.pop(gid, None) or self.inputs()
        else:
            args, kwargs = self.inputs()
            if self._last_needed() >= 0:  # some saved tensors will be rebuilt later
                self.cached_inputs[gid] = (args, kwargs)
        mismatches: list[str] = []
        with contextlib.ExitStack() as stack:
            stack.enter_context(_state.recomputing())
            stack.enter_context(self.replay.context())
            stack.enter_context(torch.enable_grad())
            stack.enter_context(_RecomputeHooks(self, gid, stop_at, mismatches, store))
            if self.contexts is not None:
                stack.enter_context(self.contexts[1])
            if self.guard:
                stack.enter_context(StateGuard())
            stack.enter_context(_quiet(self.quiet_norms))
            if self.trace is not None:
                self.recompute_trace = stack.enter_context(OpTrace())
            _recomputing_fns().append(self.fn)
            stack.callback(_recomputing_fns().pop)
            try:
                out = self.fn(*args, **kwargs)
            except _Stop:
                out = None
        self._check(gid, stop_at, mismatches)
        if need_outputs:
            flat = pytree.tree_leaves(out)
            self.rebuilt_outputs[gid] = [x.detach() if isinstance(x, torch.Tensor) else x for x in flat]
            self._fill_from_outputs(gid)

    def _fill_from_outputs(self, gid: int) -> None:
        """Saved tensors that are outputs come from the output pass, not from another run."""
        outputs = self.rebuilt_outputs[gid]
        for ref in self.holders:
            holder = ref()
            if holder is not None and holder.out_of is not None and gid not in holder.rebuilt:
                j, (size, stride, offset) = holder.out_of
                holder.rebuilt[gid] = outputs[j].as_strided(size, stride, offset)

    def _check(self, gid: int, stop_at: int | None, mismatches: list[str]) -> None:
        count = self.counter[gid]
        expected = len(self.holders) if stop_at is None else stop_at + 1
        if self.spec.determinism_check == "none":
            return
        if count != expected and not (stop_at is not None and count > stop_at):
            mismatches.insert(0, f"forward saved {len(self.holders)} tensors, recomputation saved {count}")
        if mismatches:
            raise RecomputeError(self._mismatch_message(mismatches))

    def _mismatch_message(self, mismatches: list[str]) -> str:
        text = (
            f"remat: region '{self.name}' rebuilt tensors that differ from the ones saved in "
            f"forward:\n  " + "\n  ".join(mismatches)
        )
        if self.trace is not None and self.recompute_trace is not None:
            return (
                f"{text}\n\nOperators run in forward:\n{self.trace.render()}\n\n"
                f"Operators run in recomputation:\n{self.recompute_trace.render()}"
            )
        return text + "\nPass debug=True to print the operators run in forward and in recomputation."


class _ForwardHooks(torch.autograd.graph.saved_tensors_hooks):
    def __init__(self, frame: _Frame) -> None:
        super().__init__(frame.pack, frame.unpack)


class _RecomputeHooks(torch.autograd.graph.saved_tensors_hooks):
    """Collect the tensors a re-run saves into the holders of the forward."""

    def __init__(self, frame: _Frame, gid: int, stop_at: int | None, mismatches: list,
                 store: bool) -> None:
        def pack(x: torch.Tensor) -> torch.Tensor:
            index = frame.counter[gid]
            frame.counter[gid] = index + 1
            x = x.detach()
            if index >= len(frame.holders):
                return x
            if frame.metas and frame.metas[index] != _meta(x):
                holder = frame.holders[index]()
                by = f" (saved by {holder.saved_by})" if holder is not None and holder.saved_by else ""
                mismatches.append(
                    f"tensor #{index}{by}: forward {_show_meta(frame.metas[index])}; "
                    f"recomputation {_show_meta(_meta(x))}"
                )
            holder = frame.holders[index]() if store else None
            if holder is not None and holder.kept is None and gid not in holder.rebuilt:
                holder.rebuilt[gid] = x
            if stop_at is not None and index >= stop_at:
                raise _Stop
            return x

        super().__init__(pack, lambda x: x)


class _Reentrant(torch.autograd.Function):
    """``use_reentrant=True``: the forward ran without grad; backward re-runs the region.

    The parameters the region reaches (NOTE [What a region reaches]) are inputs
    of this Function too, so ``torch.autograd.grad`` gets their gradients (torch's
    reentrant checkpoint refuses ``torch.autograd.grad``).
    """

    @staticmethod
    def forward(ctx: Any, frame: _Frame, n_inputs: int, *tensors: torch.Tensor) -> Any:
        ctx.frame, ctx.n_inputs = frame, n_inputs
        ctx.save_for_backward(*tensors[:n_inputs])
        out, frame.pending = frame.pending, None
        return out

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        frame: _Frame = ctx.frame
        in_backward_call = torch.autograd._is_checkpoint_valid()
        if not in_backward_call and frame.opaque:
            raise RecomputeError(
                f"remat: region '{frame.name}' uses use_reentrant=True and remat cannot see which "
                f"parameters it uses, so it does not work with torch.autograd.grad or "
                f"backward(inputs=...); pass a module, or use use_reentrant=False"
            )
        try:
            tensors = ctx.saved_tensors
        except RuntimeError as err:
            raise RecomputeError(
                f"remat: backward ran a second time through reentrant region '{frame.name}' after "
                f"its saved inputs were freed; pass retain_graph=True to the first backward, or "
                f"use use_reentrant=False"
            ) from err
        inputs = [x.detach().requires_grad_(x.requires_grad) for x in tensors]
        with _quiet(frame.quiet_norms):  # its inner backward reads the saved statistics
            return _Reentrant._backward(frame, inputs, grads, in_backward_call)

    @staticmethod
    def _backward(frame: _Frame, inputs: list, grads: tuple, in_backward_call: bool) -> tuple:
        outs = _rerun_reentrant(frame, inputs)
        pairs = [(o, g) for o, g in zip(outs, grads) if isinstance(o, torch.Tensor) and o.requires_grad]
        wrt = [x for x in inputs if x.requires_grad]
        if in_backward_call:  # parameters accumulate as in any backward
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            input_grads = [x.grad if x.requires_grad else None for x in inputs]
            return (None, None, *input_grads) + (None,) * len(frame.params)
        wrt = wrt + frame.params
        found = torch.autograd.grad(
            [o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True
        ) if pairs and wrt else [None] * len(wrt)
        by_id = {id(t): g for t, g in zip(wrt, found)}
        input_grads = [by_id.get(id(x)) for x in inputs]
        return (None, None, *input_grads, *[by_id.get(id(p)) for p in frame.params])


def _rerun_reentrant(frame: _Frame, inputs: list) -> tuple:
    leaves = list(frame.leaves)
    for slot, x in zip(frame.tensor_slots, inputs):
        leaves[slot] = x
    args, kwargs = frame.unflatten(leaves)
    frame.runs += 1
    guard = StateGuard() if frame.guard else contextlib.nullcontext()
    with _state.recomputing(), frame.replay.context(), torch.enable_grad(), guard:
        _recomputing_fns().append(frame.fn)
        try:
            out = frame.fn(*args, **kwargs)
        finally:
            _recomputing_fns().pop()
    return out if isinstance(out, tuple) else (out,)


def _check_reentrant_args(name: str, args: tuple, kwargs: dict) -> None:
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


def _check_reentrant_outputs(name: str, out: Any) -> None:
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


class _Handle:
    """An open region: what close_region needs to finish it."""

    def __init__(self, frame: _Frame | None, stack: contextlib.ExitStack) -> None:
        self.frame, self.stack = frame, stack
        self.exc = sys.exc_info()[1]


def _contexts(spec: RegionSpec, context_fn: Callable | None) -> tuple | None:
    if spec.policy is not None:
        return policy_context(spec.policy)()
    if context_fn is not None:
        return tuple(context_fn())
    return None


def open_region(fn: Callable, args: tuple, kwargs: dict, spec: RegionSpec, *, name: str,
                context_fn: Callable | None = None) -> _Handle:
    """Start a region around the forward of ``fn(*args, **kwargs)``; finish it with :func:`close_region`.

    Args:
        fn: what recomputation re-runs (a module, called through its hooks, or a function).
        args, kwargs: its arguments.
        spec: the region's options.
        name: how errors name the region.
        context_fn: returns the (forward, recomputation) context pair, as in torch.

    Returns:
        A handle for :func:`close_region`.
    """
    _outputs.pop_hook()
    stack = contextlib.ExitStack()
    if not torch.is_grad_enabled() or spec.policy == save_all:
        return _Handle(None, stack)
    if spec.use_reentrant:
        _check_reentrant_args(name, args, kwargs)
    frame = _Frame(fn, args, kwargs, spec, name, _contexts(spec, context_fn))
    try:
        if spec.use_reentrant:
            stack.enter_context(torch.no_grad())
        else:
            stack.enter_context(_ForwardHooks(frame))
            if frame.contexts is not None:
                stack.enter_context(frame.contexts[0])
            if frame.trace is not None:
                stack.enter_context(frame.trace)
    except BaseException:
        stack.close()
        raise
    return _Handle(frame, stack)


def close_region(handle: _Handle, output: Any) -> Any:
    """Finish a region opened by :func:`open_region`; return what the caller should see.

    When the forward raised (this is called from an always-call module hook),
    the region's hooks and contexts are popped and ``None`` is returned.
    """
    error = sys.exc_info()[1]
    if error is not None and error is not handle.exc:
        handle.stack.__exit__(type(error), error, error.__traceback__)
        return None
    handle.stack.close()
    frame = handle.frame
    if frame is None:
        return output
    if frame.watch is not None:  # NOTE [Guard only when needed]
        written = [t for t, v in frame.watch if t._version != v]
        frame.watch = None
        frame.quiet_norms = _norms_writing_only(frame.modules, written)
        frame.guard = bool(written) and not frame.quiet_norms
    spec = frame.spec
    if spec.use_reentrant:
        _check_reentrant_outputs(frame.name, output)
        frame.pending, tensors, frame.pending_inputs = output, frame.pending_inputs, []
        return _Reentrant.apply(frame, len(tensors), *tensors, *frame.params)
    flat = pytree.tree_leaves(output)
    if spec.output_recompute:
        frame.note_outputs(flat)
        _outputs.register(frame, flat)
    elif spec.keep_outputs:
        frame.keep_outputs(flat)
    return output


def run(fn: Callable, args: tuple, kwargs: dict, spec: RegionSpec, *, name: str,
        context_fn: Callable | None = None) -> Any:
    """Run ``fn(*args, **kwargs)`` as a region with options ``spec``; return its output."""
    if torch.compiler.is_compiling():
        try:
            from remat._trace_marks import run_marked
        except ImportError:
            return fn(*args, **kwargs)
        return run_marked(fn, args, kwargs, spec)
    handle = open_region(fn, args, kwargs, spec, name=name, context_fn=context_fn)
    try:
        output = fn(*args, **kwargs)
    except BaseException:
        handle.stack.__exit__(*sys.exc_info())
        raise
    return close_region(handle, output)

