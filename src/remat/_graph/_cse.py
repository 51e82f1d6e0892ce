"""Common-subexpression elimination after the recompute pass (front end: graph mode).

MindSpore marks recomputed nodes ``need_cse_after_recompute``: once copies are
in the backward graph, a copy that computes what an earlier node already
computes (same operator, same inputs) is merged into it. Only pure,
non-random operators merge.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from torch import fx

from remat._graph._regions import is_replayable


def _freeze(value: Any) -> Hashable:
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, slice):
        return ("slice", value.start, value.stop, value.step)
    return value


def eliminate_common_subexpressions(graph: fx.Graph, nodes: list[fx.Node]) -> int:
    """Merge each of ``nodes`` into an earlier one computing the same value; return how many merged.

    Args:
        graph: the graph holding ``nodes``.
        nodes: candidate nodes in graph order (remat passes the backward part).

    Returns:
        The number of nodes removed.

    Examples:
        >>> import torch, torch.fx as fx
        >>> g = fx.Graph(); x = g.placeholder("x")
        >>> a = g.call_function(torch.ops.aten.relu.default, (x,))
        >>> b = g.call_function(torch.ops.aten.relu.default, (x,))
        >>> _ = g.output((a, b))
        >>> eliminate_common_subexpressions(g, [a, b])
        1
    """
    seen: dict[Hashable, fx.Node] = {}
    merged = 0
    for node in nodes:
        if not _mergeable(node):
            continue
        try:
            key = (node.target, _freeze(node.args), _freeze(node.kwargs))
            hash(key)
        except TypeError:
            continue
        first = seen.setdefault(key, node)
        if first is node:
            continue
        node.replace_all_uses_with(first)
        graph.erase_node(node)
        merged += 1
    return merged


def _mergeable(node: fx.Node) -> bool:
    return node.op == "call_function" and is_replayable(node)
