"""The cost model's times: per block, the seconds its re-runs cost under each option, before
calibration (layer 4; `remat.planner._cost.assemble` makes them part of `BlockCosts`).

Measured (the unmarked run's forward times, shared out by the trace's operator times), or
costed by FLOPs and bytes on the device's roofline: the times that rank the options on real
tensors, with the engine's share per call (NOTE [Plans timing noise cannot flip] in
``_cost.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from remat.planner._measure import Runs
from remat.planner._settings import child_mark
from remat.planner._solve import CALL_FAMILIES, STAGED, STAGES, Choice
from remat.planner._trace import Trace


@dataclass(frozen=True)
class BlockTimes:
    """Per block, the seconds its re-runs cost before calibration: of the whole block
    (``forward_s``), under its selective policy (``selective_s``) and of each option inside it
    (``child_s``: one entry per column of `BlockCosts.options` after `BLOCK_OPTIONS`; empty:
    none). `BlockCosts.times` are measured (on fake tensors, the roofline's); its ``ranking``
    are costed by FLOPs and bytes (NOTE [Plans timing noise cannot flip] in ``_cost.py``)."""

    forward_s: list[float]
    selective_s: list[float]
    child_s: list = field(default_factory=list)


#: NOTE [Plans timing noise cannot flip]: what the engine adds per call on top of the call
#: itself, in the ranking times: a call re-run (saved-tensor hooks, the region's modes), and a
#: call run under a per-call policy (``selective``, ``ops:``; its dispatch mode, forward and
#: re-run). Measured on CPU (tiny tensors, 600 calls: 38 us and 58 us per call in all, the
#: calls' own cost included); Python's share of a call, so of the same order on CUDA.
RERUN_CALL_S = 3e-5
POLICY_CALL_S = 2e-5


def block_times(traced: Trace, runs: Runs, roofline: bool, groups: Mapping[tuple, list[int]], *,
                per_call: bool = False) -> BlockTimes:
    """Per block: the seconds a re-run of it costs, those of its selective policy's re-run, and
    those of each option inside it (``runs.columns``), averaged over each group of identical
    blocks. With ``roofline``: the trace's operators costed by FLOPs and bytes (with
    ``per_call``, plus the engine's share per call: `RERUN_CALL_S`, `POLICY_CALL_S`);
    else the unmarked run's measured forward times (the trace's operator times share them out)."""
    names, blocks, calls = traced.names, traced.blocks, traced.calls
    totals, parts, graph = traced.ops.totals, traced.ops.parts, traced.ops.graph
    keep = {r.name: r for r in runs.reports["keep"].rows}
    rerun, policy = (RERUN_CALL_S, POLICY_CALL_S) if roofline and per_call else (0.0, 0.0)

    def seconds(name: str) -> float:
        return (keep[name].forward_ms or 0.0) / 1e3 / calls

    def child_seconds(k: int, child: str) -> float:
        part = (traced.index[k], child)
        once = (parts.total.get(part, 0.0) + rerun * parts.count.get(part, 0.0) if roofline
                else seconds(f"{names[k]}.{child}"))
        # an operator mark runs twice in backward: once to hand its output to whoever saved
        # it, once to rebuild what it saved itself (NOTE [Output pass] in _engine/hooked.py)
        return once if child_mark(dict(blocks[k][1].named_children())[child]) == {} else 2 * once

    forward = ([totals.total.get(i, 0.0) for i in traced.index] if roofline
               else [seconds(name) for name in names])
    count = [totals.count.get(i, 0.0) for i in traced.index]

    def inner_seconds(k: int, option: str) -> float:
        if option not in runs.inner[names[k]]:
            return 0.0
        choice = Choice.parse(option)
        if choice.family not in CALL_FAMILIES:
            return sum(child_seconds(k, c) for c in choice.children)
        block = traced.index[k]
        found = graph.nodes.get(block, {})
        keys = [key for key in choice.calls if key in found]
        total = totals.total.get(block, 0.0)
        if choice.family != STAGED and found:  # NOTE [Options replayed call by call]
            live = replayed(found, {key for b, key in graph.needed if b == block}, set(keys))
            share = sum(found[key][0] for key in live) / total if total else 1.0
            return forward[k] * share + rerun * len(live) + policy * count[k]
        # NOTE [Options per operator]: the re-run runs all but the kept calls
        kept = sum(found[key][0] for key in keys)
        share = max(0.0, 1.0 - kept / total) if total else 1.0
        passes = STAGES if choice.family == STAGED else 1  # NOTE [Options re-run in stages]: each
        # stage's re-run runs the block's code up to its stop, under the policy's mode again
        return forward[k] * share + rerun * max(0.0, count[k] - len(keys)) + policy * count[k] * passes

    child_s = [[inner_seconds(k, o) for o in runs.columns] for k in range(len(names))]
    selective = _selective_seconds(traced, forward, count, rerun, policy)
    forward = [f + rerun * n for f, n in zip(forward, count)]
    return _averaged(BlockTimes(forward, selective, child_s), groups, len(runs.columns))


def replayed(nodes: Mapping[str, list], needed: set[str], kept: set[str]) -> set[str]:
    """NOTE [Options replayed call by call]
    An ``ops:`` option's block is marked ``stages="each"`` in eager plans (NOTE [Each saved
    tensor rebuilt on its own] in ``remat/_engine/recipes.py``): its backward runs none of the
    block's code again, only the calls that make what it reads, from the outputs kept. So
    its re-run costs the calls backward's reads reach through the calls they read, stopping
    at the kept ones: a query projection whose output only a kept attention read costs
    nothing, where the block's re-run would run it (and before that, was priced so: a plan
    of the issue-27 Llama took blocks keeping less that ran slower). ``nodes``: the block's
    calls (`CutGraph.nodes`: cost, bytes, the calls read); ``needed``: those whose output
    backward reads.

    Examples:
        >>> nodes = {"mm#0": [4, 0, [], True], "relu#0": [1, 0, ["mm#0"], True], "mm#1": [4, 0, ["relu#0"], True]}
        >>> sorted(replayed(nodes, {"relu#0", "mm#1"}, {"mm#0"}))
        ['mm#1', 'relu#0']
        >>> sorted(replayed(nodes, {"relu#0"}, {"relu#0"}))
        []
    """
    live: set[str] = set()
    stack = [key for key in needed if key not in kept]
    while stack:
        key = stack.pop()
        if key in live or key in kept or key not in nodes:
            continue
        live.add(key)
        stack.extend(nodes[key][2])
    return live


def _selective_seconds(traced: Trace, forward: list[float], count: list[float], rerun: float,
                       policy: float) -> list[float]:
    """Per block, the seconds of its selective policy's re-run: the share of its forward that
    ``save_compute_intensive`` does not keep, with the engine's share per call."""
    totals = traced.ops.totals
    share = [totals.recomputed.get(i, 0.0) / totals.total[i] if totals.total.get(i) else 1.0 for i in traced.index]
    return [f * s + rerun * totals.recomputed_count.get(i, 0.0) + policy * n
            for f, s, i, n in zip(forward, share, traced.index, count)]


def _averaged(times: BlockTimes, groups: Mapping[tuple, list[int]], columns: int) -> BlockTimes:
    """``times`` (``columns`` options inside blocks) with each group of identical blocks given
    the group's mean (in place)."""
    for members in groups.values():
        for values in (times.forward_s, times.selective_s):
            mean = sum(values[k] for k in members) / len(members)
            for k in members:
                values[k] = mean
        for c in range(columns):
            mean = sum(times.child_s[k][c] for k in members) / len(members)
            for k in members:
                times.child_s[k][c] = mean
    return times
