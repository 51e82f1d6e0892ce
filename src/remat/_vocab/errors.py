"""Errors raised by remat (layer 1: no torch import).

User mistakes raise the builtin ``TypeError``/``ValueError`` with a message that
names the API, what was expected, what was found and the fix. A failure found
while rebuilding saved tensors raises ``remat.RecomputeError``, which is torch's
``CheckpointError`` too and so lives in the engine (``_engine/errors.py``).
"""

from __future__ import annotations


def describe(obj: object) -> str:
    """Name ``obj`` for an error message: its kind and name, e.g. ``function 'f'``."""
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    kind = type(obj).__name__
    if name is None:
        return f"{kind} object"
    if kind in ("function", "builtin_function_or_method", "method"):
        return f"{kind} '{name}'"
    return f"{kind} '{name}'" if isinstance(obj, type) else f"{kind} object"


def check_bool(api: str, name: str, value: object) -> bool:
    """Return ``value`` if it is a bool, else raise a ``TypeError`` that names ``api``."""
    if not isinstance(value, bool):
        raise TypeError(
            f"{api}: '{name}' must be a bool, got {type(value).__name__} {value!r}; "
            f"pass True or False"
        )
    return value


def check_keywords(api: str, given: dict, accepted: tuple[str, ...]) -> None:
    """Raise a ``TypeError`` naming ``api`` and the accepted keywords for any unknown key."""
    unknown = sorted(k for k in given if k not in accepted)
    if unknown:
        raise TypeError(
            f"{api}: unknown keyword argument(s) {', '.join(map(repr, unknown))}; "
            f"accepted: {', '.join(accepted)}"
        )
