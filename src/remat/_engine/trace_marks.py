"""Marks that survive ``torch.compile``: functional regions traced into the graph (layer 2).

In eager mode a functional region (``remat.checkpoint``, ``remat.recompute``)
is run by the engine with saved-tensor hooks. While ``torch.compile`` traces,
hooks cannot work: the engine calls `run_marked` instead, which runs the
region plainly but under ``torch.fx.traceback.annotate``. Every node traced
inside then carries ``node.meta["custom"]["remat.region"]``, which Dynamo and
AOTAutograd copy onto the nodes of the joint forward/backward graph, where the
graph pass (``remat._graph``) reads it back with `region_of_meta`.

The annotation holds plain constants only (Dynamo cannot put a
`RegionSpec` object into node metadata), so the options are
encoded as a tuple and decoded back.

Examples:
    >>> import torch
    >>> from remat._vocab.spec import RegionSpec
    >>> from remat._engine.trace_marks import run_marked
    >>> run_marked(torch.sin, (torch.zeros(2),), {}, RegionSpec())
    tensor([0., 0.])
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any

import torch
import torch.fx.traceback as fx_traceback

from remat._vocab.policy import Policy
from remat._vocab.spec import RegionSpec

#: Key of the annotation under ``node.meta["custom"]``.
ANNOTATION_KEY = "remat.region"

_region_ids = itertools.count(1)


@torch._dynamo.assume_constant_result
def _next_region_id() -> int:
    # Evaluated once while Dynamo traces (the result is baked into the graph, no guard).
    return next(_region_ids)


def encode_spec(spec: RegionSpec) -> tuple:
    """Return the options the graph pass needs as a tuple of constants."""
    policy = spec.policy
    encoded_policy = (
        None
        if policy is None
        else (policy.name, tuple(sorted(policy.save_ops)), policy.save_everything,
              tuple(sorted(policy.save_calls)))
    )
    return (spec.output_recompute, spec.keep_outputs, spec.preserve_rng_state, encoded_policy)


@functools.lru_cache(maxsize=256)
def decode_spec(encoded: tuple) -> RegionSpec:
    """Rebuild the `RegionSpec` encoded by `encode_spec`."""
    output_recompute, keep_outputs, preserve_rng_state, encoded_policy = encoded
    policy = None
    if encoded_policy is not None:
        name, save_ops, save_everything, calls = encoded_policy
        policy = Policy(name, save_ops=frozenset(save_ops), save_everything=save_everything,
                        save_calls=frozenset(calls))
    return RegionSpec(
        output_recompute=output_recompute,
        keep_outputs=keep_outputs,
        preserve_rng_state=preserve_rng_state,
        policy=policy,
    )


def run_marked(
    fn: Callable[..., Any], args: tuple, kwargs: dict, spec: RegionSpec
) -> Any:
    """Run ``fn(*args, **kwargs)`` so that every node traced inside carries the mark ``spec``.

    Called by the engine instead of its saved-tensor hooks while
    ``torch.compiler.is_compiling()`` is true. Outside tracing it simply calls
    ``fn``. Each call is a separate region (its own output operators), even when
    two calls share ``spec``; nested calls: the innermost region's mark wins.

    Args:
        fn: the region's function (a module or a plain function).
        args: positional arguments of ``fn``.
        kwargs: keyword arguments of ``fn``.
        spec: the region's options (``output_recompute`` and ``policy`` are honoured
            by the graph pass; random operators are always kept, never replayed).

    Returns:
        Whatever ``fn`` returns.

    Examples:
        >>> import torch
        >>> from remat._vocab.spec import RegionSpec
        >>> from remat._engine.trace_marks import run_marked
        >>> run_marked(torch.add, (torch.ones(1), torch.ones(1)), {}, RegionSpec())
        tensor([2.])
    """
    if not torch.compiler.is_compiling():
        return fn(*args, **kwargs)
    annotation = {ANNOTATION_KEY: (_next_region_id(), encode_spec(spec))}
    with fx_traceback.annotate(annotation):
        return fn(*args, **kwargs)


def region_of_meta(meta: dict) -> tuple[int, RegionSpec] | None:
    """Return ``(region id, options)`` of the functional region a node was traced in, or None."""
    custom = meta.get("custom")
    if not isinstance(custom, dict) or ANNOTATION_KEY not in custom:
        return None
    region_id, encoded = custom[ANNOTATION_KEY]
    return region_id, decode_spec(encoded)
