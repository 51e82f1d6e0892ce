"""torch's selective-checkpoint names on remat's policy engine (front end).

``CheckpointPolicy``, ``SelectiveCheckpointContext`` and
``create_selective_checkpoint_contexts`` have torch 2.13's signatures; the
modes they return are remat's (``_engine/selective.py``), which keep what the
policy chooses and rebuild the rest without updating module state twice. A
policy function may return torch's ``CheckpointPolicy`` or remat's: the two
enums compare equal member by member, so either works with either library.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint as _torch_checkpoint

from remat._engine import selective as _selective
from remat._vocab.errors import check_bool
from remat._vocab.policy import Policy

SAC_IGNORED_OPS: set = _selective.IGNORED_OPS
"""Operators a policy function is never asked about (a set of about 20 ``torch.ops`` overloads):
torch's ``SAC_IGNORED_OPS`` and the aliases remat's engine inserts (``detach``,
``alias``, ``lift_fresh`` ...)."""


class CheckpointPolicy(enum.Enum):
    """What a selective policy function says about one operator call.

    ``MUST_SAVE``/``PREFER_SAVE`` keep the operator's output for backward;
    ``MUST_RECOMPUTE``/``PREFER_RECOMPUTE`` rebuild it; the ``*_CPU_OFFLOAD``
    values, as in torch's eager mode, rebuild it. Each member equals torch's
    member of the same name (``torch.utils.checkpoint.CheckpointPolicy``) and
    hashes alike, so a policy function may return either enum to either
    library's ``create_selective_checkpoint_contexts``.

    Examples:
        >>> import torch, remat
        >>> remat.CheckpointPolicy.MUST_SAVE == torch.utils.checkpoint.CheckpointPolicy.MUST_SAVE
        True
        >>> torch.utils.checkpoint.CheckpointPolicy.PREFER_RECOMPUTE in {remat.CheckpointPolicy.PREFER_RECOMPUTE}
        True
    """

    MUST_SAVE = 0
    PREFER_SAVE = 1
    MUST_RECOMPUTE = 2
    PREFER_RECOMPUTE = 3
    MUST_CPU_OFFLOAD = 4
    PREFER_CPU_OFFLOAD = 5

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (CheckpointPolicy, _torch_checkpoint.CheckpointPolicy)):
            return self.name == other.name
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._name_)  # as Enum's own hash, so torch's member hashes alike


_SAVES = frozenset({"MUST_SAVE", "PREFER_SAVE"})


class SelectiveCheckpointContext(_torch_checkpoint.SelectiveCheckpointContext):
    """What a policy function is told about an operator call, besides the call itself.

    Same as ``torch.utils.checkpoint.SelectiveCheckpointContext`` (a subclass of
    it): ``op_output`` is the operator's output; ``is_recompute`` is always
    False, since policy functions are asked in forward only and their answers
    are replayed in recomputation.

    Args:
        is_recompute: always False (kept for torch's signature).
        op_output: the output of the operator being decided on.

    Examples:
        >>> import torch, remat
        >>> ctx = remat.SelectiveCheckpointContext(is_recompute=False, op_output=torch.ones(2))
        >>> ctx.is_recompute, ctx.op_output.shape
        (False, torch.Size([2]))
    """

    def __init__(self, *, is_recompute: bool, op_output: Any = None) -> None:
        super().__init__(is_recompute=is_recompute, op_output=op_output)


def _keeps(answer: Any, policy_fn: Callable) -> bool:
    if isinstance(answer, bool):
        return answer  # torch accepts True (MUST_SAVE) and False (PREFER_RECOMPUTE)
    if isinstance(answer, (CheckpointPolicy, _torch_checkpoint.CheckpointPolicy)):
        return answer.name in _SAVES
    name = getattr(policy_fn, "__qualname__", None) or type(policy_fn).__name__
    raise TypeError(
        f"remat.create_selective_checkpoint_contexts: policy function '{name}' returned "
        f"{answer!r}; return a CheckpointPolicy (remat's or torch's) such as "
        f"CheckpointPolicy.MUST_SAVE or CheckpointPolicy.PREFER_RECOMPUTE, or a bool"
    )


def _from_op_list(ops: list) -> Callable:
    for op in ops:
        if not isinstance(op, (torch._ops.OpOverload, torch._ops.HigherOrderOperator)):
            hint = (
                " Please update the OpOverloadPacket to a specific OpOverload. For example, if "
                "you have `torch.ops.aten.mm`, change it to `torch.ops.aten.mm.default`."
                if isinstance(op, torch._ops.OpOverloadPacket) else ""
            )
            raise ValueError(  # noqa: TRY004 - torch's type, so existing handlers still match
                f"remat.create_selective_checkpoint_contexts: Expected op in `op_list` to be an "
                f"OpOverload but got: {op} of type {type(op)}.{hint}"
            )
    chosen = frozenset(ops)

    def policy_fn(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in chosen else CheckpointPolicy.PREFER_RECOMPUTE

    policy_fn.__qualname__ = f"save {sorted(map(str, chosen))}"
    return policy_fn


def create_selective_checkpoint_contexts(
    policy_fn_or_list: Callable | list | Policy,
    allow_cache_entry_mutation: bool = False,
) -> tuple[_selective.SaveMode, _selective.ReplayMode]:
    """Return the (forward, recomputation) contexts that keep what a policy chooses.

    Same signature as ``torch.utils.checkpoint.create_selective_checkpoint_contexts``;
    pass it as ``context_fn`` (through ``functools.partial``) to
    [`remat.checkpoint`][remat.checkpoint] (or to torch's checkpoint). The policy function is
    called in forward for every operator (but [`remat.SAC_IGNORED_OPS`][remat.SAC_IGNORED_OPS]) as
    ``policy_fn(ctx, op, *args, **kwargs)`` with a `SelectiveCheckpointContext`.
    Outputs of views and in-place operators are rebuilt whatever it says, and a
    kept output changed in place after forward is rebuilt rather than reported.

    Args:
        policy_fn_or_list: a policy function returning a `CheckpointPolicy`
            (remat's or torch's) or a bool; a list of ``OpOverload`` s to keep
            (``torch.ops.aten.mm.default``; everything else is rebuilt); or a
            [`remat.Policy`][remat.Policy] such as [`remat.save_compute_intensive`][remat.save_compute_intensive].
        allow_cache_entry_mutation: accepted for torch's signature; remat rebuilds
            a kept output that was changed in place, so nothing is refused either way.

    Returns:
        A tuple of two context managers (dispatch modes).

    Raises:
        ValueError: a list entry that is not an ``OpOverload``.
        TypeError: anything else than a function, a list or a ``remat.Policy``.

    Examples:
        >>> import functools, torch, remat
        >>> def policy_fn(ctx, op, *args, **kwargs):
        ...     if op == torch.ops.aten.mm.default:
        ...         return remat.CheckpointPolicy.MUST_SAVE
        ...     return remat.CheckpointPolicy.PREFER_RECOMPUTE
        >>> context_fn = functools.partial(remat.create_selective_checkpoint_contexts, policy_fn)
        >>> x, w = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4)
        >>> y = remat.checkpoint(lambda t: (t @ w).sin(), x, use_reentrant=False, context_fn=context_fn)
        >>> y.sum().backward()
    """
    api = "remat.create_selective_checkpoint_contexts"
    check_bool(api, "allow_cache_entry_mutation", allow_cache_entry_mutation)
    if isinstance(policy_fn_or_list, Policy):
        return _selective.modes(policy_fn_or_list)
    if isinstance(policy_fn_or_list, list):
        policy_fn = _from_op_list(policy_fn_or_list)
    elif callable(policy_fn_or_list):
        policy_fn = policy_fn_or_list
    else:
        raise TypeError(
            f"{api}: policy_fn_or_list must be either a function or a list of ops (or a "
            f"remat.Policy), got {type(policy_fn_or_list).__name__}"
        )

    def decide(func: Any, args: tuple, kwargs: dict, out: Any) -> bool:
        ctx = SelectiveCheckpointContext(is_recompute=False, op_output=out)
        return _keeps(policy_fn(ctx, func, *args, **kwargs), policy_fn)

    name = getattr(policy_fn, "__qualname__", None) or type(policy_fn).__name__
    return _selective.modes(_selective.CallPolicy(decide, name=name))


def adopt_torch_contexts(context_fn: Callable) -> Callable:
    """``context_fn``, with torch's selective-checkpoint contexts run by remat's policy engine.

    ``functools.partial(torch.utils.checkpoint.create_selective_checkpoint_contexts,
    policy_fn)`` passed as ``context_fn`` keeps torch's limits (a second backward, an
    in-place write to a kept output, both refused); remat reads its policy function and
    builds `create_selective_checkpoint_contexts` from it instead, so it keeps
    the same operators and runs both. Any other pair is used as it is.
    """
    def contexts() -> tuple:
        pair = context_fn()
        first = pair[0] if isinstance(pair, tuple) and len(pair) == 2 else None
        if isinstance(first, _torch_checkpoint._CachingTorchDispatchMode):
            return create_selective_checkpoint_contexts(first.policy_fn)
        return pair

    return contexts
