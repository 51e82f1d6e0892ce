"""``set_context``, ``get_context``, ``set_seed`` and the execution modes.

The context is a small record of what the program asked for. ``mode`` decides
how `_prepare` runs a function: ``PYNATIVE_MODE`` runs it eagerly;
``GRAPH_MODE`` hands the function to ``remat.compile`` (once per function), so
the marks are applied by the graph pass and ``save_graphs`` writes its dumps.

Examples:
    >>> import remat.ms as mindspore
    >>> mindspore.set_context(mode=mindspore.PYNATIVE_MODE)
    >>> mindspore.get_context("mode") == mindspore.PYNATIVE_MODE
    True
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch

GRAPH_MODE = 0
PYNATIVE_MODE = 1

_DEVICE_TARGETS = ("CPU", "GPU", "Ascend")
_DEFAULTS: dict[str, Any] = {
    "mode": PYNATIVE_MODE,
    "save_graphs": False,
    "save_graphs_path": ".",
    "device_target": "CPU",
    "device_id": 0,
    "max_call_depth": 1000,
    "pynative_synchronize": False,
    "deterministic": "OFF",
}
_context: dict[str, Any] = dict(_DEFAULTS)


def set_context(**kwargs: Any) -> None:
    """Record execution options, as ``mindspore.set_context``.

    Args:
        **kwargs: ``mode`` (``GRAPH_MODE`` or ``PYNATIVE_MODE``),
            ``save_graphs`` (bool or 0-3: dump the graph in graph mode),
            ``save_graphs_path`` (folder of the dumps), ``device_target``
            ('CPU', 'GPU' or 'Ascend'; recorded only: tensors stay where torch
            puts them), ``device_id``, ``max_call_depth``,
            ``pynative_synchronize``, ``deterministic``.

    Raises:
        TypeError: an unknown keyword (the accepted ones are named).
        ValueError: an unknown mode or device target.

    Examples:
        >>> import remat.ms as mindspore
        >>> mindspore.set_context(mode=mindspore.PYNATIVE_MODE, save_graphs=False)
    """
    api = "remat.ms.set_context"
    unknown = sorted(k for k in kwargs if k not in _DEFAULTS)
    if unknown:
        raise TypeError(
            f"{api}: unknown keyword argument(s) {', '.join(map(repr, unknown))}; "
            f"accepted: {', '.join(_DEFAULTS)}"
        )
    if "mode" in kwargs and kwargs["mode"] not in (GRAPH_MODE, PYNATIVE_MODE):
        raise ValueError(
            f"{api}: 'mode' must be remat.ms.GRAPH_MODE (0) or remat.ms.PYNATIVE_MODE (1), "
            f"got {kwargs['mode']!r}"
        )
    if "device_target" in kwargs and kwargs["device_target"] not in _DEVICE_TARGETS:
        raise ValueError(
            f"{api}: 'device_target' must be one of {_DEVICE_TARGETS}, "
            f"got {kwargs['device_target']!r}"
        )
    save_graphs = kwargs.get("save_graphs", False)
    if not isinstance(save_graphs, (bool, int)) or save_graphs not in (0, 1, 2, 3):
        raise ValueError(f"{api}: 'save_graphs' must be a bool or 0-3, got {save_graphs!r}")
    _context.update(kwargs)


def get_context(key: str) -> Any:
    """Return one option recorded by `set_context`.

    Raises:
        ValueError: an unknown key (the accepted ones are named).

    Examples:
        >>> import remat.ms as mindspore
        >>> mindspore.get_context("device_target")
        'CPU'
    """
    if key not in _context:
        raise ValueError(
            f"remat.ms.get_context: unknown key {key!r}; accepted: {', '.join(_DEFAULTS)}"
        )
    return _context[key]


def set_seed(seed: int) -> None:
    """Seed torch, Python's ``random`` and numpy (when installed), as ``mindspore.set_seed``.

    Raises:
        TypeError: ``seed`` is not a non-negative int.

    Examples:
        >>> import torch, remat.ms as mindspore
        >>> mindspore.set_seed(1); a = torch.rand(1)
        >>> mindspore.set_seed(1); bool(torch.rand(1) == a)
        True
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise TypeError(f"remat.ms.set_seed: 'seed' must be a non-negative int, got {seed!r}")
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:
        return
    np.random.seed(seed)


def _prepare(fn: Callable) -> Callable:
    """Return how ``fn`` runs in the current mode: the one routing point of graph mode.

    PYNATIVE_MODE runs ``fn`` eagerly. GRAPH_MODE compiles ``fn`` with
    ``remat.compile`` (once per function; the marks are applied on the joint
    forward/backward graph) and, when ``save_graphs`` is set, dumps its graphs
    to ``save_graphs_path``.
    """
    if _context["mode"] != GRAPH_MODE:
        return fn
    from remat._graph.internal import compile_cached

    save_graphs = _context["save_graphs_path"] if _context["save_graphs"] else None
    return compile_cached(fn, save_graphs=save_graphs)
