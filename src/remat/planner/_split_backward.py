"""A backward split into an input and a weight backward, as torch 2.13's zero-bubble pipeline
schedules run it (NOTE [A backward split in two] in ``_pipeline.py``), with public autograd
APIs only: the replay holds what torch's stage holds between the two.

The input backward (``I``) finds, walking the stage's graph from its outputs, the nodes where
a path to a parameter leaves the paths to the stage's inputs (torch's "intermediates", in
groups of parameters), records the gradients reaching them, computes the inputs' gradients
with the graph retained, and detaches the outputs. Until the weight backward (``W``) the
intermediates keep the graph below them alive (every tensor saved for backward there) and the
recorded gradients; ``W`` computes the parameters' gradients from them, and frees the graph.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node


def _node(t: torch.Tensor) -> Node | None:
    """A tensor's gradient function, or a leaf's gradient accumulator."""
    if t.requires_grad and t.grad_fn is None:
        return t.view_as(t).grad_fn.next_functions[0][0]
    return t.grad_fn


def _reverse(roots: list[Node]) -> dict[Node, list[Node]]:
    """Each node's parents (the nodes whose next functions name it), from ``roots`` down."""
    parents: dict[Node, list[Node]] = collections.defaultdict(list)
    queue = collections.deque(dict.fromkeys(r for r in roots if r is not None))
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is not None:
                if not parents[child]:
                    queue.append(child)
                parents[child].append(node)
    return parents


def _closure(roots: list[Node], stop: set[Node], parents: dict) -> tuple[set[Node], set[Node]]:
    """The nodes reached from ``roots`` up through parents, and the ones of ``stop`` met (not passed)."""
    closure, met = {r for r in roots if r is not None}, set()
    queue = collections.deque(closure)
    while queue:
        for parent in parents[queue.popleft()]:
            if parent in closure or parent is None:
                continue
            if parent in stop:
                met.add(parent)
                continue
            closure.add(parent)
            queue.append(parent)
    return closure, met


def _groups(inputs: list[Node], params: list[Node], parents: dict) -> list[dict[str, Any]]:
    """The parameters in groups, each with the intermediates on its way to the inputs' paths."""
    on_input_paths, _ = _closure(inputs, set(), parents)
    by_node: dict[Node, dict[str, Any]] = {}
    for param in params:
        _, met = _closure([param], on_input_paths, parents)
        group = {"params": {param}, "intermediates": met}
        for node in met:
            existing = by_node.get(node)
            if existing is not None:
                existing["params"] |= group["params"]
                existing["intermediates"] |= group["intermediates"]
                group = existing
            else:
                by_node[node] = group
    return list({id(g): g for g in by_node.values()}.values())


def backward_input(outputs: list[torch.Tensor], grads: list | None, inputs: list[torch.Tensor],
                   params: Iterable[torch.nn.Parameter]) -> list[dict[str, Any]]:
    """The input backward: each input's gradient added to its ``.grad``; the outputs detached;
    the parameter groups the weight backward needs (what it holds until then)."""
    valid = [(o, torch.ones_like(o) if grads is None else grads[i]) for i, o in enumerate(outputs)
             if o.requires_grad or o.grad_fn is not None]
    parents = _reverse([n for n in (_node(o) for o, _ in valid) if n is not None])
    wanted = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    groups = _groups([n for n in map(_node, wanted) if n is not None],
                     [n for n in map(_node, params) if n is not None], parents)
    handles = []
    try:
        for group in groups:
            group["intermediates"] = list(group["intermediates"])
            for i, node in enumerate(group["intermediates"]):
                handles.append(node.register_prehook(_recorder(group, i)))
        if valid and wanted:
            found = torch.autograd.grad([o for o, _ in valid], wanted, [g for _, g in valid],
                                        retain_graph=True, allow_unused=True)
            for x, g in zip(wanted, found):
                if g is None:
                    continue
                if x.grad is None:
                    x.grad = g
                else:
                    x.grad += g
        for o in outputs:
            o.detach_()
        return groups
    finally:
        for handle in handles:
            handle.remove()


def _recorder(group: dict, i: int) -> Any:
    def hook(grad_outputs: tuple) -> None:
        if group.get("grads") is None:
            group["grads"] = [None] * len(group["intermediates"])
        group["grads"][i] = grad_outputs
    return hook


def backward_weight(params: Iterable[torch.nn.Parameter], groups: list[dict[str, Any]]) -> None:
    """The weight backward: each group's parameters' gradients from the recorded gradients at
    its intermediates, added to their ``.grad``; the graph freed."""
    weight_of = {_node(p): p for p in params}
    for group in groups:
        edges, given = [], []
        for grads, node in zip(group.get("grads") or [], group["intermediates"]):
            for i, g in enumerate(grads):
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    given.append(g)
        handles = []
        try:
            if len(group["intermediates"]) > 1:  # no gradient counted twice through a descendant
                handles = [node.register_prehook(lambda _, saved=grads: saved)
                           for grads, node in zip(group["grads"], group["intermediates"])]
            del group["intermediates"]
            if edges:
                found = torch.autograd.grad(edges, tuple(GradientEdge(p, 0) for p in group["params"]),
                                            grad_outputs=given, retain_graph=False)
                del group["grads"]
                for node, g in zip(group["params"], found):
                    weight = weight_of[node]
                    if weight.grad is None:
                        weight.grad = g
                    else:
                        weight.grad += g
        finally:
            for handle in handles:
                handle.remove()
