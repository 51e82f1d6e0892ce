"""remat: MindSpore-style recomputation (activation rematerialization) for PyTorch.

Public names are re-exported here; every other module is private. Every public
name of ``torch.utils.checkpoint`` is one of them, with the same signature.

Examples:
    >>> import torch, remat
    >>> layer = torch.nn.Linear(4, 4)
    >>> x = torch.randn(2, 4, requires_grad=True)
    >>> y = remat.checkpoint(layer, x, use_reentrant=False)
    >>> y.sum().backward()
"""

from remat import memory, nn, ops, parallel, planner
from remat._engine.errors import CheckpointError, RecomputeError
from remat._engine.selective import policy_context
from remat._engine.state import is_recomputing
from remat._front.checkpoint import (
    CheckpointFunction,
    DefaultDeviceType,
    GraphExecGroup,
    check_backward_validity,
    checkpoint,
    checkpoint_sequential,
    detach_variable,
    get_device_states,
    noop_context_fn,
    set_checkpoint_debug_enabled,
    set_checkpoint_early_stop,
    set_device_states,
)
from remat._front.checkpoint_selective import (
    SAC_IGNORED_OPS,
    CheckpointPolicy,
    SelectiveCheckpointContext,
    create_selective_checkpoint_contexts,
)
from remat._front.functional import recompute
from remat._front.hf import gradient_checkpointing_enable
from remat._front.marks import apply, mark_of, marked_modules, recompute_module, unmark
from remat._vocab.policy import (
    Policy,
    recompute_all,
    save_all,
    save_calls,
    save_compute_intensive,
    save_only,
)
from remat._vocab.spec import RegionSpec
from remat.memory.estimate import estimate
from remat.memory.profile import profile
from remat.planner import BudgetError, PipelinePlan, Plan, compile, plan, plan_pipeline

__version__ = "0.1.0"

__all__ = [
    "SAC_IGNORED_OPS",
    "BudgetError",
    "CheckpointError",
    "CheckpointFunction",
    "CheckpointPolicy",
    "DefaultDeviceType",
    "GraphExecGroup",
    "PipelinePlan",
    "Plan",
    "Policy",
    "RecomputeError",
    "RegionSpec",
    "SelectiveCheckpointContext",
    "apply",
    "check_backward_validity",
    "checkpoint",
    "checkpoint_sequential",
    "compile",
    "create_selective_checkpoint_contexts",
    "detach_variable",
    "estimate",
    "get_device_states",
    "gradient_checkpointing_enable",
    "is_recomputing",
    "mark_of",
    "marked_modules",
    "memory",
    "nn",
    "noop_context_fn",
    "ops",
    "parallel",
    "plan",
    "plan_pipeline",
    "planner",
    "policy_context",
    "profile",
    "recompute",
    "recompute_all",
    "recompute_module",
    "save_all",
    "save_calls",
    "save_compute_intensive",
    "save_only",
    "set_checkpoint_debug_enabled",
    "set_checkpoint_early_stop",
    "set_device_states",
    "unmark",
]
