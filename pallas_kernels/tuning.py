"""The kernels' integer tuning values, checked alike everywhere (the Triton and Mosaic GPU kernels and their twins)."""

from __future__ import annotations

import operator

__all__ = ["tuning_int"]


def tuning_int(name: str, value, *, positive: bool = False) -> int:
    """``value`` as a Python int (any integer scalar, not a bool or a float; with ``positive``, >= 1), else a
    ValueError naming ``name``."""
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)
    except TypeError:
        number = None
    if number is None or (positive and number < 1):
        raise ValueError(f"{name}={value!r} must be {'a positive int' if positive else 'an int'}")
    return number
