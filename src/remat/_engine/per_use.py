"""Per-use gradients of a reentrant region's arguments (engine).

NOTE [Per-use gradients]
Autograd sums the gradients a tensor gets in the order they arrive: one per
edge of the graph that leads to it, each added to its buffer as the operator
at the edge's other end finishes. A ``use_reentrant=True`` region returns one
gradient per input of its Function, the sum of its own edges taken inside the
nested backward, so a tensor the region reads twice (a decoder layer's keys
and values, both from the encoder's output) that also got a gradient from
outside the region before it (the later decoder layers, which read it too)
is summed in another order than without the mark: ``(g + k) + v`` becomes
``g + (k + v)``, a rounding-level difference. To give the outer buffer the
very same additions, the Function takes such an argument once per operator
that read it in the forward (counted by `Observe`, kept in the region's
facts), and its backward hands each of those inputs one edge's gradient, in
the order the nested backward produced them: a post hook on every node of
the re-run's graph with an edge to the argument records what it sends along
that edge (`hook_edges`). The autograd engine adds a Function's gradients to their
buffers in input order, so the buffer sees each edge's gradient as unmarked.

Splitting costs a walk of the re-run's graph, so a region splits an argument
only when a later region took the same tensor (`Users`): that region's
gradients arrive first, and only then does the order differ (when this
region's gradients come first, its inner sum is the same first additions).
An argument read outside the regions after this one (an unmarked layer) is
not seen; its gradient differs from unmarked by rounding, as documented.
More edges in the re-run than inputs (another branch than in the forward)
are summed into the last input, the same rounding.
"""

from __future__ import annotations

import weakref
from typing import Any, ClassVar

import torch


class Users:
    """Which reentrant regions took a tensor as an argument, in order (weakly held).

    A region registers its arguments when its Function is applied (`note`); a later region
    that takes the same tensor marks the earlier ones (``frame.shared``), whose backward
    then splits that argument's gradient by use.
    """

    _by_id: ClassVar[dict[int, tuple[weakref.ref, list]]] = {}
    _PRUNE = 4096  # entries before the dead ones are dropped (no callback per tensor)

    @classmethod
    def note(cls, frame: Any, tensors: list, splittable: dict[int, int]) -> None:
        """``frame`` took ``tensors``; those in ``splittable`` (index -> uses) may be split."""
        by_id, me = cls._by_id, weakref.ref(frame)
        for i, x in enumerate(tensors):
            if not x.requires_grad:
                continue
            entry = by_id.get(id(x))
            if entry is not None and entry[0]() is x:
                for ref, j in entry[1]:
                    earlier = ref()
                    if earlier is not None:
                        earlier.shared.add(j)
                entry[1].clear()  # marked: they need not be marked again
                if i in splittable:
                    entry[1].append((me, i))
            elif i in splittable:
                if len(by_id) >= cls._PRUNE:
                    cls._by_id = by_id = {k: e for k, e in by_id.items() if e[0]() is not None}
                    cls._PRUNE = max(4096, 2 * len(by_id))
                by_id[id(x)] = (weakref.ref(x), [(me, i)])


def extra_inputs(frame: Any, tensors: list) -> list[torch.Tensor]:
    """The extra inputs of a region's Function: an argument read by ``n`` operators, ``n - 1``
    more times (NOTE [Per-use gradients]); ``frame.extra`` says whose."""
    uses = frame.uses
    frame.extra = []
    if not uses:
        return []
    splittable = {}
    for i, (x, n) in enumerate(zip(tensors, uses, strict=True)):
        if (n > 1 and x.requires_grad and i not in frame.same_as and i not in frame.written
                and i not in frame.same_as.values()):
            splittable[i] = n
            frame.extra.append((i, n - 1))
    Users.note(frame, tensors, splittable)
    return [tensors[i] for i, k in frame.extra for _ in range(k)]


def hook_edges(frame: Any, outs: list, wrts: list) -> dict[int, list] | None:
    """Record, for each argument to split, what every edge of the re-run sends it, in order.

    Returns ``{argument index: [gradients]}``, filled as the nested backward runs; None when
    nothing is split (no later region took an argument this region read twice).
    """
    split = {id(wrts[i]): i for i, _ in frame.extra
             if i in frame.shared and wrts[i] is not None and wrts[i].grad_fn is None}
    if not split:
        return None
    sent: dict[int, list] = {i: [] for i in split.values()}
    seen: set = set()
    todo = [o.grad_fn for o in outs if o.grad_fn is not None]
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        edges = []
        for k, (nxt, _) in enumerate(node.next_functions):
            if nxt is None:
                continue
            variable = getattr(nxt, "variable", None) if not nxt.next_functions else None
            if variable is not None:  # a leaf's accumulator: the walk stops there
                if id(variable) in split:  # (the leaves are alive: an id is theirs)
                    edges.append((k, split[id(variable)]))
                continue
            todo.append(nxt)
        if edges:
            node.register_hook(_recorder(edges, sent))
    return sent


def _recorder(edges: list, sent: dict[int, list]) -> Any:
    def record(grad_inputs: tuple, grad_outputs: tuple) -> None:
        for k, i in edges:
            if grad_inputs[k] is not None:
                sent[i].append(grad_inputs[k])
    return record


def per_input(frame: Any, input_grads: list, sent: dict[int, list] | None) -> list:
    """The gradients of the extra inputs; ``input_grads`` gets each split argument's first
    edge's instead of its sum (NOTE [Per-use gradients])."""
    extra: list = []
    for i, k in frame.extra:
        parts = sent.get(i) if sent is not None else None
        if not parts or input_grads[i] is None:
            extra += [None] * k
            continue
        if len(parts) > k + 1:  # more edges than in the forward: the rest summed, in order
            tail = parts[k]
            for g in parts[k + 1:]:
                tail = tail + g
            parts = [*parts[:k], tail]
        input_grads[i] = parts[0]
        extra += [*parts[1:], *([None] * (k + 1 - len(parts)))]
    return extra
