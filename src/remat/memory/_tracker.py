"""``remat.memory.track``: exact live-storage bytes over a step (layer 4: tools).

A `MemoryTracker` is a ``TorchDispatchMode`` that looks at the result of
every operator. Each new untyped storage is counted once, when it first
appears as an output, and uncounted when its storage object dies (a weak
reference finalizer on the storage). Views and in-place results share their
base's storage, so they cost nothing. Storages first seen as *inputs* existed
before the step (parameters, inputs, optimizer state): they form the baseline.

Each allocation is attributed to the innermost module running when it was made
(global forward hooks keep the module stack; in backward, the module whose
forward created the autograd node being run) and to a phase: ``forward``,
``backward`` (inside an autograd graph task), ``recompute``
(`remat.is_recomputing`), or a label given with `MemoryTracker.phase`.

It works alike on CPU, CUDA and fake tensors (``FakeTensorMode``: enter
``track()`` *inside* the fake mode). Allocations that bypass the dispatcher
(e.g. a oneDNN convolution workspace) are not seen.

NOTE [Memory per rank]
Under ``torch.distributed`` the tracker counts what this rank holds. An
operator on a tensor subclass (DTensor, ``AsyncCollectiveTensor``) is handed
to the subclass first, so the tracker sees the local operators it runs and
counts a DTensor by its local shard, not by its global size. The fake tensors
of global shape DTensor's sharding propagation makes are not memory: in a real
run they belong to no fake mode the tracker counts, and in a fake run
([`remat.estimate`][remat.estimate] with ``world_size``) they would be the run's own fake
tensors, so the tracker looks away while DTensor propagates. FSDP2 allocates and
frees a unit's gathered parameters by resizing their storages, outside the
dispatcher: while tracking, its ``alloc_storage``/``free_storage`` report
each resize, so gathered parameters count while they exist.

Gloo's buffers inside collective operators: NOTE [Collective temporaries] in
``_collective_buffers.py``; the storages of an operator's operands: ``_storages.py``.
The random-state snapshots a region keeps are made without an operator: the engine
reports them (``remat._engine.state.note_allocation``) and they count while they live.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from typing_extensions import Self

from remat._engine.state import is_recomputing, listening_to_allocations
from remat.memory._collective_buffers import (
    _COLLECTIVE_NAMESPACES,
    _temporary,
    _Waits,
    look_away_from_sharding_propagation,
)
from remat.memory._report import format_bytes
from remat.memory._storages import (
    _key,
    _operands,
    _storages,
    _tensors_of,
)

OUTSIDE = "(outside modules)"
PHASES = ("forward", "backward", "recompute")


@dataclass
class _Record:
    nbytes: int
    module: str
    phase: str
    baseline: bool = False


@dataclass(frozen=True)
class PeakReport:
    """What was alive at the peak of a tracked step.

    Args:
        total_bytes: baseline plus the largest increase: the step's peak footprint.
        increase_bytes: the largest increase over the bytes alive at the start.
        baseline_bytes: bytes of storages that existed before the step and were used.
        phase: the phase running when the peak was reached.
        by_module: bytes allocated during the step and alive at the peak, per module.
        by_phase: the same bytes per phase that allocated them.
    """

    total_bytes: int
    increase_bytes: int
    baseline_bytes: int
    phase: str
    by_module: dict = field(default_factory=dict)
    by_phase: dict = field(default_factory=dict)


class MemoryTracker(TorchDispatchMode):
    """Record live storage bytes of every operator run while active; see `track`."""

    def __init__(self, model: torch.nn.Module | None = None, baseline: Iterable[Any] = ()) -> None:
        super().__init__()
        self._names: dict[int, str] = {}
        if model is not None:
            self._names = {id(m): (n or type(m).__name__) for n, m in model.named_modules()}
        self._records: dict[int, _Record] = {}
        self._finalizers: dict[int, weakref.finalize] = {}
        self._live_by: dict[tuple[str, str], int] = {}
        self._stack: list[str] = []
        self._node_module: dict[int, str] = {}
        self._label = "forward"
        self._hooks: list[Any] = []
        self.live_bytes = 0
        self.baseline_bytes = 0
        self.peak_increase = 0
        self.peak_phase = "forward"
        self.peak_index = 0
        self._peak_by: dict[tuple[str, str], int] = {}
        #: ``(live bytes above the start, phase)`` after every allocation and free.
        self.timeline: list[tuple[int, str]] = [(0, "forward")]
        self.cuda_peak_bytes: int | None = None
        self._cuda, self._cuda_start = False, 0
        self._fake_ok = False
        self._patches: list[tuple[Any, str, Any]] = []
        self._pending: list[_Record] = []  # NOTE [Collective temporaries]
        self._pending_by_output: dict[int, _Waits] = {}
        self._listening: Any = None
        self._quiet = 0  # inside DTensor's sharding propagation (NOTE [Memory per rank])
        #: called after every allocation and free with ``(live bytes above the start, phase,
        #: module running)``: where in the step each footprint was reached (the planner's
        #: composed verification, NOTE [Verifying by composition] in ``planner/_verify.py``)
        self.on_change: Callable[[int, str, str], None] | None = None
        for obj in (model, *baseline):
            self.add_baseline(obj)

    # --- public reading ------------------------------------------------------

    @property
    def peak_bytes(self) -> int:
        """Peak footprint of the step: baseline bytes plus the largest increase."""
        return self.baseline_bytes + self.peak_increase

    @property
    def cuda_peak_increase(self) -> int | None:
        """The CUDA allocator's peak above what it held on entry (``None`` off CUDA): the
        figure to set beside `peak_increase`. ``cuda_peak_bytes`` is the absolute peak, and
        holds what no operator allocates in the step, such as cuBLAS's workspaces (one per
        stream, taken at its first product and kept)."""
        if self.cuda_peak_bytes is None:
            return None
        return self.cuda_peak_bytes - self._cuda_start

    def peak(self) -> PeakReport:
        """Return what was alive at the peak, grouped by module and by phase."""
        by_module: dict[str, int] = {}
        by_phase: dict[str, int] = {}
        for (module, phase), nbytes in self._peak_by.items():
            if nbytes:
                by_module[module] = by_module.get(module, 0) + nbytes
                by_phase[phase] = by_phase.get(phase, 0) + nbytes
        order = sorted(by_module.items(), key=lambda kv: -kv[1])
        return PeakReport(
            self.peak_bytes, self.peak_increase, self.baseline_bytes, self.peak_phase,
            dict(order), by_phase,
        )

    def live_by_module(self, *, exclude: Iterable[torch.Tensor] = ()) -> dict[str, int]:
        """Bytes allocated during the step and alive now, per module that allocated them.

        Args:
            exclude: tensors whose storages are left out (e.g. the loss).
        """
        skip = {_key(s) for s in _storages(exclude)}
        out: dict[str, int] = {}
        for key, rec in self._records.items():
            if not rec.baseline and key not in skip:
                out[rec.module] = out.get(rec.module, 0) + rec.nbytes
        return out

    def creator_of(self, tensor: torch.Tensor) -> str | None:
        """Name the module that allocated ``tensor``'s storage in this step (None: baseline/unseen)."""
        rec = self._records.get(_key(tensor.untyped_storage()))
        return None if rec is None or rec.baseline else rec.module

    def summary(self) -> str:
        """A few lines: peak, baseline, increase, phase and the largest modules at the peak."""
        report = self.peak()
        lines = [
            (f"peak {format_bytes(report.total_bytes)} = baseline {format_bytes(report.baseline_bytes)} "
            f"+ increase {format_bytes(report.increase_bytes)} (reached in {report.phase})"),
        ]
        for name, nbytes in list(report.by_module.items())[:8]:
            lines.append(f"  {name:<40} {format_bytes(nbytes)}")
        return "\n".join(lines)

    # --- control ---------------------------------------------------------------

    def add_baseline(self, obj: Any) -> None:
        """Count the storages of ``obj`` (tensor, module, optimizer, or nest of them) as baseline."""
        for storage in _storages(_tensors_of(obj)):
            self._see_input(storage)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Label allocations outside backward and recomputation with ``name`` (e.g. ``optimizer``)."""
        old, self._label = self._label, name
        try:
            yield
        finally:
            self._label = old

    # --- the mode ----------------------------------------------------------------

    def __enter__(self) -> Self:
        nn_module = torch.nn.modules.module
        self._hooks = [
            nn_module.register_module_forward_pre_hook(self._enter_module),
            nn_module.register_module_forward_hook(self._exit_module, always_call=True),
        ]
        self._fake_ok = torch._guards.detect_fake_mode() is not None
        self._patch_fsdp()
        self._patch_sharding_propagation()
        self._listening = listening_to_allocations(self._see_noted)
        self._listening.__enter__()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self._cuda = True
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._cuda_start = torch.cuda.memory_allocated()
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        if self._listening is not None:
            self._listening.__exit__(None, None, None)
            self._listening = None
        for module, name, original in self._patches:
            setattr(module, name, original)
        self._patches = []
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self._cuda:
            torch.cuda.synchronize()
            self.cuda_peak_bytes = torch.cuda.max_memory_allocated()
        for fin in self._finalizers.values():
            fin.detach()
        self._finalizers.clear()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        if any(getattr(t, "__tensor_flatten__", None) is not None for t in types):
            return NotImplemented  # NOTE [Memory per rank]: see the subclass's local operators
        if self._quiet:  # DTensor's sharding propagation: fake tensors of global shape
            return func(*args, **(kwargs or {}))
        for storage in _storages(_operands(args, kwargs), self._fake_ok):
            self._see_input(storage)
        temporary = _temporary(func, args, kwargs) if func.namespace in _COLLECTIVE_NAMESPACES else None
        held: list[_Record] = []
        if temporary is not None:  # NOTE [Collective temporaries]
            sizes, lifetime = temporary
            phase = self._current_phase()
            for nbytes in sizes:
                held.append(_Record(nbytes, self._current_module(phase), phase))
                self._change(held[-1], nbytes)
            fake = any(isinstance(t, torch._subclasses.fake_tensor.FakeTensor) for t in tree_leaves(args[1:2]))
            if lifetime == "work" and fake:
                temporary = sizes, "operator"  # a fake group hands no clone back
            elif lifetime == "work":
                self._pending.extend(held)
        out = func(*args, **(kwargs or {}))
        for storage in _storages(_operands(out), self._fake_ok):
            self._see_output(storage)  # allocated inside the operator, with its buffer
        if held:
            if temporary[1] == "operator":
                for rec in held:
                    self._change(rec, -rec.nbytes)
            elif temporary[1] == "wait":
                waits = _Waits(held, {_key(s) for s in _storages(tree_leaves(out))})
                for key in waits.outputs:
                    self._pending_by_output[key] = waits
        if self._pending_by_output and func._opname == "wait_tensor":
            for storage in _storages(tree_leaves((args, kwargs))):
                waits = self._pending_by_output.pop(_key(storage), None)
                if waits is not None:
                    waits.outputs.discard(_key(storage))
                    if not waits.outputs:  # every output waited: the work and its clones are gone
                        for rec in waits.records:
                            self._change(rec, -rec.nbytes)
        return out

    def _see_noted(self, tensor: torch.Tensor) -> None:
        """A tensor the engine made outside the dispatcher (a random-state snapshot)."""
        for storage in _storages([tensor], self._fake_ok):
            self._see_output(storage)

    def _patch_fsdp(self) -> None:
        """NOTE [Memory per rank]: see FSDP2's storage resizes while tracking."""
        import sys

        param = sys.modules.get("torch.distributed.fsdp._fully_shard._fsdp_param")
        if param is None:
            return
        group = sys.modules.get("torch.distributed.fsdp._fully_shard._fsdp_param_group")
        for name in ("alloc_storage", "free_storage"):
            original = getattr(param, name)

            def resized(tensor: torch.Tensor, _original: Any = original) -> None:
                _original(tensor)
                self._see_resize(tensor.untyped_storage())

            for module in (param, group):
                if module is not None and getattr(module, name, None) is original:
                    self._patches.append((module, name, original))
                    setattr(module, name, resized)

    def _patch_sharding_propagation(self) -> None:
        """NOTE [Memory per rank]: DTensor's sharding propagation is not memory."""
        self._patches.extend(look_away_from_sharding_propagation(self._propagating))

    def _propagating(self, depth: int) -> None:
        self._quiet += depth

    def _see_resize(self, storage: torch.UntypedStorage) -> None:
        rec = self._records.get(_key(storage))
        if rec is None:
            self._see_output(storage)
        elif rec.nbytes != storage.nbytes():
            self._resize(rec, storage.nbytes())

    # --- bookkeeping ---------------------------------------------------------------

    def _see_input(self, storage: torch.UntypedStorage) -> None:
        key = _key(storage)
        rec = self._records.get(key)
        if rec is None and self._pending:  # a reduce-scatter's clone, handed back by its work
            held = next((r for r in self._pending if r.nbytes == storage.nbytes()), None)
            if held is not None:
                self._pending.remove(held)
                self._records[key] = held
                self._watch(storage, key)
                return
        if rec is None:
            rec = _Record(storage.nbytes(), "(baseline)", "baseline", baseline=True)
            self._records[key] = rec
            self.baseline_bytes += rec.nbytes
            self._watch(storage, key)
        elif rec.nbytes != storage.nbytes():
            self._resize(rec, storage.nbytes())

    def _see_output(self, storage: torch.UntypedStorage) -> None:
        key = _key(storage)
        rec = self._records.get(key)
        if rec is not None:
            if rec.nbytes != storage.nbytes():
                self._resize(rec, storage.nbytes())
            return
        phase = self._current_phase()
        rec = _Record(storage.nbytes(), self._current_module(phase), phase)
        self._records[key] = rec
        self._watch(storage, key)
        self._change(rec, rec.nbytes)

    def _watch(self, storage: torch.UntypedStorage, key: int) -> None:
        self._finalizers[key] = weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self._finalizers.pop(key, None)
        rec = self._records.pop(key, None)
        if rec is not None:
            self._change(rec, -rec.nbytes)

    def _resize(self, rec: _Record, nbytes: int) -> None:
        # A storage that existed before the step and grows during it (FSDP2's unsharded
        # parameters, freed to 0 bytes between uses) allocates during the step.
        delta, rec.nbytes = nbytes - rec.nbytes, nbytes
        self._change(rec, delta)

    def _change(self, rec: _Record, delta: int) -> None:
        # A baseline storage freed during the step lowers the footprint below the start.
        self.live_bytes += delta
        if not rec.baseline:
            slot = (rec.module, rec.phase)
            self._live_by[slot] = self._live_by.get(slot, 0) + delta
        phase = self._current_phase()
        self.timeline.append((self.live_bytes, phase))
        if self.on_change is not None:
            self.on_change(self.live_bytes, phase, self._current_module(phase))
        if self.live_bytes > self.peak_increase:
            self.peak_increase = self.live_bytes
            self.peak_phase = phase
            self.peak_index = len(self.timeline) - 1
            self._peak_by = dict(self._live_by)

    def _current_phase(self) -> str:
        if is_recomputing():
            return "recompute"
        if torch._C._current_graph_task_id() != -1:
            return "backward"
        return self._label

    def _current_module(self, phase: str) -> str:
        if self._stack and phase != "backward":
            return self._stack[-1]
        node = torch._C._current_autograd_node()
        if node is not None:
            return self._node_module.get(node._sequence_nr(), OUTSIDE)
        return self._stack[-1] if self._stack else OUTSIDE

    # --- module hooks ----------------------------------------------------------------

    def _name(self, module: torch.nn.Module) -> str:
        return self._names.get(id(module)) or type(module).__name__

    def _enter_module(self, module: torch.nn.Module, args: Any) -> None:
        self._stack.append(self._name(module))

    def _exit_module(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        name = self._stack.pop() if self._stack else self._name(module)
        if torch.is_grad_enabled():
            self._claim_nodes(name, args, output)

    def _claim_nodes(self, name: str, args: Any, output: Any) -> None:
        """Attribute the autograd nodes this module's forward created to it (innermost wins)."""
        stop = {id(t.grad_fn) for t in tree_leaves(args) if isinstance(t, torch.Tensor) and t.grad_fn}
        todo = [t.grad_fn for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.grad_fn]
        seen: set[int] = set()
        while todo:
            node = todo.pop()
            if node is None or id(node) in seen or id(node) in stop:
                continue
            seen.add(id(node))
            self._node_module.setdefault(node._sequence_nr(), name)
            todo.extend(n for n, _ in node.next_functions)


def track(model: torch.nn.Module | None = None, *, baseline: Iterable[Any] = ()) -> MemoryTracker:
    """Track live tensor storage bytes over the enclosed step, exactly.

    Args:
        model: the model run in the step; names modules in the report, and its
            parameters, buffers and gradients count as baseline.
        baseline: more objects whose storages existed before the step (input
            tensors, an optimizer's state); storages used but not listed here are
            added to the baseline when first seen.

    Returns:
        A `MemoryTracker` to use as a context manager; read ``peak_bytes``,
        ``peak_increase``, ``baseline_bytes``, ``peak()``, ``timeline`` after it.

    Examples:
        >>> import torch, remat
        >>> fc = torch.nn.Linear(256, 256)
        >>> x = torch.randn(64, 256, requires_grad=True)
        >>> with remat.memory.track(fc, baseline=[x]) as tracker:
        ...     fc(x).relu().sum().backward()
        >>> tracker.peak_bytes > tracker.baseline_bytes
        True
    """
    return MemoryTracker(model, baseline)
