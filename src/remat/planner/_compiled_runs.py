"""The compiled runs of a compiled plan (layer 4): each configuration compiled and its step
run once under the allocator's watch, the runs timed in interleaved rounds, and the device's
roofline timed once (NOTE [Planning a compiled step] in ``_compiled.py``, steps 2 and 3)."""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from remat._graph import compile as graph_compile
from remat._graph.internal import allocation_peak
from remat.memory.internal import Step
from remat.planner._loop import let_go
from remat.planner._settings import mark_choices
from remat.planner._solve import Choice

API = "remat.compile"


@dataclass(frozen=True)
class Run:
    """One compiled configuration: its model, the compiled callable, its measured peak, and
    what its copies compute (FLOPs, bytes moved, nodes: the graph pass's reports)."""

    model: torch.nn.Module
    compiled: Any
    peak: int
    flops: float = 0.0
    moved: float = 0.0
    nodes: int = 0

    def parts(self, machine: tuple[float, float, float]) -> tuple[float, float]:
        """Seconds the copies take on ``machine`` ``(FLOP/s, bytes/s, seconds per node)``: their
        arithmetic, and their memory traffic with each node's own cost."""
        throughput, bandwidth, per_node = machine
        return self.flops / throughput, self.moved / bandwidth + self.nodes * per_node


def build_run(model: torch.nn.Module, made: Step, backend: str, base: int, choices: dict[str, str]) -> Run:
    """A copy of ``model`` with its items marked ``{name: option}``, compiled, and its step run
    once: its peak (``base`` plus the allocator's) and what its copies compute."""
    net = copy.deepcopy(model)
    mark_choices(dict(net.named_modules()),
                 {name: Choice.parse(c).without_module() for name, c in choices.items()})
    compiled = graph_compile(net, backend=backend)
    made.run(compiled)  # compiles
    net.zero_grad(set_to_none=True)
    if not compiled.remat_reports:
        raise RuntimeError(f"{API}: torch.compile ran the model without compiling it (a graph "
                           f"break or Dynamo's recompile limit); budget= plans compiled steps "
                           f"only: compile without budget= and mark with remat.plan's plan")
    peak = allocation_peak(lambda: step_once(made, compiled, net))
    reports = compiled.remat_reports
    return Run(net, compiled, base + peak, flops=sum(r.copy_flops for r in reports),
               moved=sum(r.copy_bytes for r in reports),
               nodes=sum(len(r.duplicated) for r in reports))


def machine(device: torch.device) -> tuple[float, float, float]:
    """``(FLOP/s, bytes/s, seconds per operator)`` of ``device``, timed once on a matrix product,
    an addition and a one-element operator (the best of a few runs)."""
    def best(fn: Callable[[], Any], repeat: int = 5) -> float:
        fn()
        seconds = []
        for _ in range(repeat):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            begin = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds.append(time.perf_counter() - begin)
        return min(seconds)

    n = 512 if device.type == "cpu" else 4096
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    one = torch.ones(1, device=device)
    per_node = best(lambda: one + 1)
    throughput = 2 * n ** 3 / max(best(lambda: a @ b) - per_node, 1e-9)
    bandwidth = 3 * a.numel() * a.element_size() / max(best(lambda: a + b) - per_node, 1e-9)
    return throughput, bandwidth, per_node


def step_once(step: Step, compiled: Any, net: torch.nn.Module) -> None:
    """Run the compiled step once, its output freed and the gradients cleared."""
    held = step.run(compiled)
    del held
    net.zero_grad(set_to_none=True)


def interleaved(step: Step, runs: dict[str, Run], rounds: int) -> dict[str, float]:
    """Median seconds of each compiled step over ``rounds`` rounds in alternating order."""
    order = list(runs)
    times: dict[str, list[float]] = {o: [] for o in order}
    let_go()  # timed in the heap the user's loop runs in (NOTE [What planning leaves behind])
    for r in range(rounds):
        for option in order if r % 2 == 0 else reversed(order):
            run = runs[option]
            begin = time.perf_counter()
            step_once(step, run.compiled, run.model)
            times[option].append(time.perf_counter() - begin)
    return {o: statistics.median(t) for o, t in times.items()}
