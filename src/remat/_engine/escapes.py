"""Tensors that leave a reentrant region other than through its outputs (engine).

NOTE [Tensors that escape a reentrant region] (``observe.py``) says what escapes and
why it matters; this module finds the escapes of a watched forward and hands them
back to the re-run.

NOTE [Escapes handed back by position]
A tensor a forward hook captured (a router's logits recorded by Hugging Face's output
recorder) or the region appended to a container is held where remat cannot rebind it.
It need not be rebound: the region's Function returns that very tensor as an extra
output, and autograd gives the returned object its history in place, so every holder
sees a tensor that carries its gradient as without the mark (a view cannot be given
one that way, and is refused). In backward the Function needs the re-run's value of
that tensor, which no name reaches: the watched forward noted each operator it ran,
in order, and where the escaped tensor came from (the operator's index, the
output's). The re-run is watched by `Pick`, which takes the tensor at the same
place and checks, operator by operator up to the last place it needs, that the re-run
runs the operators the forward ran (``detach`` aside, which autograd issues itself
under grad mode, as torch's selective checkpoint ignores it too): a re-run that diverges (a branch taken
otherwise) is refused with a ``RecomputeError`` before any gradient is returned,
never matched by guess. Such a region is watched on every call (its facts are not
stored: NOTE [Observed once, confirmed every call]), and so is every reentrant
region whose modules carry forward hooks (the hook may capture only on some calls:
Hugging Face's recorder does when its collector is on).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from remat._engine import boundary as _boundary
from remat._engine import structure as _structure
from remat._engine.errors import RecomputeError
from remat._engine.hooked import HookedFrame
from remat._engine.observe import (
    _STOPS_GRADIENT,
    Observe,
    _replaying,
    _Watch,
    restore_state,
    tensors_in,
)


class Picks:
    """Where the escaped tensors of a forward came from, and the operators before them."""

    __slots__ = ("calls", "places", "tensors")

    def __init__(self, calls: list, found: list[tuple[torch.Tensor, tuple[int, int]]]) -> None:
        self.places = [at for _, at in found]
        self.calls = calls[:max(call for call, _ in self.places) + 1]
        self.tensors = [t for t, _ in found]

    def take(self) -> list[torch.Tensor]:
        """The escaped tensors, once: the frame must not hold them (each leads back to it
        through autograd once it is the Function's output)."""
        tensors, self.tensors = self.tensors, []
        return tensors


def _bound(fn: Callable) -> list:
    """The arguments a ``functools.partial`` binds (Hugging Face binds a layer's keywords)."""
    found = []
    while isinstance(fn, functools.partial):
        found += [*fn.args, *fn.keywords.values()]
        fn = fn.func
    return found


def _inside_another_region() -> bool:
    """True inside a non-reentrant region's forward: a tensor handed out as an output of
    this region's Function there is one the enclosing region's re-run makes again, which
    the Function cannot follow; such an escape is refused."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return top is not None and isinstance(getattr(top[0], "__self__", None), HookedFrame)


def find(frame: Any, observe: Observe, output: Any) -> tuple[list, Picks | None]:
    """The escapes of a watched reentrant forward: ``(dict, key, tensor)`` for each
    attribute of the region's modules bound to an escaped tensor, and where every other
    escaped tensor was made (NOTE [Escapes handed back by position]); refuses what
    cannot be handed back, leaving the state the forward wrote and the attributes it
    rebound as they were."""
    kept = [*_structure.tensors_held(output), *frame.arguments, *frame.aliases,
            *_structure.tensors_held([*frame.leaves, *_bound(frame.fn)])]
    escaped = observe.escaped([t for t in kept if isinstance(t, torch.Tensor)])
    if not escaped:
        return [], None
    rebound, attributes = [], []
    for entry in frame.module_state.entries:
        for place, key, now in entry.rebound():
            rebound.append((place, key, entry.value_then(place, key)))
            if isinstance(now, torch.Tensor) and any(now is t for t, _ in escaped):
                attributes.append((place, key, now))
    others = [(t, at) for t, at in escaped if not any(t is now for _, _, now in attributes)]
    views = [t for t, _ in others if t._is_view()]
    if not views and not _inside_another_region():
        return attributes, (Picks(observe.calls, others) if others else None)
    restore_state(observe.state)
    for place, key, then in rebound:
        _boundary.put(place, key, then)
    frame.abandon()
    shape = list((views or [t for t, _ in escaped])[0].shape)
    raise RecomputeError(
        f"remat: region '{frame.name}' (use_reentrant=True): a tensor it computes (shape "
        f"{shape}) leaves it through a forward hook, a container it wrote to or an attribute, "
        f"not through its outputs, {'as a view, ' if views else 'inside another region, '}which "
        f"the reentrant implementation cannot give a gradient (it runs forward without grad; "
        f"without the mark that tensor carries one: an auxiliary or router loss would train "
        f"nothing); use use_reentrant=False, which keeps its graph, or return the tensor as an "
        f"output (torch's reentrant checkpoint drops that gradient silently)"
    )


class Pick(_Watch):
    """Take the re-run's tensors at the places the forward's escaped ones were made,
    checking that the re-run runs the forward's operators (NOTE [Escapes handed back by
    position])."""

    def __init__(self, name: str, picks: Picks) -> None:
        super().__init__()
        self.name, self.picks = name, picks
        self.wanted = {call: [] for call, _ in picks.places}
        for call, j in picks.places:
            self.wanted[call].append(j)
        self.found: dict[tuple[int, int], torch.Tensor] = {}
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (_replaying[0] or self.depth or self.n >= len(self.picks.calls)  # as Observe counts
                or func in _STOPS_GRADIENT):
            return func(*args, **kwargs)
        out = self._call(func, args, kwargs, tensors_in(args, kwargs))
        if func is not self.picks.calls[self.n]:
            self._diverged(f"runs {func} where its forward ran {self.picks.calls[self.n]}")
        if self.n in self.wanted:
            made = tensors_in((out,))
            for j in self.wanted[self.n]:
                self.found[(self.n, j)] = made[j]
        self.n += 1
        return out

    def taken(self) -> tuple:
        """The re-run's counterparts of the escaped tensors, in the forward's order."""
        if len(self.found) < len(self.picks.places):
            self._diverged("stops before the operators that made them")
        return tuple(self.found[at] for at in self.picks.places)

    def _diverged(self, how: str) -> None:
        raise RecomputeError(
            f"remat: region '{self.name}' (use_reentrant=True): tensors it computed left it "
            f"through a hook or a container (NOTE [Escapes handed back by position]), and its "
            f"re-run in backward {how} (operator {self.n}), so remat cannot find their "
            f"recomputed values to give them their gradients; make the forward run the same "
            f"operators again (no branch on state that changes between forward and backward), "
            f"or use use_reentrant=False"
        )
