"""``remat.planner``: the planner behind `remat.plan`, choosing what to recompute for a
memory budget (layer 4). The function is ``remat.plan``; this package holds its vocabulary
(``remat.planner.OPTIONS``, ``BLOCK_OPTIONS``) and its data (``Plan``, ``Decision``, ``Measured``, ``JobRank``).

Examples:
    >>> import torch, remat
    >>> net = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
    ...                             torch.nn.Linear(256, 64)) for _ in range(4)])
    >>> from remat.planner import BLOCK_OPTIONS
    >>> p = remat.plan(net, torch.randn(512, 64), budget="90%", options=BLOCK_OPTIONS)
    >>> set(p.choices.values()) <= {"keep", "recompute", "selective", "output"}
    True
"""

from remat.planner._budget import parse_budget
from remat.planner._compiled import compile, plan_compiled
from remat.planner._pipeline import PipelinePlan, RankPlan, plan_pipeline
from remat.planner._plan import Decision, JobRank, Measured, Plan, plan, sweep
from remat.planner._schedule import in_flight_counts, schedule_actions
from remat.planner._solve import (
    BLOCK_OPTIONS,
    FAMILIES,
    OPTIONS,
    BudgetError,
    Choice,
    Problem,
    Solution,
    evaluate,
    floor,
    solve,
    solve_chain,
    solve_milp,
    solve_savings,
)

__all__ = ["BLOCK_OPTIONS", "FAMILIES", "OPTIONS", "BudgetError", "Choice", "Decision", "JobRank", "Measured", "PipelinePlan", "Plan", "Problem", "RankPlan", "Solution",
           "compile", "evaluate", "floor", "in_flight_counts", "parse_budget", "plan", "plan_compiled", "plan_pipeline", "schedule_actions", "solve",
           "solve_chain", "solve_milp", "solve_savings", "sweep"]
