"""``remat.estimate``: the memory of a training step, measured on fake tensors.

The model is built inside ``FakeTensorMode``: every tensor has a shape, dtype
and device but no data, so a 7B-parameter model costs nothing to build. The
step (forward, loss, backward, optimizer step) then runs under
:func:`remat.memory.track` exactly as :func:`remat.profile` runs it, and the
tracker's bytes are those a real run on the same device's kernels allocates.
A CPU build of torch cannot fake CUDA tensors: estimates made here reflect
CPU kernels (the report's ``device`` says so).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from remat._marks import apply
from remat.memory._report import ProfileReport
from remat.memory.profile import OptimizerLike, measure

Marks = None | str | type | Iterable[type] | Callable[[torch.nn.Module], Any]
API = "remat.estimate"


def build_model(model: Any) -> torch.nn.Module:
    """Build ``model`` (a factory, a model class, or a Llama/GPT config) in the current mode."""
    if dataclasses.is_dataclass(model) and not isinstance(model, type):
        from remat.models.llama import Llama, LlamaConfig

        if isinstance(model, LlamaConfig):
            return Llama(model)
        try:
            from remat.models.gpt import GPT, GPTConfig
        except ImportError:  # pragma: no cover - the GPT model ships with remat.models
            GPT = GPTConfig = None
        if GPTConfig is not None and isinstance(model, GPTConfig):
            return GPT(model)
    if isinstance(model, torch.nn.Module):
        raise TypeError(
            f"{API}: pass a factory that builds the model (a class, a function, or "
            f"functools.partial), not a built {type(model).__name__}; it is built on fake tensors"
        )
    if not callable(model):
        raise TypeError(f"{API}: model must be a factory or a LlamaConfig/GPTConfig, got {type(model).__name__}")
    built = model()
    if not isinstance(built, torch.nn.Module):
        raise TypeError(f"{API}: the factory must return a torch.nn.Module, got {type(built).__name__}")
    return built


def apply_marks(model: torch.nn.Module, marks: Marks, api: str = API) -> None:
    """Mark ``model`` as ``marks`` says: ``"blocks"`` (the model's ``mark_blocks()`` if it
    has one, else :func:`remat.apply`'s ``where="blocks"``), class names, globs or module
    types for :func:`remat.apply`, or a function ``marks(model)``."""
    if marks is None:
        return
    if marks == "blocks" and callable(getattr(model, "mark_blocks", None)):
        model.mark_blocks()
    elif isinstance(marks, (str, type)) or (
        isinstance(marks, (list, tuple)) and all(isinstance(t, (str, type)) for t in marks)
    ):
        try:
            apply(model, where=marks)
        except (TypeError, ValueError) as err:
            raise type(err)(str(err).replace("remat.apply", api).replace("where=", "marks=")) from None
    elif callable(marks):
        marks(model)
    else:
        raise TypeError(f"{api}: marks must be None, 'blocks', class names, module types or a function, "
                        f"got {type(marks).__name__}")


def _build_in(model: Any, dtype: torch.dtype | None) -> torch.nn.Module:
    # Module.to(dtype) cannot swap fake parameters; build them in the dtype instead.
    if dtype is None:
        return build_model(model)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return build_model(model)
    finally:
        torch.set_default_dtype(old)


def _fake_inputs(mode: FakeTensorMode, inputs: tuple, dtype: torch.dtype | None) -> tuple:
    if len(inputs) == 1 and callable(inputs[0]) and not isinstance(inputs[0], torch.Tensor):
        made = inputs[0]()
        return made if isinstance(made, tuple) else (made,)
    out = []
    for item in inputs:
        if isinstance(item, torch.Tensor):
            out.append(mode.from_tensor(item))
        elif isinstance(item, (tuple, list, torch.Size)) and all(isinstance(n, int) for n in item):
            out.append(torch.randn(*item, dtype=dtype))
        else:
            raise TypeError(f"{API}: each example input must be a tensor or a shape (tuple of ints), "
                            f"or pass one function that returns the inputs; got {type(item).__name__}")
    return tuple(out)


def estimate(model: Any, *example_inputs: Any, batch: dict | None = None,
             loss_fn: Callable | None = None,
             optimizer: OptimizerLike = "adam", marks: Marks = None,
             dtype: torch.dtype | None = None, output_recompute: bool = False,
             label: str = "") -> ProfileReport:
    """Estimate the peak memory of one training step without allocating it.

    Args:
        model: a factory returning the model (class, function, ``functools.partial``),
            or a :class:`~remat.models.llama.LlamaConfig` / GPT config.
        *example_inputs: tensors (copied as fake tensors), shapes (random inputs in ``dtype``),
            or one function returning the inputs (called under the fake mode).
        batch: keyword inputs, ``model(*inputs, **batch)``: tensors or shapes, as above
            (a Hugging Face batch: ``{"input_ids": ..., "labels": ...}``).
        loss_fn: ``loss_fn(output) -> scalar``; default: sum of floating outputs.
        optimizer: ``"adam"`` (default), ``"adamw"``, ``"sgd"``, ``callable(params)``
            or None; its state (Adam: twice the parameters) exists before the step.
        marks: recompute marks to apply: ``"blocks"``, class names or globs (``"GPT2Block"``),
            module types, or ``marks(model)``.
        dtype: cast the model's floating parameters to this dtype (e.g. ``torch.bfloat16``).
        output_recompute: passed to the ``if_recomputed`` column of unmarked modules.
        label: the report's name.

    Returns:
        A :class:`~remat.memory.ProfileReport` (``estimated=True``, no times):
        ``peak_bytes`` is the step's peak, parameters and optimizer state included.

    Raises:
        TypeError: ``model`` is a built module, or an input is neither tensor nor shape.

    Example:
        >>> import torch, remat
        >>> make = lambda: torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU())
        >>> report = remat.estimate(make, (4096, 1024))
        >>> report.peak_bytes > 3 * report.param_bytes   # params, Adam state, grads
        True
    """
    with FakeTensorMode() as mode:
        net = _build_in(model, dtype)
        apply_marks(net, marks)
        inputs = _fake_inputs(mode, example_inputs, dtype)
        if batch is not None and not isinstance(batch, dict):
            raise TypeError(f"{API}: batch must be a dict of keyword inputs, got {type(batch).__name__}")
        keywords = dict(zip(batch, _fake_inputs(mode, tuple(batch.values()), dtype))) if batch else {}
        net.train()
        first = next(iter((*inputs, *keywords.values())), None)
        device = first.device.type if isinstance(first, torch.Tensor) else "cpu"
        return measure(net, inputs, batch=keywords, loss_fn=loss_fn, optimizer=optimizer,
                       output_recompute=output_recompute, repeat=0, estimated=True,
                       label=label or type(net).__name__, device=f"{device} kernels (FakeTensorMode)",
                       api=API)
