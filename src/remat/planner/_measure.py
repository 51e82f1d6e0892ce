"""Measuring the options: one tracked step per option with every block marked alike, and
on real tensors each option's step timed, interleaved (layer 4).

NOTE [Planning a rank]
A plan for one rank of a job (``world_size=``, ``parallelize=``) cannot mark a
model in place and measure it: marks go on before ``parallelize``, which
shards the model (NOTE [Estimating a rank]). So every run of the cost model,
and every verification, builds a fresh model with a `Builder`: build,
truncate a container of identical blocks when composing, mark, parallelize.
The model the blocks are found in is an unsharded one, never run. Bytes are
this rank's: parameters and gradients by their local shard.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from remat._front.marks import unmark_module
from remat.memory.internal import Step
from remat.memory.profile import OptimizerLike, make_optimizer, measure, prime_optimizer
from remat.planner._loop import let_go
from remat.planner._options import inner_options
from remat.planner._settings import Settings, mark_choices
from remat.planner._solve import BLOCK_OPTIONS
from remat.planner._trace import Trace, _named

API = "remat.plan"


@dataclass
class Runs:
    """The tracked runs of `measure_options`: one step per option, blocks marked alike."""

    reports: dict  # option -> ProfileReport
    inner: dict[str, list[str]]  # block name -> its options inside the block
    columns: list[str]  # every option inside blocks, in order
    steps: dict[str, float]  # option -> seconds of its step (interleaved timing; real tensors)
    measured: torch.nn.Module  # the model whose parameters count (a rank's: sharded)



def _measure_one(model: torch.nn.Module, blocks: list, chosen: dict, settings: Settings,
                 keep_timing: bool, state: dict | None, optimizer: torch.optim.Optimizer | None = None,
                 unmarked: Any = None) -> tuple[Any, torch.nn.Module]:
    """One tracked step with ``chosen`` (``{block: option}``) marked; the report and the model run.

    ``optimizer``: made and primed once for every run (NOTE [One optimizer phase]); stepped
    unless ``unmarked`` (the unmarked run's report) is given, whose optimizer phase then
    stands in for this run's."""
    if settings.build is not None:  # NOTE [Planning a rank]
        net = settings.build(chosen)
        return measure(net, settings.step.inputs, step=settings.step, optimizer=settings.optimizer,
                       estimated=settings.machine.fake, api=API), net
    marked = mark_choices(dict(blocks), chosen)
    try:
        report = measure(model, settings.step.inputs, step=settings.step,
                         optimizer=settings.optimizer if optimizer is None else optimizer,
                         repeat=settings.repeat if keep_timing else 0, estimated=settings.machine.fake,
                         api=API, optimizer_step=unmarked is None)
        return (report if unmarked is None else _with_optimizer_phase(report, unmarked)), model
    finally:
        for m in marked:
            unmark_module(m)
        if state is not None:
            model.load_state_dict(state)


def _with_optimizer_phase(report: Any, unmarked: Any) -> Any:
    """``report`` of a run without the optimizer's step, given the unmarked run's optimizer
    phase (NOTE [One optimizer phase])."""
    phase = unmarked.phase_peaks.get("optimizer")
    if phase is None:
        return report
    report.phase_peaks = {**report.phase_peaks, "optimizer": phase}
    if phase > report.peak_bytes:
        report.peak_bytes, report.peak_phase = phase, "optimizer"
        report.peak_increase = phase - report.baseline_bytes
    return report


def measure_options(model: torch.nn.Module, traced: Trace, settings: Settings,
                    state: dict | None) -> Runs:
    """Run the step once per option with every block that has it marked alike, under the
    tracker; the unmarked run also chooses the options inside blocks (NOTE [Options inside
    blocks]). On real tensors each option's step is then timed, interleaved.

    NOTE [One optimizer phase]
    The optimizer's step runs after backward, on gradients no mark changes, with only the
    step's outputs still alive, which no mark changes either: its phase is the same under
    every option. On fake tensors (where a step of the optimizer is a large share of a run)
    one optimizer is made and primed for all the runs and steps in the unmarked run only;
    every other run takes that run's optimizer phase. On real tensors each run makes its
    own, as a user's step would."""
    names, blocks = traced.names, traced.blocks
    inner: dict[str, list[str]] = {name: [] for name in names}
    columns: list[str] = []
    pending = ["keep", *(o for o in settings.options if o in BLOCK_OPTIONS and o != "keep")]
    uniform: dict[str, dict[str, str]] = {}  # option -> the blocks its run marks
    reports = {}
    measured = model
    opt = None  # NOTE [One optimizer phase]
    if settings.machine.fake and settings.build is None and settings.optimizer is not None:
        opt = make_optimizer(settings.optimizer, model, API)
        prime_optimizer(opt)
    while pending:
        option = pending.pop(0)
        chosen = {name: option for name in names if option in BLOCK_OPTIONS or option in inner[name]}
        uniform[option] = chosen
        settings.say(f"measuring '{option}' on {len(chosen)} blocks")
        timing = not settings.machine.fake and option == "keep"
        unmarked = None if opt is None or option == "keep" else reports["keep"]
        reports[option], net = _measure_one(model, blocks, chosen, settings, timing, state, opt, unmarked)
        if option == "keep" and settings.build is not None:
            measured, blocks = net, _named(net, blocks)
        if option == "keep":  # NOTE [Options inside blocks], [Options per operator]
            inner = inner_options(traced, {r.name: r for r in reports["keep"].rows}, settings.options,
                                  every=True)  # NOTE [Every child]
            columns = list(dict.fromkeys(c for name in names for c in inner[name]))
            pending += columns
    steps: dict[str, float] = {}
    if not settings.machine.fake and settings.build is None and settings.repeat:
        settings.say(f"timing the {len(uniform)} options, interleaved")
        steps = interleaved_steps(model, settings.step, dict(blocks), uniform, settings.repeat,
                                   settings.optimizer)
    return Runs(reports=reports, inner=inner, columns=columns, steps=steps, measured=measured)


def interleaved_steps(model: torch.nn.Module, step: Step, blocks: Mapping[str, torch.nn.Module],
                       uniform: Mapping[str, Mapping[str, str]], rounds: int,
                       optimizer: OptimizerLike = None) -> dict[str, float]:
    """Seconds of ``step`` (forward and backward) with each option's blocks marked (``uniform``:
    option -> ``{block: option}``), over ``rounds`` rounds after one to warm up; and under
    ``"optimizer"`` the seconds of the optimizer's step, timed after the unmarked one.

    Each round steps every option once, in a rotating order, so a busy spell of the machine
    slows them alike. Every option's marks are set and taken off once before the first round:
    a module's first mark adds its remembered marks to it (NOTE [A mark set again is the same
    mark]), which changed the tree of a block whose option had already run in the warm-up
    round, so its first timed round was watched again (NOTE [Trees seen before]). An
    option's figure is the unmarked step's median times the median over rounds of its ratio
    to the unmarked step of the same round: the statistic a user's loop shows (a typical
    step, not the luckiest), with the machine's slow spells divided out."""
    opt = make_optimizer(optimizer, model, API)
    if opt is not None:
        prime_optimizer(opt)
    let_go()  # timed in the heap the user's loop runs in (NOTE [What planning leaves behind])
    order = list(uniform)
    for option in order:  # every mark set once first: the warm-up round sees the trees the rest do
        for m in mark_choices(blocks, uniform[option]):
            unmark_module(m)
    times: dict[str, list[float]] = {option: [] for option in order}
    optimizer_s: list[float] = []
    for r in range(rounds + 1):
        for option in order[r % len(order):] + order[:r % len(order)]:
            marked = mark_choices(blocks, uniform[option])
            try:
                start = time.perf_counter()
                held = step.run(model)
                elapsed = time.perf_counter() - start
                del held
                if opt is not None and option == "keep":
                    start = time.perf_counter()
                    opt.step()
                    optimizer_s.append(time.perf_counter() - start)
            finally:
                for m in marked:
                    unmark_module(m)
                model.zero_grad(set_to_none=True)
            if r:
                times[option].append(elapsed)
    keep = statistics.median(times["keep"])
    out = {option: keep * statistics.median(t / k for t, k in zip(seconds, times["keep"]))
           for option, seconds in times.items()}
    if optimizer_s[1:]:
        out["optimizer"] = statistics.median(optimizer_s[1:])
    return out



def measure_peak(model: torch.nn.Module, step: Step, *, optimizer: OptimizerLike, fake: bool,
                 optimizer_peak: int | None = None) -> int:
    """Peak bytes of one ``step`` of ``model`` as marked (the model's state is restored after).

    With ``optimizer_peak`` (the optimizer phase's peak, which no mark changes) the
    optimizer's step is not run again: the peak is the larger of that and the rest's."""
    state = None if fake else {k: v.detach().clone() for k, v in model.state_dict().items()}
    try:
        report = measure(model, step.inputs, step=step, optimizer=optimizer,
                         estimated=fake, api=API, optimizer_step=optimizer_peak is None)
        return max(report.peak_bytes, optimizer_peak or 0)
    finally:
        if state is not None:
            model.load_state_dict(state)
            model.zero_grad(set_to_none=True)

