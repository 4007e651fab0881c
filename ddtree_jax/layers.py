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
from jax import lax


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


# Token rows a one-token product is padded to on CUDA (``dot``): two rows already leave XLA's one-row kernel.
ONE_TOKEN_PAD_ROWS = 2


def dot(x: jax.Array, w: jax.Array, spec: str, out_dtype=None) -> jax.Array:
    """einsum with f32 accumulation, result in ``out_dtype`` (default x.dtype).

    On CUDA a product of one token by a weight (every axis of x that is not contracted with w has size 1,
    and w shares no batch axis with x) runs padded with a zero row to ``ONE_TOKEN_PAD_ROWS`` tokens and
    sliced back. XLA compiles a one-row dot as a matrix-vector kernel; on the H200 (traced, weights
    rotated past L2; ``experiments/bench_skinny_gemm.py``, session 33) K2.6's q_b took 20.3 µs with one
    row and 12.8 with two, the shared expert's down projection 20.1 and 12.2, its gate 15.0 and 9.7, q_a
    13.5 and 8.6, kv_a 8.0 and 6.4, the output projection 33.2 and 29.0. Rows are independent, so the
    padding changes no result's value beyond the order of its f32 sum.
    """
    w = w.astype(x.dtype)
    out_dtype = x.dtype if out_dtype is None else out_dtype
    axis = _one_token_axis(spec, x.shape)
    if axis is None:
        return _plain_dot(x, w, spec, out_dtype)
    return lax.platform_dependent(x, w, cuda=lambda x, w: _padded_dot(x, w, spec, axis, out_dtype),
                                  default=lambda x, w: _plain_dot(x, w, spec, out_dtype))


def _plain_dot(x: jax.Array, w: jax.Array, spec: str, out_dtype) -> jax.Array:
    return jnp.einsum(spec, x, w, preferred_element_type=jnp.float32).astype(out_dtype)


def _padded_dot(x: jax.Array, w: jax.Array, spec: str, axis: tuple[int, int], out_dtype) -> jax.Array:
    """``_plain_dot`` of one token with x padded by zero rows along axis[0], the result sliced along axis[1]."""
    pads = [(0, 0)] * x.ndim
    pads[axis[0]] = (0, ONE_TOKEN_PAD_ROWS - 1)
    return lax.slice_in_dim(_plain_dot(jnp.pad(x, pads), w, spec, out_dtype), 0, 1, axis=axis[1])


def _one_token_axis(spec: str, x_shape: tuple[int, ...]) -> tuple[int, int] | None:
    """(axis of x, axis of the result) to pad for a one-token ``dot``, or None where ``spec`` is not a
    product of one token by a weight. A leading "..." counts as one "." label per axis it covers."""
    inputs, out = spec.replace(" ", "").split("->")
    x_labels, w_labels = inputs.split(",")
    ellipsis = len(x_shape) - len(x_labels) + 3 if x_labels.startswith("...") else 0

    def expand(labels: str) -> list[str]:
        return ["."] * ellipsis + list(labels[3:]) if labels.startswith("...") else list(labels)

    xs, outs = expand(x_labels), expand(out)
    token_axes = [i for i, label in enumerate(xs) if label not in w_labels]
    batch = [label for label in w_labels if label in xs and label in out]
    if not token_axes or batch or "." in w_labels or any(x_shape[i] != 1 for i in token_axes):
        return None
    first = token_axes[0]
    return first, (first if xs[first] == "." else outs.index(xs[first]))


class SwiGLU(nnx.Module):
    """down(silu(gate(x)) * up(x)); weights [D, F], [D, F], [F, D]."""

    def __init__(self, dim: int, hidden: int, dtype, rngs: nnx.Rngs, std: float = 0.02):
        self.gate = declare(rngs, (dim, hidden), ("embed", "ffn"), dtype, std=std)
        self.up = declare(rngs, (dim, hidden), ("embed", "ffn"), dtype, std=std)
        self.down = declare(rngs, (hidden, dim), ("ffn", "embed"), dtype, std=std)

    def __call__(self, x: jax.Array) -> jax.Array:
        return swiglu(x, self.gate.get_value(), self.up.get_value(), self.down.get_value())


def swiglu(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array, out_dtype=None) -> jax.Array:
    """down(silu(x gate) * x up): x [..., D], gate and up [D, F], down [F, D] -> [..., D] in ``out_dtype``
    (default x.dtype; f32 keeps the last product's sums unrounded, e.g. a partial sum over a slice of F)."""
    hidden = jax.nn.silu(dot(x, gate, "...d,df->...f")) * dot(x, up, "...d,df->...f")
    return dot(hidden, down, "...f,fd->...d", out_dtype)
