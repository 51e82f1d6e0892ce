"""What both implementations of a region share (engine).

A region is a callable run with its arguments (NOTE [Regions] in ``region.py``).
`RegionCore` holds what either implementation needs to run it again: the
callable, its arguments split into tensors and the rest, the options, the random
and autocast state to replay. The saved-tensor hooks
implementation (``hooked.py``) and the ``autograd.Function`` one
(``reentrant.py``) each extend it with the fields of their own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Self

import torch
from torch.utils import _pytree as pytree

from remat._engine import boundary as _boundary
from remat._engine import facts as _facts
from remat._engine import flat as _flat
from remat._engine import rng as _rng
from remat._vocab.spec import RegionSpec

_PLAIN = (torch.Tensor, torch.nn.Parameter)  # a subclass's tensors are its own business


class Contexts:
    """The contexts a region's forward or re-run runs in, left in reverse order (a lean
    ``ExitStack``: a region enters several on every call and every re-run)."""

    __slots__ = ("entered",)

    def __init__(self) -> None:
        self.entered: list = []

    def enter_context(self, context: Any) -> Any:
        value = context.__enter__()
        self.entered.append(context)
        return value

    def __enter__(self) -> Self:
        return self

    def close(self) -> None:
        self.__exit__(None, None, None)

    def __exit__(self, *exc_info: object) -> None:
        entered, self.entered = self.entered, []
        try:
            while entered:
                entered.pop().__exit__(*exc_info)
        finally:
            for context in reversed(entered):  # one raised: the others still leave
                context.__exit__(*exc_info)


class RegionCore:
    """One forward run of a region: what re-running it needs, for both implementations.

    Args:
        fn: what recomputation re-runs.
        args, kwargs: its arguments.
        spec: the region's options.
        name: how errors name the region.
        contexts: the (forward, recomputation) context pair of a ``context_fn`` or a
            policy, or None.
    """

    def __init__(self, fn: Callable, args: tuple, kwargs: dict, spec: RegionSpec, name: str,
                 contexts: tuple | None) -> None:
        self.fn, self.spec, self.name, self.contexts = fn, spec, name, contexts
        if not kwargs and all(isinstance(a, torch.Tensor) for a in args):  # the common case, without pytree
            self.treespec, self.tensor_slots = None, list(range(len(args)))
            self.leaves: list = [None] * len(args)
            self.arguments: list[torch.Tensor] = list(args)
        else:
            leaves, self.treespec = _flat.flatten(args, kwargs)  # NOTE [Plain arguments flattened directly]
            self.tensor_slots = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
            self.leaves = [None if isinstance(x, torch.Tensor) else x for x in leaves]
            self.arguments = [leaves[i] for i in self.tensor_slots]
        self.replay = _rng.capture(self.arguments, spec.preserve_rng_state)
        self.first_node = torch.autograd._get_sequence_nr()  # NOTE [Tensors returned as they were]
        self.kept_collectives: list | None = None  # NOTE [Kept collectives]
        self.runs = 0
        roots = _boundary.modules_of(fn)  # NOTE [Module state at the boundary]
        self.module_state = _boundary.ModuleState(name, roots)
        self.facts_key = _facts.key_of(self, self.arguments)  # NOTE [Observed once, confirmed every call]
        self.watched = True  # its forward ran under Observe
        self.uses: tuple = ()  # per tensor argument, the operators that took it (reentrant)
        self.known: Any = None  # unwatched: the facts it runs on (`facts.Facts`)

    def returned_as_it_was(self, t: Any) -> bool:
        """Whether output ``t`` is a tensor that requires grad and whose history (none, or one
        older than the frame: autograd numbers its nodes as it makes them) the region's forward
        did not make (NOTE [Tensors returned as they were] in ``reentrant.py``)."""
        if type(t) not in _PLAIN or not t.requires_grad:
            return False
        return t.grad_fn is None or t.grad_fn._sequence_nr() < self.first_node

    def module_state_restored(self, replayed: list) -> contextlib.AbstractContextManager:
        """The re-run's view of its modules: as the forward found them (``boundary.py``)."""
        return self.module_state.restored(replayed)

    def unflatten(self, leaves: list) -> tuple[tuple, dict]:
        """``(args, kwargs)`` from the flat leaves."""
        if self.treespec is None:
            return tuple(leaves), {}
        if type(self.treespec) is _flat.Plain:
            return self.treespec.unflatten(leaves)
        return pytree.tree_unflatten(leaves, self.treespec)

    def call_with(self, tensors: list) -> tuple[tuple, dict]:
        """``(args, kwargs)`` with the tensor arguments replaced by ``tensors``."""
        if self.treespec is None and len(tensors) == len(self.leaves):  # tensors only
            return tuple(tensors), {}
        leaves = list(self.leaves)
        for slot, x in zip(self.tensor_slots, tensors, strict=True):
            leaves[slot] = x
        return self.unflatten(leaves)

    def abandon(self) -> None:
        """The forward raised: drop the tensors the frame holds (see ``region._abandon``)."""
        self.arguments = []
