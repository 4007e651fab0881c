"""Small building blocks: parameter declaration with logical axes, RMSNorm, SwiGLU MLP.

Every weight is declared once, here or in a module's ``__init__``, as an ``nnx.Param`` carrying its
``logical_axes`` (names from ``ddtree_jax.sharding.LOGICAL_AXES``). Shardings, abstract restore
targets and checkpoint mapping are all derived from that one declaration.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx


def declare(rngs: nnx.Rngs | None, shape: Sequence[int], axes: Sequence[str | None], dtype,
            init: str = "normal", std: float = 0.02) -> nnx.Param:
    """One parameter: ``init`` in {"normal", "ones", "zeros"}; ``rngs`` may be None for ones/zeros."""
    if len(shape) != len(axes):
        raise ValueError(f"shape {tuple(shape)} and logical axes {tuple(axes)} differ in rank")
    if init == "normal":
        value = (std * jax.random.normal(rngs.params(), tuple(shape), jnp.float32)).astype(dtype)
    elif init == "ones":
        value = jnp.ones(tuple(shape), dtype)
    elif init == "zeros":
        value = jnp.zeros(tuple(shape), dtype)
    else:
        raise ValueError(f"unknown init {init!r}")
    return nnx.Param(value, logical_axes=tuple(axes))


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """HF semantics: normalise in f32, cast back to x.dtype, then multiply by the weight."""
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype, axis_name: str | None = None):
        self.weight = declare(None, (dim,), (axis_name,), dtype, init="ones")
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight.get_value(), self.eps)


def dot(x: jax.Array, w: jax.Array, spec: str) -> jax.Array:
    """einsum with f32 accumulation, result in x.dtype."""
    return jnp.einsum(spec, x, w.astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)


class SwiGLU(nnx.Module):
    """down(silu(gate(x)) * up(x)); weights [D, F], [D, F], [F, D]."""

    def __init__(self, dim: int, hidden: int, dtype, rngs: nnx.Rngs, std: float = 0.02):
        self.gate = declare(rngs, (dim, hidden), ("embed", "ffn"), dtype, std=std)
        self.up = declare(rngs, (dim, hidden), ("embed", "ffn"), dtype, std=std)
        self.down = declare(rngs, (hidden, dim), ("ffn", "embed"), dtype, std=std)

    def __call__(self, x: jax.Array) -> jax.Array:
        gate = dot(x, self.gate.get_value(), "...d,df->...f")
        up = dot(x, self.up.get_value(), "...d,df->...f")
        return dot(jax.nn.silu(gate) * up, self.down.get_value(), "...f,fd->...d")
