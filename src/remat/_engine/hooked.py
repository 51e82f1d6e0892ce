"""``use_reentrant=False``: a region whose saved tensors are held by saved-tensor hooks (engine).

See NOTE [Regions] in ``region.py``. While the region runs forward, every tensor it
saves is packed into a `Holder`; in backward the first unpack re-runs it.

NOTE [Arguments that are one tensor]
A region called with one tensor in several argument slots (``attn(h, h, h)``) must
be re-run with one tensor there too: code may ask ``q is k`` (``nn.MultiheadAttention``
projects a packed query, key and value then, in one matrix product) and would take
another path, with other shapes or other rounding. The re-run hands the tensor saved
for the first of those slots to all of them (every slot is still saved: an enclosing
region counts what is saved); a reentrant region aliases and feeds it once.

NOTE [Early stop]
Re-running stops as soon as the last holder still needed is rebuilt: holders
that autograd already freed, and holders kept in forward, are not waited for.

NOTE [Backward inside a region's forward]
A region whose forward calls backward itself (``torch.autograd.grad`` inside
the checkpointed function, as ``checkpoint(grad(f))`` does) unpacks its own
holders while it is still running: the region re-runs, whole, before its
forward has finished. That re-run saves more tensors than the holders made so
far (everything after the backward call, and the backward call's own re-runs
of inner regions), so without early stop the count check cannot hold; as in
torch's checkpoint (``forward_completed``/``ignore_saved_mismatch``), a re-run
that starts before the region has closed rebuilds the holders that exist and
is not held to "more tensors than forward saved". Shapes are still checked,
and a re-run after the region closed is checked in full.

NOTE [Graph tasks]
Each backward call (``backward``, ``torch.autograd.grad``) is a graph task with
its own id. A region re-runs once per graph task that needs it, so
``backward(retain_graph=True)`` twice rebuilds twice and both are exact. A
rebuilt tensor is dropped as soon as it is unpacked. Inside a
``GraphExecGroup`` (remat's or torch's, NOTE [Global switches] in ``flags.py``)
the group stands for the graph task: its backward calls share one re-run, and
a saved tensor unpacked by two of them is an error.

NOTE [Inputs come back as themselves]
A saved tensor that does not require grad (a region input a custom
``autograd.Function`` saves, say) is handed back as the very object the re-run
saved, which for a region input is the input itself: ``ctx.saved_tensors[0] is
x`` holds inside a region as it does outside one (and in torch's checkpoint).

NOTE [Saved arguments are read back]
A tensor an operator saves that is one of the region's own arguments (GELU and a
matrix product save their inputs) is not rebuilt: its holder keeps a weak reference
and the version it was saved at, and backward hands back the argument itself while it
is alive at that version, as autograd would. The region keeps its arguments for its
re-run anyway, so this keeps no byte more; a region whose only saved tensors are
arguments (a marked activation or matrix product) is then re-run only when a consumer
needs its output, not for its own backward (one re-run fewer per step, for the same
gradients). An argument gone (an ``output_recompute`` chain keeps none) or changed in
place since is rebuilt as before: the re-run reads the inputs the region kept, and
refuses one changed in place.

NOTE [Keep outputs]
``Cell.recompute`` keeps the result of the cell's output operator. When the
region closes, a holder whose tensor shares storage with one of the region's
outputs (alive anyway) keeps the tensor instead of waiting for a rebuild.

NOTE [Regions that write their inputs]
A region that changes one of its inputs in place (``nn.ReLU(inplace=True)``
marked on its own, a block that starts with an in-place activation) cannot be
re-run: the input it would start from is gone. The input versions recorded
when the region opened tell, at each new operator that saves a tensor and when
the region closes. From the first sign on, the region keeps what it saves, as
if it were not marked, and takes back every earlier saved tensor still alive;
what the latest saving operator saved is held until the next one saves (an
in-place operator such as dropout's ``mul_`` saves its other operands before
it writes). It drops its saved inputs (stale, and a reference cycle through
the autograd graph if kept). Its outputs are not registered for output
recompute. An earlier saved tensor already gone (a temporary saved two saving
operators before the write) can be neither kept nor rebuilt: a
``RecomputeError`` says so when the region closes.

A kept tensor records its version. If it is changed in place after it was
kept (an in-place operator on a kept output), a region that can re-run
rebuilds it instead, as if it had not been kept; one that cannot raises
autograd's own error.

NOTE [Rebuilt tensors keep their version]
A tensor a re-run saves is handed to backward as the re-run's own tensor, so
a later operator of the same re-run that changes it in place (the forward did
the same after saving it) would hand backward the changed value: autograd's
own saved tensors record their version and refuse that, and a tensor behind a
saved-tensor hook is not checked by autograd. So a rebuilt tensor records its
version when the re-run saves it, and unpacking it at another version raises
a ``RecomputeError``. A region whose input the model writes in place after
the region read it is refused so (NOTE [Regions that write their inputs]);
inside an ``output_recompute`` region that input is rebuilt by the outer
re-run, which writes it again before the inner region's re-run reads it
(shared fuzzer case 960800: fc2's weight gradient off by 0.88, silently).
"""

from __future__ import annotations

import uuid
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from remat._engine import boundary as _boundary
from remat._engine import collectives as _collectives
from remat._engine import dead as _dead
from remat._engine import flags as _flags
from remat._engine import outputs as _outputs
from remat._engine import recipes as _recipes
from remat._engine import refusal as _refusal
from remat._engine import stages as _stages
from remat._engine import state as _state
from remat._engine.core import Contexts, RegionCore
from remat._engine.errors import RecomputeError
from remat._engine.held import HeldInputs
from remat._engine.modes import OpTrace, storage_of
from remat._engine.observe import replayed_state
from remat._engine.rebuilt import (
    Holder,
    RecomputeHooks,
    Stop,
    changed_after_rebuilt,
    check,
    meta,
    refuse_expired,
    unpacked_twice,
)
from remat._engine.selective import ReplayMode
from remat._vocab.spec import RegionSpec

_sequence_nr = torch.autograd._get_sequence_nr


def _graph_task() -> object:
    """The key of this backward call's re-runs (NOTE [Graph tasks])."""
    group = _flags.current_group()
    if group is not None:
        return group
    gid = torch._C._current_graph_task_id()
    return gid if gid != -1 else uuid.uuid4().int


def _leaves(output: Any) -> list:
    """A region's output as a flat list (a single tensor without pytree)."""
    return [output] if isinstance(output, torch.Tensor) else pytree.tree_leaves(output)


class HookedFrame(_stages.StagedRuns, HeldInputs, RegionCore):
    """A region run with saved-tensor hooks (``use_reentrant=False``): its holders and re-runs."""

    def __init__(self, fn: Callable, args: tuple, kwargs: dict, spec: RegionSpec, name: str,
                 contexts: tuple | None) -> None:
        super().__init__(fn, args, kwargs, spec, name, contexts)
        self.state: list = []  # NOTE [Observed writes]
        self.holders: list[weakref.ref] = []
        self.metas: list[tuple] = []
        self.out_refs: list[weakref.ref] = []
        self.rebuilt_outputs: dict[int, list] = {}
        self.cached_inputs: dict[int, tuple] = {}
        self.stored: set[int] = set()
        self.staged = _stages.staged(spec, contexts)  # NOTE [Re-runs in stages] (stages.py)
        self.each = _recipes.each(spec, contexts)  # NOTE [Each saved tensor rebuilt on its own]
        self.replays: dict = {}  # graph task -> its `recipes._Shared`
        self.sizes: list[int] = []  # bytes per saved tensor, when staged
        self.positions: list[int] = []  # per saved tensor, the calls of the region before it (staged)
        self.starts = [0]  # the first saved tensor of each stage
        self.stored_stages: dict[int, set[int]] = {}  # graph task -> the stages stored for it
        self.more_stages = False  # a later stage of this backward is still to re-run
        self.counter: dict[int, int] = {}
        self.expired: str | None = None  # why it let go: NOTE [Regions made inside a re-run]
        self.trace, self.recompute_trace = OpTrace() if spec.debug else None, None  # OpTrace | None
        self.saver: torch.Tensor | None = None
        self.held: list | None = None  # NOTE [Inputs held directly]
        self.input_versions: list | None = None  # until close: NOTE [Regions that write their inputs]
        self.keep_all = False
        self.lost: list[int] = []
        self.recent: list[torch.Tensor] = []  # what the latest saving operator saved
        self.recent_op = -1
        self.closed = False  # NOTE [Backward inside a region's forward]
        self.input_of: list[int] = []  # argument slot -> its saved tensor (NOTE [Arguments that are one tensor])
        self._save_inputs(self.arguments)
        self.input_versions = [(t, t._version) for t in self.arguments]
        self.argument_ids = frozenset(map(id, self.arguments))  # NOTE [Saved arguments are read back]
        self.arguments = []  # saved through the hooks around the region, not held here

    def abandon(self) -> None:
        super().abandon()
        self.input_versions, self.recent, self.saver, self.held = None, [], None, None

    def close(self, output: Any) -> Any:
        """The forward returned ``output``: settle what the region keeps; return what the caller sees."""
        self.closed = True  # NOTE [Backward inside a region's forward]
        spec = self.spec
        if not self.keep_all and self.inputs_written():  # NOTE [Regions that write their inputs]
            self.start_keeping()
        inputs = [t for t, _ in self.input_versions or ()]
        self.input_versions, self.recent = None, []
        if self.keep_all:
            self.finish_keeping()
            return output
        _refusal.pending.add(self)  # NOTE [Backward refused] (refusal.py)
        flat = _leaves(output)
        out_keys = list(map(storage_of, flat))  # each storage read once for the three uses below
        in_list = list(map(storage_of, inputs))
        in_keys = set(in_list) - {None}
        if in_keys and not in_keys.isdisjoint(out_keys):
            returned = set(out_keys)
            self._copy_returned_inputs(inputs, [k is not None and k in returned for k in in_list])
        if spec.output_recompute or spec.keep_outputs:
            self.settle_outputs(flat, out_keys)
        if self.staged:
            self.starts = _stages.stage_starts(self.sizes, self._rebuilt_ones(), self.spec.stages)
        if spec.output_recompute:  # an input passed through is not this region's to rebuild, nor
            # a tensor it returns as it was (a parameter: NOTE [Tensors returned as they were])
            _outputs.register(self, [None if k in in_keys or self.returned_as_it_was(t) else t
                                     for t, k in zip(flat, out_keys)])
        return output

    # -- forward packing ---------------------------------------------------------
    def pack(self, x: torch.Tensor) -> Holder:
        holder = Holder(len(self.holders))
        if self.input_versions and not self.keep_all:  # NOTE [Regions that write their inputs]
            op = _sequence_nr()  # one autograd node per operator
            if op != self.recent_op:
                self._next_operator(op)
            if not self.keep_all:
                self.recent.append(x)
                holder.probe_version = x._version
        self.holders.append(weakref.ref(holder))
        if self.spec.determinism_check == "default":
            self.metas.append(meta(x))
        if self.keep_all:
            holder.keep(x)
        else:
            holder.probe = weakref.ref(x)
            if id(x) in self.argument_ids:  # NOTE [Saved arguments are read back]
                holder.argument, holder.argument_version = holder.probe, x._version
        if self.trace is not None:
            holder.saved_by = self.trace.last_op
        own = self.note_staged(x, holder.index) if self.staged else None  # NOTE [Re-runs in stages]
        if self.each and not self.keep_all:  # NOTE [Each saved tensor rebuilt on its own]
            holder.recipe = _recipes.saved(self, x, holder)
        if _dead.forwards:  # NOTE [Saved inside a nested region]
            for flow in _dead.forwards:
                if flow is not own:
                    flow.note_saved(x)
        return holder

    def _next_operator(self, op: int) -> None:
        """A new operator saves: did an earlier one write an input?

        An in-place operator saves its other operands before it writes, so what
        the latest saving operator saved is held until the next one saves: a
        write by it (or by operators that save nothing after it) is seen while
        its tensors are still alive (NOTE [Regions that write their inputs]).
        """
        if self.inputs_written():
            self.start_keeping()
        else:
            self.recent.clear()
            self.recent_op = op

    def inputs_written(self) -> bool:
        """True when an input changed in place since the region opened."""
        for t, v in self.input_versions or ():
            if t._version != v:
                return True
        return False

    def start_keeping(self) -> None:
        """NOTE [Regions that write their inputs]: keep every saved tensor from now on."""
        self.keep_all = True
        for ref in self.holders:
            holder = ref()
            if holder is None or holder.kept is not None:
                continue  # freed by autograd already: not needed
            x = holder.probe() if holder.probe is not None else None
            if x is None:
                self.lost.append(holder.index)
            else:
                holder.keep_as_saved(x)
        self.recent.clear()

    def finish_keeping(self) -> None:
        """Close a region that keeps what it saved; it is never re-run."""
        self.saver = self.held = None  # the saved inputs are stale
        if self.lost:
            raise RecomputeError(
                f"remat: region '{self.name}' changed one of its inputs in place after it had "
                f"saved {len(self.lost)} tensor(s) for backward that are gone, so they can be "
                f"neither kept nor rebuilt (the input they come from was overwritten); make the "
                f"in-place operation out-of-place (e.g. inplace=False) or move it out of the region"
            )

    def settle_outputs(self, flat_outputs: list, keys: list) -> None:
        """Match saved tensors with the outputs (``keys``: their storages), once the region
        has returned.

        A holder whose tensor shares storage with an output keeps it (NOTE [Keep
        outputs]) or, under ``output_recompute``, will take it from the output
        pass (NOTE [Output pass]).
        """
        where = {k if k is not None else t.untyped_storage()._cdata: j
                 for j, (t, k) in enumerate(zip(flat_outputs, keys)) if isinstance(t, torch.Tensor)}
        for ref in self.holders:
            holder = ref()
            if holder is None or holder.probe is None:
                continue
            x, holder.probe = holder.probe(), None
            j = where.get(x.untyped_storage()._cdata) if x is not None else None
            if j is None or x.dtype != flat_outputs[j].dtype:
                continue
            if self.spec.output_recompute:
                holder.out_of = (j, (tuple(x.shape), x.stride(), x.storage_offset()))
            else:
                holder.keep(x)

    def add_output_ref(self, ref: _outputs.OutputRef) -> None:
        self.out_refs.append(weakref.ref(ref))

    # -- backward ------------------------------------------------------------------
    def unpack(self, holder: Holder) -> torch.Tensor:
        if holder.kept is not None:
            if not holder.kept_is_stale():
                return holder.kept
            if self.keep_all:  # NOTE [Regions that write their inputs]
                raise RuntimeError(
                    f"one of the variables needed for gradient computation has been modified by "
                    f"an inplace operation: [{holder.kept.type()} {list(holder.kept.shape)}] is at "
                    f"version {holder.kept._version}; expected version {holder.kept_version} instead "
                    f"(saved by remat region '{self.name}')"
                )
        if holder.argument is not None:  # NOTE [Saved arguments are read back]
            x = holder.argument()
            if x is not None and x._version == holder.argument_version:
                if holder.rebuilt:  # a re-run for the other saved tensors rebuilt it too
                    holder.rebuilt.pop(_graph_task(), None)
                return x.detach() if x.requires_grad else x
        gid = _graph_task()
        if gid not in holder.rebuilt:
            if holder.recipe is not None and (x := _recipes.rebuild(self, holder)) is not None:
                return x  # NOTE [Each saved tensor rebuilt on its own]
            if gid in self.stored and self._stage_stored(gid, holder.index):
                raise RecomputeError(unpacked_twice(self.name, holder, gid is _flags.current_group()))
            self.recompute(gid, index=holder.index)
        x, version = holder.rebuilt.pop(gid)
        if version is not None and x._version != version:
            raise RecomputeError(changed_after_rebuilt(self.name, holder, x, version))
        return x

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

    def _last_needed(self, gid: int | None = None, below: int | None = None) -> int:
        """The last saved tensor a re-run must rebuild (``below``: of those before it)."""
        below = len(self.holders) if below is None else below
        alive = [
            h.index for r in self.holders
            if (h := r()) is not None and h.kept is None and gid not in h.rebuilt and h.index < below
        ]
        return max(alive) if alive else -1

    def recompute(self, gid: int, store: bool = True, index: int | None = None) -> None:
        """`_recompute`; a refusal lets go of the regions the backward will not reach (NOTE
        [Backward refused] in ``refusal.py``)."""
        try:
            self._recompute(gid, store, index)
        except RecomputeError:
            _refusal.refused()
            raise

    def _recompute(self, gid: int, store: bool, index: int | None = None) -> None:
        """Re-run the region for graph task ``gid``.

        NOTE [Output pass]: a consumer that needs an output of an
        ``output_recompute`` region (the next region's recomputation) gets it
        from a run that stores no saved tensor (``store=False``); the inputs it
        used are held for the later run that rebuilds the saved tensors, when
        this region's own backward comes. So a chain of marked regions is never
        rebuilt all at once: backward holds one region's tensors at a time and
        the chain's boundary outputs, as a chain of plain regions would.
        """
        if self.expired:  # NOTE [Regions made inside a re-run] in region.py, [Backward refused] in refusal.py
            refuse_expired(self.name, self.expired == "refused")
        self._drop_stale_kept()
        if self.spec.output_recompute:
            _outputs.pop_after_backward()
        need_outputs = not store or self._refs_pending(gid)
        during_forward = not self.closed  # NOTE [Backward inside a region's forward]
        stop_at = self._last_needed(gid) if self.spec.early_stop and not need_outputs else None
        first = 0
        if self.staged and store:  # NOTE [Re-runs in stages]
            first, stop_at = self._stage(gid, index, stop_at)
        self.counter[gid] = 0
        self.runs += 1
        if store:
            self.stored.add(gid)
            args, kwargs = self.cached_inputs.pop(gid, None) or self.inputs()
            if self.staged and self.more_stages:  # read once per backward, as unstaged
                self.cached_inputs[gid] = (args, kwargs)
        else:
            args, kwargs = self.inputs()
            if self._last_needed() >= 0:  # some saved tensors will be rebuilt later
                self.cached_inputs[gid] = (args, kwargs)
        mismatches: list[str] = []
        with Contexts() as stack:
            stack.enter_context(_state.recomputing())
            stack.enter_context(self.module_state_restored(self.state))  # NOTE [Module state at the boundary]
            if self.state:
                stack.enter_context(replayed_state(self.state))  # outside every mode (NOTE [Observed writes])
            stack.enter_context(self.replay.context())
            stack.enter_context(torch.enable_grad())
            stack.enter_context(RecomputeHooks(self, gid, stop_at, mismatches, store, first))
            if self.kept_collectives is not None:
                stack.enter_context(_collectives.replaying(self))  # NOTE [Kept collectives]
            if self.contexts is not None:
                if type(self.contexts[1]) is ReplayMode:  # NOTE [Dead operators in a selective re-run]
                    self.contexts[1].prune = stop_at is not None  # early stop, carried through
                stack.enter_context(self.contexts[1])
            if self.trace is not None:
                self.recompute_trace = stack.enter_context(OpTrace())
            try:
                out = self.fn(*args, **kwargs)
            except Stop:
                out = None
        check(self, gid, stop_at, mismatches, during_forward)
        if need_outputs:
            flat = _leaves(out)
            self.rebuilt_outputs[gid] = [x.detach() if isinstance(x, torch.Tensor) else x for x in flat]
            self._fill_from_outputs(gid)

    def expire(self, why: str = "re-run") -> None:
        """NOTE [Regions made inside a re-run] (``region.py``), NOTE [Backward refused]
        (``refusal.py``): let go of what a re-run needs."""
        self.expired, self.module_state = why, _boundary.ModuleState(self.name, [])
        self.state, self.cached_inputs, self.rebuilt_outputs = [], {}, {}
        self.saver = self.held = None
        _refusal.pending.discard(self)

    def _drop_stale_kept(self) -> None:
        """Kept tensors changed in place since are rebuilt (NOTE [Regions that write their inputs])."""
        if not self.spec.keep_outputs or self.spec.output_recompute:
            return  # nothing kept
        for ref in self.holders:
            holder = ref()
            if holder is not None and holder.kept_is_stale():
                holder.kept = None

    def _fill_from_outputs(self, gid: int) -> None:
        """Saved tensors that are outputs come from the output pass, not from another run."""
        outputs = self.rebuilt_outputs[gid]
        for ref in self.holders:
            holder = ref()
            if holder is not None and holder.out_of is not None and gid not in holder.rebuilt:
                j, (size, stride, offset) = holder.out_of
                holder.rebuilt[gid] = (outputs[j].as_strided(size, stride, offset), None)


class ForwardHooks(torch.autograd.graph.saved_tensors_hooks):
    def __init__(self, frame: HookedFrame) -> None:
        super().__init__(frame.pack, frame.unpack)
