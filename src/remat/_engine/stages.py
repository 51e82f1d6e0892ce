"""Re-runs in stages: a selective region rebuilt a part at a time, as its backward needs it (engine).

NOTE [Re-runs in stages]
A ``use_reentrant=False`` region is re-run once per backward, at the first unpack, and that
re-run rebuilds every saved tensor the backward will read: the region's backward then holds
all of them at once, with its gradients. A transformer block's re-run rebuilds the MLP's
activations and the attention's inputs together, though backward reads the MLP's first and
is done with them before it reaches the attention. torch.compile's partitioner places each
recomputed operator just before the backward operator that reads it, so its backward holds
less; that gap kept an eager plan's peak above compile's at the same choice.

A region marked with ``stages=k`` (a selective policy, not ``output_recompute``) splits its
saved tensors, in the order forward saved them, into ``k`` runs of about equal bytes
(those it rebuilds: not the ones it keeps, not its arguments read back). The first unpack
re-runs the region up to the last saved tensor still needed and stores only the last stage's;
an unpack of an earlier tensor re-runs again, up to it, storing the stage it belongs to. Each
re-run carries the dead-operator analysis (NOTE [Dead operators in a selective re-run] in
``dead.py``) for its own stage: what only a later stage reads is not run, what only an earlier
one reads is skipped, and the kept outputs are handed back to every stage (the last one lets
go of them). So a block's MLP stage runs the MLP's cheap operators only, and its attention
stage only the attention's: about the operators of one re-run, in ``k`` passes through the
region's Python, for a backward that holds one stage at a time.

Each stage's re-run is checked as a whole re-run is: the same operators in the same order
up to where it stops, the shapes, dtypes and devices of what it saves (a placeholder saved for
an earlier stage is not compared: the stage that rebuilds it compares it). A region whose
forward records no usable flow (a tensor subclass, a backward inside the forward) re-runs in
one stage, as without the option. The random state is replayed at every stage's start, so every
stage draws what forward drew.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from remat._engine.selective import ReplayMode
from remat._vocab.spec import RegionSpec


def stage_starts(sizes: list[int], rebuilt: list[bool], stages: int) -> list[int]:
    """The first saved tensor of each stage: ``stages`` runs of about equal rebuilt bytes.

    Args:
        sizes: bytes of each saved tensor, in the order forward saved them.
        rebuilt: per saved tensor, whether a re-run rebuilds it (not kept, not an argument).
        stages: how many stages at most.

    Examples:
        >>> stage_starts([4, 4, 4, 4], [True] * 4, 2)
        [0, 2]
        >>> stage_starts([1, 1, 8, 8], [True] * 4, 2)
        [0, 3]
        >>> stage_starts([4, 4], [False, False], 3)
        [0]
    """
    total = sum(s for s, r in zip(sizes, rebuilt) if r)
    starts, seen, k = [0], 0, 1
    for i, (size, r) in enumerate(zip(sizes, rebuilt)):
        if not r:
            continue
        if seen >= total * k / stages and i > starts[-1] and k < stages:
            starts.append(i)
            k += 1
        seen += size
    return starts


def stage_of(starts: list[int], index: int) -> int:
    """The first saved tensor of the stage holding saved tensor ``index``."""
    return max(s for s in starts if s <= index)


def staged(spec: RegionSpec, contexts: tuple | None) -> bool:
    """Whether a region re-runs in stages (NOTE [Re-runs in stages]): asked for, selective,
    rebuilding saved tensors only; its forward then records its flow."""
    if spec.stages == "each" or spec.stages <= 1 or spec.output_recompute or contexts is None or type(contexts[1]) is not ReplayMode:
        return False
    contexts[0].staged = True
    return True


class StagedRuns:
    """What a ``use_reentrant=False`` frame (``hooked.py``) does to re-run in stages: which
    stage a re-run stores, what it hands back and keeps for later stages, what it lets go of
    when the backward ends (NOTE [Re-runs in stages])."""

    def note_staged(self, x: torch.Tensor, index: int) -> Any:
        """Forward saved ``x`` as saved tensor ``index``: note its bytes, the calls before it and
        the call that made it; return the region's own flow (None when it records none)."""
        self.sizes.append(x.numel() * x.element_size())
        own = self.contexts[0].store.flow
        self.positions.append(len(own.funcs) if own is not None else 0)
        if own is not None:
            own.note_saved_at(x, index)
        return own

    def _stage_stored(self, gid: int, index: int) -> bool:
        """Whether graph task ``gid`` stored the stage of saved tensor ``index`` already."""
        stages = self.stored_stages.get(gid)
        return stages is None or stage_of(self.starts, index) in stages

    def _stage(self, gid: int, index: int | None, stop_at: int | None) -> tuple[int, int | None]:
        """``(first, stop_at)`` of this re-run: the stage of saved tensor ``index``, up to the
        last of it still needed, when staged (NOTE [Re-runs in stages]); else all, as asked."""
        replay = self.contexts[1]
        replay.stage, replay.keep_before = None, 0
        self.more_stages = False
        if index is None or stop_at is None or not self._flow_usable():
            self.stored_stages.pop(gid, None)  # every stage stored at once
            return 0, stop_at
        first = stage_of(self.starts, index)
        if gid not in self.stored_stages and type(gid) is int and torch._C._current_graph_task_id() != -1:
            ref = weakref.ref(self)  # the frame dies with its holders, as unstaged, not at the end
            torch.autograd.Variable._execution_engine.queue_callback(lambda: (f := ref()) and f._end_stages(gid))
        later = [s for s in self.starts if s > first]
        stop_at = self._last_needed(gid, below=later[0] if later else None)
        stored = self.stored_stages.setdefault(gid, set())
        stored.add(first)
        # the kept outputs a later stage's re-run reaches (it stops before the first saved
        # tensor of this stage) are handed back and kept; the others are let go, as unstaged
        again = any((h := r()) is not None and h.kept is None and stage_of(self.starts, h.index) not in stored
                    for r in self.holders)
        replay.stage, replay.keep_before = (first, stop_at), self.positions[first - 1] if first and again else 0
        self.more_stages = again
        return first, stop_at

    def _end_stages(self, gid: int) -> None:
        """The backward that re-ran stages ended: let go of what a stage it never reached
        would have read, the kept outputs and the inputs (a single re-run hands them back and
        lets go as it passes them; a later backward rebuilds them, as then)."""
        self.cached_inputs.pop(gid, None)
        self.contexts[1].store.kept.clear()

    def _rebuilt_ones(self) -> list[bool]:
        """Per saved tensor, whether a re-run rebuilds it: alive, neither kept nor an argument."""
        return [(h := r()) is not None and h.kept is None and h.argument is None for r in self.holders]

    def _flow_usable(self) -> bool:
        flow = self.contexts[1].store.flow
        return flow is not None and flow.usable and self.contexts[1].store.finished
