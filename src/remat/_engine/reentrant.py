"""``use_reentrant=True``: a region as a custom ``autograd.Function`` (engine).

The forward ran without grad; the Function's backward re-runs the region with
grad and back-propagates through the re-run. Limits, each with a clear error:
tensors nested in containers, ``torch.autograd.grad`` through an opaque callable,
a second backward after the graph was freed.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.utils import _pytree as pytree

from remat._engine import collectives as _collectives
from remat._engine import state as _state
from remat._engine.modes import StateGuard
from remat._engine.reach import quiet
from remat._errors import RecomputeError


class Reentrant(torch.autograd.Function):
    """``use_reentrant=True``: the forward ran without grad; backward re-runs the region.

    The parameters the region reaches (NOTE [What a region reaches]) are inputs
    of this Function too, so ``torch.autograd.grad`` gets their gradients (torch's
    reentrant checkpoint refuses ``torch.autograd.grad``).
    """

    @staticmethod
    def forward(ctx: Any, frame: Any, n_inputs: int, *tensors: torch.Tensor) -> Any:
        ctx.frame, ctx.n_inputs = frame, n_inputs
        ctx.save_for_backward(*tensors[:n_inputs])
        out, frame.pending = frame.pending, None
        return out

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        frame: Any = ctx.frame
        in_backward_call = torch.autograd._is_checkpoint_valid()
        if not in_backward_call and frame.opaque:
            raise RecomputeError(
                f"remat: region '{frame.name}' uses use_reentrant=True and remat cannot see which "
                f"parameters it uses, so it does not work with torch.autograd.grad or "
                f"backward(inputs=...); pass a module, or use use_reentrant=False"
            )
        try:
            tensors = ctx.saved_tensors
        except RuntimeError as err:
            raise RecomputeError(
                f"remat: backward ran a second time through reentrant region '{frame.name}' after "
                f"its saved inputs were freed; pass retain_graph=True to the first backward, or "
                f"use use_reentrant=False"
            ) from err
        inputs = [x.detach().requires_grad_(x.requires_grad) for x in tensors]
        with quiet(frame.quiet_norms):  # its inner backward reads the saved statistics
            return Reentrant._backward(frame, inputs, grads, in_backward_call)

    @staticmethod
    def _backward(frame: Any, inputs: list, grads: tuple, in_backward_call: bool) -> tuple:
        outs = _rerun(frame, inputs)
        pairs = [(o, g) for o, g in zip(outs, grads) if isinstance(o, torch.Tensor) and o.requires_grad]
        wrt = [x for x in inputs if x.requires_grad]
        if in_backward_call:  # parameters accumulate as in any backward
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            input_grads = [x.grad if x.requires_grad else None for x in inputs]
            return (None, None, *input_grads) + (None,) * len(frame.params)
        wrt = wrt + frame.params
        found = torch.autograd.grad(
            [o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True
        ) if pairs and wrt else [None] * len(wrt)
        by_id = {id(t): g for t, g in zip(wrt, found)}
        input_grads = [by_id.get(id(x)) for x in inputs]
        return (None, None, *input_grads, *[by_id.get(id(p)) for p in frame.params])


def _rerun(frame: Any, inputs: list) -> tuple:
    leaves = list(frame.leaves)
    for slot, x in zip(frame.tensor_slots, inputs):
        leaves[slot] = x
    args, kwargs = frame.unflatten(leaves)
    frame.runs += 1
    guard = StateGuard() if frame.guard else contextlib.nullcontext()
    replay = _collectives.replaying(frame)  # NOTE [Kept collectives]
    with _state.recomputing(), frame.replay.context(), torch.enable_grad(), guard, replay:
        _state.recomputing_fns().append(frame.fn)
        try:
            out = frame.fn(*args, **kwargs)
        finally:
            _state.recomputing_fns().pop()
    return out if isinstance(out, tuple) else (out,)


def check_args(name: str, args: tuple, kwargs: dict) -> None:
    if kwargs:
        pass  # keyword arguments are saved like positional ones
    for position, arg in enumerate(args):
        if isinstance(arg, torch.Tensor):
            continue
        nested = [x for x in pytree.tree_leaves(arg) if isinstance(x, torch.Tensor) and x.requires_grad]
        if nested:
            raise TypeError(
                f"remat: region '{name}' (use_reentrant=True) got argument {position} of type "
                f"{type(arg).__name__} holding {len(nested)} tensor(s) that require grad; the "
                f"reentrant implementation cannot differentiate tensors inside lists, tuples or "
                f"dicts; pass them as separate arguments or use use_reentrant=False"
            )


def check_outputs(name: str, out: Any) -> None:
    outs = out if isinstance(out, tuple) else (out,)
    for position, item in enumerate(outs):
        if isinstance(item, torch.Tensor):
            continue
        if any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves(item)):
            raise TypeError(
                f"remat: region '{name}' (use_reentrant=True) returned output {position} of type "
                f"{type(item).__name__} holding tensors; the reentrant implementation cannot "
                f"differentiate tensors inside lists, tuples or dicts; return them directly "
                f"(a flat tuple) or use use_reentrant=False"
            )
