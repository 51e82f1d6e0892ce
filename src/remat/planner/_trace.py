"""Tracing the step for the planner: which blocks run, in what order and how often, which
feed only the next, and what each block's and child's operators cost (layer 4).

One step runs under a dispatch mode (`remat.planner._ops.Ops`) with the blocks and their
children hooked. It costs each operator (measured on CPU tensors, else by FLOPs and bytes:
the roofline), numbers the calls as the engine does (NOTE [Counting calls] in
``remat/_vocab/policy.py``), and records what the options inside blocks are drawn from
(NOTE [Options per operator], [Options cut by min-cut] in ``_options.py``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from remat._front import blocks as _blocks
from remat.memory.internal import Step, local_storages
from remat.planner._ops import Ops
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



@dataclass
class Trace:
    """What one traced step tells about the blocks (`trace`), in the order they run.

    Args:
        blocks: ``(name, module)`` in call order.
        index: each block's position in the list given to `trace`.
        chain: per block, whether its output feeds only the next block (or it is the last).
        leaving: per block name, the children whose output is the block's.
        ops: the operator costs per block and per child, and the calls options are drawn
            from (`remat.planner._ops.Ops`).
        calls: how many times the step runs each block (micro-batches of gradient accumulation).
    """

    blocks: list
    index: list[int]
    chain: list[bool]
    leaving: dict[str, set]
    ops: Ops
    calls: int = 1

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.blocks]



def _run_traced(model: torch.nn.Module, step: Step, blocks: list, ops: Ops) -> tuple:
    """Run ``step`` once under ``ops``, hooking the blocks and their children: block call
    order and the storages going in and out of each block and child."""
    alive: list = []  # storages stay alive while traced, so their keys are not reused
    order, ins, outs, handles = _hook_blocks(blocks, ops, alive)
    handles += _hook_children(blocks, ops, alive)
    try:
        with ops, torch.autograd.graph.saved_tensors_hooks(ops.pack, lambda t: t):
            alive.append(step.run(model))
    finally:
        ops.candidates.held.clear()
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
    return order, ins, outs


def _storage_keys(obj: Any) -> set:
    """The keys of the storages of the tensors in ``obj``."""
    return {s._cdata for s in local_storages(tree_leaves(obj))}


def _hook_blocks(blocks: list, ops: Ops, alive: list) -> tuple[list[int], dict, dict, list]:
    """Hook the blocks: their call order, the storages going in and out of each (``ins``,
    ``outs``), each call's operators counted apart by ``ops``; outputs kept in ``alive``."""
    ids = {id(m): i for i, (_, m) in enumerate(blocks)}
    order: list[int] = []
    ins: dict[int, set] = {}
    outs: dict[int, set] = {}

    def pre(module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        i = ids[id(module)]
        order.append(i)
        ins.setdefault(i, set()).update(_storage_keys((args, kwargs)))
        ops.start_block(i)

    def post(module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        outs.setdefault(ids[id(module)], set()).update(_storage_keys(output))
        alive.append(output)
        ops.end_block()

    handles = [h for _, m in blocks for h in (m.register_forward_pre_hook(pre, with_kwargs=True),
                                              m.register_forward_hook(post, with_kwargs=True))]
    return order, ins, outs, handles


def _hook_children(blocks: list, ops: Ops, alive: list) -> list:
    """Hook the blocks' children, for each child's own cost (options inside blocks); outputs
    kept in ``alive``."""
    def enter(key: tuple[int, str]) -> Any:
        def hook(*_: Any) -> None:
            ops.parts.enter(key)
        return hook

    def leave(module: torch.nn.Module, args: Any, output: Any) -> None:
        ops.parts.leave(_storage_keys(output))
        alive.append(output)

    handles = []
    for i, (_, block) in enumerate(blocks):
        for child, kid in block.named_children():
            handles.append(kid.register_forward_pre_hook(enter((i, child))))
            handles.append(kid.register_forward_hook(leave))
    return handles


def trace(model: torch.nn.Module, blocks: list, settings: Settings, *, timed: bool = False) -> Trace:
    """Run the step once with the blocks hooked: which blocks run, in what order, how
    often, which feed only the next, and what their operators cost (measured times with
    ``timed``, else the roofline).

    Raises:
        TypeError: a block does not run, or blocks run unequal numbers of times.
    """
    machine = settings.machine
    ops = Ops(machine.throughput or THROUGHPUT.get(machine.device, THROUGHPUT["cpu"]),
              machine.bandwidth or BANDWIDTH.get(machine.device, BANDWIDTH["cpu"]), timed=timed)
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
    ops.per_forward(calls)
    ordered = [blocks[i] for i in index]
    leaving = {ordered[k][0]: {child for (i, child), out in ops.parts.outs.items()
                               if i == index[k] and out & outs.get(i, set())} for k in range(n)}
    return Trace(blocks=ordered, index=index, chain=chain, leaving=leaving, ops=ops, calls=calls)

