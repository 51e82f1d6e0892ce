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
