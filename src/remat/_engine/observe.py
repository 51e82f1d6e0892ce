"""What a region reads and writes, learned by watching its forward run (engine).

NOTE [Observed reads]
A ``use_reentrant=True`` region runs forward without grad and again, with grad,
inside its ``autograd.Function``'s backward. Every gradient it owes a tensor it
did not take as an argument (a parameter, a buffer that requires grad, a tensor
read through a closure, a keyword argument, a module attribute: whatever the
callable is) must leave through the Function, so those tensors must be inputs of
the Function. They are learned by watching the forward: `Observe`, a
dispatch mode, sees every tensor every operator of the region reads. A tensor
that requires grad, that no operator of the region produced and that is not an
argument is a read of the region. The arguments that require grad are handed to
the region as aliases (``detach()``: same storage, same version counter), so a
read of the argument itself (through a closure) is told apart from a read of the
argument, and both gradients flow.

In backward the re-run must read the same tensors. Two modes watch it: one
(`Substitute`, above autograd) hands it an alias of each non-leaf tensor the
forward read, so the nested backward stops there and the tensor's own history gets
its gradient through the Function only (a tensor computed from the region's own
parameters, ``self.memo = f(h)``, would otherwise send part of its gradient to
them twice); the other (`CheckReads`, below autograd) refuses a read of a
tensor that requires grad which the forward did not read (an attribute replaced
between forward and backward): its value is not the one the forward used.
What neither can see (a custom ``autograd.Function`` whose forward
never reads a tensor it returns a gradient for) is caught in backward: the
re-run's graph is walked before it is differentiated (``walk.reached_outside``); a
tensor it reaches that is not an input of the Function is differentiated too, and
if it gets a gradient (which would be lost) the region is refused with a typed
error instead (``walk.refuse_lost``).

NOTE [Observed writes]
The same mode sees every tensor the forward writes in place that it neither
created nor took as an argument: a buffer, batch norm's running statistics, a
counter. Re-running the region would write them a second time, and would read
them as the forward left them, not as the forward found them. So before the
first write that updates such a tensor (an in-place operator, which reads it), or
that overwrites one the region read before, its value is copied (a tensor only
overwritten, as FSDP's all-gather fills its parameters, is written alike by the
re-run and needs nothing); the re-run starts from those
values and, once done, puts back what the tensors held when it began (written
through ``.data``: no version bump, as batch norm's own kernel updates its
statistics without one). The re-run so reads exactly what the forward read and
leaves the state as it found it (NOTE [No double state updates]). A region
that writes nothing pays nothing; one that writes batch-norm statistics pays a
copy of a few numbers per channel. A written tensor that requires grad (its
history would change) is refused.

NOTE [Compiled code inside a region]
A region may call code the user compiled (``torch.compile`` of a submodule, FlexAttention).
``torch.compile`` runs compiled code only while no dispatch mode that wants to see every
operator is active: under one it falls back to eager. So a watched forward, a selective
forward and its re-run ran the region's compiled parts eagerly while the unwatched calls,
the re-runs and the unmarked model ran them compiled: other kernels, other rounding (the
gradients differed from the unmarked model's in the last bits, silently), a re-run that
saved other tensors than its forward (refused), and a compiled submodule recompiled on
every region call until torch gave up compiling it. torch's checkpoint has no mode
around its re-run, and its selective modes declare ``ignore_compile_internals``, so
compiled code runs compiled: bitwise as unmarked. remat's modes (`Observe`, the selective
`SaveMode` and `ReplayMode`) declare it too: compiled code runs compiled everywhere, and
they see the operators it dispatches (every one under ``aot_eager``; under Inductor, the
calls it leaves to ATen, such as matrix products, and the input writes it applies). What a
compiled kernel reads inside itself they do not see: a reentrant region, which must know
every tensor it reads that requires grad, finds such a parameter only in its re-run's
graph (`reached_outside`) and is refused with a ``RecomputeError`` (use
``use_reentrant=False``); a selective policy keeps and skips only calls it sees, in the
forward and the re-run alike, and none that runs without grad inside compiled code.

NOTE [Tensors that escape a reentrant region]
A ``use_reentrant=True`` region runs forward without grad. A tensor it makes that
leaves it other than through its outputs (an auxiliary loss stored on the module,
``self.aux = h.pow(2).mean()``; a router's logits captured by a forward hook; a list
it appends to) would carry a gradient without the mark and carries none with it: its
loss term trains nothing, silently (torch's reentrant checkpoint does the same). So
a watched reentrant forward also follows which tensors would carry a gradient (made
by an operator, other than ``detach``, from an argument or a read that does) and
keeps a weak reference to each; when the region returns, one still alive that is
not an output, an argument or the base of one has escaped. One the forward bound to an
attribute of the region's modules is made an output of the region's Function, and
the attribute is bound to that output instead: it carries its gradient as without
the mark (the re-run hands back its own value of the attribute beside the region's
outputs). Such a region lets go of its module after a backward that does not keep
its graph (the attribute leads back to it through autograd, a cycle Python's collector
cannot free); under ``retain_graph=True`` it keeps it for the next backward. Inside
a non-reentrant region's forward, whose own re-run would rebuild the attribute again,
an attribute escape is refused like any other. Any other escape (a hook's capture, a
list) is returned by the Function as itself and found again in the re-run by where
the forward made it (NOTE [Escapes handed back by position] in ``escapes.py``); a
view, which cannot be given a history in place, is refused with a ``RecomputeError``
naming the fix, ``use_reentrant=False``, after putting back the state its forward
wrote and the attributes it rebound. A tensor stored into an object the region was called with (a key/value cache passed
as ``past_key_values``) is the caller's container updated in place, as unmarked,
and is not refused. A module region is watched until a call shows none of this
(NOTE [Observed once, confirmed every call] in ``facts.py``); an attribute rebound
in forward changes the module's key, so such a region is watched on every call.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any, ClassVar

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from remat._engine.errors import RecomputeError
from remat._engine.modes import _UNANNOTATED, _allocates, _storage_key, _written_args


def tensors_in(args: tuple, kwargs: dict | None = None) -> list[torch.Tensor]:
    """The tensors among an operator's arguments or outputs, in lists and tuples too (no pytree)."""
    found = []
    for a in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found += tensors_in(a)
    return found


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _subclass_call(tensors: list) -> bool:
    """True for an operator on a tensor subclass (``DTensor``): the operators its
    ``__torch_dispatch__`` runs on the local tensors come back through the modes; they
    are the subclass's business, not reads of the region (`_inside_subclass`)."""
    return any(type(t) not in _PLAIN and type(t).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__
               for t in tensors)


def _storage(t: torch.Tensor) -> int | None:
    try:
        return _storage_key(t)
    except (RuntimeError, NotImplementedError):  # a wrapper subclass (DTensor) has no storage
        return None


class _Watch(TorchDispatchMode):
    """A dispatch mode that looks past the local operators of tensor subclasses."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Compiled code runs compiled under it (NOTE [Compiled code inside a region])."""
        return True

    depth = 0

    def _call(self, func: Any, args: tuple, kwargs: dict, tensors: list) -> Any:
        if not _subclass_call(tensors):
            return func(*args, **kwargs)
        self.depth += 1
        try:
            return func(*args, **kwargs)
        finally:
            self.depth -= 1


class Observe(_Watch):
    """Watch a region's forward: what it reads and what state it writes.

    NOTE [Observed reads], NOTE [Observed writes].

    Args:
        name: how errors name the region.
        arguments: the tensors the region is called with (neither reads nor state).
        reads: whether to record reads (a reentrant region's extra inputs).
    """

    def __init__(self, name: str, arguments: list, reads: bool, flowing: list | None = None) -> None:
        super().__init__()
        self.name = name
        # NOTE [Tensors that escape a reentrant region]: what would carry a gradient unmarked
        # by id, with a weak reference: a dead tensor's id is reused by the next one made
        self.flowing: dict[int, weakref.ref] | None = (
            None if flowing is None else {id(t): weakref.ref(t) for t in flowing})
        self.made: list[tuple[weakref.ref, tuple[int, int]]] = []  # and where: (call, output)
        self.calls: list = []  # the operators, in order (NOTE [Escapes handed back by position])
        self.arguments = {id(t) for t in arguments}
        self.argument_storages = {_storage(t) for t in arguments} - {None}
        self.want_reads = reads
        self.produced: set[int] = set()  # ids of tensors the region's operators returned
        self.fresh: set[int] = set()  # storages the region's operators allocated
        self.reads: dict[int, torch.Tensor] = {}
        self.host_reads = False  # it read a tensor's values on the host (NOTE [Reads that vary])
        self.frozen: dict[int, torch.Tensor] = {}  # parameters it read that do not require grad
        self.seen: dict[int, weakref.ref] = {}  # every tensor it read that is not an argument
        self.uses: dict[int, int] = {}  # operators that took each argument (NOTE [Per-use gradients])
        self.state: list[tuple[torch.Tensor, torch.Tensor]] = []  # (written tensor, value before)
        self._state_ids: set[int] = set()
        self._read_storages: set[int] = set()  # storages of tensors it read and did not produce
        self.depth = 0  # inside a tensor subclass's operator

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _replaying[0] or self.depth:  # the engine's own copies; a subclass's local operators
            return func(*args, **kwargs)
        tensors = tensors_in(args, kwargs)
        outside = [t for t in tensors if id(t) not in self.produced]
        for t in outside:  # NOTE [Tensors read from outside the module]: held by their owners
            if id(t) not in self.arguments and ((ref := self.seen.get(id(t))) is None or ref() is not t):
                self.seen[id(t)] = weakref.ref(t)
        if self.want_reads:
            for t in outside:
                if id(t) in self.arguments:
                    self.uses[id(t)] = self.uses.get(id(t), 0) + 1
                elif t.requires_grad:
                    self.reads.setdefault(id(t), t)
                elif type(t) is torch.nn.Parameter:  # frozen now, maybe not later (NOTE [Reads that vary])
                    self.frozen.setdefault(id(t), t)
        if func._schema.is_mutable or func in _UNANNOTATED:
            self._note_writes(func, args, kwargs)
        if func in _HOST_READS:
            self.host_reads = True
        if outside and _allocates(func):  # a view reads nothing yet
            self._read_storages.update(_storage(t) for t in outside)
        out = self._call(func, args, kwargs, tensors)
        allocates = _allocates(func)
        made = tensors_in((out,))
        if self.flowing is not None and func not in _STOPS_GRADIENT:  # autograd's own detach
            self.calls.append(func)  # varies with grad mode (NOTE [Escapes handed back by position])
        for t in made:
            self.produced.add(id(t))
            if allocates and (key := _storage(t)) is not None:
                self.fresh.add(key)
        if self.flowing is not None and func not in _STOPS_GRADIENT and any(
                t.requires_grad or self._flows(t) for t in tensors):
            for j, t in enumerate(made):
                if t.is_floating_point() or t.is_complex():
                    ref = weakref.ref(t)
                    self.flowing[id(t)] = ref
                    if _storage(t) in self.fresh:  # allocated here (not a buffer written by out=)
                        self.made.append((ref, (len(self.calls) - 1, j)))
        return out

    def _flows(self, t: torch.Tensor) -> bool:
        ref = self.flowing.get(id(t))
        return ref is not None and ref() is t

    def escaped(self, kept: list) -> list[tuple[torch.Tensor, tuple[int, int]]]:
        """Tensors the forward made that would carry a gradient unmarked and are still alive
        other than as ``kept`` (the outputs, the arguments) or the base of one of them (a
        view of one, held elsewhere, has escaped: it carries no gradient either), each
        with where it was made: (the operator's index in `calls`, its output's).

        NOTE [Tensors that escape a reentrant region].
        """
        ids = {id(t) for t in kept} | {id(t._base) for t in kept if t._base is not None}
        return [(t, at) for ref, at in self.made if (t := ref()) is not None and id(t) not in ids]

    def _note_writes(self, func: Any, args: tuple, kwargs: dict) -> None:
        for i, name in _written_args(func):
            written = args[i] if i < len(args) else kwargs.get(name)
            for t in written if isinstance(written, (list, tuple)) else (written,):
                if isinstance(t, torch.Tensor) and id(t) not in self._state_ids:
                    self._note_write(func, i, t)

    def _note_write(self, func: Any, position: int, t: torch.Tensor) -> None:
        key = _storage(t)
        if key in self.fresh or key in self.argument_storages or id(t) in self.arguments:
            return  # the region's own tensors; arguments have rules of their own
        if _overwrites(func, position) and key not in self._read_storages:
            return  # written, not updated, and not read before: a re-run writes it alike
        if t.requires_grad:
            raise RecomputeError(
                f"remat: region '{self.name}' changes in place ({func}) a tensor that "
                f"requires grad and that it neither created nor took as an argument "
                f"(shape {list(t.shape)}); recomputing it would change that tensor's history "
                f"again; pass the tensor as an argument of the region, or change it outside"
            )
        self._state_ids.add(id(t))
        self.state.append((t, t.detach().clone()))


_STOPS_GRADIENT = {torch.ops.aten.detach.default}


def _host_reads() -> frozenset:
    """Operators whose result on the host depends on a tensor's values: ``.item()``,
    ``bool(t)``, ``int(t)`` (``_local_scalar_dense``), ``torch.equal``, and the operators whose
    output's shape does (``nonzero``: ``torch.where(mask)``, an MoE layer's tokens per expert).
    A forward that runs one may branch on its tensors' values (NOTE [Reads that vary])."""
    aten = torch.ops.aten
    names = [("_local_scalar_dense", "default"), ("is_nonzero", "default"), ("equal", "default"),
             ("nonzero", "default"), ("nonzero_static", "default"), ("masked_select", "default"),
             ("_unique2", "default"), ("unique_dim", "default"), ("unique_consecutive", "default"),
             ("repeat_interleave", "Tensor"), ("bincount", "default")]
    return frozenset(getattr(getattr(aten, op), overload) for op, overload in names
                     if hasattr(getattr(aten, op, None), overload))


_HOST_READS = _host_reads()

_OVERWRITE = {"copy_", "fill_", "zero_", "uniform_", "normal_", "bernoulli_", "exponential_",
              "random_", "geometric_", "cauchy_", "log_normal_", "set_"}


def _overwrites(func: Any, position: int) -> bool:
    """True when ``func`` writes its argument ``position`` without reading it (an ``out=``)."""
    arg = func._schema.arguments[position]
    return arg.kwarg_only or func._schema.name.split("::")[-1] in _OVERWRITE


_replaying = [False]


@contextlib.contextmanager
def replayed_state(state: list) -> Iterator[None]:
    """Run a re-run from the state the forward found; put back what is there now.

    NOTE [Observed writes]. ``state`` holds ``(tensor, value before the forward's
    first write)`` pairs, in the order the forward wrote them. It is the forward's
    own list: a re-run inside the region's forward (a backward call there) finds
    what the forward wrote so far, and what it writes beyond that is noted by the
    forward's `Observe` and put back to the value the forward will find.
    """
    if not state:
        yield
        return
    n = len(state)
    with engine_copies():
        # a storage a framework freed since (FSDP's gathered parameters) holds nothing
        now = [t.detach().clone() if t.untyped_storage().nbytes() else None for t, _ in state]
        for t, before in reversed(state):  # overlapping views: the earliest value wins
            if t.untyped_storage().nbytes():
                t.data.copy_(before)  # no version bump: see the NOTE
    try:
        yield
    finally:
        with engine_copies():
            for t, before in reversed(state[n:]):
                t.data.copy_(before)
            for (t, _), value in zip(state, now):
                if value is not None:
                    t.data.copy_(value)


def restore_state(state: list) -> None:
    """Put back the values a forward found in the state it wrote (a refused region)."""
    with engine_copies():
        for t, before in reversed(state):
            if t.untyped_storage().nbytes():
                t.data.copy_(before)


class _EngineOps:
    """`engine_ops`: a class, not a generator (every region entered under grad makes one)."""

    __slots__ = ("saved",)

    def __enter__(self) -> None:
        self.saved, _replaying[0] = _replaying[0], True

    def __exit__(self, *exc_info: object) -> None:
        _replaying[0] = self.saved


def engine_ops() -> _EngineOps:
    """The engine's own operators (a region's bookkeeping tensors), unseen by the watchers:
    they run when a region opens under grad, which a reentrant forward's inner regions do
    in the re-run only (NOTE [Escapes handed back by position])."""
    return _EngineOps()


@contextlib.contextmanager
def engine_copies() -> Iterator[None]:
    saved, _replaying[0] = _replaying[0], True
    try:
        with torch.no_grad():
            yield
    finally:
        _replaying[0] = saved


class Substitute(TorchFunctionMode):
    """Hand a re-run ``aliases[id(t)]`` wherever it passes ``t`` to torch (NOTE [Observed reads]).

    A custom ``autograd.Function`` is applied without a torch function; the engine's own
    (a reentrant region nested in the re-run) asks `substituted` for its inputs.
    """

    active: ClassVar[list[Substitute]] = []

    def __init__(self, aliases: dict[int, torch.Tensor]) -> None:
        super().__init__()
        self.aliases = aliases

    def __enter__(self) -> Any:
        Substitute.active.append(self)
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        Substitute.active.remove(self)
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        args, kwargs = pytree.tree_map_only(
            torch.Tensor, lambda t: self.aliases.get(id(t), t), (args, kwargs or {}))
        return func(*args, **kwargs)


def substituted(tensors: list) -> list:
    """``tensors``, each replaced by the alias an enclosing re-run reads in its place."""
    for mode in reversed(Substitute.active):
        tensors = [mode.aliases.get(id(t), t) for t in tensors]
    return tensors


class CheckReads(_Watch):
    """Refuse a re-run reading a leaf that requires grad which the forward did not read.

    A tensor with a history (made by an ``autograd.Function`` the re-run calls, or
    one from outside) is left to `reached_outside`, which follows its history.

    NOTE [Observed reads]. ``allowed``: the tensors the re-run may read besides those it
    produces.
    """

    def __init__(self, name: str, allowed: list) -> None:
        super().__init__()
        self.name, self.allowed = name, {id(t) for t in allowed}
        # an alias made without an operator (a subclass's wrapper around a feed) reads the same
        self.storages = {_storage(t) for t in allowed} - {None}
        self.produced: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.depth:
            return func(*args, **kwargs)
        tensors = tensors_in(args, kwargs)
        for t in tensors:
            if (t.requires_grad and t.grad_fn is None
                    and id(t) not in self.produced and id(t) not in self.allowed
                    and _storage(t) not in self.storages):
                raise RecomputeError(
                    f"remat: region '{self.name}' (use_reentrant=True): its recomputation reads "
                    f"a tensor that requires grad (shape {list(t.shape)}, by {func}) which its "
                    f"forward did not read: the region reads other tensors in backward than in "
                    f"forward (a module attribute replaced after the region ran?), so its "
                    f"gradients would be wrong; keep what the region reads until backward, or "
                    f"pass the tensor as an argument"
                )
        out = self._call(func, args, kwargs, tensors)
        self.produced.update(id(t) for t in tensors_in((out,)))
        return out
