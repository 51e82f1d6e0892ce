"""Errors raised by remat (layer 1: no torch import).

User mistakes raise the builtin ``TypeError``/``ValueError`` with a message that
names the API, what was expected, what was found and the fix. A failure found
while rebuilding saved tensors raises :class:`RecomputeError`.
"""

from __future__ import annotations


class RecomputeError(RuntimeError):
    """A tensor rebuilt in backward differs from the one saved in forward.

    Raised when recomputation of a region saves a different number of tensors,
    or a tensor of another shape, dtype or device, than the original forward.
    The message names the region and the tensor; pass ``debug=True`` to print
    the operators run in forward and in recomputation side by side.

    Example:
        >>> import remat
        >>> issubclass(remat.RecomputeError, RuntimeError)
        True
    """

    __module__ = "remat"  # printed by its public name, remat.RecomputeError


#: ``torch.utils.checkpoint`` calls the same failure ``CheckpointError``.
CheckpointError = RecomputeError


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
