"""Where a reentrant region's cost goes: torch's checkpoint, a minimal Function, and the parts remat adds.

One pre-norm transformer block of width 8 (``engine_overhead.Block``), 1 x 2 tokens: every
kernel is tiny, so a step's time is its Python and launches. Each configuration runs a
whole step (forward and backward) on the same block; the configurations run in interleaved
trials, and the least time of each is reported (the least is what the code costs; the rest
is the machine's noise), as microseconds over torch's reentrant checkpoint:

- ``minimal``: a custom ``autograd.Function`` that does what a reentrant region must do and
  nothing more: the forward without grad, the random state kept and replayed, every
  parameter an input of the Function (NOTE [Reentrant gradients]), one
  ``torch.autograd.grad`` over the re-run;
- ``+ module state``: the same, plus the snapshot of the module tree a re-run reads
  (``ModuleState``: the check that the tree is the one seen, NOTE [Snapshots reused while
  nothing changed], and the shallow copies of its dictionaries, NOTE [Module state at the
  boundary]);
- ``+ facts``: plus the key of the call and the lookup of what an earlier call observed
  (NOTE [Observed once, confirmed every call]);
- ``+ per-use``: plus the registration of arguments read twice (NOTE [Per-use gradients]);
- ``+ settle``: plus the parameters' versions kept (NOTE [Parameters changed before backward]);
- ``+ re-run contexts``: plus the re-run's module state restored and checked, and the
  recomputation flag;
- ``+ graph walk``: plus the walk of the re-run's autograd graph for a leaf that is not an
  input of the Function (NOTE [Reads that vary] in ``remat/_engine/facts.py``);
- ``remat``: a block marked by ``remat.apply(..., use_reentrant=True)``.

What ``remat`` takes beyond the last line is the engine's own code around those parts (the
mark, the frame, the checks of the output and arguments a lean call makes).

``--stack`` measures the same configurations where they cost most, in place: a step of
``engine_overhead.py``'s 12 blocks of width 32 on 2 x 16 tokens, every configuration in
each of ``--rounds`` interleaved rounds (the order rotated each round), reported as the
median and interquartile range of the per-round ratios to torch's reentrant checkpoint.

    OMP_NUM_THREADS=1 python benchmarks/reentrant_parts.py [--trials 25] [--stack --rounds 60]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import copy
import statistics
import sys
import time
import timeit
from typing import Any

import torch
import torch.utils.checkpoint as tuc

sys.path.insert(0, os.path.dirname(__file__))

import engine_overhead as eo

import remat
from remat._engine import boundary, facts, per_use, rng, state
from remat._engine.walk import reached_outside
from remat._front.marks import mark_of

PARTS = ("minimal", "+ module state", "+ facts", "+ per-use", "+ settle", "+ re-run contexts", "+ graph walk")


class _Frame:
    """What the minimal region keeps between its forward and its backward."""


class _Minimal(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, fn: Any, frame: _Frame, out: torch.Tensor, n: int, *tensors: torch.Tensor) -> Any:
        ctx.fn, ctx.frame = fn, frame
        ctx.save_for_backward(*tensors[:n])
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        frame = ctx.frame
        wrt = [x.detach().requires_grad_() for x in ctx.saved_tensors]
        if frame.level >= 5:
            with state.recomputing(), frame.module_state.restored(()), frame.replay.context(), \
                    torch.enable_grad():
                out = ctx.fn(*wrt)
        else:
            with frame.replay.context(), torch.enable_grad():
                out = ctx.fn(*wrt)
        if frame.level >= 6 and reached_outside([out], wrt + frame.params):
            raise RuntimeError("a leaf outside the Function's inputs")
        found = torch.autograd.grad((out,), wrt + frame.params, (grad,), allow_unused=True)
        return (None, None, None, None, *found, *[None] * len(frame.extra))


def _minimal(block: torch.nn.Module, spec: Any, level: int) -> Any:
    params = list(block.parameters())

    def call(x: torch.Tensor) -> torch.Tensor:
        frame = _Frame()
        frame.level, frame.replay, frame.params, frame.extra = level, rng.capture([x], True), params, []
        if level >= 1:
            frame.module_state = boundary.ModuleState("Block", [block])
        if level >= 2:
            frame.spec, frame.arguments, frame.treespec, frame.leaves = spec, [x], None, [None]
            facts.known(frame, facts.key_of(frame, [x]))
        with torch.no_grad():
            out = block(x.detach())
        extra = []
        if level >= 3:
            frame.uses, frame.same_as, frame.written, frame.shared = (2,), {}, frozenset(), set()
            extra = per_use.extra_inputs(frame, [x])
        if level >= 4:
            frame.module_state.settle([])
        return _Minimal.apply(block, frame, out, 1, x, *params, *extra)

    return call


def run(trials: int) -> dict[str, float]:
    """Least step time of each configuration, in microseconds."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    block = eo.Block(8)
    x = torch.randn(1, 2, 8, requires_grad=True)
    marked = copy.deepcopy(block)
    remat.apply(torch.nn.ModuleList([marked]), where=eo.Block, use_reentrant=True)
    configs = {"torch": lambda: tuc.checkpoint(block, x, use_reentrant=True)}
    for level, name in enumerate(PARTS):
        call = _minimal(block, mark_of(marked), level)
        configs[name] = lambda call=call: call(x)
    configs["remat"] = lambda: marked(x)

    def step(forward: Any) -> Any:
        def go() -> None:
            forward().sum().backward()
            for p in (*block.parameters(), *marked.parameters()):
                p.grad = None
        return go

    for forward in configs.values():  # warm-up: remat's first call is observed
        for _ in range(5):
            step(forward)()
    times: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(trials):
        for name, forward in configs.items():
            times[name].append(timeit.timeit(step(forward), number=200) / 200 * 1e6)
    return {name: min(found) for name, found in times.items()}


def _stack_configs(width: int) -> dict[str, tuple[Any, torch.nn.Module]]:
    """``name -> (forward over the 12 blocks, the blocks)`` for every configuration."""
    torch.manual_seed(0)
    base = torch.nn.ModuleList([eo.Block(width) for _ in range(eo.BLOCKS)])
    marked = copy.deepcopy(base)
    remat.apply(marked, where=eo.Block, use_reentrant=True)

    def chain(calls: list) -> Any:
        def forward(x: torch.Tensor) -> torch.Tensor:
            for call in calls:
                x = call(x)
            return x
        return forward

    configs = {"torch": (chain([lambda x, b=b: tuc.checkpoint(b, x, use_reentrant=True) for b in base]), base)}
    for level, name in enumerate(PARTS):
        blocks = copy.deepcopy(base)
        configs[name] = (chain([_minimal(b, mark_of(marked[0]), level) for b in blocks]), blocks)
    configs["remat"] = (chain(list(marked)), marked)
    return configs


def run_stack(rounds: int, width: int = 32) -> dict[str, tuple[float, float, float]]:
    """Per configuration, the median and quartiles of its step's ratio to torch's, in place."""
    torch.set_num_threads(1)
    configs = _stack_configs(width)
    x = torch.randn(2, 16, width, requires_grad=True)

    def step(name: str) -> float:
        forward, blocks = configs[name]
        start = time.perf_counter()
        forward(x).sum().backward()
        took = time.perf_counter() - start
        for p in blocks.parameters():
            p.grad = None
        return took

    names = list(configs)
    for name in names:  # warm-up: remat's first call is observed
        for _ in range(5):
            step(name)
    ratios: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        took = {name: step(name) for name in names[r % len(names):] + names[:r % len(names)]}
        for name in names:
            ratios[name].append(took[name] / took["torch"])
    return {name: (statistics.median(found), *statistics.quantiles(found, n=4)[::2])
            for name, found in ratios.items()}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=25)
    parser.add_argument("--stack", action="store_true", help="12 blocks of width 32 in place")
    parser.add_argument("--rounds", type=int, default=60)
    args = parser.parse_args(argv)
    if args.stack:
        found = run_stack(args.rounds)
        print(f"| configuration | step / torch's reentrant checkpoint (median of {args.rounds} rounds) | IQR |")
        print("|---|---|---|")
        for name, (median, low, high) in found.items():
            print(f"| {name} | {median:.3f}x | {low:.3f}-{high:.3f} |")
        return found
    least = run(args.trials)
    base = least["torch"]
    print(f"| configuration | step us (least of {args.trials}) | over torch's reentrant checkpoint |")
    print("|---|---|---|")
    for name, t in least.items():
        print(f"| {name} | {t:.1f} | {t - base:+.1f} us ({t / base:.3f}x) |")
    return least


if __name__ == "__main__":
    main()
