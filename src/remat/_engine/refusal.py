"""Regions a refused backward never reached let go of what their re-runs need (engine).

NOTE [Backward refused]
A ``RecomputeError`` raised in backward (a parameter changed in place before it, a re-run
that read another tensor) aborts that backward: the regions it had not reached yet never
run theirs, so they keep their saved arguments and their copies of their modules'
attributes (NOTE [Module state at the boundary]). A copy may hold a list a hook appends the
region's tensors to, and those lead back to the region through autograd: once the model
rebinds the list, a cycle Python's collector cannot free kept the step's tensors (and an
``output_recompute`` output registered, with remat's hook pushed) while the process lived.
So every closed region that may still be re-run is noted (`pending`, weakly), and a
``RecomputeError`` leaving a backward (`HookedFrame.unpack`, `rebuild_output`, the reentrant
Function's backward) lets all of them go (`refused`): the message says to run the step again,
and a later backward that reaches one of them is refused, not re-run. A forward that no
backward ever differentiates keeps that cycle too: run it under ``torch.no_grad()``, or empty
such a list in place instead of rebinding it (the docs' limits say so).
"""

from __future__ import annotations

import weakref

#: closed regions (`HookedFrame`) that may still be re-run, held weakly
pending: weakref.WeakSet = weakref.WeakSet()


def refused() -> None:
    """A RecomputeError is leaving a backward: every closed region that could still be
    re-run lets go of what its re-run needs (NOTE [Backward refused])."""
    for frame in list(pending):
        if frame.closed:
            frame.expire("refused")
