"""A reentrant module region that earlier calls showed needs no watching, run lean (engine).

NOTE [Lean reentrant calls]
On a launch-bound step a region's own Python cost is the step's cost: torch's reentrant
checkpoint adds about 30 microseconds to a block's forward, and remat's generic path (a
region opened with its contexts, a handle, the checks each kind of region needs, closed
through the code that handles every output structure, escape and written argument) added
three times as much. Most of that is for regions that need it: the ones watched, writing
state, returning their arguments or views, writing their arguments in place, nested in a
re-run, under a transform. So a reentrant call that is plain on its face (each
tensor argument once, no ``context_fn``, policy or ``output_recompute``, a module region,
not under ``torch.func`` or a re-run's substitution) and whose facts are known
(NOTE [Observed once, confirmed every call] in ``facts.py``) runs here:

- the frame is made as the generic path makes it (its module state, random state and the
  facts' key: everything a re-run and the checks read), and the forward runs under
  ``no_grad`` on its arguments' aliases, as there;
- the facts are confirmed as there (no state written), then the output is looked at: a
  plain tensor that is not a view and shares no storage with an argument, no argument
  written in place, becomes the Function's output directly (`_close`); anything else goes
  through the generic close, which handles every case with the same frame;
- the frame is marked ``lean`` only when nothing its backward must handle specially is
  there, and its backward (``reentrant_backward._lean``) checks again what could have
  changed since (a later region that took the same argument, a parameter that is no
  longer a leaf or gained a hook, a process group, ``create_graph``) before it skips the
  generic one's contexts; it still walks its re-run's graph, as every unwatched re-run
  does, for a tensor the observed call did not read (NOTE [Reads that vary] in
  ``facts.py``): what a Python branch outside the modules reads, no fact can foresee.

Nothing is decided from a name or a guess: a call the facts do not cover, or that does
anything unusual, takes the generic path, which is exact in every case.
"""

from __future__ import annotations

from typing import Any

import torch

from remat._engine import facts as _facts
from remat._engine import outputs as _outputs
from remat._engine import per_use as _per_use
from remat._engine import reentrant as _reentrant
from remat._engine import structure as _structure
from remat._engine.modes import storage_of
from remat._engine.observe import Substitute
from remat._engine.state import is_recomputing
from remat._vocab.spec import RegionSpec


def plain(spec: RegionSpec, context_fn: Any) -> bool:
    """Whether a call may take the lean path on its face (NOTE [Lean reentrant calls])."""
    if (not spec.use_reentrant or context_fn is not None or spec.policy is not None
            or spec.output_recompute or not spec.mp_comm_recompute):
        return False
    return (torch.is_grad_enabled() and not Substitute.active and not is_recomputing()
            and torch._C._functorch.peek_interpreter_stack() is None)


def open_frame(fn: Any, args: tuple, kwargs: dict, spec: RegionSpec, name: str) -> tuple[Any, bool]:
    """``(frame, lean)``: the region's frame, and whether its facts let it run lean; a frame
    that may not is handed to the generic path (``region.open_region``)."""
    _outputs.pop_hook()
    _structure.check_args(name, args, kwargs)
    frame = _reentrant.ReentrantFrame(fn, args, kwargs, spec, name, None)
    if frame.module_state.root is None or frame.same_as or not frame.arguments:
        return frame, False
    facts = _facts.known(frame, frame.facts_key)
    if facts is None or not _facts.differentiates(frame, facts):  # NOTE [Forwards with nothing
        return frame, False  # to differentiate] (facts.py): watched, on the generic path
    frame.uses, frame.known, frame.watched = facts.uses, facts, False
    return frame, True


def close(frame: Any, output: Any) -> Any:
    """The forward returned: confirm the facts, then the Function (NOTE [Lean reentrant calls]).

    Returns None when the output needs the generic close."""
    if frame.module_state.versioned:  # buffers or tensor attributes it could have written
        try:
            _facts.confirm(frame, frame.facts_key)
        except Exception:
            frame.abandon()
            raise
    if type(output) is not torch.Tensor or output._is_view() or output.requires_grad:
        return None  # NOTE [Tensors returned as they were] (reentrant.py)
    if frame.module_state.versioned and frame.module_state.holds(output):
        return None  # a buffer returned: the same note
    tensors = frame.arguments
    if any(x._version != v for x, v in zip(tensors, frame.versions)):
        return None  # NOTE [Written arguments]
    key = storage_of(output)
    if key is None or any(storage_of(x) == key for x in tensors):
        return None  # NOTE [Arguments returned as outputs]
    return _apply(frame, output, tensors, key)


def _apply(frame: Any, output: torch.Tensor, tensors: list, key: int) -> Any:
    frame.module_state.settle([])
    frame.params = [t for t in frame.known.read() if t.requires_grad]
    frame.arguments, frame.aliases = [], []  # the Function saves them
    frame.returned = {key}
    frame.lean = True
    frame.pending = output
    inputs = [*tensors, *frame.params, *_per_use.extra_inputs(frame, tensors)]
    return _reentrant.Reentrant.apply(frame, len(tensors), *inputs)
