"""Parameter versions a re-run's own writes moved (engine).

NOTE [Versions a re-run moved]
A region's forward may write its parameters (an embedding's ``max_norm`` renormalizes its
weight, in place, through a detached alias). Its re-runs replay that write, never run it
twice (NOTE [Observed writes] in ``observe.py``): the values stay the forward's, but the
versions move. A region whose parameters' versions moved since its forward is refused as a
parameter changed before backward (NOTE [Parameters changed before backward] in
``boundary.py``), and a region inside another one, or ``output_recompute``'s output pass
followed by the same region's re-run, read those moves as the user's: a false refusal,
in every mode. So each re-run notes, per parameter whose version its run moved, the
version before and after (`note`), and a version is taken as unchanged when a chain of
such moves leads from it to the current one (`reached`). Only a re-run's own code runs
between the two readings, so nothing the user did is ever taken for one.
"""

from __future__ import annotations

import weakref

import torch

_MOVES: dict[int, tuple[weakref.ref, dict[int, int]]] = {}  # id -> (parameter, {before: after})
_KEEP = 16  # moves kept per parameter
_PRUNE = [1024]  # entries before the dead ones are dropped


def note(params: list[torch.Tensor], before: list[int], after: list[int]) -> None:
    """A re-run moved ``params``' versions from ``before`` to ``after``."""
    for p, b, a in zip(params, before, after, strict=True):
        if a == b:
            continue
        entry = _MOVES.get(id(p))
        if entry is None or entry[0]() is not p:
            if len(_MOVES) >= _PRUNE[0]:
                for key in [k for k, (ref, _) in _MOVES.items() if ref() is None]:
                    del _MOVES[key]
                _PRUNE[0] = max(1024, 2 * len(_MOVES))
            entry = _MOVES[id(p)] = (weakref.ref(p), {})
        moves = entry[1]
        moves[b] = a
        if len(moves) > _KEEP:
            moves.pop(next(iter(moves)))


def reached(param: torch.Tensor, version: int) -> bool:
    """Whether re-runs alone moved ``param`` from ``version`` to its current one."""
    entry = _MOVES.get(id(param))
    if entry is None or entry[0]() is not param:
        return False
    moves, now = entry[1], param._version
    for _ in range(_KEEP):
        if version == now:
            return True
        if version not in moves:
            return False
        version = moves[version]
    return version == now
