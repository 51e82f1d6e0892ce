"""Selective recompute: keep the outputs a policy chooses, rebuild the rest (engine).

In forward, `SaveMode` runs every operator and stores the outputs of
those the policy saves. In recomputation, `ReplayMode` hands the stored
outputs back instead of running those operators again, and runs the others.
The same pair works as the ``context_fn`` of [`remat.checkpoint`][remat.checkpoint].

NOTE [Kept random operators]
Recomputation restores the generators' state of the region's forward and draws again
in the same order. A kept output of a random operator (a dropout's, ``rand_like``'s) is
handed back without running the operator, which would leave the generator behind and
every random operator rebuilt after it drawing other numbers than forward did: a silent
wrong gradient (a dropout kept, a second one rebuilt). So a kept call that drew in forward
(an operator tagged ``nondeterministic_seeded`` across which a generator's state changed,
``rng.drew``: attention with ``dropout_p=0`` draws nothing and is not re-run) still runs in
recomputation, its result discarded; the planner never keeps such a call (NOTE [Options
cut by min-cut] in ``remat/planner/_options.py``). ``tests/test_save_calls.py`` holds the case.

NOTE [Aliases with a version of their own]
A kept output changed in place after forward is rebuilt, not handed back: its version
counter tells. But some operators return a tensor sharing a kept output's storage that
autograd does not count as a view, with a version counter of its own: ``_unsafe_view``,
which a ``Linear`` without bias runs on a 3-D input after its ``mm``. An in-place change
through it (``y = fc(x); y.add_(1)``) left the kept ``mm`` output's version as it was,
and recomputation handed back the changed values: a silent wrong gradient (found by the
independent fuzzer). So in forward every later output sharing a kept output's storage is
watched too, and a change to any of them rebuilds the call.

NOTE [Kept outputs detached in forward]
Code can write a tensor's memory where the dispatcher does not see: through ``numpy()``
(``h.detach().numpy()[...] *= 2``), an extension's pointer. A kept output written so after it
was kept holds the written values with its version unchanged, and the re-run, handed it back,
ran the write again on it: twice written, a silent wrong gradient (a selective region only: a
full re-run rebuilds the output before writing it). Every such path starts with a ``detach``
the forward's mode sees (``.data``, ``detach()``, ``numpy()`` each issue one), so a kept output
whose memory a ``detach`` reached in forward is rebuilt, not handed back: exact, at the cost of
running its operator again. ``tests/test_each.py`` holds the case.

A policy is either a [`remat.Policy`][remat.Policy] (by operator name) or a
`CallPolicy`, which asks a function about every operator call, as
torch's ``create_selective_checkpoint_contexts`` does; the function is asked in
forward only, and its answers are replayed by call index in recomputation.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint as _torch_checkpoint
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from remat._engine import dead as _dead
from remat._engine import recipes as _recipes
from remat._engine.errors import RecomputeError
from remat._engine.placeholder import Placeholder
from remat._engine.rng import drew, generator_states
from remat._engine.state import recompute_depth
from remat._vocab.policy import Policy

# Operators that never hold a value worth keeping: aliases and bookkeeping.
_PASS_THROUGH = {
    torch.ops.aten.detach.default,
    torch.ops.aten.alias.default,
    torch.ops.aten.lift_fresh.default,
    torch.ops.aten.lift_fresh_copy.default,
    torch.ops.prim.device.default,
    torch.ops.aten.sym_size.int,
    torch.ops.aten.sym_stride.int,
    torch.ops.aten.sym_numel.default,
    torch.ops.aten.sym_storage_offset.default,
}


#: Operators a per-call policy is never asked about (torch's ``SAC_IGNORED_OPS`` and the above).
IGNORED_OPS: set = set(_torch_checkpoint.SAC_IGNORED_OPS) | _PASS_THROUGH


@dataclass(frozen=True)
class CallPolicy:
    """A per-call policy: ``decide(func, args, kwargs, out)`` returns True to keep ``out``.

    Outputs of views and of in-place operators are rebuilt whatever ``decide``
    says (a kept alias or a skipped write would be wrong in recomputation).
    """

    decide: Callable[[Any, tuple, dict, Any], bool]
    name: str = "policy_fn"

    def __repr__(self) -> str:
        return self.name


def _keeps(policy: Policy | CallPolicy, func: Any) -> bool:
    """True when ``func``'s calls are counted (and its outputs may be kept)."""
    if isinstance(policy, CallPolicy):
        return func not in IGNORED_OPS
    if func in _PASS_THROUGH or func._schema.is_mutable or func.is_view:
        return False
    return policy.saves(func._schema.name)


def _counted(policy: Policy | CallPolicy, func: Any) -> Any:
    """What calls are numbered by: the operator's name for a `Policy` (NOTE [Counting
    calls] in ``remat/_vocab/policy.py``: any overload), the overload for a per-call policy."""
    return func if isinstance(policy, CallPolicy) else func._schema.name


def _decides_to_keep(policy: Policy | CallPolicy, func: Any, args: tuple, kwargs: dict,
                     out: Any, index: int) -> bool:
    if not isinstance(policy, CallPolicy):
        return policy.saves_call(func._schema.name, index)
    keep = policy.decide(func, args, kwargs, out)
    return bool(keep) and not (func._schema.is_mutable or func.is_view)


class _Store:
    """Outputs kept in forward, indexed by operator and call number."""

    def __init__(self) -> None:
        self.kept: dict[Any, dict[int, Any]] = defaultdict(dict)
        self.count: dict[Any, int] = {}  # calls seen in forward, per operator
        self.draws: set[tuple[Any, int]] = set()  # kept calls that drew from a generator
        # NOTE [Aliases with a version of their own]: kept storages, and the later outputs
        # sharing one of them that autograd does not count as views (with their versions)
        self.watched: dict[Any, tuple[Any, int]] = {}
        self.aliases: dict[tuple[Any, int], list] = {}
        self.escaped: set[tuple[Any, int]] = set()  # NOTE [Kept outputs detached in forward]
        self.finished = False  # the forward returned (NOTE [Re-runs inside a selective forward])
        self.flow: _dead.Flow | None = None  # NOTE [Dead operators in a selective re-run]

    def stored(self, key: Any, index: int) -> list | None:
        """The kept output of call ``index`` of ``key`` as ``(alias, version)`` pairs (its
        watched aliases too), or None when not kept."""
        entry = self.kept.get(key, {}).get(index)
        if entry is None:
            return None
        return [t for t in pytree.tree_leaves(entry, is_leaf=_is_pair) if _is_pair(t)] + self.aliases.get((key, index), [])

    def hands_back(self, key: Any, index: int) -> bool:
        """Whether recomputation hands call ``index`` of ``key`` back without running it:
        kept, unchanged since forward, and drew nothing (NOTE [Kept random operators])."""
        stored = self.stored(key, index)
        return (stored is not None and (key, index) not in self.draws and (key, index) not in self.escaped
                and all(t._version == version for t, version in stored))


class SaveMode(TorchDispatchMode):
    """Forward half: run each operator, keep the outputs ``policy`` saves.

    NOTE [Re-runs inside a selective forward]
    A forward that calls backward itself (``torch.autograd.grad`` inside the region:
    a force field's ``-dE/dx``) re-runs the region before it has returned (NOTE
    [Backward inside a region's forward] in ``hooked.py``). That re-run's operators
    pass through this mode too, below its own replay mode; numbering them as calls
    of the forward shifted every later call's number, and recomputation handed back
    another call's kept output: a silent wrong gradient (found by an outside fuzzer,
    with ``output_recompute``). Operators run deeper in re-runs than the forward
    itself are not the forward's calls: they pass through unnumbered. Such a re-run may
    also run further than the forward has yet (``early_stop=False`` runs the whole region,
    past the ``torch.autograd.grad`` the forward is waiting in): calls the forward has not
    reached run as they are, kept by nothing; only once the forward has returned is a call
    it never made a sign of a region that is not deterministic.
    """

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """NOTE [Compiled code inside a region] in ``observe.py``."""
        return True

    def __init__(self, policy: Policy | CallPolicy, store: _Store) -> None:
        super().__init__()
        self.policy, self.store = policy, store
        self.calls: dict[Any, int] = defaultdict(int)
        self.depth = 0
        self.staged = False  # a staged region's forward records its flow always (NOTE [Re-runs in stages])
        self.each = False  # and notes how to run each call again (NOTE [Each saved tensor rebuilt on its own])

    def __enter__(self):
        self.depth = recompute_depth()
        self.store.finished = False
        # NOTE [Dead operators in a selective re-run]
        recorded = self.staged or self.each or _dead.worth_recording(self.policy)
        self.store.flow = flow = _dead.Flow() if recorded else None
        if self.each:
            flow.recipes = _recipes.Recipes()
        if flow is not None:
            _dead.forwards.append(flow)  # NOTE [Saved inside a nested region]
        return super().__enter__()

    def __exit__(self, *exc_info):
        self.store.finished = True
        flow = self.store.flow
        if flow is not None and _dead.forwards and _dead.forwards[-1] is flow:
            _dead.forwards.pop()
        elif flow is not None and flow in _dead.forwards:
            _dead.forwards.remove(flow)
        return super().__exit__(*exc_info)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if recompute_depth() > self.depth:  # NOTE [Re-runs inside a selective forward]
            return func(*args, **kwargs)
        flow, store = self.store.flow, self.store
        if func is _dead.DETACH and store.watched:  # NOTE [Kept outputs detached in forward]
            entry = store.watched.get(_storage_key(args[0]))
            if entry is not None:
                store.escaped.add(entry)
        recipes = flow.recipes if flow is not None else None
        if recipes is not None:  # NOTE [Each saved tensor rebuilt on its own]: in place of the flow
            call = recipes.before(func, args, kwargs) if recipes.usable else -1
        else:
            call = flow.before(func, args, kwargs) if flow is not None and flow.usable else -1
        _, keeps, random, is_view = _facts(self.policy, func)
        before = generator_states((args, kwargs)) if random else None
        out = func(*args, **kwargs)
        if call >= 0:
            if recipes is not None:
                recipes.after(call, out)
            else:
                flow.after(call, func, out)
        if store.watched and not is_view:  # NOTE [Aliases with a version of their own]
            for t in (out,) if type(out) is torch.Tensor else pytree.tree_leaves(out):
                entry = store.watched.get(_storage_key(t))
                if entry is not None:
                    store.aliases.setdefault(entry, []).append((_alias(t), t._version))
        if keeps:
            key = _counted(self.policy, func)
            index = self.calls[key]
            self.calls[key] += 1
            store.count[key] = index + 1
            if call >= 0:
                flow.keys[call] = (key, index)
            if _decides_to_keep(self.policy, func, args, kwargs, out, index):
                store.kept[key][index] = pytree.tree_map_only(
                    torch.Tensor, lambda t: (_alias(t), t._version), out
                )
                for t in pytree.tree_leaves(out):
                    if _storage_key(t) is not None:
                        store.watched[_storage_key(t)] = (key, index)
                if random and drew(before, generator_states((args, kwargs))):
                    store.draws.add((key, index))  # NOTE [Kept random operators]
        return out


#: (id of a policy, id of an operator) -> (the policy, whether the operator's calls are
#: counted, whether it is a counted random operator, whether it is a view): learned once per
#: pair, read at every call (ids: hashing a policy or an operator is Python code; the policy
#: held, so its id is not reused while the entry stands; an operator lives as long as torch)
_FACTS: dict = {}


def _facts(policy: Policy | CallPolicy, func: Any) -> tuple:
    found = _FACTS.get((id(policy), id(func)))
    if found is None or found[0] is not policy:
        if len(_FACTS) > 4096:  # policies made per call (a context_fn's closure)
            _FACTS.clear()
        keeps = _keeps(policy, func)
        found = _FACTS[id(policy), id(func)] = (
            policy, keeps, keeps and torch.Tag.nondeterministic_seeded in func.tags, func.is_view)
    return found


class ReplayMode(TorchDispatchMode):
    """Recompute half: return kept outputs, skip dead calls, run every other operator."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """NOTE [Compiled code inside a region] in ``observe.py``."""
        return True

    def __init__(self, policy: Policy | CallPolicy, store: _Store) -> None:
        super().__init__()
        self.policy, self.store = policy, store
        self.calls: dict[Any, int] = defaultdict(int)
        self.depth = 0
        #: set by the region before a re-run that only rebuilds saved tensors (NOTE [Dead
        #: operators in a selective re-run]); read and cleared as the re-run starts
        self.prune = False
        #: set with ``prune`` by a staged region (NOTE [Re-runs in stages] in ``stages.py``):
        #: the first and last saved tensor this re-run rebuilds, and the calls before which
        #: kept outputs are handed back and kept (a later stage's re-run reaches them)
        self.stage: tuple[int, int] | None = None
        self.keep_before = 0
        self.live: list[bool] | None = None  # per forward call, while the re-run follows it
        self.call = 0
        self.handed_back: set[int] = set()  # the calls whose kept outputs this re-run hands back
        self.made = False  # a placeholder was handed out in this re-run
        self.reading = True  # the running call is live

    def __enter__(self):
        self.calls.clear()
        self.depth = recompute_depth()
        self.call, self.made, self.live, self.reading = 0, False, None, True
        flow, store = self.store.flow, self.store
        if self.prune and flow is not None and flow.usable and store.finished:
            self.handed_back = {c for c, (k, i) in flow.keys.items() if store.hands_back(k, i)}
            self.live = flow.live(self.handed_back, self.stage)
            _dead.judge(self.policy, flow, self.live, self.handed_back)
        self.prune, self.stage = False, None
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # NOTE [Re-runs inside a selective forward]: a re-run inside this re-run (an inner
        # region's forward that calls backward) is not this re-run's calls
        if recompute_depth() > self.depth:
            return func(*args, **kwargs)
        if self.live is not None and func is not _dead.DETACH:  # NOTE [Dead operators in a selective re-run]
            skipped = self._skipped(func)
            if skipped is not None:
                return skipped
        if not _facts(self.policy, func)[1]:
            return self._run(func, args, kwargs)
        key = _counted(self.policy, func)
        index = self.calls[key]
        self.calls[key] += 1
        kept = self.store.kept.get(key, {})
        if index not in kept:
            if index < self.store.count.get(key, 0) or not self.store.finished:
                return self._run(func, args, kwargs)  # not kept, handed back already, or ahead
                # of a forward still running (NOTE [Re-runs inside a selective forward])
            raise RecomputeError(
                f"remat selective recompute: {func} call #{index} ran in recomputation but "
                f"not in forward (policy {self.policy!r}); the region is not deterministic. "
                f"{func} invocation index {index} encountered during backward but not found "
                f"in storage."
            )
        stored = self.store.stored(key, index)
        # handed back once (a later backward rebuilds it), or kept for a later stage's re-run
        entry = kept[index] if self.call <= self.keep_before else kept.pop(index)
        if (key, index) in self.store.escaped or any(t._version != version for t, version in stored):
            return self._run(func, args, kwargs)  # changed in place after forward, or may have been: rebuild it
        if (key, index) in self.store.draws:
            # NOTE [Kept random operators]: the draw still runs, so the generator stands where
            # forward left it for the random operators rebuilt after this one
            self._run(func, args, kwargs)
        # a fresh alias: autograd attaches the recomputation's graph to it, not to the store
        return pytree.tree_map(lambda p: _alias(p[0]) if _is_pair(p) else p, entry, is_leaf=_is_pair)

    def _skipped(self, func: Any) -> Any:
        """Placeholders for a dead call, numbered as in forward; None for a call that runs."""
        call, live, flow = self.call, self.live, self.store.flow
        self.call = call + 1
        if call >= len(live) or flow.funcs[call] is not func:
            self.live, self.reading = None, True  # the re-run diverged: run the rest
            return None
        self.reading = live[call]
        # a kept output is handed back, dead or not: it costs nothing, and a placeholder
        # where the forward had a value can change what code above the dispatcher does
        if not flow.skips(call, live) or call in self.handed_back:
            return None
        self.made = True
        if _facts(self.policy, func)[1]:  # numbered as in forward
            self.calls[_counted(self.policy, func)] += 1
        return flow.placeholder(call)

    def _run(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if self.made and self.reading and any(type(t) is Placeholder for t in _dead.tensors_of(args, kwargs)):
            _dead.refuse_placeholder(func, self.policy)
        return func(*args, **kwargs)


def _storage_key(t: Any) -> Any:
    """The storage ``t`` holds, as a key (None for a non-tensor or a tensor without one)."""
    if type(t) is not torch.Tensor and (not isinstance(t, torch.Tensor) or is_traceable_wrapper_subclass(t)):
        return None
    return t.untyped_storage()._cdata


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A detached alias of ``t`` that shares its version counter.

    Under a dispatch mode the ADInplaceOrView key is excluded, so a plain
    ``detach()`` would get a version counter of its own and in-place changes to
    ``t`` would go unseen.
    """
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
        return t.detach()


def _is_pair(x: Any) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], torch.Tensor)


def modes(policy: Policy | CallPolicy) -> tuple[SaveMode, ReplayMode]:
    """Return a fresh (forward, recomputation) pair of modes applying ``policy``."""
    store = _Store()
    return SaveMode(policy, store), ReplayMode(policy, store)


def policy_context(policy: Policy) -> Callable[[], tuple[SaveMode, ReplayMode]]:
    """Return a ``context_fn`` for [`remat.checkpoint`][remat.checkpoint] that applies ``policy``.

    Args:
        policy: which operator outputs to keep, e.g. [`remat.save_compute_intensive`][remat.save_compute_intensive].

    Returns:
        A function returning the (forward, recomputation) context pair, as
        ``torch.utils.checkpoint.create_selective_checkpoint_contexts`` does.

    Examples:
        >>> import torch, remat
        >>> fc = torch.nn.Linear(8, 8)
        >>> x = torch.randn(4, 8, requires_grad=True)
        >>> y = remat.checkpoint(lambda t: torch.relu(fc(t)), x, use_reentrant=False,
        ...                      context_fn=remat.policy_context(remat.save_compute_intensive))
        >>> y.sum().backward()
    """
    if not isinstance(policy, Policy):
        raise TypeError(
            f"remat.policy_context: policy must be a remat.Policy such as "
            f"remat.save_compute_intensive, got {type(policy).__name__}"
        )

    def context_fn() -> tuple[SaveMode, ReplayMode]:
        return modes(policy)

    context_fn.policy = policy  # type: ignore[attr-defined]
    return context_fn
