"""Argument checks shared by the public entry points (static: they read shapes and dtypes, so they also run
under jit, at trace time)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def is_number(value) -> bool:
    """A Python or numpy int or float, not a bool."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


def is_integer(value) -> bool:
    """A Python or numpy int, not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_token_id(value) -> bool:
    """An integer (``is_integer``) >= 0."""
    return is_integer(value) and value >= 0


def check_int(name: str, values, shape: tuple[int, ...] | None = None) -> None:
    """A ValueError naming ``name`` unless ``values`` has an integer dtype (a float id or position would be
    truncated without a word) and, when ``shape`` is given, that shape. Reads an array's shape and dtype
    without converting or moving it (lists are read through numpy)."""
    if not (hasattr(values, "shape") and hasattr(values, "dtype")):
        values = np.asarray(values)
    if not jnp.issubdtype(values.dtype, jnp.integer):
        raise ValueError(f"{name} must be integers, got dtype {values.dtype}")
    if shape is not None and tuple(values.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(values.shape)}")


INT32_RANGE = (-2**31, 2**31 - 1)


def as_int32(name: str, values, shape: tuple[int, ...] | None = None) -> jax.Array:
    """``values`` as an int32 array once ``check_int`` has passed it; a host value (list or numpy) outside int32's
    range is a ValueError naming ``name`` (a cast would wrap it: 2**32 + 3 read as 3). A JAX array is the caller's
    to keep in range (reading its values would move it to the host, and a traced one has none)."""
    check_int(name, values, shape)
    if not isinstance(values, jax.Array):
        host = np.asarray(values)
        low, high = INT32_RANGE
        if host.size and (host.min() < low or host.max() > high):
            bad = host.min() if host.min() < low else host.max()
            raise ValueError(f"{name} must lie in int32's range [-2**31, 2**31 - 1], got {bad}")
    return jnp.asarray(values).astype(jnp.int32)
