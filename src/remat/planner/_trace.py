"""Tracing the step for the planner: which blocks run, in what order and how often, which
feed only the next, and what each block's and child's operators cost (layer 4).

One step runs under a dispatch mode (`_Ops`) with the blocks and their children hooked.
It costs each operator (measured on CPU tensors, else by FLOPs and bytes: the roofline),
numbers the calls as the engine does (NOTE [Counting calls] in ``remat/_vocab/policy.py``),
and records what the options inside blocks are drawn from (NOTE [Options per operator],
[Options cut by min-cut] in ``_options.py``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from remat._engine.rng import drew, generator_states
from remat._front import blocks as _blocks
from remat._vocab.policy import COMPUTE_INTENSIVE_OPS, call_key, save_compute_intensive
from remat.memory.internal import (
    Step,
    local_nbytes,
    local_storages,
    look_away_from_sharding_propagation,
)
from remat.planner._options import REDUCTIONS, SMALL, cut_options
from remat.planner._settings import Settings

API = "remat.plan"
#: Default roofline of the fake-tensor time model: FLOP/s and bytes/s (ratios matter, not units).
THROUGHPUT = {"cpu": 1e11, "cuda": 4e14}
BANDWIDTH = {"cpu": 2e10, "cuda": 2e12}


def find_blocks(model: torch.nn.Module, blocks: Any = None) -> list[tuple[str, torch.nn.Module]]:
    """The modules the planner chooses for: ``blocks`` (names or types), else the blocks
    ``remat.apply(model, where="blocks")`` marks (NOTE [Finding blocks] in ``remat/_front/blocks.py``)."""
    if blocks is not None:
        return _select(model, blocks)
    found = _blocks.find_blocks(model)
    if not found:
        raise TypeError(
            f"{API}: found no blocks in {type(model).__name__} (no ModuleList or Sequential of "
            f"repeated modules, no Hugging Face decoder layers); pass blocks=[module names] or "
            f"blocks=BlockType"
        )
    return found


def _select(model: torch.nn.Module, blocks: Any) -> list[tuple[str, torch.nn.Module]]:
    named = dict(model.named_modules())
    if isinstance(blocks, type) or (isinstance(blocks, tuple) and all(isinstance(t, type) for t in blocks)):
        chosen = [(n, m) for n, m in named.items() if n and isinstance(m, blocks)]
    elif isinstance(blocks, Iterable) and not isinstance(blocks, str):
        names = list(blocks)
        missing = [n for n in names if n not in named]
        if missing:
            raise ValueError(f"{API}: blocks {missing} are not modules of {type(model).__name__}")
        chosen = [(n, named[n]) for n in names]
    else:
        raise TypeError(f"{API}: blocks must be None, a module type or a list of module names, "
                        f"got {type(blocks).__name__}")
    outer = [(n, m) for n, m in chosen if not any(n.startswith(o + ".") for o, _ in chosen if o != n)]
    if not outer:
        raise TypeError(f"{API}: blocks={blocks!r} selects no module of {type(model).__name__}")
    return outer



def _named(model: torch.nn.Module, blocks: list) -> list[tuple[str, torch.nn.Module]]:
    """``blocks`` (name, module) as the modules of the same names in ``model``."""
    named = dict(model.named_modules())
    return [(name, named[name]) for name, _ in blocks]



class _Ops(TorchDispatchMode):
    """Per block: cost of all operators and of those a selective policy recomputes; the
    roofline estimate, or with ``timed`` each operator's measured time (CPU tensors)."""

    def __init__(self, throughput: float, bandwidth: float, timed: bool = False) -> None:
        super().__init__()
        from torch.utils.flop_counter import flop_registry

        self.registry = flop_registry
        self.throughput, self.bandwidth, self.timed = throughput, bandwidth, timed
        self.block: int | None = None
        self.total: dict[int, float] = {}
        self.recomputed: dict[int, float] = {}
        self.parts: list[tuple[int, str]] = []  # the children of the block running now
        self.part_total: dict[tuple[int, str], float] = {}
        self.part_outs: dict[tuple[int, str], set] = {}  # storages of each child's output
        # the calls behind ``total``, ``recomputed`` and ``part_total`` (NOTE [Plans timing
        # noise cannot flip]: each re-run call costs the engine's dispatch too)
        self.count: dict[int, float] = {}
        self.recomputed_count: dict[int, float] = {}
        self.part_count: dict[tuple[int, str], float] = {}
        # per block: the calls of each operator name in the forward running now, and the cost
        # (as ``total``), roofline cost and output bytes of each call a per-operator option
        # may keep (NOTE [Options per operator])
        self.numbered: dict[int, dict[str, int]] = {}
        self.calls: dict[int, dict[str, list[float]]] = {}
        self.producer: dict[int, tuple[int, str]] = {}  # storage -> the candidate call that made it
        self.held: list = []
        self.small: dict[int, list[str]] = {}  # per block: reductions with a small result
        self.saved: set[tuple[int, str]] = set()  # candidate calls whose output backward reads
        # every call of each block, for the min-cut options (NOTE [Options cut by min-cut]):
        # key -> [cost, output bytes, the keys of the block's calls it reads, keepable]; which
        # call made each storage (overwritten when a storage is made anew), the calls whose
        # output the block's own backward reads, the operators each block runs in place
        self.nodes: dict[int, dict[str, list]] = {}
        self.made: dict[int, tuple[int, str]] = {}
        self.needed: set[tuple[int, str]] = set()
        self.inplace: dict[int, set[str]] = {}  # per block: functional names of its in-place calls
        self._cuts: dict[tuple, list[str]] = {}
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
            if self.timed:
                cost = elapsed
            else:
                packet = func._overloadpacket
                flops = self.registry[packet](*args, **kwargs, out_val=out) if packet in self.registry else 0
                moved = sum(t.numel() * t.element_size() for t in tree_leaves((args, out))
                            if isinstance(t, torch.Tensor))
                cost = flops / self.throughput + moved / self.bandwidth
            self.total[self.block] = self.total.get(self.block, 0.0) + cost
            self.count[self.block] = self.count.get(self.block, 0.0) + 1
            for part in self.parts:
                self.part_total[part] = self.part_total.get(part, 0.0) + cost
                self.part_count[part] = self.part_count.get(part, 0.0) + 1
            if not save_compute_intensive.saves(func.name()):
                self.recomputed[self.block] = self.recomputed.get(self.block, 0.0) + cost
                self.recomputed_count[self.block] = self.recomputed_count.get(self.block, 0.0) + 1
            self._number(func, args, kwargs, out, cost, drawn)
        elif isinstance(func, torch._ops.OpOverload) and not func.is_view and not func._schema.is_mutable:
            for storage in _new_storages(args, kwargs, out):  # made outside every block
                self.made.pop(storage, None)
        return out

    def start_block(self, block: int) -> None:
        """Block ``block``'s forward begins: its calls are numbered from 0 again."""
        self.block = block
        self.numbered[block] = {}
        # each forward records its calls anew (micro-batches: the last stands), reading only
        # what this forward made: a value an earlier forward of the block made is from outside
        self.nodes[block] = {}
        self.made = {s: made for s, made in self.made.items() if made[0] != block}

    def _number(self, func: Any, args: tuple, kwargs: dict, out: Any, cost: float, drawn: bool = False) -> None:
        """Number the call as the selective engine does (NOTE [Counting calls] in
        ``remat/_vocab/policy.py``); record a matrix product's, a convolution's or an attention's."""
        if not isinstance(func, torch._ops.OpOverload) or func.is_view:
            return
        name = func._schema.name
        if func._schema.is_mutable:  # NOTE [Options cut by min-cut]: a write into a value
            self._written_into(name, func, args, kwargs, out, cost)
            return
        numbered = self.numbered.setdefault(self.block, {})
        index = numbered.get(name, 0)
        numbered[name] = index + 1
        key = call_key(name, index)
        # a call that drew is never kept (NOTE [Kept random operators])
        self._node(key, args, kwargs, out, cost, keepable=not drawn, makes=_new_storages(args, kwargs, out))
        if name in REDUCTIONS:  # NOTE [Options per operator]: a small result that cuts a chain
            ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            largest = max((t.numel() for t in ins), default=0)
            if outs and SMALL * sum(t.numel() for t in outs) <= largest:
                self.small.setdefault(self.block, []).append(call_key(name, index))
            return
        if name not in COMPUTE_INTENSIVE_OPS:
            return
        packet = func._overloadpacket
        flops = self.registry[packet](*args, **kwargs, out_val=out) if packet in self.registry else 0
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        moved = sum(t.numel() * t.element_size() for t in tree_leaves((args, outs)) if isinstance(t, torch.Tensor))
        key = call_key(name, index)
        entry = self.calls.setdefault(self.block, {}).setdefault(key, [0.0, 0.0, 0.0])
        entry[0] += cost
        entry[1] += flops / self.throughput + moved / self.bandwidth
        entry[2] = float(sum(t.numel() * t.element_size() for t in outs))
        self.held.append(outs)  # held until the step ends: no later tensor reuses the storage
        for storage in local_storages(outs):
            self.producer[storage._cdata] = (self.block, key)

    def _written_into(self, name: str, func: Any, args: tuple, kwargs: dict, out: Any, cost: float) -> None:
        """An in-place or ``out=`` call of the running block, which the engine does not number
        (NOTE [Options cut by min-cut]): one node no option keeps, reading what the call reads,
        now makes the values it writes into and any it returns anew; no option keeps the call
        that made a value written into, nor a call of the operator's functional form (the
        graph pass, functionalized, numbers those; the engine does not)."""
        nodes = self.nodes.setdefault(self.block, {})
        self.inplace.setdefault(self.block, set()).add(name.removesuffix("_"))
        touched = [s._cdata for s in local_storages(_written(func, args, kwargs))]
        for storage in touched:
            before = self.made.get(storage)
            if before is not None and before[0] == self.block:
                nodes[before[1]][3] = False
        self._node(f"{name}!{len(nodes)}", args, kwargs, out, cost, keepable=False,
                   makes=[*touched, *_new_storages(args, kwargs, out)])

    def _node(self, key: str, args: tuple, kwargs: dict, out: Any, cost: float, *, keepable: bool,
              makes: list[int]) -> None:
        """Record call ``key`` of the running block: ``[cost, output bytes, the keys of the block's
        calls it reads, whether an option may keep it]``; it now makes the storages ``makes``."""
        reads = {self.made.get(s._cdata) for s in local_storages(tree_leaves((args, kwargs)))}
        self.nodes.setdefault(self.block, {})[key] = [
            cost, sum(local_nbytes(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor)),
            sorted({k for b, k in filter(None, reads) if b == self.block}), keepable]
        for storage in makes:
            self.made[storage] = (self.block, key)

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        """Saved-tensor hook: note the candidate call whose output autograd saves (a view's too),
        and the call of the running block whose output its backward reads."""
        for storage in local_storages([tensor]):
            made = self.producer.get(storage._cdata)
            if made is not None:
                self.saved.add(made)
            made = self.made.get(storage._cdata)
            if made is not None and made[0] == self.block:
                self.needed.add(made)
        return tensor

    def candidates(self, block: int) -> dict[str, tuple[float, float]]:
        """Block ``block``'s candidate calls, ``{key: (roofline cost, output bytes)}`` in call
        order: those whose output backward reads (keeping another saves no memory in graph mode
        and buys only its own re-run in eager)."""
        found = self.calls.get(block, {})
        return {key: (e[1], e[2]) for key, e in found.items() if (block, key) in self.saved}

    def cut_options(self, block: int) -> list[str]:
        """Block ``block``'s ``ops:`` options found by min-cut (NOTE [Options cut by min-cut])."""
        nodes = self.nodes.get(block, {})
        inplace = self.inplace.get(block, set())
        graph = tuple((key, e[1], tuple(e[2])) for key, e in nodes.items())
        fixed = tuple(key for key, e in nodes.items() if not e[3] or key.partition("#")[0] in inplace)
        needed = tuple(sorted(key for b, key in self.needed if b == block))
        intensive = tuple((key, e[1], e[2]) for key, e in self.calls.get(block, {}).items())
        small = tuple(self.small_results(block))
        memo = (graph, needed, intensive, small, fixed)  # identical blocks: one cut, solved once
        if memo not in self._cuts:
            self._cuts[memo] = cut_options({k: (b, r) for k, b, r in graph}, needed,
                                           {k: (c, b) for k, c, b in intensive}, small, fixed)
        return list(self._cuts[memo])

    def small_results(self, block: int) -> list[str]:
        """Block ``block``'s reductions whose result is small (a norm's mean): keeping them costs
        next to no memory and cuts what recomputation runs (NOTE [Options per operator])."""
        return list(dict.fromkeys(self.small.get(block, [])))


def _new_storages(args: Any, kwargs: Any, out: Any) -> list[int]:
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


@dataclass
class Trace:
    """What one traced step tells about the blocks (`trace`), in the order they run.

    Args:
        blocks: ``(name, module)`` in call order.
        index: each block's position in the list given to `trace`.
        chain: per block, whether its output feeds only the next block (or it is the last).
        leaving: per block name, the children whose output is the block's.
        ops: the operator costs per block and per child (`_Ops`).
        calls: how many times the step runs each block (micro-batches of gradient accumulation).
    """

    blocks: list
    index: list[int]
    chain: list[bool]
    leaving: dict[str, set]
    ops: Any
    calls: int = 1

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.blocks]



def _run_traced(model: torch.nn.Module, step: Step, blocks: list, ops: Any) -> tuple:
    """Run ``step`` once under ``ops``, hooking the blocks and their children: block call
    order and the storages going in and out of each block and child."""
    ids = {id(m): i for i, (_, m) in enumerate(blocks)}
    order: list[int] = []
    ins: dict[int, set] = {}
    outs: dict[int, set] = {}

    def keys(obj: Any) -> set:
        return {s._cdata for s in local_storages(tree_leaves(obj))}

    def pre(module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        i = ids[id(module)]
        order.append(i)
        ins.setdefault(i, set()).update(keys((args, kwargs)))
        ops.start_block(i)

    alive: list = []  # storages stay alive while traced, so their keys are not reused

    def post(module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        outs.setdefault(ids[id(module)], set()).update(keys(output))
        alive.append(output)
        ops.block = None

    handles = [h for _, m in blocks for h in (m.register_forward_pre_hook(pre, with_kwargs=True),
                                              m.register_forward_hook(post, with_kwargs=True))]

    def enter(key: tuple[int, str]) -> Any:
        def hook(*_: Any) -> None:
            ops.parts.append(key)
        return hook

    def leave(module: torch.nn.Module, args: Any, output: Any) -> None:
        ops.part_outs.setdefault(ops.parts.pop(), set()).update(keys(output))
        alive.append(output)

    for i, (_, block) in enumerate(blocks):  # each child's own cost (options inside blocks)
        for child, kid in block.named_children():
            handles.append(kid.register_forward_pre_hook(enter((i, child))))
            handles.append(kid.register_forward_hook(leave))
    try:
        with ops, torch.autograd.graph.saved_tensors_hooks(ops.pack, lambda t: t):
            alive.append(step.run(model))
    finally:
        ops.held.clear()
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
    return order, ins, outs


def trace(model: torch.nn.Module, blocks: list, settings: Settings, *, timed: bool = False) -> Trace:
    """Run the step once with the blocks hooked: which blocks run, in what order, how
    often, which feed only the next, and what their operators cost (measured times with
    ``timed``, else the roofline).

    Raises:
        TypeError: a block does not run, or blocks run unequal numbers of times.
    """
    ops = _Ops(settings.throughput or THROUGHPUT.get(settings.device, THROUGHPUT["cpu"]),
               settings.bandwidth or BANDWIDTH.get(settings.device, BANDWIDTH["cpu"]), timed=timed)
    order, ins, outs = _run_traced(model, settings.step, blocks, ops)
    counts = {i: order.count(i) for i in set(order)}
    unused = [blocks[i][0] for i in range(len(blocks)) if i not in counts]
    calls = max(counts.values(), default=1)
    uneven = [blocks[i][0] for i, c in counts.items() if c != calls]
    if unused or uneven:
        raise TypeError(f"{API}: every block must run once per forward; "
                        f"{'not run: ' + str(unused) if unused else ''}"
                        f"{' run more than once: ' + str(uneven) if uneven else ''}; "
                        f"pass blocks=[...] naming modules that run once each")
    index = order[:len(counts)]
    n = len(index)
    chain = []
    for k in range(n):
        mine = outs.get(index[k], set())
        later = [ins.get(index[m], set()) for m in range(k + 1, n)]
        chain.append(k == n - 1 or (bool(mine & later[0]) and not any(mine & s for s in later[1:])))
    for cost in (ops.total, ops.recomputed, ops.part_total, ops.count, ops.recomputed_count,
                 ops.part_count):  # per forward of a block
        for key in cost:
            cost[key] /= calls
    for block in ops.calls.values():
        for entry in block.values():
            entry[0] /= calls
            entry[1] /= calls
    ordered = [blocks[i] for i in index]
    leaving = {ordered[k][0]: {child for (i, child), out in ops.part_outs.items()
                               if i == index[k] and out & outs.get(i, set())} for k in range(n)}
    return Trace(blocks=ordered, index=index, chain=chain, leaving=leaving, ops=ops, calls=calls)

