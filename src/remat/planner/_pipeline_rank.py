"""A fake-tensor pipeline rank's plan, solved on its stages' cost models and checked by the
composed peak (NOTE [A rank's peak composed] in ``_pipeline_compose.py``; layer 4)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from remat.memory import format_bytes
from remat.planner._budget import parse_budget
from remat.planner._loop import fit
from remat.planner._pipeline_compose import Composer
from remat.planner._result import Decision, Measured, Plan
from remat.planner._solve import BudgetError, Problem, Solution, evaluate, floor, solve

API = "remat.plan_pipeline"


class _RankProblem:
    """A rank's blocks (its stages' in order) as one solver problem: each block's kept bytes
    times ``counts[stage]``, the micro-batches its stage holds at the unmarked peak, its times
    per step (NOTE [A rank's peak composed]); `problems` is offset so that it predicts the
    composed peak with no mark, and never below the optimizer's step."""

    def __init__(self, composer: Composer, held: list[int], counts: dict[int, int]) -> None:
        self.held, self.composer = held, composer
        self.costs = [composer.costs(s) for s in held]
        self.options = list(dict.fromkeys(o for c in self.costs for o in c.options))
        #: per block: (stage, name in the stage, name in the rank's ModuleList, class name)
        self.blocks = [(s, name, f"{pos}.{name}".rstrip("."), kind) for pos, (s, c) in enumerate(zip(held, self.costs))
                       for name, kind in zip(composer.specs[s].blocks, c.types)]
        self.counts = counts

    def problems(self, keep_peak: float, base: float) -> tuple[Problem, Problem]:
        """``(ranking, calibrated)``: the problem the solver chooses on and the one whose times
        predict the plan's extra seconds (NOTE [Plans timing noise cannot flip]); ``keep_peak``:
        the loop's composed peak unmarked, ``base`` the optimizer step's."""
        out = []
        for ranking in (True, False):
            raw = self._joined([c.problem(ranking=ranking) for c in self.costs], 0.0, 0.0)
            offset = keep_peak - evaluate(raw, [0] * raw.blocks)[0]
            out.append(self._joined([c.problem(ranking=ranking) for c in self.costs], offset, base))
        return out[0], out[1]

    def _joined(self, problems: list[Problem], offset: float, base: float) -> Problem:
        n = self.composer.n
        kept, time_of, rebuilt, fixed, output, chain, last_held, ends, tails = ([] for _ in range(9))
        for s, c, p in zip(self.held, self.costs, problems):
            k, start = self.counts.get(s, 1), c.memory.baseline_bytes
            columns = [p.options.index(o) if o in p.options else None for o in self.options]
            for i in range(p.blocks):
                mine = [None if o is None else p.kept[i][o] for o in columns]
                kept.append([None if b is None else k * b for b in mine])
                time_of.append([0.0 if o is None else n * p.time[i][o] for o in columns])
                rebuilt.append([(p.rebuilt_of(i, o) + (k - 1) * p.kept[i][o]) if o is not None
                                and p.kept[i][o] is not None else 0.0 for o in columns])
                fixed.append(p.fixed[i] - start + offset)
                output.append(p.output[i])
                chain.append(n * p.extra_time(i))
                last_held.append(p.held_last(i))
            ends.append(p.end - start)
            tails.append(None if p.tail is None else p.tail - start)
        tail = max((t for t in tails if t is not None), default=None)
        return Problem(kept=kept, time=time_of, rebuilt=rebuilt, fixed=fixed, output=output,
                       end=max(ends) + offset, chain_time=chain, base=base, last_held=last_held,
                       tail=None if tail is None else tail + offset, options=self.options)

    def choices(self, solution: Sequence[str]) -> dict[int, dict[str, str]]:
        """The solution's options per stage, by block name in the stage."""
        out: dict[int, dict[str, str]] = {s: {} for s in self.held}
        for (s, name, _, _), choice in zip(self.blocks, solution):
            out[s][name] = choice
        return out


def plan_rank(composer: Composer, actions: list, held: list[int], budget: Any, solver: str) -> Plan:
    """One rank's plan on fake tensors (NOTE [A rank's peak composed]): solved on its stages'
    cost models, its peak composed and re-solved for while it exceeds ``budget``."""
    base = composer.base(held)[1]
    at_peak: dict[int, int] = {}
    loop_peak = composer.loop_peak(actions, held, {s: {} for s in held}, at_peak)
    # each stage's kept bytes count as often as the unmarked peak holds them (a stage that
    # holds none there: once, as its own moments do)
    rank = _RankProblem(composer, held, {s: max(1, at_peak.get(s, 0)) for s in held})
    keep_peak = max(loop_peak, base)
    value, fractional = parse_budget(budget, API)
    fitting = _RankFit(rank, actions, rank.problems(loop_peak, base), value * keep_peak if fractional else value,
                       keep_peak, solver)
    start = time.perf_counter()
    solution, measured, _ = fit(fitting.budget, fitting.solved, fitting.composed, fitting.uniform, fitting.refused)
    return _made(rank, fitting.problem, solution, (fitting.budget, keep_peak, fitting.least, measured),
                 time.perf_counter() - start)


class _RankFit:
    """What `remat.planner._loop.fit` calls for one rank: the solver on its problem, the
    composed peak of a plan, the uniform fallback, the error (NOTE [Solve, measure, lower the
    target])."""

    def __init__(self, rank: _RankProblem, actions: list, problems: tuple[Problem, Problem], budget: float,
                 keep_peak: float, solver: str) -> None:
        self.rank, self.actions, self.solver = rank, actions, solver
        self.ranking, self.problem = problems
        self.budget, self.keep_peak, self.least = budget, keep_peak, floor(self.ranking)
        #: per plan composed, its composed peak less the predicted one
        self.errors: dict[tuple, float] = {}
        self.peaks: list[int] = []

    def solved(self, target: float, rejected: Sequence[Solution]) -> Solution | None:
        # a plan composed over the budget: the next is solved for the budget less the largest
        # error of the prediction seen (the target lowered by the excess alone can find it again)
        missed = max((self.errors.get(r.choices, 0.0) for r in rejected), default=0.0)
        target = min(target, self.budget - missed)
        try:
            found = solve(self.ranking, target, resolution=max(1.0, target / 8192), solver=self.solver)
        except BudgetError:
            return None
        choice = [self.problem.options.index(c) for c in found.choices]
        return dataclasses.replace(found, time=evaluate(self.problem, choice)[1])

    def composed(self, solution: Solution) -> int:
        rank = self.rank
        peak = rank.composer.peak(self.actions, rank.held, rank.choices(solution.choices))
        self.errors[solution.choices] = peak - solution.peak
        self.peaks.append(peak)
        return peak

    def uniform(self, over: Sequence[int]) -> tuple[Solution, int] | None:
        """The fastest plan marking every block alike whose composed peak fits (the cost model
        is another stage's where stages share their blocks': it may mislead near a floor)."""
        for choice in sorted(_uniform_choices(self.ranking), key=lambda c: evaluate(self.ranking, c)[1]):
            peak, extra = evaluate(self.problem, choice)
            found = Solution(tuple(self.problem.options[c] for c in choice), peak, extra, "uniform fallback")
            if self.composed(found) <= self.budget:
                return found, self.peaks[-1]
        return None

    def refused(self, over: Sequence[int], exhausted: bool) -> BudgetError:
        shown = min(self.peaks) if self.peaks else max(self.least, self.budget + 1)
        return BudgetError(f"{API}: no plan fits a budget of {format_bytes(self.budget)} ({self.budget:,.0f} "
                           f"bytes); the smallest peak composed is {format_bytes(shown)} ({shown:,.0f} bytes; "
                           f"no recompute: {format_bytes(self.keep_peak)}); raise the budget",
                           budget_bytes=self.budget, floor_bytes=shown)


def _uniform_choices(problem: Problem) -> list[list[int]]:
    """Every option all of ``problem``'s blocks allow, as a choice per block (not ``keep``)."""
    return [[o] * problem.blocks for o in range(1, len(problem.options))
            if all(problem.kept[i][o] is not None for i in range(problem.blocks))]


def _made(rank: _RankProblem, problem: Problem, solution: Solution, peaks: tuple, seconds: float) -> Plan:
    budget, keep_peak, least, measured = peaks
    decisions = []
    for i, ((_, _, name, kind), choice) in enumerate(zip(rank.blocks, solution.choices)):
        o = problem.options.index(choice)
        kept = problem.kept[i][o] / max(1, rank.counts.get(rank.blocks[i][0], 1))
        decisions.append(Decision(name, kind, choice, float(kept), problem.time[i][o]))
    step = [c.step.seconds for c in rank.costs]
    timing = rank.costs[0].step.timing if rank.costs else "roofline"
    return Plan(decisions=tuple(decisions), budget_bytes=int(budget), predicted_peak_bytes=int(solution.peak),
                predicted_extra_s=solution.time,
                step_s=None if None in step else rank.composer.n * sum(step),
                no_recompute_peak_bytes=int(keep_peak), floor_bytes=int(least),
                measured=Measured(peak_bytes=measured), solver=solution.solver, solve_s=seconds,
                timing=f"{timing}; each stage measured on one micro-batch, the rank's peak composed")



def replayed_peaks(plan: Any, stages: list, example: Any, *, schedule: type, loss_fn: Any = None,
                   target: Any = None, world_size: int | None = None, dtype: Any = None,
                   optimizer: Any = "adam") -> list[int]:
    """Each rank's peak with its part of ``plan`` (a `remat.PipelinePlan` of factories) applied,
    its whole loop replayed on fake tensors (`remat.planner._pipeline._RankStep`): the reference
    the composed peaks are checked against (NOTE [A rank's peak composed]); the other arguments
    as `remat.plan_pipeline` was given them."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.pipelining import schedules

    from remat.memory.internal import Step, build_in
    from remat.planner._measure import measure_peak
    from remat.planner._pipeline import _RankStep, _stage_inputs, _sum_loss
    from remat.planner._schedule import schedule_actions

    single = issubclass(schedule, schedules.PipelineScheduleSingle)
    world = world_size or (len(stages) if single else max(1, len(stages) // 2))
    inputs = _stage_inputs(stages, example, target, dtype, True)
    order = schedule_actions(schedule, len(stages), world, plan.n_microbatches)
    peaks = []
    for rank in sorted(order):
        held = list(plan.ranks[rank].stages)
        step = _RankStep(held, order[rank], inputs, len(stages), plan.n_microbatches, loss_fn or _sum_loss,
                         sends_wait_next=issubclass(schedule, schedules.Schedule1F1B))
        with FakeTensorMode():
            model = torch.nn.ModuleList(build_in(stages[s], dtype) for s in held)
            plan.ranks[rank].plan.apply(model)
            peaks.append(measure_peak(model, Step(custom=step, batch=()), optimizer=optimizer, fake=True))
    return peaks
