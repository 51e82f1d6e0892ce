"""Hugging Face transformers: the key/value cache of a marked layer (front end).

NOTE [Cache of a marked layer]
With ``use_cache=True`` (the default of most Hugging Face configs), each decoder
layer appends its keys and values to the cache object it is given. Recomputing a
marked layer would append them a second time: a longer cache, wrong attention
in the re-run (with ``use_reentrant=True`` gradients silently wrong), or an error
(T5). Hugging Face's own ``gradient_checkpointing_enable`` turns the cache off
while training (``GradientCheckpointingLayer``). A mark does the same for a
transformers module called in training mode with grad enabled, with a one-time
warning: the model's cache is not written. But instead of no cache, the layer
gets a throwaway copy of the cache as it was when the layer was called, and its
recomputation another one: so forward and recomputation run exactly the code and
the tensor layouts of an unmarked layer (bitwise the same gradients; without a
cache, GPT-2's attention reads its keys in another memory layout). A cache whose
layers are written in place (``StaticCache``, quantized caches) cannot be copied
cheaply: the layer gets no cache and ``use_cache=False`` then, as in Hugging Face.
In evaluation, under ``no_grad`` and in ``generate`` the call is left as it is,
so the cache works there. Layers that only read the cache
(``_can_checkpoint_with_cache``) keep it, as in Hugging Face. transformers is never
imported here: modules and caches are recognized by their classes.

Example:
    >>> import torch
    >>> from remat._hf import guard_cache
    >>> guard_cache(torch.nn.Linear(2, 2), (), {"past_key_values": object()}) is None  # not transformers
    True
"""

from __future__ import annotations

import copy
import functools
import inspect
import warnings
from typing import Any

import torch

CACHE_OBJECTS = ("past_key_values", "past_key_value", "layer_past")
_warned: set[str] = set()


def is_transformers_module(module: torch.nn.Module) -> bool:
    """True when ``module``'s class, or one of its bases, comes from the transformers package."""
    return _from_transformers(type(module))


@functools.lru_cache(maxsize=1024)
def _from_transformers(cls: type) -> bool:
    return any(c.__module__.startswith("transformers.") for c in cls.__mro__)


@functools.lru_cache(maxsize=256)
def _parameters(cls: type) -> tuple[str, ...]:
    try:
        signature = inspect.signature(cls.forward)
    except (TypeError, ValueError):
        return ()
    return tuple(
        name for name, p in list(signature.parameters.items())[1:]
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    )


class CacheSnapshot:
    """The cache a marked layer was called with, as it was then (NOTE [Cache of a marked layer])."""

    __slots__ = ("cache",)

    def __init__(self, cache: Any) -> None:
        self.cache = cache

    def fresh(self) -> Any:
        """A throwaway copy for one run of the layer."""
        return _snapshot(self.cache)


def _is_dynamic_layer(layer: Any) -> bool:
    return any(c.__name__ == "DynamicLayer" for c in type(layer).__mro__) and not any(
        "Quantized" in c.__name__ for c in type(layer).__mro__
    )


def _snapshot(cache: Any) -> Any:
    """A copy of ``cache`` that a layer may append to, sharing its tensors; None if unsupported."""
    if all(hasattr(cache, a) for a in ("self_attention_cache", "cross_attention_cache", "is_updated")):
        parts = [_snapshot(cache.self_attention_cache), _snapshot(cache.cross_attention_cache)]
        if any(p is None for p in parts):
            return None
        new = copy.copy(cache)
        new.self_attention_cache, new.cross_attention_cache = parts
        new.is_updated = dict(cache.is_updated)
        return new
    layers = getattr(cache, "layers", None)
    if type(cache).__name__ != "DynamicCache" or not isinstance(layers, list):
        return None
    if not all(_is_dynamic_layer(layer) for layer in layers):
        return None
    new = copy.copy(cache)
    new.layers = [copy.copy(layer) for layer in layers]  # a layer rebinds its tensors on update
    return new


def fresh_caches(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Replace each :class:`CacheSnapshot` argument by a throwaway copy (for a re-run)."""
    if not any(isinstance(a, CacheSnapshot) for a in (*args, *kwargs.values())):
        return args, kwargs
    return (
        tuple(a.fresh() if isinstance(a, CacheSnapshot) else a for a in args),
        {k: v.fresh() if isinstance(v, CacheSnapshot) else v for k, v in kwargs.items()},
    )


def guard_cache(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """The arguments a marked layer's region records, the cache replaced; None to leave them.

    See NOTE [Cache of a marked layer]. Cache objects become :class:`CacheSnapshot`
    (the region's re-run and the forward call each take a copy: :func:`fresh_caches`),
    or, for a cache that cannot be copied, ``None`` with ``use_cache=False``.

    Args:
        module: the marked module being called.
        args, kwargs: its arguments.

    Returns:
        ``(args, kwargs)`` to record, or None when nothing changes (not training, grad
        disabled, not a transformers module, no cache passed).
    """
    if not (module.training and torch.is_grad_enabled() and is_transformers_module(module)):
        return None
    if getattr(module, "_can_checkpoint_with_cache", False):
        return None
    names = _parameters(type(module))
    new_args, new_kwargs = list(args), dict(kwargs)
    found: list[tuple[str, int | None, Any]] = []
    for name in CACHE_OBJECTS:
        if new_kwargs.get(name) is not None:
            found.append((name, None, new_kwargs[name]))
        elif name in names and names.index(name) < len(new_args) and new_args[names.index(name)] is not None:
            found.append((name, names.index(name), new_args[names.index(name)]))
    if not found:
        return None
    snapshots = [_snapshot(cache) for _, _, cache in found]
    copied = all(snap is not None for snap in snapshots)
    for (name, position, _), snap in zip(found, snapshots):
        value = CacheSnapshot(snap) if copied else None
        if position is None:
            new_kwargs[name] = value
        else:
            new_args[position] = value
    if not copied:
        if new_kwargs.get("use_cache"):
            new_kwargs["use_cache"] = False
        elif "use_cache" in names and names.index("use_cache") < len(new_args):
            new_args[names.index("use_cache")] = False
    _warn_once(type(module).__name__, copied)
    return tuple(new_args), new_kwargs


def _warn_once(name: str, copied: bool) -> None:
    if name in _warned:
        return
    _warned.add(name)
    how = ("each run of the layer appends to a throwaway copy" if copied
           else "the layer runs with use_cache=False and no cache")
    warnings.warn(
        f"remat: {name} is marked for recomputation and was called in training with a key/value "
        f"cache, which its recomputation would write a second time; so while training the "
        f"model's cache is not written ({how}), as with Hugging Face's gradient checkpointing; "
        f"evaluation and generate() use the cache",
        UserWarning,
        stacklevel=4,
    )


class LayerCheckpoint:
    """A ``gradient_checkpointing_func`` for Hugging Face layers that recomputes with remat.

    Called by a Hugging Face layer as ``func(partial(forward, layer, **kwargs), *args)``,
    the way it calls ``torch.utils.checkpoint.checkpoint``.

    Args:
        spec: the region options (see :func:`remat.recompute_module`).
    """

    __slots__ = ("spec",)

    def __init__(self, spec: Any) -> None:
        self.spec = spec

    def __call__(self, function: Any, *args: Any, **kwargs: Any) -> Any:
        from remat._engine import region

        layer = getattr(function, "args", (None,))[0] if isinstance(function, functools.partial) else None
        name = type(layer).__name__ if isinstance(layer, torch.nn.Module) else "layer"
        return region.run(function, args, kwargs, self.spec, name=name)

    def __repr__(self) -> str:
        return f"remat.LayerCheckpoint({self.spec})"


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
            ``early_stop``, ``preserve_rng_state`` as for :func:`remat.recompute_module`.

    Returns:
        The qualified names of the layers that recompute.

    Raises:
        TypeError: ``model`` has no ``gradient_checkpointing_enable``; a bad option.

    Example:
        >>> import torch, remat
        >>> try:  # with a transformers model: remat.gradient_checkpointing_enable(model)
        ...     remat.gradient_checkpointing_enable(torch.nn.Linear(2, 2))
        ... except TypeError as err:
        ...     print(str(err).split(" (")[0])
        remat.gradient_checkpointing_enable: expected a Hugging Face PreTrainedModel
    """
    from remat._marks import mark_from_keywords

    api = "remat.gradient_checkpointing_enable"
    if not callable(getattr(model, "_set_gradient_checkpointing", None)):
        raise TypeError(
            f"{api}: expected a Hugging Face PreTrainedModel (with gradient_checkpointing_enable), "
            f"got {type(model).__name__}; for any other model use remat.apply(model, where='blocks')"
        )
    spec = mark_from_keywords(api, options, keep_outputs=False)
    extra = {"every_n_layers": every} if every != 1 else {}
    model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": spec.use_reentrant}, **extra
    )
    model._set_gradient_checkpointing(
        enable=True, gradient_checkpointing_func=LayerCheckpoint(spec), **extra
    )
    return [n for n, m in model.named_modules()
            if getattr(m, "gradient_checkpointing", False) and _is_layer(m)]


def _is_layer(module: torch.nn.Module) -> bool:
    return any(c.__name__ == "GradientCheckpointingLayer" for c in type(module).__mro__)
