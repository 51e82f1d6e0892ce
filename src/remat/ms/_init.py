"""Weight initializers named as in MindSpore (``weight_init='he_uniform'`` and friends).

MindSpore looks names up case-insensitively, with or without underscores
(``'TruncatedNormal'``, ``'truncatednormal'``, ``'xavier_uniform'``,
``'XavierUniform'``). Each name maps to MindSpore's default parameters:
``normal`` is N(0, 0.01), ``uniform`` is U(-0.07, 0.07), ``truncatednormal`` is
N(0, 0.01) cut at two sigma, ``he_uniform``/``he_normal`` use fan-in and
leaky-relu gain with slope 0, ``xavier_*`` use gain 1.

Examples:
    >>> import torch
    >>> from remat.ms._init import initialize
    >>> w = torch.empty(2, 3)
    >>> initialize("remat.ms.nn.Dense", "weight_init", w, "ones").sum().item()
    6.0
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn import init

_Fill = Callable[[torch.Tensor], Any]

_INITIALIZERS: dict[str, _Fill] = {
    "zeros": init.zeros_,
    "ones": init.ones_,
    "normal": lambda w: init.normal_(w, mean=0.0, std=0.01),
    "uniform": lambda w: init.uniform_(w, -0.07, 0.07),
    "truncatednormal": lambda w: init.trunc_normal_(w, std=0.01, a=-0.02, b=0.02),
    "heuniform": lambda w: init.kaiming_uniform_(w, a=0.0, mode="fan_in"),
    "henormal": lambda w: init.kaiming_normal_(w, a=0.0, mode="fan_in"),
    "xavieruniform": init.xavier_uniform_,
    "xaviernormal": init.xavier_normal_,
    "orthogonal": init.orthogonal_,
    "identity": init.eye_,
}
_ALIASES = {"zero": "zeros", "one": "ones", "eye": "identity"}

#: The names ``weight_init``/``bias_init`` accept, for error messages and docs.
INITIALIZER_NAMES = (
    "zeros", "ones", "normal", "uniform", "TruncatedNormal", "he_uniform", "he_normal",
    "xavier_uniform", "xavier_normal", "orthogonal", "identity",
)  # fmt: skip


def _lookup(name: str) -> _Fill | None:
    key = name.lower().replace("_", "")
    key = _ALIASES.get(key, key)
    return _INITIALIZERS.get(key)


@torch.no_grad()
def initialize(api: str, arg: str, weight: torch.Tensor, spec: Any) -> torch.Tensor:
    """Fill ``weight`` in place as ``spec`` says, and return it.

    Args:
        api: the calling API, named in errors (e.g. ``"remat.ms.nn.Conv2d"``).
        arg: the argument name, named in errors (e.g. ``"weight_init"``).
        weight: the parameter to fill.
        spec: an initializer name, a number (every element gets it), or a
            tensor / numpy array of the parameter's shape.

    Returns:
        ``weight``.

    Raises:
        ValueError: an unknown name, or a tensor of another shape.
        TypeError: ``spec`` is of another kind.
    """
    if isinstance(spec, str):
        fill = _lookup(spec)
        if fill is None:
            raise ValueError(
                f"{api}: unknown {arg} {spec!r}; accepted names: {', '.join(INITIALIZER_NAMES)}, "
                f"or a number, or a Tensor of shape {list(weight.shape)}"
            )
        fill(weight)
    elif isinstance(spec, (int, float)) and not isinstance(spec, bool):
        weight.fill_(spec)
    elif torch.is_tensor(spec) or hasattr(spec, "__array__"):
        value = torch.as_tensor(spec)
        if tuple(value.shape) != tuple(weight.shape):
            raise ValueError(
                f"{api}: {arg} has shape {list(value.shape)}, the parameter needs "
                f"{list(weight.shape)}; pass a Tensor of that shape or an initializer name"
            )
        weight.copy_(value)
    else:
        raise TypeError(
            f"{api}: {arg} must be an initializer name such as 'he_uniform', a number or a "
            f"Tensor, got {type(spec).__name__}"
        )
    return weight
