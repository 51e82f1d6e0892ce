"""The planners' shared control loop, `remat.planner._loop.fit`, on fake solvers and
measurements (NOTE [Solve, measure, lower the target])."""

import pytest

from remat.planner._loop import TRIES, fit
from remat.planner._solve import BudgetError


def _error(over, exhausted):
    return BudgetError(f"over={list(over)} exhausted={exhausted}", budget_bytes=100, floor_bytes=0)


def test_a_plan_measured_over_the_budget_is_solved_again_for_a_target_lowered_by_the_excess():
    targets, rejected_seen = [], []

    def solve(target, rejected):
        targets.append(target)
        rejected_seen.append(tuple(rejected))
        return f"plan{len(targets)}"

    peaks = {"plan1": 130, "plan2": 95}
    solution, measured, over = fit(100, solve, peaks.__getitem__, lambda over: pytest.fail("no fallback"),
                                   _error)
    assert (solution, measured, over) == ("plan2", 95, [130])
    assert targets == [100, 70]  # lowered by the overshoot, 130 - 100
    assert rejected_seen == [(), ("plan1",)]


def test_the_overshoots_add_up_and_a_plan_not_measured_is_taken_as_it_is():
    targets = []

    def solve(target, rejected):
        targets.append(target)
        return len(targets)

    solution, measured, over = fit(100, solve, {1: 110, 2: 105, 3: None}.__getitem__, lambda over: None, _error)
    assert (solution, measured, over) == (3, None, [110, 105])
    assert targets == [100, 90, 85]


def test_when_every_try_overshoots_the_fallback_is_taken_with_the_peaks_measured_over():
    targets, offered = [], []

    def fallback(over):
        offered.append(list(over))
        return "uniform", 90

    solution, measured, over = fit(100, lambda t, r: targets.append(t) or "plan", lambda s: 101, fallback, _error)
    assert (solution, measured) == ("uniform", 90)
    assert len(targets) == TRIES == 6 and targets == [100 - k for k in range(TRIES)]
    assert over == offered[0] == [101] * TRIES


def test_without_a_fallback_the_callers_error_is_raised():
    with pytest.raises(BudgetError, match=r"over=\[101, 101\] exhausted=True"):
        fit(100, lambda t, r: "plan", lambda s: 101, lambda over: None, _error, tries=2)
    # the solver finds no plan: at once (nothing measured yet), or on a lowered target
    with pytest.raises(BudgetError, match=r"over=\[\] exhausted=False"):
        fit(100, lambda t, r: None, lambda s: pytest.fail("nothing to measure"), lambda over: None, _error)
    with pytest.raises(BudgetError, match=r"over=\[120\] exhausted=False"):
        fit(100, lambda t, r: None if r else "plan", lambda s: 120, lambda over: None, _error)
    assert fit(100, lambda t, r: None, None, lambda over: ("uniform", 99), _error) == ("uniform", 99, [])
