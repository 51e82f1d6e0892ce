"""Hugging Face transformers: the key/value cache of a marked layer (front end).

NOTE [Cache of a marked layer]
With ``use_cache=True`` (the default of most Hugging Face configs) a decoder layer
appends its keys and values to the ``Cache`` it is given, in training too.
Recomputing a marked layer on that cache would append them a second time: a longer
cache, wrong attention in the re-run (with ``use_reentrant=True`` gradients silently
wrong), or an error (T5). So, whenever grad is enabled (a backward may recompute), a
marked module called with a ``transformers.Cache`` argument is guarded (NOTE [Call
guards] in ``_front/marks.py``):

1. The first run of the region (forward) gets the model's cache and writes it once,
   as the unmarked layer does; each recomputation gets a throwaway copy of the cache
   as it was when the layer was called. So forward and recomputation read the same
   tensors in the same layouts, and the model trains bitwise as unmarked (Hugging
   Face's own switch instead drops the cache in training: GPT-2's keys then have
   another layout, and its gradients change in the last bits).
2. The copy shares the cache's tensors: it is a new ``Cache`` object with new cache
   layer objects (``Cache.layers``), whose ``update`` rebinds their tensors instead of
   writing them. What a cache does is asked through its public API, not guessed from
   its class name: ``is_compileable`` (its layers are written in place, at static
   addresses: ``StaticCache``), ``is_croppable`` False (state that cannot be cut back
   to an earlier length: quantized caches), ``is_linear`` (recurrent states updated in
   place) or offloading: such a cache cannot be copied so, and the call is refused
   with a ``TypeError`` that names the fix (``use_cache=False`` in training, or a
   ``DynamicCache``). Never wrong gradients; never a silently dropped past either.
3. Layers that only read the cache (``GradientCheckpointingLayer._can_checkpoint_with_cache``)
   keep it, as in Hugging Face. Under ``no_grad`` (``generate``, evaluation) the call
   is left as it is.

transformers is never imported here: its public classes (``Cache``,
``GradientCheckpointingLayer``) are looked up in ``sys.modules``, where they are
whenever a model or a cache of theirs exists.

Examples:
    >>> import torch
    >>> from remat._front.hf import guard_cache
    >>> guard_cache(torch.nn.Linear(2, 2), (), {"cache": object()}) is None  # no transformers cache
    True
"""

from __future__ import annotations

import copy
import functools
import sys
import warnings
import weakref
from typing import Any

import torch

from remat._front.marks import PerRun, add_call_guard, mark_from_keywords


def public_class(module: str, name: str) -> type | None:
    """The class ``name`` of the transformers module ``module`` if it is loaded, else None."""
    found = getattr(sys.modules.get(module), name, None)
    return found if isinstance(found, type) else None


def is_hf_layer(module: torch.nn.Module) -> bool:
    """True for a Hugging Face ``GradientCheckpointingLayer`` (what its own switch checkpoints)."""
    layer = public_class("transformers.modeling_layers", "GradientCheckpointingLayer")
    return layer is not None and isinstance(module, layer)


class CacheRun(PerRun):
    """A cache argument of a marked layer: the cache itself for forward, copies after."""

    __slots__ = ("cache", "runs", "snapshot", "written")

    def __init__(self, cache: Any) -> None:
        self.cache, self.snapshot, self.runs = cache, _copy(cache), 0
        self.written = weakref.ref(cache)  # what the forward writes to, as long as it lives

    def take(self) -> Any:
        """The model's cache for the first run (forward), a throwaway copy for each re-run."""
        self.runs += 1
        if self.runs == 1:  # let go of the model's cache: its later layers' tensors lead back
            cache, self.cache = self.cache, None  # here through autograd, a cycle gc cannot free
            return cache
        return _copy(self.snapshot)


def _copy(cache: Any) -> Any:
    """A cache that a layer may update without touching ``cache``: new objects, shared tensors."""
    base = public_class("transformers.cache_utils", "Cache")
    new = copy.copy(cache)
    for name, value in vars(cache).items():
        if base is not None and isinstance(value, base):
            setattr(new, name, _copy(value))  # EncoderDecoderCache's two caches
        elif name == "layers":
            setattr(new, name, [_copy_layer(layer) for layer in value])
        elif isinstance(value, (dict, list)):
            setattr(new, name, copy.copy(value))  # EncoderDecoderCache.is_updated
    return new


def _copy_layer(layer: Any) -> Any:
    new = copy.copy(layer)
    for name, value in vars(layer).items():
        if isinstance(value, (dict, list)):
            setattr(new, name, copy.copy(value))
    return new


def _not_copyable(cache: Any) -> str | None:
    """Why a throwaway copy of ``cache`` would not be faithful, asked through its public API; None if it is."""
    if cache.is_compileable:
        return "writes its tensors in place (is_compileable is True)"
    croppable = getattr(cache, "is_croppable", None)
    if croppable is None:
        return ("cannot tell whether its state can be cut back (no is_croppable: transformers "
                "older than 5.17)")
    if not croppable:
        return "holds state that cannot be cut back to an earlier length (is_croppable is False)"
    if any(getattr(cache, "is_linear", ())):
        return "holds recurrent states that are updated in place (is_linear)"
    if getattr(cache, "offloading", False):
        return "offloads its layers to the CPU"
    base = public_class("transformers.cache_utils", "Cache")
    inner = [v for v in vars(cache).values() if isinstance(v, base)]
    return next((why for why in map(_not_copyable, inner) if why is not None), None)


def guard_cache(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """The arguments a marked module's region records, each ``Cache`` a `CacheRun`.

    See NOTE [Cache of a marked layer].

    Args:
        module: the marked module being called.
        args, kwargs: its arguments.

    Returns:
        ``(args, kwargs)`` to record, or None when nothing changes (grad disabled, no
        transformers ``Cache`` among the arguments, a layer that only reads its cache).

    Raises:
        TypeError: a cache that cannot be copied faithfully (StaticCache, quantized,
            offloaded, recurrent states).
    """
    base = public_class("transformers.cache_utils", "Cache")
    if base is None or not torch.is_grad_enabled():
        return None
    if not any(isinstance(a, base) for a in (*args, *kwargs.values())):
        return None
    if is_hf_layer(module) and getattr(module, "_can_checkpoint_with_cache", False):
        return None

    def guarded(value: Any) -> Any:
        return _guarded(module, value) if isinstance(value, base) else value

    return tuple(map(guarded, args)), {k: guarded(v) for k, v in kwargs.items()}


def _guarded(module: torch.nn.Module, cache: Any) -> CacheRun:
    why = _not_copyable(cache)
    if why is not None:
        raise TypeError(
            f"remat mark on {type(module).__name__}: called with grad enabled and a "
            f"{type(cache).__name__}, which {why}; recomputing the layer would write it a second "
            f"time, and remat cannot give the recomputation the cache as forward saw it. Pass "
            f"use_cache=False while training (Hugging Face's gradient checkpointing does the "
            f"same), use a DynamicCache (transformers>=5.17), or remat.unmark the layer"
        )
    return CacheRun(cache)


add_call_guard(guard_cache)


class LayerCheckpoint:
    """A ``gradient_checkpointing_func`` for Hugging Face layers that recomputes with remat.

    Called by a Hugging Face layer as ``func(partial(forward, layer, **kwargs), *args)``,
    the way it calls ``torch.utils.checkpoint.checkpoint``.

    Args:
        spec: the region options (see [`remat.recompute_module`][remat.recompute_module]).
    """

    __slots__ = ("spec",)

    def __init__(self, spec: Any) -> None:
        self.spec = spec

    def __call__(self, function: Any, *args: Any, **kwargs: Any) -> Any:
        from remat._engine import region

        name = _layer_name(function)
        return region.run(function, args, kwargs, self.spec, name=name)

    def __repr__(self) -> str:
        return f"remat.LayerCheckpoint({self.spec})"


def _layer_name(function: Any) -> str:
    """The class of the layer in ``partial(forward, layer)`` (5.24) or ``partial(layer.__call__)`` (5.17)."""
    if isinstance(function, functools.partial):
        candidates = (*function.args[:1], getattr(function.func, "__self__", None))
        for layer in candidates:
            if isinstance(layer, torch.nn.Module):
                return type(layer).__name__
    return "layer"


def _prefix_call_without_switch(model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """NOTE [A prefix cache under the switch]
    Hugging Face's switch drops the key/value cache in training (its layers set
    ``use_cache=False``, its models pass no cache), so a continuation trained on a
    prefix cache (``past_key_values`` from an earlier pass) gets a mask that covers
    prefix and new tokens with keys for the new ones only: a raw size error deep in
    attention (torch's checkpoint through the switch), or under another mask silently
    other attention. So remat's switch runs such a call with the switch off: its modules'
    ``gradient_checkpointing`` flags are cleared before the model's forward and set back
    after it (:func:`_switch_back`, an always-called hook). The call makes no region, so
    its backward re-runs nothing: it trains exactly as unmarked, keeping what the unmarked
    model keeps, and a warning says so once, naming ``remat.apply(model,
    where="blocks")``, which recomputes with the cache kept and guarded (NOTE [Cache of a
    marked layer])."""
    if not (model.training and torch.is_grad_enabled()):
        return
    cache = kwargs.get("past_key_values", kwargs.get("cache"))
    length = getattr(cache, "get_seq_length", None)
    if not (callable(length) and length() > 0):
        return
    switched = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    if not any(is_hf_layer(m) for m in switched):
        return
    for m in switched:
        m.gradient_checkpointing = False
    model.__dict__["_remat_prefix_switched"] = switched
    warnings.warn(
        f"remat.gradient_checkpointing_enable: {type(model).__name__} was called in training with "
        f"a past_key_values cache holding {length()} positions, which Hugging Face's switch "
        f"cannot recompute (it drops the cache in training); this call runs without recompute, "
        f"exactly as unmarked; use remat.apply(model, where='blocks') to recompute it with the "
        f"cache", UserWarning, stacklevel=2)


def _switch_back(model: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    """After a call :func:`_prefix_call_without_switch` ran with the switch off: set it back."""
    for m in model.__dict__.pop("_remat_prefix_switched", ()):
        m.gradient_checkpointing = True


def gradient_checkpointing_enable(model: torch.nn.Module, *, every: int = 1, **options: Any) -> list[str]:
    """Hugging Face's ``model.gradient_checkpointing_enable()``, recomputing with remat.

    Hugging Face's own switch (its layers, its cache handling, ``every_n_layers``),
    with remat's engine instead of ``torch.utils.checkpoint``: by default the same
    gradients and the same saved bytes as torch's; ``output_recompute=True`` keeps
    no layer output either (adjacent layers merge, NOTE [Output recompute]).

    Args:
        model: a transformers ``PreTrainedModel`` that supports gradient checkpointing.
        every: checkpoint every ``every``-th layer (Hugging Face's ``every_n_layers``).
        **options: ``use_reentrant`` (default False), ``output_recompute``, ``policy``,
            ``early_stop``, ``preserve_rng_state`` as for [`remat.recompute_module`][remat.recompute_module].

    Returns:
        The qualified names of the layers that recompute.

    Raises:
        TypeError: ``model`` has no ``gradient_checkpointing_enable``; a bad option.

    Examples:
        >>> import torch, remat
        >>> try:  # with a transformers model: remat.gradient_checkpointing_enable(model)
        ...     remat.gradient_checkpointing_enable(torch.nn.Linear(2, 2))
        ... except TypeError as err:
        ...     print(str(err).split(" (")[0])
        remat.gradient_checkpointing_enable: expected a Hugging Face PreTrainedModel
    """
    api = "remat.gradient_checkpointing_enable"
    if not callable(getattr(model, "_set_gradient_checkpointing", None)):
        raise TypeError(
            f"{api}: expected a Hugging Face PreTrainedModel (with gradient_checkpointing_enable), "
            f"got {type(model).__name__}; for any other model use remat.apply(model, where='blocks')"
        )
    spec = mark_from_keywords(api, options, keep_outputs=False)
    extra = {"every_n_layers": every} if every != 1 else {}
    kwargs = {"use_reentrant": spec.use_reentrant}
    if callable(getattr(model, "activation_checkpointing_enable", None)):  # its name since 5.x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, **extra)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs, **extra)
    model._set_gradient_checkpointing(
        enable=True, gradient_checkpointing_func=LayerCheckpoint(spec), **extra
    )
    if "_remat_prefix_guard" not in model.__dict__:  # NOTE [A prefix cache under the switch]
        model._remat_prefix_guard = (
            model.register_forward_pre_hook(_prefix_call_without_switch, with_kwargs=True),
            model.register_forward_hook(_switch_back, with_kwargs=True, always_call=True))
    return [n for n, m in model.named_modules()
            if getattr(m, "gradient_checkpointing", False) and is_hf_layer(m)]
