"""The training step a measurement runs: forward, loss and backward (layer 4: tools).

NOTE [The step users run]
1. A training loop keeps what the model returned alive while backward runs:
   ``logits = model(x); loss = F.cross_entropy(logits.flatten(0, 1), y.flatten());
   loss.backward(); opt.step()`` holds ``logits`` (or a Hugging Face ``ModelOutput``
   and every tensor in it) until the step ends, the optimizer's step included.
   ``loss_fn(model(x)).backward()`` frees them before backward, and a peak measured
   on it is lower than the loop's by the outputs' bytes (for an 8B Llama step, the
   logits alone are 7.8 GiB).
2. So the standard `Step` keeps the model's outputs and the loss alive until
   the caller drops what `Step.run` returned, after the optimizer's step.
3. A ``custom`` step, ``step(model, batch) -> loss``, is the loop's own body (gradient
   accumulation, several losses, an output freed early on purpose): it keeps what its
   code keeps. It calls ``loss.backward()`` itself, or returns a loss whose backward
   the step then runs (seen by the parameters' gradients: none created or changed).
4. What autograd keeps for backward is read when the first backward operator runs
   (`AtBackward`, a dispatch mode), so it needs no split of the step into a
   forward and a backward: with gradient accumulation it is the first micro-batch's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

#: ``step(model, batch) -> loss``: one step's forward and backward (NOTE [The step users run])
StepFn = Callable[[torch.nn.Module, Any], Any]


def default_loss(output: Any) -> torch.Tensor:
    """The loss used when none is given: the output's ``loss`` (Hugging Face models given
    labels), else the sum of every floating output, as float32."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    leaves = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not leaves:
        raise TypeError("remat.profile: the model returned no floating tensor; pass loss_fn=...")
    return sum(t.float().sum() for t in leaves)


@dataclass(frozen=True, eq=False)
class Step:
    """One training step's forward and backward, as a measurement runs it.

    Args:
        inputs: the model's positional inputs (standard step).
        batch: the model's keyword inputs (standard step), or what ``custom`` is given.
        loss_fn: ``loss_fn(output) -> scalar`` (standard step); default `default_loss`.
        custom: ``custom(model, batch) -> loss``, the user's loop body; None: the standard step.
        api: the public function that owns the step, named in errors.
    """

    inputs: tuple = ()
    batch: Any = None
    loss_fn: Callable | None = None
    custom: StepFn | None = None
    api: str = "remat.plan"

    def run(self, model: torch.nn.Module) -> Any:
        """Run the forward and the backward once; return what the loop still holds (drop it
        when the step ends, after the optimizer's step: NOTE [The step users run])."""
        if self.custom is None:
            output = model(*self.inputs, **(self.batch or {}))
            loss = (self.loss_fn or default_loss)(output)
            loss.backward()
            return output, loss
        before = _gradients(model)
        loss = self.custom(model, self.batch)
        if _gradients(model) == before:  # the step left its backward to us
            if not (isinstance(loss, torch.Tensor) and loss.requires_grad):
                raise TypeError(f"{self.api}: step(model, batch) ran no backward and returned "
                                f"{type(loss).__name__}, not a loss that requires grad; call "
                                f"loss.backward() in the step or return the loss")
            loss.backward()
        return loss


def _gradients(model: torch.nn.Module) -> list:
    """Each parameter's gradient by identity and version: changed when a backward ran."""
    return [None if p.grad is None else (id(p.grad), p.grad._version) for p in model.parameters()]


class AtBackward(TorchDispatchMode):
    """Call ``read()`` once, when the first operator of a backward runs; keep its value.

    Examples:
        >>> import torch
        >>> from remat.memory._step import AtBackward
        >>> x = torch.randn(4, requires_grad=True)
        >>> with AtBackward(lambda: "read") as at:
        ...     (x * x).sum().backward()
        >>> at.value
        'read'
    """

    def __init__(self, read: Callable[[], Any]) -> None:
        super().__init__()
        self.read = read
        self.value: Any = None
        self.seen = False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        if any(getattr(t, "__tensor_flatten__", None) is not None for t in types):
            return NotImplemented  # a subclass (DTensor) runs its local operators through us
        if not self.seen and torch._C._current_graph_task_id() != -1:
            self.seen = True
            self.value = self.read()
        return func(*args, **(kwargs or {}))
