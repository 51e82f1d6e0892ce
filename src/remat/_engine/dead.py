"""Operators a selective re-run need not run: nothing backward reads comes from them (engine).

NOTE [Dead operators in a selective re-run]
A ``use_reentrant=False`` region is re-run to rebuild the tensors its forward saved for
backward; the re-run's own graph is never differentiated and its outputs are dropped (but
in ``output_recompute``'s output pass). Under a selective policy the re-run hands kept
outputs back instead of running their operators, and then the operators that only fed
kept calls (a projection whose output only a kept rotary embedding or residual sum read;
a block's last projection, whose output only leaves the region) compute values nothing
reads. torch's selective checkpoint runs them all, and allocates their outputs.

So the forward's policy mode notes (`Flow`), per operator call, which earlier calls'
outputs it read (by the identity of the tensors, stable while they live), and the
region's pack hook tells it which calls' outputs were saved for backward. Each re-run
marks live, from the last call back, every call whose output backward reads, every call
that runs whatever reads its outputs (not an ``aten`` operator, an in-place or ``out=``
one, a random one, one that returns anything but tensors), and every call a live call
reads that runs (a kept call handed back reads nothing). A dead call returns, instead of
running, placeholders of its outputs' shapes, strides, dtypes and devices, without memory
(NOTE [Placeholders keep the device] in ``placeholder.py``; views run as they are: they
cost nothing; a kept call is handed back, dead or not: a placeholder where the forward
had a value can change what code above the dispatcher does, an attention choosing its
kernel by its inputs' device). What autograd saves of a dead call's inputs
(it saves them before the call runs) is still saved. This is early stop carried through
the whole region: ``early_stop=False`` (or ``remat.set_checkpoint_early_stop(False)``)
re-runs every operator.

NOTE [Reads the dispatcher does not show]
Code can read a tensor's values without an operator: ``tolist()`` issues none,
``numpy()`` only a ``detach``, an extension reads ``data_ptr()``. What it reads in the
re-run would be a placeholder, which has no memory: an error, never a wrong value, but a
region that trained before would fail. Such reads are of tensors that need no gradient
(routing counts an MoE block splits by, a mask, statistics): so a call may be skipped only
when it returns floating tensors and reads a tensor that requires grad, in grad mode,
and every other call is live; a tensor detached in forward (what ``numpy()`` and
``.detach().cpu()`` read) keeps its call live too. A dead activation that code reads
without an operator (``tolist()`` on a tensor that requires grad, an extension reading
its memory) is the case left: it fails, loudly; ``early_stop=False`` runs it.

A fact of the forward is re-checked, never trusted:
- each re-run call is compared with the forward's call at the same place; from the first
  that differs, nothing more is skipped;
- a live call that reads a placeholder (a re-run that reads otherwise than its forward)
  is refused with a ``RecomputeError`` before it runs, and a placeholder saved for backward
  fails the saved-tensor check (its device is not the forward's);
- a placeholder holds no memory: no value can be computed from it.

Nothing is skipped in a region whose forward ran a backward inside itself (an inner
``torch.autograd.grad``: the engine checks each gradient's device, and a gradient through
a dead call would be a placeholder), in a forward on the ``meta`` device, in the output
pass (it returns the outputs), or in a re-run during the forward. Forward hooks still run
in the re-run; one that records a dead activation records its placeholder.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from remat._engine.errors import RecomputeError
from remat._engine.placeholder import placeholder
from remat._vocab.policy import COMPUTE_INTENSIVE_OPS

_SKIPPABLE, _VIEW, _RUNS = 0, 1, 2
_KIND: dict = {}  # id of an operator -> its kind, learned once per operator
_INTENSIVE: dict = {}  # id of an operator -> whether it is a matrix product, a convolution, attention
_graph_task = torch._C._current_graph_task_id
_skipped = [0]

#: NOTE [Saved inside a nested region]
#: The flows of the selective forwards running now, innermost last. A region's pack hook
#: tells each of them what it saves: a region inside a selective region saves through its
#: own hooks, which the outer region's never see, yet the outer re-run runs the inner
#: region's forward again, and an operator there whose output the inner region saves was
#: taken for dead: skipped, its placeholder reached the attention the inner region called,
#: whose choice of kernel reads its inputs' device, and the re-run ran other operators than
#: its forward (refused, found by the project's fuzzer). What an inner region saves is live
#: in every enclosing re-run.
forwards: list = []
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # tensors whose reads the mode sees itself

#: NOTE [Tensors whose reads the mode does not see]
#: A tensor subclass (a DTensor, FSDP2's sharded parameters, a fake tensor) runs its own
#: operators on the tensors it wraps, below the policy's mode, and hands them out (``to_local``,
#: ``from_local``): what reads what there is not seen, and a call whose output only a
#: subclass's operator read looked dead (a tensor-parallel block's re-run was refused). So a
#: forward that passes a subclass to any operator records no flow: nothing is skipped in it.


def skipped_calls() -> int:
    """How many operator calls re-runs have skipped in this process (a counter for tests)."""
    return _skipped[0]

#: not numbered: the re-run's pack hook detaches what it saves (autograd issues ``detach``
#: itself under grad mode), so a re-run runs more of them than its forward; a detached
#: tensor is read as the tensor it came from
DETACH = torch.ops.aten.detach.default


def _kind(func: Any) -> int:
    """Whether a dead call of ``func`` is skipped (0), runs as a view (1) or always runs (2)."""
    kind = _KIND.get(id(func))  # an operator lives as long as torch: its id is its key
    if kind is None:
        schema = func._schema
        if func.namespace != "aten" or schema.is_mutable or torch.Tag.nondeterministic_seeded in func.tags:
            kind = _RUNS
        elif func.is_view:  # a view of a list of tensors too (``split``)
            kind = _VIEW
        elif not schema.returns or any(type(r.type) is not torch.TensorType for r in schema.returns):
            kind = _RUNS
        else:
            kind = _SKIPPABLE
        _KIND[id(func)] = kind
    return kind


def tensors_of(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors among an operator's arguments (an aten schema nests them one list deep)."""
    found = []
    for a in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif type(a) is list or type(a) is tuple:
            found.extend(b for b in a if isinstance(b, torch.Tensor))
    return found


def _intensive(func: Any) -> bool:
    found = _INTENSIVE.get(id(func))
    if found is None:
        found = _INTENSIVE[id(func)] = func._schema.name in COMPUTE_INTENSIVE_OPS
    return found


#: policy -> [whether its re-runs skip a compute-intensive call (None: not seen yet),
#: regions opened since it was last looked at] (NOTE [Flows recorded where they pay])
_WORTH: dict = {}
_LOOK_AGAIN = 64


_EVERYWHERE = [False]


@contextlib.contextmanager
def recorded_everywhere() -> Iterator[None]:
    """Record every policy region's flow while active (tests: every dead call skipped)."""
    before, _EVERYWHERE[0] = _EVERYWHERE[0], True
    try:
        yield
    finally:
        _EVERYWHERE[0] = before


def worth_recording(policy: Any) -> bool:
    """NOTE [Flows recorded where they pay]
    Noting a forward's flow costs a few microseconds per operator; skipping pays where a
    dead call is a matrix product, a convolution or attention. So a policy whose re-runs
    skipped none is not recorded for, but for one region in every 64, which looks again
    (a plan's policy differs per block; a shared one records while any of its regions
    skips a product). What is not recorded is not skipped: exactness never depends on it.
    """
    if _EVERYWHERE[0]:
        return True
    entry = _WORTH.get(policy)
    if entry is None:
        if len(_WORTH) > 1024:  # policies made per call (a context_fn's closure)
            _WORTH.clear()
        _WORTH[policy] = [None, 0]
        return True
    if entry[0] is not False:
        return True
    entry[1] += 1
    if entry[1] >= _LOOK_AGAIN:
        entry[1] = 0
        return True
    return False


def judge(policy: Any, flow: Flow, live: list[bool], handed_back: set[int]) -> None:
    """Whether this re-run of ``policy``'s region skips a compute-intensive call it would
    run: not handed back, and before its last live call (early stop ends it there)."""
    entry = _WORTH.setdefault(policy, [None, 0])
    if entry[0] is True:
        return
    last = max((c for c, alive in enumerate(live) if alive), default=-1)
    funcs, outs = flow.funcs, flow.outs
    entry[0] = any(not live[c] and outs[c] is not None and c not in handed_back and _intensive(funcs[c])
                   for c in range(last))


class Flow:
    """What a selective forward's calls read and what backward reads of them
    (NOTE [Dead operators in a selective re-run])."""

    __slots__ = ("deps", "differentiable", "funcs", "keys", "needed", "outs", "producer", "recipes", "saved_at",
                 "task", "usable")

    def __init__(self) -> None:
        self.producer: dict[int, int] = {}  # id of a tensor a call returned -> that call
        self.deps: list[list[int]] = []  # per call, the calls whose outputs it read
        self.funcs: list = []
        #: per call, its output's (shape, stride, dtype) (a list of them when several) when a
        #: re-run may skip it, else None
        self.outs: list = []
        self.keys: dict[int, tuple] = {}  # call -> (policy key, index) of a counted call
        #: calls live whatever reads them: an output saved for backward, or read where the
        #: dispatcher does not show (NOTE [Reads the dispatcher does not show])
        self.needed: set[int] = set()
        #: call -> the indices of the staged region's own saved tensors it made (NOTE [Re-runs
        #: in stages] in ``stages.py``): live only in the stage that rebuilds one of them
        self.saved_at: dict[int, list[int]] = {}
        self.task = _graph_task()
        self.usable = True
        #: NOTE [Each saved tensor rebuilt on its own] in ``recipes.py``: noted in place of the
        #: flow's own reads, which then stays empty (a re-run that falls back skips nothing)
        self.recipes: Any = None
        self.differentiable = False  # the running call reads a tensor that requires grad, in grad mode

    def before(self, func: Any, args: tuple, kwargs: dict) -> int:
        """Note a call's reads; return its number (-1 for a ``detach`` or once the flow is
        unusable)."""
        if _graph_task() != self.task:  # a backward inside the forward
            self.usable = False
            return -1
        producer = self.producer
        if func is DETACH:  # NOTE [Reads the dispatcher does not show]
            call = producer.get(id(args[0]))
            if call is not None:
                self.needed.add(call)
            return -1
        tensors = tensors_of(args, kwargs)
        if any(type(t) not in _PLAIN for t in tensors):  # NOTE [Tensors whose reads the mode does not see]
            self.usable = False
            return -1
        deps = [c for t in tensors if (c := producer.get(id(t))) is not None]
        grad = any(t.requires_grad for t in tensors)
        self.deps.append(deps)
        self.funcs.append(func)
        self.differentiable = grad and torch.is_grad_enabled()
        return len(self.funcs) - 1

    def after(self, call: int, func: Any, out: Any) -> None:
        """Note what call ``call`` returned: a call that may be skipped returns floating
        tensors that require grad (NOTE [Reads the dispatcher does not show])."""
        producer, kind = self.producer, _kind(func)
        single = isinstance(out, torch.Tensor)
        outputs = (out,) if single else out if type(out) is tuple or type(out) is list else ()
        skippable = self.differentiable and kind == _SKIPPABLE
        metas = []
        for t in outputs:
            if not isinstance(t, torch.Tensor):
                skippable = False
                continue
            producer[id(t)] = call
            if t.is_meta:
                self.usable = False
            if (skippable and type(t) is torch.Tensor and t.is_floating_point() and t.layout == torch.strided
                    and not t.is_nested):  # a plain dense tensor: its placeholder is one too
                metas.append((t.shape, t.stride(), t.dtype, t.device))
            else:
                skippable = False
        self.outs.append((metas[0] if single else metas) if skippable else None)
        if not skippable and kind == _SKIPPABLE:
            self.needed.add(call)

    def note_saved(self, x: torch.Tensor) -> None:
        """The region saved ``x`` for backward (its pack hook, in forward)."""
        call = self.producer.get(id(x))
        if call is not None:
            self.needed.add(call)

    def note_saved_at(self, x: torch.Tensor, index: int) -> None:
        """The staged region whose flow this is saved ``x`` as its saved tensor ``index``."""
        call = self.producer.get(id(x))
        if call is not None:
            self.saved_at.setdefault(call, []).append(index)

    def live(self, handed_back: set[int], stage: tuple[int, int] | None = None) -> list[bool]:
        """Per call, whether a re-run needs what it returns (``handed_back``: the calls whose
        kept outputs the re-run hands back without running them, reading nothing; ``stage``:
        the first and last saved tensor a staged re-run rebuilds, None for all of them)."""
        n = len(self.funcs)
        live = [False] * n
        needed, deps, funcs = self.needed, self.deps, self.funcs
        if self.saved_at and stage is None:
            needed = needed | self.saved_at.keys()
        elif self.saved_at:  # NOTE [Re-runs in stages] in ``stages.py``
            lo, hi = stage
            needed = needed | {c for c, at in self.saved_at.items() if any(lo <= i <= hi for i in at)}
        for call in range(n - 1, -1, -1):
            if not (live[call] or call in needed or _kind(funcs[call]) == _RUNS):
                continue
            live[call] = True
            if call not in handed_back:
                for d in deps[call]:
                    live[d] = True
        return live

    def skips(self, call: int, live: list[bool]) -> bool:
        """Whether a re-run skips call ``call``: dead, and not a view nor a call that must run."""
        return not live[call] and self.outs[call] is not None

    def placeholder(self, call: int) -> Any:
        """Stand-ins for call ``call``'s outputs: their shapes, strides, dtypes and devices,
        no memory (NOTE [Placeholders keep the device] in ``placeholder.py``)."""
        _skipped[0] += 1
        outs = self.outs[call]
        if type(outs) is list:
            return tuple(placeholder(*out) for out in outs)
        return placeholder(*outs)


def refuse_placeholder(func: Any, policy: Any) -> None:
    """A running call read a placeholder: the re-run reads otherwise than its forward."""
    raise RecomputeError(
        f"remat selective recompute: {func} read, in recomputation, the output of an operator "
        f"the forward's reads showed nothing needed (policy {policy!r}); the region does not "
        f"read the same way in forward and recomputation (code under remat.is_recomputing() "
        f"that reads other tensors, for instance). Make it read the same tensors in both, or "
        f"re-run every operator: early_stop=False on the mark, or "
        f"remat.set_checkpoint_early_stop(False) around the forward"
    )
