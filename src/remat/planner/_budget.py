"""Read a memory budget, the one way ``remat.plan`` and ``remat plan --budget`` do (layer 4).

A budget is bytes or a fraction of the step's peak without recompute:

============================== ===================================
given                          means
============================== ===================================
``int`` ``4_000_000_000``      bytes
``float`` ``0.6``              60% of the no-recompute peak
``"60%"``, ``"0.6"``, ``"1"``  60%, 60%, 100% (a number up to 1)
``"2GiB"``, ``"512MB"``        bytes (binary ``KiB``..``TiB``, decimal ``KB``..``TB``)
``"4000000000"``, ``"4e9"``    bytes (a whole number above 1)
============================== ===================================
"""

from __future__ import annotations

import re
from typing import Any

API = "remat.plan"
UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
         "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_NUMBER = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z%]*)\s*")
_HOW = "write e.g. '2GiB', '512MB', '60%' or '0.6' (a fraction of the no-recompute peak)"


def parse_budget(budget: Any, api: str = API) -> tuple[float, bool]:
    """Read ``budget`` as ``(bytes, False)`` or ``(fraction of the no-recompute peak, True)``.

    Args:
        budget: bytes (int), a fraction in (0, 1] (float), or a string: ``"60%"``,
            ``"0.6"``, ``"2GiB"``, ``"512MB"``, ``"4000000000"``.
        api: the function named in errors.

    Returns:
        ``(value, fractional)``.

    Raises:
        TypeError: not an int, float or string.
        ValueError: a string that is not a budget, a fraction outside (0, 1], a non-positive size.

    Examples:
        >>> from remat.planner import parse_budget
        >>> parse_budget("0.6"), parse_budget("60%"), parse_budget("2GiB")
        ((0.6, True), (0.6, True), (2147483648.0, False))
    """
    if isinstance(budget, bool) or not isinstance(budget, (int, float, str)):
        raise TypeError(f"{api}: budget must be bytes (int), a fraction (float in (0, 1]) of the "
                        f"no-recompute peak, or a string; {_HOW}; got {budget!r}")
    if isinstance(budget, float):
        return _fraction(budget, budget, api)
    if isinstance(budget, int):
        return _bytes(budget, budget, api)
    match = _NUMBER.fullmatch(budget)
    unit = match.group(2).upper() if match else None
    if match is None or (unit not in UNITS and unit not in ("", "%")):
        raise ValueError(f"{api}: cannot read budget {budget!r}; {_HOW}")
    value = float(match.group(1))
    if unit == "%":
        return _fraction(value / 100, budget, api)
    if unit == "" and value <= 1:
        return _fraction(value, budget, api)
    if unit == "" and value != int(value):
        raise ValueError(f"{api}: budget {budget!r} is neither a fraction in (0, 1] nor whole bytes; {_HOW}")
    if unit == "" and value <= 100:  # "60": a share in percent, or really 60 bytes?
        raise ValueError(f"{api}: budget {budget!r} has no unit; did you mean '{match.group(1)}%' "
                         f"(of the no-recompute peak) or '{match.group(1)}B' (bytes)? {_HOW}")
    return _bytes(value * UNITS[unit or "B"], budget, api)


def _fraction(value: float, given: Any, api: str) -> tuple[float, bool]:
    if not 0 < value <= 1:
        raise ValueError(f"{api}: a fractional budget must be in (0, 1] of the no-recompute peak, "
                         f"got {given!r}; pass bytes as an int or a string such as '6GiB'")
    return value, True


def _bytes(value: float, given: Any, api: str) -> tuple[float, bool]:
    if value <= 0:
        raise ValueError(f"{api}: budget must be positive, got {given!r}")
    return float(value), False
