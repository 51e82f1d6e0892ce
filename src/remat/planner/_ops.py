"""What the planner's trace records per operator call (layer 4): one dispatch mode (`Ops`)
that costs each call once and hands it to a record per job.

- `Roofline`: a call's cost by FLOPs and bytes moved;
- `BlockTotals`: each block's cost, all its calls and those a selective policy re-runs;
- `PartTotals`: each child's cost and output storages (options inside blocks);
- `CallCandidates`: the calls a per-operator option may keep (NOTE [Options per operator]
  in ``_options.py``);
- `CutGraph`: every call of each block, for the min-cut options (NOTE [Options cut by
  min-cut] in ``_options.py``).

One mode, not one per job: each Python dispatch costs every operator of the step.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from remat._engine.rng import drew, generator_states
from remat._vocab.policy import COMPUTE_INTENSIVE_OPS, call_key, save_compute_intensive
from remat.memory.internal import local_nbytes, local_storages, look_away_from_sharding_propagation
from remat.planner._options import REDUCTIONS, SMALL, cut_options


def _add(costs: dict, key: Any, value: float) -> None:
    costs[key] = costs.get(key, 0.0) + value


def _divide(costs: dict, calls: int) -> None:
    for key in costs:
        costs[key] /= calls


class Roofline:
    """A call's cost by FLOPs over ``throughput`` plus bytes moved over ``bandwidth``."""

    __slots__ = ("bandwidth", "registry", "throughput")

    def __init__(self, throughput: float, bandwidth: float) -> None:
        from remat._graph.internal import flop_formulas

        self.registry = flop_formulas()  # NOTE [Attention's FLOPs on the CPU] (remat/_graph/_flops.py)
        self.throughput, self.bandwidth = throughput, bandwidth

    def cost(self, func: Any, args: tuple, kwargs: dict, out: Any) -> float:
        packet = func._overloadpacket
        flops = self.registry[packet](*args, **kwargs, out_val=out) if packet in self.registry else 0
        moved = sum(t.numel() * t.element_size() for t in tree_leaves((args, out)) if isinstance(t, torch.Tensor))
        return flops / self.throughput + moved / self.bandwidth


class BlockTotals:
    """Per block: the cost and number of all its calls, and of those a selective policy
    re-runs (NOTE [Plans timing noise cannot flip] in ``_cost.py``: each re-run call costs
    the engine's dispatch too)."""

    __slots__ = ("count", "recomputed", "recomputed_count", "total")

    def __init__(self) -> None:
        self.total: dict[int, float] = {}
        self.count: dict[int, float] = {}
        self.recomputed: dict[int, float] = {}
        self.recomputed_count: dict[int, float] = {}

    def add(self, block: int, cost: float, recomputed: bool) -> None:
        _add(self.total, block, cost)
        _add(self.count, block, 1)
        if recomputed:
            _add(self.recomputed, block, cost)
            _add(self.recomputed_count, block, 1)

    def per_forward(self, calls: int) -> None:
        for costs in (self.total, self.recomputed, self.count, self.recomputed_count):
            _divide(costs, calls)


class PartTotals:
    """Per ``(block, child)``: the cost and number of the child's calls, and the storages of
    its output; ``running``: the children of the block running now."""

    __slots__ = ("count", "outs", "running", "total")

    def __init__(self) -> None:
        self.running: list[tuple[int, str]] = []
        self.total: dict[tuple[int, str], float] = {}
        self.count: dict[tuple[int, str], float] = {}
        self.outs: dict[tuple[int, str], set] = {}

    def enter(self, part: tuple[int, str]) -> None:
        self.running.append(part)

    def leave(self, storages: set) -> None:
        self.outs.setdefault(self.running.pop(), set()).update(storages)

    def add(self, cost: float) -> None:
        for part in self.running:
            _add(self.total, part, cost)
            _add(self.count, part, 1)

    def per_forward(self, calls: int) -> None:
        _divide(self.total, calls)
        _divide(self.count, calls)


class CallCandidates:
    """Per block, the calls a per-operator option may keep (NOTE [Options per operator]):
    each matrix product's, convolution's or attention's cost, roofline cost and output bytes,
    which of them backward reads, and the reductions with a small result."""

    __slots__ = ("calls", "held", "producer", "saved", "small")

    def __init__(self) -> None:
        self.calls: dict[int, dict[str, list[float]]] = {}
        self.producer: dict[int, tuple[int, str]] = {}  # storage -> the candidate call that made it
        self.held: list = []  # outputs held until the step ends: no later tensor reuses the storage
        self.small: dict[int, list[str]] = {}
        self.saved: set[tuple[int, str]] = set()  # candidate calls whose output backward reads

    def reduction(self, block: int, key: str, args: tuple, kwargs: dict, out: Any) -> None:
        """A reduction's call: a candidate if its result is small (it cuts a chain)."""
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        largest = max((t.numel() for t in ins), default=0)
        if outs and SMALL * sum(t.numel() for t in outs) <= largest:
            self.small.setdefault(block, []).append(key)

    def intensive(self, block: int, key: str, out: Any, cost: float, roofline: float) -> None:
        """A compute-intensive call: its cost, roofline cost and output bytes."""
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        entry = self.calls.setdefault(block, {}).setdefault(key, [0.0, 0.0, 0.0])
        entry[0] += cost
        entry[1] += roofline
        entry[2] = float(sum(t.numel() * t.element_size() for t in outs))
        self.held.append(outs)
        for storage in local_storages(outs):
            self.producer[storage._cdata] = (block, key)

    def pack(self, storage: int) -> None:
        made = self.producer.get(storage)
        if made is not None:
            self.saved.add(made)

    def per_forward(self, calls: int) -> None:
        for block in self.calls.values():
            for entry in block.values():
                entry[0] /= calls
                entry[1] /= calls

    def of(self, block: int) -> dict[str, tuple[float, float]]:
        """Block ``block``'s candidate calls, ``{key: (roofline cost, output bytes)}`` in call
        order: those whose output backward reads (keeping another saves no memory in graph mode
        and buys only its own re-run in eager)."""
        found = self.calls.get(block, {})
        return {key: (e[1], e[2]) for key, e in found.items() if (block, key) in self.saved}

    def intensive_calls(self, block: int) -> tuple:
        """Block ``block``'s compute-intensive calls, ``(key, roofline cost, output bytes)``."""
        return tuple((key, e[1], e[2]) for key, e in self.calls.get(block, {}).items())

    def small_results(self, block: int) -> list[str]:
        """Block ``block``'s reductions whose result is small (a norm's mean): keeping them costs
        next to no memory and cuts what recomputation runs (NOTE [Options per operator])."""
        return list(dict.fromkeys(self.small.get(block, [])))


class CutGraph:
    """Every call of each block, for the min-cut options (NOTE [Options cut by min-cut]).

    ``nodes``: per block, key -> ``[cost, output bytes, the keys of the block's calls it reads,
    keepable]``; ``made``: which call made each storage (overwritten when a storage is made
    anew); ``needed``: the calls whose output the block's own backward reads; ``inplace``: per
    block, the functional names of its in-place calls; ``cuts``: each distinct graph's cut."""

    __slots__ = ("cuts", "inplace", "made", "needed", "nodes")

    def __init__(self) -> None:
        self.nodes: dict[int, dict[str, list]] = {}
        self.made: dict[int, tuple[int, str]] = {}
        self.needed: set[tuple[int, str]] = set()
        self.inplace: dict[int, set[str]] = {}
        self.cuts: dict[tuple, list[str]] = {}

    def start(self, block: int) -> None:
        """Each forward records its calls anew (micro-batches: the last stands), reading only
        what this forward made: a value an earlier forward of the block made is from outside."""
        self.nodes[block] = {}
        self.made = {s: made for s, made in self.made.items() if made[0] != block}

    def outside(self, storages: list[int]) -> None:
        """Storages made outside every block."""
        for storage in storages:
            self.made.pop(storage, None)

    def node(self, block: int, key: str, args: tuple, kwargs: dict, out: Any, cost: float, *,
             keepable: bool, makes: list[int]) -> None:
        """Record call ``key`` of block ``block``: ``[cost, output bytes, the keys of the block's
        calls it reads, whether an option may keep it]``; it now makes the storages ``makes``."""
        reads = {self.made.get(s._cdata) for s in local_storages(tree_leaves((args, kwargs)))}
        self.nodes.setdefault(block, {})[key] = [
            cost, sum(local_nbytes(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor)),
            sorted({k for b, k in filter(None, reads) if b == block}), keepable]
        for storage in makes:
            self.made[storage] = (block, key)

    def written_into(self, block: int, name: str, func: Any, args: tuple, kwargs: dict, out: Any,
                     cost: float) -> None:
        """An in-place or ``out=`` call of the running block, which the engine does not number
        (NOTE [Options cut by min-cut]): one node no option keeps, reading what the call reads,
        now makes the values it writes into and any it returns anew; no option keeps the call
        that made a value written into, nor a call of the operator's functional form (the
        graph pass, functionalized, numbers those; the engine does not)."""
        nodes = self.nodes.setdefault(block, {})
        self.inplace.setdefault(block, set()).add(name.removesuffix("_"))
        touched = [s._cdata for s in local_storages(_written(func, args, kwargs))]
        for storage in touched:
            before = self.made.get(storage)
            if before is not None and before[0] == block:
                nodes[before[1]][3] = False
        self.node(block, f"{name}!{len(nodes)}", args, kwargs, out, cost, keepable=False,
                  makes=[*touched, *new_storages(args, kwargs, out)])

    def pack(self, storage: int, block: int | None) -> None:
        made = self.made.get(storage)
        if made is not None and made[0] == block:
            self.needed.add(made)

    def cut_options(self, block: int, intensive: tuple, small: tuple) -> list[str]:
        """Block ``block``'s ``ops:`` options found by min-cut, with its compute-intensive calls
        ``(key, roofline cost, output bytes)`` and small reductions (`CallCandidates`)."""
        nodes = self.nodes.get(block, {})
        inplace = self.inplace.get(block, set())
        graph = tuple((key, e[1], tuple(e[2])) for key, e in nodes.items())
        fixed = tuple(key for key, e in nodes.items() if not e[3] or key.partition("#")[0] in inplace)
        needed = tuple(sorted(key for b, key in self.needed if b == block))
        memo = (graph, needed, intensive, small, fixed)  # identical blocks: one cut, solved once
        if memo not in self.cuts:
            self.cuts[memo] = cut_options({k: (b, r) for k, b, r in graph}, needed,
                                          {k: (c, b) for k, c, b in intensive}, small, fixed)
        return list(self.cuts[memo])


class Ops(TorchDispatchMode):
    """The trace's dispatch mode: costs each call of a block (the `Roofline`, or with ``timed``
    its measured time, CPU tensors), numbers it as the engine does (NOTE [Counting calls] in
    ``remat/_vocab/policy.py``) and hands it to each job's record: `totals`, `parts`,
    `candidates`, `graph`."""

    def __init__(self, throughput: float, bandwidth: float, timed: bool = False) -> None:
        super().__init__()
        self.roofline = Roofline(throughput, bandwidth)
        self.timed = timed
        self.block: int | None = None
        self.numbered: dict[int, dict[str, int]] = {}  # per block: calls of each operator name
        self.totals = BlockTotals()
        self.parts = PartTotals()
        self.candidates = CallCandidates()
        self.graph = CutGraph()
        self._propagating = 0
        self._patches: list = []

    def __enter__(self) -> Any:
        self._patches = look_away_from_sharding_propagation(self._count)
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        for owner, name, original in reversed(self._patches):
            setattr(owner, name, original)
        self._patches = []

    def _count(self, depth: int) -> None:
        self._propagating += depth

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        if any(getattr(t, "__tensor_flatten__", None) is not None for t in types):
            return NotImplemented  # a DTensor: cost its local operators, this rank's
        if self._propagating:  # DTensor learning output shapes: not this rank's work
            return func(*args, **(kwargs or {}))
        kwargs = kwargs or {}
        random = self.block is not None and torch.Tag.nondeterministic_seeded in getattr(func, "tags", ())
        before = generator_states((args, kwargs)) if random else None
        start = time.perf_counter()
        out = func(*args, **kwargs)
        elapsed = time.perf_counter() - start
        drawn = random and drew(before, generator_states((args, kwargs)))
        if self.block is not None:
            cost = elapsed if self.timed else self.roofline.cost(func, args, kwargs, out)
            self.totals.add(self.block, cost, not save_compute_intensive.saves(func.name()))
            self.parts.add(cost)
            self._number(func, args, kwargs, out, cost, drawn)
        elif isinstance(func, torch._ops.OpOverload) and not func.is_view and not func._schema.is_mutable:
            self.graph.outside(new_storages(args, kwargs, out))
        return out

    def start_block(self, block: int) -> None:
        """Block ``block``'s forward begins: its calls are numbered from 0 again."""
        self.block = block
        self.numbered[block] = {}
        self.graph.start(block)

    def end_block(self) -> None:
        self.block = None

    def _number(self, func: Any, args: tuple, kwargs: dict, out: Any, cost: float, drawn: bool = False) -> None:
        """Number the call as the selective engine does (NOTE [Counting calls] in
        ``remat/_vocab/policy.py``); record it in the graph, and as a candidate a matrix
        product's, a convolution's, an attention's or a reduction's."""
        if not isinstance(func, torch._ops.OpOverload) or func.is_view:
            return
        name = func._schema.name
        if func._schema.is_mutable:  # NOTE [Options cut by min-cut]: a write into a value
            self.graph.written_into(self.block, name, func, args, kwargs, out, cost)
            return
        numbered = self.numbered.setdefault(self.block, {})
        index = numbered.get(name, 0)
        numbered[name] = index + 1
        key = call_key(name, index)
        # a call that drew is never kept (NOTE [Kept random operators])
        self.graph.node(self.block, key, args, kwargs, out, cost, keepable=not drawn,
                        makes=new_storages(args, kwargs, out))
        if name in REDUCTIONS:  # NOTE [Options per operator]: a small result that cuts a chain
            self.candidates.reduction(self.block, key, args, kwargs, out)
        elif name in COMPUTE_INTENSIVE_OPS:
            rough = self.roofline.cost(func, args, kwargs, out) if self.timed else cost
            self.candidates.intensive(self.block, key, out, cost, rough)

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        """Saved-tensor hook: note the candidate call whose output autograd saves (a view's too),
        and the call of the running block whose output its backward reads."""
        for storage in local_storages([tensor]):
            self.candidates.pack(storage._cdata)
            self.graph.pack(storage._cdata, self.block)
        return tensor

    def per_forward(self, calls: int) -> None:
        """Costs per forward of a block, the step having run each ``calls`` times."""
        self.totals.per_forward(calls)
        self.parts.per_forward(calls)
        self.candidates.per_forward(calls)

    def cut_options(self, block: int) -> list[str]:
        """Block ``block``'s ``ops:`` options found by min-cut (NOTE [Options cut by min-cut])."""
        return self.graph.cut_options(block, self.candidates.intensive_calls(block),
                                      tuple(self.candidates.small_results(block)))


def new_storages(args: Any, kwargs: Any, out: Any) -> list[int]:
    """Keys of the storages ``out`` holds that none of the operator's inputs does."""
    given = {s._cdata for s in local_storages(tree_leaves((args, kwargs)))}
    return [s._cdata for s in local_storages(tree_leaves(out)) if s._cdata not in given]


def _written(func: Any, args: tuple, kwargs: dict) -> list:
    """The tensors an in-place or ``out=`` operator writes into (its schema's mutable arguments)."""
    written = []
    for i, argument in enumerate(func._schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(argument.name)
            written += [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
    return written
