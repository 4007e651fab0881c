"""Argument checks shared by the public entry points (static: they read shapes and dtypes, so they also run
under jit, at trace time)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def as_int32(name: str, values, shape: tuple[int, ...] | None = None) -> jax.Array:
    """``values`` as an int32 array, refusing a non-integer dtype (a float id or position would be truncated
    without a word) and, when ``shape`` is given, any other shape; the ValueError names the argument."""
    values = jnp.asarray(values)
    if not jnp.issubdtype(values.dtype, jnp.integer):
        raise ValueError(f"{name} must be integers, got dtype {values.dtype}")
    if shape is not None and values.shape != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {values.shape}")
    return values.astype(jnp.int32)
