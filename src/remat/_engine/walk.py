"""The re-run's autograd graph, walked for leaves its Function does not take (engine).

NOTE [Observed reads] in ``observe.py`` says why: a reentrant region's gradients leave
through its Function only, so a leaf its re-run reaches that is not an input of the
Function would lose its gradient. NOTE [Reads that vary] in ``facts.py`` says when every
re-run walks: an unwatched call cannot see a read that varies from call to call.
"""

from __future__ import annotations

import torch

from remat._engine.errors import RecomputeError


def reached_outside(outs: list, wrt: list, made: set = frozenset(), made_reached: list | None = None
                    ) -> list[torch.Tensor]:
    """The leaves a re-run's graph reaches that are not inputs of the Function.

    NOTE [Observed reads]: a gradient for one of them would be lost. Walks the re-run's
    autograd graph from ``outs``; stops at ``wrt`` (their ``grad_fn``, or their gradient
    accumulator for leaves). A leaf the re-run made itself (``made``: ids of what its
    operators returned; T5 makes its position bias a leaf that requires grad) is the
    region's own temporary, as in its forward: its gradient leaves the region nowhere
    (each one reached is appended to ``made_reached``).
    The caller differentiates them too and refuses only one that gets a gradient
    (`refuse_lost`): an edge that carries none (a parameter of an inner region's
    module that its forward did not use) loses nothing.

    Every unwatched re-run walks too (NOTE [Reads that vary] in ``facts.py``), so the walk
    does the least per node: each node's edges are read once, a node is marked seen as it is
    first reached (never pushed twice), and a gradient accumulator is told by its type, not
    by an attribute lookup that fails on every other node, and is never pushed.
    """
    leaf_ids = {id(t) for t in wrt if t.grad_fn is None}
    seen = {t.grad_fn for t in wrt if t.grad_fn is not None}
    seen.add(None)
    found: dict[int, torch.Tensor] = {}
    todo = [node for node in dict.fromkeys(o.grad_fn for o in outs) if node not in seen]
    seen.update(todo)
    pop, push, add, accumulator = todo.pop, todo.append, seen.add, _accumulator_type()
    while todo:
        for node, _ in pop().next_functions:
            if node in seen:
                continue
            add(node)
            if type(node) is not accumulator:
                push(node)
                continue
            variable = node.variable
            if id(variable) in made:
                if made_reached is not None:
                    made_reached.append(variable)
            elif id(variable) not in leaf_ids:
                found.setdefault(id(variable), variable)
    return list(found.values())


_ACCUMULATOR: list = []


def _accumulator_type() -> type:
    """The type of a leaf's gradient accumulator (the node ``variable`` belongs to)."""
    if not _ACCUMULATOR:
        leaf = torch.zeros((), requires_grad=True)
        with torch.enable_grad():  # the walk runs inside a backward, where grad is off
            _ACCUMULATOR.append(type(leaf.view_as(leaf).grad_fn.next_functions[0][0]))
    return _ACCUMULATOR[0]


def refuse_lost(name: str, outside: list, grads: list) -> None:
    """Refuse when a leaf outside the Function's inputs got a gradient (NOTE [Observed reads])."""
    for variable, g in zip(outside, grads, strict=True):
        if g is not None:
            raise RecomputeError(
                f"remat: region '{name}' (use_reentrant=True): its recomputation reaches a "
                f"tensor that requires grad (shape {list(variable.shape)}) which its forward "
                f"did not read, so that tensor's gradient would be lost (a custom "
                f"autograd.Function that returns a gradient for an input its forward never "
                f"reads, a torch.compile'd function that reads it inside a compiled kernel, "
                f"or state that changed between forward and backward); use "
                f"use_reentrant=False, or make the forward read it"
            )
