"""Fitting plans to budgets: the measured cost model solved, measured and lowered for each
budget of `remat.plan` and `remat.planner.sweep` (layer 4)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from remat._front.marks import unmark_module
from remat.memory import format_bytes
from remat.memory.internal import identical_container
from remat.planner._cost import BlockCosts, composed_costs, measure_costs
from remat.planner._loop import fit
from remat.planner._measure import interleaved_steps, measure_peak
from remat.planner._result import Decision, Measured, Plan
from remat.planner._settings import Settings, mark_choices
from remat.planner._solve import BudgetError, Problem, Solution, evaluate, floor, solve
from remat.planner._trace import find_blocks
from remat.planner._verify import composed_peak

API = "remat.plan"


def _plans(model: torch.nn.Module, budgets: list, settings: Settings) -> list:
    chosen = find_blocks(model, settings.blocks)
    container = identical_container(model, chosen) if settings.machine.fake and settings.compose else None
    costs = composed_costs(model, chosen, container, settings) if container else None
    if costs is None:
        costs = measure_costs(model, chosen, settings)
    problem = costs.problem()
    ranking = costs.problem(ranking=True)  # NOTE [Plans timing noise cannot flip]
    least = _reachable_floor(model, costs, (ranking, problem), floor(problem), settings)
    out = []
    for value, fractional in budgets:
        budget = value * costs.memory.peaks["keep"] if fractional else value
        try:
            out.append(_fit(model, costs, (ranking, problem), budget, least, settings))
        except BudgetError as err:
            if not settings.solving.floors:
                raise
            out.append(err)
    return _shared(out) if len(out) > 1 else out


def _shared(found: list) -> list:
    """Each budget of a sweep gets the plan predicted fastest of those the sweep measured within it.

    NOTE [A sweep is monotone]
    Every plan of a sweep was measured; one found for a lower budget fits every higher one.
    Searching each budget alone, a cost model that errs (the U-Net's ``output`` options,
    predicted low) can end one budget on a fallback that a lower budget's search beat: the
    measured peak then rose as the budget fell (727,000 bytes at one budget, 734,232 at the
    next lower); and the FLOP-based ranking that chooses each plan (NOTE [Plans timing noise
    cannot flip]) can disagree with the timed prediction, so a higher budget got a plan
    predicted slower than a lower budget's (7.8 ms against 5.8, measured 5.4 against 3.9).
    So each budget takes, of all the sweep's plans measured within it, the one predicted
    fastest, the lower peak on a tie (a budget refused alone may get one too). Then both
    the measured peak and the predicted overhead are monotone: the plans within a lower
    budget are among those within a higher one, so the higher budget's choice is predicted
    no slower; and were its peak lower than the lower budget's choice, it would fit the lower
    budget too and be chosen there.
    """
    plans = [p for p in found if isinstance(p, Plan)]

    def key(p: Plan) -> tuple:
        return p.predicted_extra_s, _peak(p)

    out = []
    for item in found:
        budget = item.budget_bytes
        best = min((p for p in plans if _peak(p) <= budget), key=key, default=None)
        if best is None or (isinstance(item, Plan) and key(item) <= key(best)):
            out.append(item)
        else:
            out.append(dataclasses.replace(best, budget_bytes=int(budget)))
    return out


def _peak(plan: Plan) -> int:
    return plan.predicted_peak_bytes if plan.measured_peak_bytes is None else plan.measured_peak_bytes


def _reachable_floor(model: torch.nn.Module, costs: BlockCosts, problems: tuple[Problem, Problem],
                     least: float, settings: Settings) -> float:
    """The floor a plan is found at: the cost model's, raised to what its plan measures.

    NOTE [A floor that plans reach]
    The cost model's floor is the lowest peak it predicts. On some graphs it is optimistic:
    the U-Net's skip connections keep more than its blocks' moments add up to, and the plan at
    its floor measured 803,500 bytes for 770,080 predicted. Reported as it was, the floor
    named a budget no plan met (refused with "raise the budget"), and a sweep from it started
    with refusals. So where plans are measured (real tensors, ``verify``), the floor plan is
    measured once, and the floor is raised to the lowest peak a known plan measured: that plan,
    or a marking of every block alike (their runs were measured for the cost model), where one
    measured lower (the floor plan may measure worse than a uniform one where the model errs).
    """
    if settings.machine.fake or not settings.solving.verify:
        return least  # predictions only: composed or unmeasured
    ranking, problem = problems
    try:
        solution = solve(ranking, least, resolution=max(1.0, least / 8192), solver=settings.solving.solver)
    except BudgetError:
        return least
    measured = _measure_choices(model, costs, solution.choices, settings)
    peaks = costs.memory.peaks
    uniform = [peaks[option] for o, option in enumerate(problem.options) if option in peaks
               and all(problem.kept[i][o] is not None for i in range(problem.blocks))]
    return max(least, min([measured, *uniform]))


def _fit(model: torch.nn.Module, costs: BlockCosts, problems: tuple[Problem, Problem], budget: float,
         least: float, settings: Settings) -> Plan:
    """The plan for ``budget``: chosen on the first of ``problems`` (the ranking times), its
    extra time predicted by the second (the calibrated ones), its peak measured and re-solved
    for while it exceeds the budget (NOTE [Solve, measure, lower the target])."""
    ranking, problem = problems
    settings.say(f"solving for {format_bytes(budget)}")

    def solved(target: float, _rejected: Sequence[Solution]) -> Solution | None:
        try:
            return _predicted(problem, solve(ranking, target, resolution=max(1.0, target / 8192),
                                             solver=settings.solving.solver))
        except BudgetError:
            return None

    def measured_peak(solution: Solution) -> int | None:
        if not settings.solving.verify:
            return None
        settings.say(f"measuring the plan for {format_bytes(budget)}")
        return _measure_choices(model, costs, solution.choices, settings)

    # after a plan measured over the budget, the cost model erred near its floor: a measured uniform plan
    solution, measured, _ = fit(budget, solved, measured_peak,
                                lambda over: _uniform(costs, problems, budget) if over else None,
                                lambda over, exhausted: _budget_error(budget, least, costs, over, exhausted))
    # the marking of every block alike wins when it is faster and measured within the budget
    # (the model may have thought it over: its run was measured, not predicted)
    uniform = _uniform(costs, problems, budget)
    if uniform is not None and _ranked(ranking, uniform[0]) < _ranked(ranking, solution):
        solution, measured = uniform
    plan = _make(costs, problem, solution, budget, least, measured)
    if (settings.machine.fake or settings.build is not None or not settings.solving.verify
            or not settings.repeat):
        return plan
    settings.say(f"timing the plan for {format_bytes(budget)}")
    extra = _timed_extra(model, costs, solution.choices, settings)
    return dataclasses.replace(plan, measured=dataclasses.replace(plan.measured, extra_s=extra))


def _budget_error(budget: float, least: float, costs: BlockCosts, over: Sequence[int],
                  exhausted: bool) -> BudgetError:
    """Why no plan was found for ``budget``: every try measured over it (``exhausted``), the
    solver found none on a lowered target after the peaks ``over``, or none at all."""
    if exhausted:
        measured = over[-1]
        return BudgetError(
            f"{API}: no plan measured within a budget of {format_bytes(budget)} "
            f"({budget:,.0f} bytes); the last plan measured {format_bytes(measured)}; raise the budget",
            budget_bytes=budget, floor_bytes=measured)
    if over:
        return BudgetError(
            f"{API}: no plan measured within a budget of {format_bytes(budget)} ({budget:,.0f} "
            f"bytes): the cost model's floor is {format_bytes(least)}, but the plans near it "
            f"measured {format_bytes(min(over))} or more; raise the budget to {min(over):,.0f} bytes",
            budget_bytes=budget, floor_bytes=min(over))
    shown = max(least, budget + 1)
    no_recompute = costs.memory.peaks["keep"]
    return BudgetError(
        f"{API}: no plan fits a budget of {format_bytes(budget)} ({budget:,.0f} bytes); the "
        f"smallest reachable peak is {format_bytes(shown)} ({shown:,.0f} bytes; no recompute: "
        f"{format_bytes(no_recompute)}); raise the budget or shrink the batch",
        budget_bytes=budget, floor_bytes=shown)


#: interleaved rounds, per unit of ``repeat``, that time a plan against the unmarked step
TIMED_ROUNDS = 4


def _timed_extra(model: torch.nn.Module, costs: BlockCosts, choices: Sequence[str],
                 settings: Settings) -> float:
    """The plan's extra seconds per step (forward and backward): the plan and the unmarked
    step timed in `TIMED_ROUNDS` x ``repeat`` interleaved rounds, the median of the
    rounds' ratios times the unmarked step's median; the model's state put back after."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    uniform = {"keep": {}, "plan": dict(zip(costs.names, choices))}
    try:
        steps = interleaved_steps(model, settings.step, dict(model.named_modules()), uniform,
                                   TIMED_ROUNDS * settings.repeat)
    finally:
        model.load_state_dict(state)
        model.zero_grad(set_to_none=True)
    return steps["plan"] - steps["keep"]


def _ranked(ranking: Problem, solution: Solution) -> float:
    """The extra time of ``solution`` by the ranking times."""
    return evaluate(ranking, [ranking.options.index(c) for c in solution.choices])[1]


def _predicted(problem: Problem, solution: Solution) -> Solution:
    """``solution`` (solved on the ranking times) with the extra time ``problem`` predicts."""
    choice = [problem.options.index(c) for c in solution.choices]
    return dataclasses.replace(solution, time=evaluate(problem, choice)[1])


def _uniform(costs: Any, problems: tuple[Problem, Problem], budget: float) -> tuple | None:
    """The fastest plan (by the ranking times) marking every block alike whose measured peak
    (from the cost model's runs) fits ``budget``, with that peak; None if none fits."""
    ranking, problem = problems
    best = None
    for o, option in enumerate(problem.options):
        measured = costs.memory.peaks.get(option, float("inf"))
        if measured > budget or any(problem.kept[i][o] is None for i in range(problem.blocks)):
            continue  # (the run marked every block alike; a plan that cannot is another plan)
        rank = evaluate(ranking, [o] * problem.blocks)[1]
        if best is None or rank < best[0]:
            extra = evaluate(problem, [o] * problem.blocks)[1]
            best = (rank, Solution((option,) * problem.blocks, measured, extra, "uniform fallback"), measured)
    return None if best is None else best[1:]


def _measure_choices(model: torch.nn.Module, costs: BlockCosts, choices: Sequence[str],
                     settings: Settings) -> int:
    """The measured peak of the step with the blocks marked as ``choices`` say."""
    chosen = dict(zip(costs.names, choices))
    # (with micro-batches a block's moments recur after the gradients exist: traced whole)
    if settings.solving.verify != "full" and settings.compose and settings.machine.fake and costs.calls == 1:
        named = dict(model.named_modules())
        container = identical_container(model, [(name, named[name]) for name in costs.names])
        if container is not None:  # NOTE [Verifying by composition]
            peak = composed_peak(model, costs.names, choices, container, settings,
                                 costs.memory.optimizer_peak)
            if peak is not None:
                return peak
    measure = {"optimizer": settings.optimizer, "fake": settings.machine.fake,
               "optimizer_peak": costs.memory.optimizer_peak}
    if settings.build is not None:  # NOTE [Planning a rank]: a fresh model, marked, then sharded
        return measure_peak(settings.build(chosen), settings.step, **measure)
    marked = mark_choices(dict(model.named_modules()), chosen)
    try:
        return measure_peak(model, settings.step, **measure)
    finally:
        for module in marked:
            unmark_module(module)


def _make(costs: Any, problem: Problem, solution: Any, budget: float, least: float,
          measured: int | None) -> Plan:
    decisions = []
    for i, (name, kind, choice) in enumerate(zip(costs.names, costs.types, solution.choices)):
        o = problem.options.index(choice)
        extra = problem.time[i][o]
        if choice == "output" and i + 1 < len(solution.choices) and solution.choices[i + 1] == "output":
            extra += problem.extra_time(i)
        decisions.append(Decision(name, kind, choice, float(problem.kept[i][o]), extra))
    return Plan(decisions=tuple(decisions), budget_bytes=int(budget),
                predicted_peak_bytes=int(solution.peak), predicted_extra_s=solution.time,
                step_s=costs.step.seconds, no_recompute_peak_bytes=int(costs.memory.peaks["keep"]),
                floor_bytes=int(least), measured=Measured(peak_bytes=measured), solver=solution.solver,
                solve_s=solution.seconds, timing=costs.step.timing)
