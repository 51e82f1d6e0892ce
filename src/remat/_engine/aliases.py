"""What a reentrant region's Function saves and returns where its outputs and arguments
share memory: copies, detached aliases, versions kept (engine).

A reentrant region's forward runs without grad and its Function hands its outputs out: an
output that is an argument, a view of one, or a view of a tensor the region made, and an
argument written in place, each needs the Function to save or return something else than
the tensor itself for the gradients to be those of the unmarked model (the notes below).
"""

from __future__ import annotations

from typing import Any

import torch

from remat._engine.modes import storage_of


def argument_views(frame: Any, views: list, inputs: tuple) -> list:
    """``(output index, alias, version)`` of the outputs that are views of an argument.

    NOTE [Views of an argument changed after the region]
    A region may return a view of its argument (a block that transposes its input and passes
    it through beside its result). Unmarked, that output is a view of the argument: a change
    in place through it, or through the argument, rewrites the argument's history, and every
    later reader of the argument back-propagates through the change. A reentrant region hands
    it out as an output of its Function, a detached alias of the same memory: the change
    reaches the argument's values but not its history, and the argument's later readers sent
    gradients that missed it (a shared-fuzzer case: a convolution's weight gradient off by
    181%, silently). Such an output's version is kept, and a backward that finds it moved is
    refused with a ``RecomputeError`` before the region is re-run. An output that is the
    argument itself is handed out as the argument (NOTE [Arguments returned as outputs]).
    """
    if not views:
        return []
    kept = {storage_of(x) for j, x in enumerate(inputs) if j not in frame.written} - {None}
    return [(i, alias, version) for i, _, alias, version in views if storage_of(alias) in kept]


def returned_copied(frame: Any, inputs: tuple) -> tuple:
    """The arguments to save, a copy of each one the region returns (or a view of it).

    NOTE [Arguments returned as outputs]
    A region may return its argument, or a view of it (a block passing its input
    through). A caller may change that output in place, which the unmarked model
    allows; it would also change the argument the re-run starts from. So such an
    argument is saved as a copy (its bytes once more, for this case only). An output
    that is the argument itself (or, for a reentrant region, its alias) is handed to
    the caller as the argument, outside the Function: its gradient goes straight to
    the argument and a change in place rewrites the argument's history, as without
    the mark (returned from the Function it would be a view autograd forbids changing
    in place, or an alias whose change the argument's other readers never see). A view
    of the argument is such an alias: changed after a reentrant region, it is refused
    (NOTE [Views of an argument changed after the region]).
    """
    frame.copied = {}
    keys = frame.returned
    if not keys:
        return inputs
    saved = []
    for i, x in enumerate(inputs):
        if i not in frame.written and storage_of(x) in keys:  # a written one: NOTE [Written arguments]
            frame.copied[i] = x.requires_grad
            x = x.detach().clone()
        saved.append(x)
    return tuple(saved)


def without_history(frame: Any, inputs: tuple) -> tuple:
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


def as_written_views(ctx: Any, grads: tuple) -> tuple:
    """The gradients of outputs that were views and were changed in place after the region,
    laid out as the view was (NOTE [Views changed after the region]).

    NOTE [Views changed after the region]
    A region that returns a view of a tensor it made (a block ending in ``transpose``)
    hands the caller a detached alias instead (`alias`). Without the mark, an
    in-place change of that view (``out.add_(1)``) puts a ``CopySlices`` over its base,
    whose backward hands the base's producer a gradient in the base's own layout; through
    the region, the view's gradient came in the caller's layout and reached the base
    through the view's backward, strided otherwise. The values are the same, but a
    reduction further back (a batch norm's, a convolution's bias) sums them in another
    order: rounding-level differences, amplified by a batch norm of a small batch (a
    shared-fuzzer case: a relative 4e-2 on a convolution's bias gradient). So the alias's
    version is kept (a detached alias of it shares its version counter, not its history),
    and when it moved, the gradient is copied into the view's strides first: the view's
    backward then gives the base its own layout, as ``CopySlices`` does.
    """
    if not ctx.views:
        return grads
    grads = list(grads)
    for i, stride, alias, version in ctx.views:
        g = grads[i]
        if alias._version != version and g is not None and g.stride() != stride:
            grads[i] = torch.empty_strided(g.shape, stride, dtype=g.dtype, device=g.device).copy_(g)
    return tuple(grads)


def alias(x: Any) -> Any:
    """What the Function returns for output ``x``: a detached alias.

    NOTE [Outputs returned as aliases]
    Autograd gives a Function's output tensor the Function's node as its history, on that
    very object. A region's forward runs without grad, so remat cannot tell a tensor it made
    from one it returns that was made before (a global constant, a closure's): returned as
    itself, such a tensor took the region's history for good, and the re-run, which returns
    it again, re-entered the Function without end (torch's reentrant checkpoint hangs
    there). So every output leaves as a detached alias: the same memory and version
    counter, the history on the alias only. A view returned from a custom Function may not be
    changed in place; an alias may (NOTE [Views changed after the region]).
    """
    return x.detach() if isinstance(x, torch.Tensor) else x
