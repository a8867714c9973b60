"""Argument checks shared by every layer: a clear TypeError or ValueError that names the argument.

This module sits at the bottom of the package (it imports nothing from it), so patterns, ops, the engine,
the distributed layer and the lab helpers can all use it.
"""

from __future__ import annotations

import math
import numbers


def check_int(name: str, value, *, minimum: int = 1, allow_none: bool = False) -> int | None:
    """``value`` as an int >= ``minimum`` (None passes when ``allow_none``); bools are refused."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    return int(value)


def check_finite(name: str, value, *, positive: bool) -> float:
    """``value`` as a Python float: a finite real number, > 0 when ``positive`` else >= 0; bools are refused
    (a NumPy or torch scalar comes back as a float, which JSON can hold)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise ValueError(f"{name} must be a finite number {'> 0' if positive else '>= 0'}, got {value}")
    return float(value)


def check_in_range(name: str, value, low: float, high: float, *, open_low: bool = False) -> float:
    """``value`` as a Python float in ``[low, high]`` (``(low, high]`` when ``open_low``); NaN and infinities
    are refused even when ``high`` is infinite, and so are bools."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or not low <= value <= high or (open_low and value == low):
        raise ValueError(f"{name} must lie in {'(' if open_low else '['}{low:g}, {high:g}], got {value}")
    return float(value)
