"""``remat.plan``: the planner, choosing what to recompute for a memory budget (layer 4).

Example:
    >>> import torch, remat
    >>> net = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    >>> p = remat.plan(net, torch.randn(256, 64), budget="95%")
    >>> set(p.choices.values()) <= {"keep", "recompute", "selective", "output"}
    True
"""

from remat.plan._plan import Decision, Plan, parse_budget, plan
from remat.plan._solve import OPTIONS, BudgetError

__all__ = ["OPTIONS", "BudgetError", "Decision", "Plan", "parse_budget", "plan"]
