"""`solve`: the solver each problem gets, and the brute-force reference (layer 1).

Examples:
    >>> from remat.planner._solve import Problem, solve
    >>> p = Problem(kept=[[8, 2, 4, 0]] * 3, time=[[0, 3, 1, 4]] * 3, rebuilt=[8] * 3,
    ...             fixed=[0] * 3, output=[2] * 3, end=0)
    >>> solve(p, 20).choices == solve(p, 20, solver="brute").choices
    True
"""

from __future__ import annotations

import itertools
import time as _time

from remat.planner._solve._chain import infeasible, solve_chain
from remat.planner._solve._graph import solve_milp
from remat.planner._solve._problem import OUTPUT, Problem, Solution, evaluate, solution


def solve_brute_force(problem: Problem, budget: float) -> Solution:
    """The reference: try every combination (tiny problems only); least time, then least peak."""
    start = _time.perf_counter()
    best: tuple[float, float, tuple] | None = None
    for choice in itertools.product(*(problem.allowed(i) for i in range(problem.blocks))):
        peak, total = evaluate(problem, choice)
        if peak <= budget and (best is None or (total, peak) < best[:2]):
            best = (total, peak, choice)
    if best is None:
        raise infeasible(problem, budget)
    return solution(problem, best[2], "brute force", start)


def is_chain(problem: Problem) -> bool:
    """True when every block allows ``output`` but perhaps the last (a plain chain)."""
    return all(problem.kept[i][OUTPUT] is not None for i in range(problem.blocks - 1))


def solve(problem: Problem, budget: float, *, resolution: float = 1.0,
          solver: str = "auto") -> Solution:
    """Least extra time with a predicted peak within ``budget``.

    Args:
        problem: the costs.
        budget: peak bytes allowed.
        resolution: memory granularity of the dynamic program, in bytes.
        solver: ``"auto"`` (the dynamic program for chains, the MILP for other graphs),
            ``"dp"`` (also exact on graphs: the cost model orders blocks), ``"milp"`` or ``"brute"``.

    Raises:
        BudgetError: no plan fits; ``floor_bytes`` is the smallest peak reachable.
    """
    if solver == "dp" or (solver == "auto" and is_chain(problem)):
        return solve_chain(problem, budget, resolution=resolution)
    if solver in ("auto", "milp"):
        return solve_milp(problem, budget)
    if solver == "brute":
        return solve_brute_force(problem, budget)
    raise ValueError(f"remat.plan: solver must be 'auto', 'dp', 'milp' or 'brute', got {solver!r}")
