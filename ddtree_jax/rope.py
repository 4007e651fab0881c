"""Rotary position embeddings with YaRN scaling (as the HF reference computes them).

Two layouts share the same frequencies:
  * ``apply_rope_interleaved``: DeepSeek/Kimi MLA. Pairs (2i, 2i+1) rotate together; the result is
    returned de-interleaved ([even rotated | odd rotated]) exactly as transformers does, so cached
    rope keys and queries agree and dot products equal the interleaved form.
  * ``apply_rope_half``: Qwen3-style rotate-half (the DFlash drafter).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from ddtree_jax.config import RopeConfig, yarn_mscale


def rope_inv_freq(rope: RopeConfig, dim: int) -> tuple[np.ndarray, float]:
    """Inverse frequencies [dim/2] (float32) and the cos/sin amplitude ("attention factor")."""
    # theta ** (2i / dim) as transformers states it (a float32 base and exponent), rounded once from float64: numpy's
    # float32 power is off by up to 0.9 ulp on AVX-512 CPUs, torch's by up to 0.53, each its own way
    exponents = (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)).astype(np.float64)
    pos_freqs = (np.float64(np.float32(rope.theta)) ** exponents).astype(np.float32)
    inv_extra = (1.0 / pos_freqs).astype(np.float32)
    if rope.kind == "default":
        return inv_extra, 1.0
    inv_inter = (1.0 / (np.float32(rope.factor) * pos_freqs)).astype(np.float32)

    def correction_dim(num_rotations):
        return dim * math.log(rope.original_max_position / (num_rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low = max(math.floor(correction_dim(rope.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rope.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    extrapolation = (1 - ramp).astype(np.float32)
    inv_freq = (inv_inter * (1 - extrapolation) + inv_extra * extrapolation).astype(np.float32)
    return inv_freq, rope_attention_factor(rope)


def rope_attention_factor(rope: RopeConfig) -> float:
    if rope.kind != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return float(rope.attention_factor)
    if rope.mscale and rope.mscale_all_dim:
        return yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
    return yarn_mscale(rope.factor)


def rope_cos_sin(positions: jnp.ndarray, rope: RopeConfig, dim: int) -> tuple[jnp.ndarray, jnp.ndarray]:
    """positions [...] int -> cos, sin [..., dim/2] float32 (amplitude included)."""
    inv_freq, amplitude = rope_inv_freq(rope, dim)
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    return jnp.cos(angles) * amplitude, jnp.sin(angles) * amplitude


def apply_rope_interleaved(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """x [..., S, (heads...), R] with cos/sin [..., S, R/2] broadcast over the head axes in between.

    Returns [x_even*cos - x_odd*sin | x_odd*cos + x_even*sin] in x.dtype.
    """
    cos, sin = _broadcast(cos, x), _broadcast(sin, x)
    xf = x.astype(jnp.float32)
    even, odd = xf[..., 0::2], xf[..., 1::2]
    out = jnp.concatenate([even * cos - odd * sin, odd * cos + even * sin], axis=-1)
    return out.astype(x.dtype)


def apply_rope_half(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """Rotate-half RoPE: x [..., S, (heads...), Dh], cos/sin [..., S, Dh/2]."""
    cos, sin = _broadcast(cos, x), _broadcast(sin, x)
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    first, second = xf[..., :half], xf[..., half:]
    out = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return out.astype(x.dtype)


def _broadcast(table: jnp.ndarray, x: jnp.ndarray) -> jnp.ndarray:
    """Inserts singleton head axes so table [..., S, R/2] broadcasts against x [..., S, h..., R]."""
    extra = x.ndim - table.ndim
    return table.reshape(table.shape[:-1] + (1,) * extra + table.shape[-1:])
