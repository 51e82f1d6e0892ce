"""Which forward nodes of a joint graph a mark asks to recompute (front end: graph mode).

Marks reach the graph two ways:

* module marks (``Cell.recompute``, ``remat.recompute_module``, ``remat.apply``,
  primitives of ``remat.ops``): Dynamo records, on every node, the stack of
  module calls it was traced in (``node.meta["nn_module_stack"]``, keyed by
  ``id(module)`` plus ``@n`` for the n-th call). The ids are mapped back to the
  modules the user compiled, and ``remat.mark_of`` gives their options;
* functional regions (``remat.checkpoint``, ``remat.recompute``): the engine
  annotates the nodes it traces (see ``remat._engine.trace_marks``).

One call of a marked module, or one functional region, is a *region*. The rule
is MindSpore's: every operator of a region is recomputed except its output
operators (the nodes whose values leave the region), whose results are kept;
with ``output_recompute`` the outputs are recomputed too; a selective policy
keeps the operators it saves. A view costs no memory of its own: it follows its
base. Random and mutating operators are always kept (a replay would differ).
"""

from __future__ import annotations

import operator
import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import fx

from remat._engine.collectives import NAMESPACES as COLLECTIVE_NAMESPACES
from remat._engine.trace_marks import region_of_meta
from remat._front.marks import mark_of
from remat._vocab.spec import RegionSpec


@dataclass(frozen=True)
class Region:
    """One call of a marked module, or one functional region, in a traced graph.

    Args:
        key: unique per call (``"139..@1"`` for a module, ``"region 3"`` for a function).
        path: the module path shown in dumps (``"layers.1.0"``), or ``"checkpoint"``.
        kind: the module's class name, or ``"function"``.
        spec: the mark's options.
    """

    key: str
    path: str
    kind: str
    spec: RegionSpec


_SOURCE_PREFIX = re.compile(r"^(?:L|G)\['([^']+)'\]")
#: Names Dynamo gives the compiled module itself (``self`` in ``forward``, ``fn`` in ``__call__``).
_ROOT_NAMES = ("self", "fn")


def clean_path(source: str) -> str:
    """Turn a Dynamo source name (``"L['self'].layers[1]"``) into a module path (``"layers.1"``)."""
    path = _SOURCE_PREFIX.sub(lambda m: "" if m.group(1) in _ROOT_NAMES else m.group(1), source)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\['([^']+)'\]", r".\1", path)
    # a marked module reached through its MarkedForward (remat._front.marks): its forward's
    # _remat_module, a weak reference called (NOTE [A mark holds its module weakly])
    path = re.sub(r"(?:^|\.)(?:forward\.)?_remat_module(?:\(\))?(?=\.|$)", "", path)
    return path.lstrip(".")


def module_path(node: fx.Node) -> str:
    """Return the path and class of the innermost module ``node`` was traced in, or ``""``."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    source, cls = list(stack.values())[-1]
    name = getattr(cls, "__name__", str(cls))
    path = clean_path(source)
    return f"{path} ({name})" if path else name


def regions_of(node: fx.Node, modules: dict[int, torch.nn.Module]) -> list[Region]:
    """Return the marked regions ``node`` belongs to, outermost first."""
    regions = []
    for key, (source, cls) in (node.meta.get("nn_module_stack") or {}).items():
        module = modules.get(_module_id(key))
        spec = mark_of(module) if module is not None else None
        if spec is not None:
            regions.append(Region(key, clean_path(source), cls.__name__, spec))
    functional = region_of_meta(node.meta)
    if functional is not None:
        region_id, spec = functional
        regions.append(Region(f"region {region_id}", "checkpoint", "function", spec))
    return regions


def _module_id(key: str) -> int | None:
    try:
        return int(key.split("@", 1)[0])
    except ValueError:
        return None


def is_view(node: fx.Node) -> bool:
    """Whether ``node`` is an aten view (its value aliases its first input)."""
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and target.is_view


def op_name(node: fx.Node) -> str:
    """Return the aten name of the operator producing ``node`` (``"aten::relu"``)."""
    if node.target is operator.getitem:
        return op_name(node.args[0])
    target = node.target
    return target.name() if isinstance(target, torch._ops.OpOverload) else str(target)


def is_communication(node: fx.Node) -> bool:
    """Whether ``node`` is a functional collective or the ``wait_tensor`` of one.

    The decision depends on the graph only, so every rank keeps the same nodes.
    """
    if node.target is operator.getitem:
        return is_communication(node.args[0])
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and target.namespace in COLLECTIVE_NAMESPACES


#: NOTE [Seeded operators that never draw]
#: ``nondeterministic_seeded`` marks an operator that may draw from a generator; a copy of
#: one in backward would draw again, other numbers, so a marked region keeps it. But the
#: CPU's flash attention carries the tag for the dropout of the fused attentions and never
#: draws: it refuses ``dropout_p > 0`` ("Currently do not support dropout > 0"). Kept, it
#: held every marked block's attention output and its log-sum-exp (the bench's GPT under
#: cell marks: 58.1 MiB against 53.0 for torch's checkpoint compiled, which rebuilds it).
#: So it is replayed like any pure operator. The CUDA attentions draw when their dropout is
#: not zero, which a graph cannot see from a value computed at run time: they stay kept.
NEVER_DRAW = frozenset({torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default})


def is_replayable(node: fx.Node) -> bool:
    """Whether running ``node`` again gives the same value: a pure aten op that draws from no
    generator (NOTE [Seeded operators that never draw])."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return is_replayable(node.args[0])
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    if target._schema.is_mutable or (torch.Tag.nondeterministic_seeded in target.tags
                                     and target not in NEVER_DRAW):
        return False
    if "val" not in node.meta:  # a graph built by hand: trust the operator
        return True
    val = node.meta["val"]
    values = val if isinstance(val, (tuple, list)) else (val,)
    return all(isinstance(v, torch.Tensor) for v in values)


def plan_recompute(
    forward: Iterable[fx.Node],
    modules: dict[int, torch.nn.Module],
    root: torch.nn.Module | None = None,
) -> tuple[dict[fx.Node, list[Region]], set[fx.Node]]:
    """Decide which forward values are recomputed rather than saved.

    Args:
        forward: the forward nodes of a joint graph, in order.
        modules: ``id(module) -> module`` for every module that may be marked.
        root: the compiled module, if any. Dynamo does not list it in the module
            stacks (its ``forward`` is the traced frame); when it is marked, every
            forward node belongs to its region.

    Returns:
        ``(regions, recompute)``: the marked regions of each node, and the set of
        forward value nodes whose copies the backward graph will use.
    """
    forward = [n for n in forward if n.op == "call_function"]
    spec = mark_of(root) if root is not None else None
    outer = [Region("root", "", type(root).__name__, spec)] if spec is not None else []
    regions = {n: outer + regions_of(n, modules) for n in forward}
    kept = _region_outputs(forward, regions)
    calls = _call_numbers(forward, regions)
    recompute: set[fx.Node] = set()
    for node in forward:
        if _is_multi_output(node):
            continue
        if is_view(node):
            if node.args[0] in recompute:
                recompute.add(node)
            continue
        if not is_replayable(node):
            continue
        if any(_region_recomputes(r, node, kept, calls) for r in regions[node]):
            recompute.add(node)
    return regions, recompute


def _call_numbers(forward: list[fx.Node], regions: dict[fx.Node, list[Region]]) -> dict:
    """``(region key, node) -> k``: the node is the ``k``-th call of its operator (any overload)
    among the region's calls a policy may keep (NOTE [Counting calls] in
    ``remat/_vocab/policy.py``: no views, no mutating operators), in graph order."""
    seen: dict[tuple[str, str], int] = {}
    numbers: dict[tuple[str, fx.Node], int] = {}
    for node in forward:
        target = node.target
        if not isinstance(target, torch._ops.OpOverload) or target.is_view or target._schema.is_mutable:
            continue
        for region in regions[node]:
            at = (region.key, target._schema.name)
            numbers[(region.key, node)] = seen.get(at, 0)
            seen[at] = seen.get(at, 0) + 1
    return numbers


def _is_multi_output(node: fx.Node) -> bool:
    return bool(node.users) and all(u.target is operator.getitem for u in node.users)


def _region_recomputes(region: Region, node: fx.Node, kept: dict[fx.Node, set[str]],
                       calls: dict) -> bool:
    if region.key in kept.get(node, ()) and not region.spec.output_recompute:
        return False
    if not region.spec.mp_comm_recompute and is_communication(node):
        return False  # NOTE [Kept collectives]: backward reads the forward's result
    policy = region.spec.policy
    if policy is None:
        return True
    call = node.args[0] if node.target is operator.getitem else node  # one call, several outputs
    index = calls.get((region.key, call))
    if index is None:
        return not policy.saves(op_name(node))
    return not policy.saves_call(op_name(node), index)


def _region_outputs(
    forward: list[fx.Node], regions: dict[fx.Node, list[Region]]
) -> dict[fx.Node, set[str]]:
    """Map each value leaving a region to the keys of the regions it leaves.

    A value leaves region R when a forward user outside R (or the graph output)
    reads it. When such a value is a view, its base leaves too: keeping a view
    keeps its base's memory.
    """
    keys = {n: {r.key for r in rs} for n, rs in regions.items()}
    leaving: dict[fx.Node, set[str]] = {}
    for node in forward:
        if not keys[node]:
            continue
        for user in node.users:
            if user.op == "output":
                outside = keys[node]
            elif user in keys:
                outside = keys[node] - keys[user]
            else:
                continue  # a backward user does not make an output
            if outside:
                leaving.setdefault(node, set()).update(outside)
    for node in reversed(forward):
        if node in leaving and is_view(node) and isinstance(node.args[0], fx.Node):
            base = node.args[0]
            shared = leaving[node] & keys.get(base, set())
            if shared:
                leaving.setdefault(base, set()).update(shared)
    return leaving
