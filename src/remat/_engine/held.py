"""The arguments a saved-tensor region re-runs from, saved or held (engine).

`HeldInputs` is the part of `hooked.HookedFrame` that keeps the region's tensor
arguments from forward to its re-runs: saved through a custom Function where a
saved-tensor hook outside the region must see them, held with their versions
otherwise (NOTE [Inputs held directly]), each one once (NOTE [Arguments that are one
tensor] in ``hooked.py``), a copy of one the region returns (NOTE [Arguments returned as
outputs] in ``aliases.py``).
"""

from __future__ import annotations

from typing import Any

import torch

from remat._engine.errors import RecomputeError
from remat._engine.observe import engine_ops

_top_hooks = torch._C._autograd._top_saved_tensors_default_hooks  # as outputs.py reads the stack


class _SaveInputs(torch.autograd.Function):
    """Saves a region's tensor inputs through the saved-tensor hooks around the region."""

    @staticmethod
    def forward(ctx: Any, dummy: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*tensors)
        return dummy.new_empty((0,))

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> None:  # pragma: no cover - never differentiated
        raise AssertionError("remat internal error: the input saver was differentiated")


class HeldInputs:
    """A region's saved arguments (a mixin of `hooked.HookedFrame`: ``name``, ``leaves``,
    ``tensor_slots`` and ``unflatten`` come from `core.RegionCore`)."""

    input_of: list[int]
    held: list | None
    saver: torch.Tensor | None
    name: str
    leaves: list
    tensor_slots: list[int]

    def _copy_returned_inputs(self, inputs: list, shared: list[bool]) -> None:
        """Save a copy of each input the region returns, or returns a view of (``shared``:
        per input, whether an output shares its storage).

        NOTE [Arguments returned as outputs] (``aliases.py``): a caller may change
        such an output in place, which would change the input the re-run starts from.
        """
        with engine_ops():
            copies = [t.detach().clone().requires_grad_(t.requires_grad) if s else t
                      for t, s in zip(inputs, shared)]
        self._save_inputs(copies)

    def _save_inputs(self, tensors: list) -> None:
        """Save the tensor arguments once each (NOTE [Arguments that are one tensor]).

        NOTE [Inputs held directly]
        The arguments are saved through a custom Function so that whatever saved-tensor
        hooks are outside the region pack them: an enclosing region (which counts and
        drops them), remat's hook for outputs nobody keeps (NOTE [Output recompute]),
        CPU offload. With no hook outside, saving does nothing a reference does not: a
        Function's saved input is the tensor itself, handed back as itself, refused once
        its version moved. So then the frame holds each argument with its version and
        refuses a moved one the same way, without the Function's node (about a quarter
        of a marked activation's forward cost in remat's code).
        """
        if not tensors:
            return
        if len(tensors) == 1:
            self.input_of = [0]
        else:  # every slot is saved (an enclosing region counts them)
            first: dict[int, int] = {}
            self.input_of = [first.setdefault(id(t), i) for i, t in enumerate(tensors)]
        if _top_hooks(False) is None:
            self.held, self.saver = [(t, t._version) for t in tensors], None
            return
        with engine_ops():
            dummy = torch.empty((0,), requires_grad=True)
            self.saver, self.held = _SaveInputs.apply(dummy, *tensors), None

    def _saved_inputs(self) -> tuple | list:
        """The saved arguments, per slot; a moved one is refused (NOTE [Inputs held directly])."""
        if self.held is not None:
            if any(t._version != v for t, v in self.held):
                raise RecomputeError(self._moved_input())
            return [t for t, _ in self.held]
        try:
            return self.saver.grad_fn.saved_tensors if self.saver is not None else ()
        except RuntimeError as err:
            if "modified by an inplace operation" not in str(err):
                raise
            raise RecomputeError(self._moved_input()) from err

    def _moved_input(self) -> str:
        return (
            f"remat: region '{self.name}' cannot be re-run: one of its inputs was changed in "
            f"place after the region ran (one of the variables needed for gradient "
            f"computation has been modified by an inplace operation). A region is rebuilt "
            f"from its inputs in backward; change the input out of place, or clone it first"
        )

    def inputs(self) -> tuple[tuple, dict]:
        leaves = list(self.leaves)
        saved = self._saved_inputs()
        for slot, k in zip(self.tensor_slots, self.input_of):
            leaves[slot] = saved[k]
        return self.unflatten(leaves)
