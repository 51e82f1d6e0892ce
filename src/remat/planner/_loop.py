"""The planners' control loop: solve, measure, lower the target, fall back (layer 4).

NOTE [Solve, measure, lower the target]
A cost model predicts a plan's peak; the step run with the plan has the peak that counts.
Both planners (``remat.plan``, eager, and ``remat.compile(budget=...)``, NOTE [Planning a
compiled step]) therefore measure the plan they solved for, and while its measured peak
exceeds the budget they solve again for a target lowered by that excess (the overshoots add
up: the k-th try solves for the budget less every earlier excess), at most `TRIES` times.
When the solver finds no plan for a lowered target, or every try overshoots, the caller's
fallback (a plan marking every block alike whose own run was measured within the budget)
is taken; without one, the caller's `BudgetError` is raised. `fit` is that loop alone, a
pure function of plain callables; what a plan is, how it is solved and measured and what
the error says are the caller's.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from typing import TypeVar

from remat.planner._solve import BudgetError

#: solves per budget: the first and five more on lowered targets (NOTE [Solve, measure, lower the target])
TRIES = 6

S = TypeVar("S")


def fit(budget: float, solve: Callable[[float, Sequence[S]], S | None],
        measure: Callable[[S], int | None],
        fallback: Callable[[Sequence[int]], tuple[S, int] | None],
        error: Callable[[Sequence[int], bool], BudgetError],
        tries: int = TRIES) -> tuple[S, int | None, list[int]]:
    """The plan for ``budget``: solved, measured, re-solved on a lowered target while it
    measures over the budget (NOTE [Solve, measure, lower the target]).

    One loop for the eager and the compiled planner, so the two cannot drift apart.

    Args:
        budget: the peak allowed, in bytes.
        solve: ``solve(target, rejected)``: the plan predicted to peak within ``target`` bytes,
            not one of ``rejected`` (the plans already measured over the budget), or None
            when there is none.
        measure: the plan's measured peak; None: not measured (the plan is taken as it is).
        fallback: ``fallback(over)``, called with the peaks measured over the budget so far
            when the solver finds no plan or every try overshoots: ``(plan, measured peak)``
            to take instead, or None.
        error: ``error(over, exhausted)``: the `BudgetError` to raise when there is no
            fallback; ``exhausted``: every try measured over the budget (``over[-1]``, the
            last peak measured), else the solver found no plan for the target after ``over``.
        tries: how many times to solve at most.

    Returns:
        ``(plan, measured peak or None, the peaks measured over the budget on the way)``.

    Raises:
        BudgetError: ``error``'s, when neither a try nor the fallback fits.
    """
    target = budget
    over: list[int] = []
    rejected: list[S] = []
    for _ in range(tries):
        solution = solve(target, tuple(rejected))
        if solution is None:
            return _fall_back(fallback, error, over, exhausted=False)
        measured = measure(solution)
        if measured is None or measured <= budget:
            return solution, measured, over
        over.append(measured)
        rejected.append(solution)
        target -= measured - budget  # solve again for the budget less the excess
    return _fall_back(fallback, error, over, exhausted=True)


def _fall_back(fallback: Callable[[Sequence[int]], tuple[S, int] | None],
               error: Callable[[Sequence[int], bool], BudgetError], over: list[int],
               exhausted: bool) -> tuple[S, int | None, list[int]]:
    """``fallback``'s plan, or ``error``'s `BudgetError` raised."""
    taken = fallback(tuple(over))
    if taken is None:
        raise error(tuple(over), exhausted)
    solution, measured = taken
    return solution, measured, over


def let_go() -> None:
    """Collect what planning left in reference cycles.

    NOTE [What planning leaves behind]
    Planning runs the user's step many times, marked and compiled many ways, and what those
    runs leave in reference cycles (an exception's traceback holding the frame that saved
    the model's state, the planner's rows, a compiled option's graphs and fake tensors) is
    freed only when Python's cyclic collector next runs its oldest generation: after a
    planner's hundreds of thousands of objects, that can be thousands of steps into the
    user's loop. Until then the loop runs with that memory held (after `remat.plan` of
    four small blocks, 29 tensors; after ``remat.compile(budget=)`` of a 4-layer Llama
    of width 64, 651,047 objects, 589 of them tensors holding 11.7 MB, on a GPU device memory
    the budget did not count), and its marked steps took 5 to 8% longer than after a
    collection (measured against the unmarked step, interleaved). So `plan`, `sweep` and
    ``remat.compile(budget=)`` end with one collection, a fraction of a second against the
    planning's seconds or minutes, and hand the model back with nothing of the planning
    alive but the plan; and both collect before their interleaved timing rounds, so that
    the options are timed in the heap the user's loop will run in. One collection can free
    objects whose finalizers let go of more cycles (4,344 objects more after
    ``remat.compile``'s), so it runs until one finds nothing.
    """
    for _ in range(8):
        if not gc.collect():
            return
