"""Values read from a config.json that may come from a peer: each checked to be what the model
code takes, or a ValueError naming the key and showing (the start of) the value."""

from __future__ import annotations

import math
from typing import Any

_SHOWN_CHARS = 64  # of a bad value, in an error


def shown(value: Any) -> str:
    """repr(value), clipped: a peer's config.json may hold anything, of any length."""
    text = repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 3] + "..."


def whole(name: str, value: Any, low: int, high: int) -> int:
    """`value` as an int if it is a whole number (or its text) in low..high; else ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)) or isinstance(value, float) and not value.is_integer():
        raise ValueError(f"{name} {shown(value)} is not a whole number")
    try:
        number = int(value)
    except (ValueError, OverflowError):
        raise ValueError(f"{name} {shown(value)} is not a whole number") from None
    if not low <= number <= high:
        raise ValueError(f"{name} {shown(number)} is outside {low}..{high}")
    return number


def real(name: str, value: Any, zero: bool = False) -> float:
    """`value` as a finite float above 0 (or at least 0 with `zero`); else ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"{name} {shown(value)} is not a number")
    try:
        number = float(value)
    except (ValueError, OverflowError):
        raise ValueError(f"{name} {shown(value)} is not a number") from None
    if not math.isfinite(number) or number < 0 or number == 0 and not zero:
        raise ValueError(f"{name} {shown(value)} is not a finite number {'>= 0' if zero else '> 0'}")
    return number


def mapping(name: str, value: Any) -> dict[str, Any]:
    """`value` if it is a JSON object, {} for null or absent; else ValueError naming it."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{name} {shown(value)} is not a JSON object")
    return value


def as_list(name: str, value: Any) -> list:
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} {shown(value)} is not a list")
    return list(value)
