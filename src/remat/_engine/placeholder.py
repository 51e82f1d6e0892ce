"""What a selective re-run hands out for an operator it skips (engine).

NOTE [Placeholders keep the device]
A dead call of a selective re-run (NOTE [Dead operators in a selective re-run] in ``dead.py``)
returns a stand-in of its output: its shape, strides and dtype, no memory. Code above the
dispatcher still reads it: an attention's Python-level checks compare its inputs' devices
before the kernel a policy hands back is ever asked for, and a stand-in on the ``meta``
device, beside a real query, failed there ("Expected query, key, and value to have the
same device type"). That happened as soon as a re-run skipped what only a later re-run
of the same region reads (NOTE [Re-runs in stages] in ``stages.py``).

So a stand-in is a `Placeholder`: a tensor that reports the device, shape, strides and
dtype the forward's output had and holds no memory. A view of it (``view``, ``transpose``,
``detach``: views run as they are in a re-run) is a placeholder too; any other operator
on it raises a ``RecomputeError``, so does reading its values from Python (``item``,
``tolist``, ``bool``: each is an operator) or its memory (``data_ptr``: it has none). It
never yields a value: a re-run that reads one fails, loudly, as with ``meta`` stand-ins.
"""

from __future__ import annotations

from typing import Any

import torch

from remat._engine.errors import RecomputeError

_VIEWS_OF_NOTHING = {torch.ops.aten.detach.default, torch.ops.aten.alias.default}


class Placeholder(torch.Tensor):
    """A skipped call's output in a re-run: its metadata on its device, no memory, no value."""

    _meta: torch.Tensor

    @staticmethod
    def __new__(cls, meta: torch.Tensor, device: torch.device) -> Placeholder:  # noqa: PYI034
        made = torch.Tensor._make_wrapper_subclass(
            cls, meta.shape, strides=meta.stride(), storage_offset=meta.storage_offset(),
            dtype=meta.dtype, device=device, requires_grad=meta.requires_grad)
        made._meta = meta
        return made

    @property
    def is_meta(self) -> bool:  # type: ignore[override]
        """True, as for the ``meta`` stand-ins before it: it holds no memory, and remat's own
        checks and memory trackers (which skip ``meta`` tensors) pass it by."""
        return True

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"Placeholder(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not (func.is_view or func in _VIEWS_OF_NOTHING):
            raise RecomputeError(
                f"remat selective recompute: {func} read, in recomputation, the output of an "
                f"operator the re-run skipped (its forward's reads showed nothing rebuilt needs "
                f"it); code that reads a tensor's values outside the operators the forward ran "
                f"(a Python condition on it, .tolist(), an extension) cannot run on it. Re-run "
                f"every operator: early_stop=False on the mark, or "
                f"remat.set_checkpoint_early_stop(False) around the forward"
            )
        device = None
        metas = []
        for a in args:  # an aten schema nests tensors one list deep; no pytree (per view)
            if type(a) is Placeholder:
                device = a.device
                a = a._meta
            elif type(a) is list or type(a) is tuple:
                device = next((b.device for b in a if type(b) is Placeholder), device)
                a = [b._meta if type(b) is Placeholder else b for b in a]
            metas.append(a)
        out = func(*metas, **kwargs)
        if type(out) is torch.Tensor:
            return Placeholder(out, device)
        return type(out)(Placeholder(m, device) if type(m) is torch.Tensor else m for m in out)


def placeholder(shape: Any, stride: Any, dtype: torch.dtype, device: torch.device) -> Placeholder:
    """A placeholder of that layout on ``device`` (made below every mode: none counts it)."""
    with torch._C._DisableTorchDispatch():
        meta = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
    return Placeholder(meta, device)
