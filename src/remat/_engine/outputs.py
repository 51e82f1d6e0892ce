"""Output recompute: outputs of a region that nothing keeps (engine).

NOTE [Output recompute]
A region marked ``output_recompute`` must not keep its outputs either, even
when operators *after* it save them for backward (MindSpore's
``output_recompute``). When such a region closes, its output tensors are
registered here by storage. Whoever saves one of them afterwards gets an
`OutputRef` (the region and the output's index) instead of the tensor;
unpacking the reference re-runs the region and returns the rebuilt output.

Who packs: the input saver of the next region (so two adjacent marked regions
merge: the first's output is never kept and its recomputation runs right
before the second's), and, for plain operators outside any region, a
saved-tensor hook that remat pushes when the stack of saved-tensor hooks is
empty and pops as soon as no registered output is alive, or at the end of a
backward that rebuilt a marked region (an output still alive then, the model's
output say, is saved as itself from then on, which changes memory, not
numbers; the next region that registers outputs pushes the hook again). So no
hook is left on the stack after a training step (``torch.func`` refuses to
run under one). The pop happens when the engine releases the backward's final
callbacks (`_PopWhenReleased`), not in a callback. Under someone
else's saved-tensor hooks (CPU offload, torch.utils.checkpoint) the outputs
are kept.

An output changed in place after its region closed (``nn.ReLU(inplace=True)``
right after the region) no longer holds what a rebuild returns: its version
counter has moved since registration, so whoever saves it from then on saves
the tensor itself, as without remat. Saves made before the change still get a
reference; the rebuild returns the value they saved.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch._C import _autograd as _ag

_registry: dict[int, tuple] = {}


class OutputRef:
    """Stands for a saved tensor that is (a view of) an output of a region."""

    __slots__ = ("__weakref__", "done", "frame", "index", "layout")

    def __init__(self, frame: Any, index: int, layout: tuple | None) -> None:
        self.frame, self.index, self.layout = frame, index, layout
        self.done: set[int] = set()  # graph tasks that unpacked it

    def unpack(self) -> torch.Tensor:
        pop_after_backward()
        out = self.frame.rebuild_output(self.index, self)
        if self.layout is not None:
            size, stride, offset = self.layout
            out = out.as_strided(size, stride, offset)
        return out


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class _Watch(weakref.ref):
    """A registered output's weak reference; its death forgets the entry (`_forget`).

    Held by the entry itself: an entry replaced first takes its watch with it, whose
    callback then never runs (the new entry has its own). Cheaper than a
    ``weakref.finalize`` per output, which a region pays on every call."""

    __slots__ = ("key",)


def register(frame: Any, outputs: list) -> None:
    """Register the tensor ``outputs`` of ``frame`` (flat list) as not to be kept; the hook is
    pushed only when one is (a region that only passes its inputs through registers none, and
    a hook pushed then had no output whose death would pop it: it stayed after the step)."""
    registered = False
    frame_ref = weakref.ref(frame)
    for index, t in enumerate(outputs):
        if not isinstance(t, torch.Tensor) or t.is_sparse or t.is_meta:
            continue
        key = _key(t)
        layout = (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype)
        watch = _Watch(t, _forget)
        watch.key = key
        _registry[key] = (frame_ref, index, layout, watch, t._version)
        registered = True
    if registered:
        _push_hook()


def _forget(watch: _Watch) -> None:
    key = watch.key
    entry = _registry.get(key)
    if entry is not None and entry[3] is watch:
        del _registry[key]
    if not _registry:
        if torch._C._current_graph_task_id() != -1:
            # freed while a backward tears its graph down: a pop here would be undone
            # when the engine restores the caller's state (see _PopWhenReleased)
            pop_after_backward()
        else:
            pop_hook()


def lookup(x: torch.Tensor) -> OutputRef | None:
    """Return a reference for ``x`` if it shares storage with a registered output."""
    if not _registry or not isinstance(x, torch.Tensor) or x.is_sparse:
        return None
    entry = _registry.get(_key(x))
    if entry is None:
        return None
    frame_ref, index, (size, stride, offset, dtype), _, version = entry
    frame = frame_ref()
    if frame is None or x.dtype != dtype or x._version != version:  # changed in place: keep it
        return None
    same = tuple(x.shape) == size and x.stride() == stride and x.storage_offset() == offset
    ref = OutputRef(frame, index, None if same else (tuple(x.shape), x.stride(), x.storage_offset()))
    frame.add_output_ref(ref)
    return ref


# --- the hook for plain operators outside regions --------------------------------


def _pack(x: torch.Tensor) -> Any:
    ref = lookup(x)
    if ref is not None:
        return ref
    return (x.detach(), x._version)


def _unpack(packed: Any) -> torch.Tensor:
    if isinstance(packed, OutputRef):
        return packed.unpack()
    x, version = packed
    if x._version != version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: [{x.type()} {list(x.shape)}] is at version {x._version}; "
            f"expected version {version} instead."
        )
    return x


def _ours_on_top() -> bool:
    top = _ag._top_saved_tensors_default_hooks(False)
    return top is not None and top[0] is _pack


def _push_hook() -> None:
    if _ag._top_saved_tensors_default_hooks(False) is None and _ag._saved_tensors_hooks_is_enabled():
        _ag._push_saved_tensors_default_hooks(_pack, _unpack)


def pop_hook() -> None:
    """Pop remat's hook if it is on top of the stack and no registered output is alive."""
    if not _registry and _ours_on_top():
        _ag._pop_saved_tensors_default_hooks()


_queued: set[int] = set()  # graph tasks that will pop the hook when they end


class _PopWhenReleased:
    """Pops remat's hook when the backward that holds it is torn down.

    The engine runs each node and each final callback under the thread-local
    state it captured when backward began, and restores the caller's state
    afterwards: a pop made there would be undone. The graph task releases its
    final callbacks (this object with them) after that, on the calling thread,
    in the caller's own state.
    """

    def __init__(self, gid: int) -> None:
        self.gid = gid

    def __call__(self) -> None:
        pass

    def __del__(self) -> None:
        _queued.discard(self.gid)
        if _ours_on_top():  # elsewhere (an accelerator's worker thread): leave it
            _ag._pop_saved_tensors_default_hooks()


def pop_after_backward() -> None:
    """Pop remat's hook once the running backward is over (see NOTE [Output recompute])."""
    gid = torch._C._current_graph_task_id()
    if gid == -1 or gid in _queued:
        return
    _queued.add(gid)
    torch.autograd.Variable._execution_engine.queue_callback(_PopWhenReleased(gid))


def hook_active() -> bool:
    """Return True while remat's hook for plain operators is pushed (for tests)."""
    return _ours_on_top()
