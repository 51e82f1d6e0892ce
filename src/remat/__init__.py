"""remat: MindSpore-style recomputation (activation rematerialization) for PyTorch.

Public names are re-exported here; every other module is private.

Example:
    >>> import torch, remat
    >>> layer = torch.nn.Linear(4, 4)
    >>> x = torch.randn(2, 4, requires_grad=True)
    >>> y = remat.checkpoint(layer, x, use_reentrant=False)
    >>> y.sum().backward()
"""

from remat import memory, nn, ops
from remat._checkpoint import checkpoint, checkpoint_sequential
from remat._engine.selective import policy_context
from remat._engine.state import is_recomputing
from remat._errors import CheckpointError, RecomputeError
from remat._functional import recompute
from remat._graph import compile
from remat._marks import apply, mark_of, marked_modules, recompute_module, unmark
from remat._policy import Policy, recompute_all, save_all, save_compute_intensive, save_only
from remat._spec import RegionSpec
from remat.memory.estimate import estimate
from remat.memory.profile import profile
from remat.plan import BudgetError, Plan, plan

__version__ = "0.1.0"

__all__ = [
    "BudgetError",
    "CheckpointError",
    "Plan",
    "Policy",
    "RecomputeError",
    "RegionSpec",
    "apply",
    "checkpoint",
    "checkpoint_sequential",
    "compile",
    "estimate",
    "is_recomputing",
    "mark_of",
    "marked_modules",
    "memory",
    "nn",
    "ops",
    "plan",
    "policy_context",
    "profile",
    "recompute",
    "recompute_all",
    "recompute_module",
    "save_all",
    "save_compute_intensive",
    "save_only",
    "unmark",
]
