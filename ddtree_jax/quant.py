"""INT4 weights in the compressed-tensors ``pack-quantized`` layout (what K2.6 ships).

Layout of one linear with PyTorch weight W [O, I] (out, in):
  weight_packed  int32 [O, I/8]   eight 4-bit values per word along I, element j at bits 4j..4j+3
                                  (least significant first), each stored as the unsigned value q + 8
  weight_scale   bf16  [O, I/G]   one scale per group of G=32 consecutive inputs
  dequantised    w[o, i] = q[o, i] * scale[o, i // G],  q in [-8, 7]

Routed experts keep this layout in memory, stacked over experts: packed [E, O, I/8], scale [E, O, I/G].
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PACK_FACTOR = 8  # int4 values per int32 word
INT4_OFFSET = 8


def parse_quantization_config(raw: dict[str, Any] | None):
    """Reads an HF ``quantization_config``; returns a QuantConfig or None (unquantized).

    Only compressed-tensors ``pack-quantized`` symmetric INT4 with group strategy is accepted; any
    other format is refused with a message that names it.
    """
    from ddtree_jax.config import ConfigError, QuantConfig

    if not raw:
        return None
    method = raw.get("quant_method")
    if method != "compressed-tensors":
        raise ConfigError(f"unsupported quant_method {method!r}: only 'compressed-tensors' pack-quantized int4")
    fmt = raw.get("format")
    if fmt != "pack-quantized":
        raise ConfigError(f"unsupported compressed-tensors format {fmt!r}: only 'pack-quantized'")
    groups = raw.get("config_groups") or {}
    if len(groups) != 1:
        raise ConfigError(f"expected exactly one compressed-tensors config group, found {len(groups)}")
    (group,) = groups.values()
    weights = group.get("weights") or {}
    for key in ("input_activations", "output_activations"):
        if group.get(key) is not None:
            raise ConfigError(f"activation quantization is not supported ({key} {group[key]}; weight-only INT4 "
                              "expected)")
    if group.get("format") not in (None, "pack-quantized"):
        raise ConfigError(f"unsupported config group format {group['format']!r}: only 'pack-quantized'")
    for key in ("kv_cache_scheme", "sparsity_config", "moe_sparsity_config", "transform_config"):
        if raw.get(key):  # each would change the numbers; none is implemented, so none may pass unread
            raise ConfigError(f"quantization_config {key} is not supported, got {raw[key]}")
    num_bits = weights.get("num_bits")
    if num_bits != 4 or weights.get("type", "int") != "int":
        raise ConfigError(f"unsupported weight quantization num_bits={num_bits} type={weights.get('type')!r}")
    if not weights.get("symmetric", True):  # absent: compressed-tensors' default, symmetric
        raise ConfigError("asymmetric INT4 (zero points) is not supported")
    if weights.get("dynamic"):
        raise ConfigError("dynamic weight quantization is not supported (stored scales expected)")
    if weights.get("actorder") is not None:
        raise ConfigError(f"activation ordering actorder={weights['actorder']!r} is not supported")
    # absent with a group size: compressed-tensors infers the group strategy
    strategy = weights.get("strategy") or ("group" if weights.get("group_size") else None)
    if strategy != "group":
        raise ConfigError(f"unsupported quantization strategy {weights.get('strategy')!r}: only 'group'")
    group_size = int(weights.get("group_size") or 0)
    if group_size <= 0 or group_size % PACK_FACTOR:
        raise ConfigError(f"group_size {group_size} must be a positive multiple of {PACK_FACTOR}")
    return QuantConfig(num_bits=4, group_size=group_size, symmetric=True)


# ----------------------------------------------------------------------------------------------
# Pack / unpack (numpy on the host, jnp on the device: same bit layout)
# ----------------------------------------------------------------------------------------------
def pack_int4(q):
    """Packs int values in [-8, 7] of shape [..., I] (I % 8 == 0) into int32 [..., I/8] (numpy or jax)."""
    xp = np if isinstance(q, np.ndarray) else jnp
    if q.shape[-1] % PACK_FACTOR:
        raise ValueError(f"last dim {q.shape[-1]} is not a multiple of {PACK_FACTOR}")
    if xp is np and q.size and (q.min() < -8 or q.max() > 7):
        raise ValueError(f"int4 values must lie in [-8, 7], got [{q.min()}, {q.max()}]")
    u = (q.astype(xp.int32) + INT4_OFFSET).astype(xp.uint32)
    u = u.reshape(*q.shape[:-1], q.shape[-1] // PACK_FACTOR, PACK_FACTOR)
    words = (u << (4 * xp.arange(PACK_FACTOR, dtype=xp.uint32))).sum(axis=-1, dtype=xp.uint32)  # disjoint bits
    return words.view(xp.int32) if xp is np else jax.lax.bitcast_convert_type(words, jnp.int32)


def unpack_int4(packed) -> jax.Array:
    """int32 [..., I/8] -> int8 [..., I] with values in [-8, 7]. Works on numpy or jax arrays."""
    xp = np if isinstance(packed, np.ndarray) else jnp
    shifts = 4 * xp.arange(PACK_FACTOR, dtype=xp.int32)
    nibbles = (packed[..., None] >> shifts) & 0xF  # arithmetic shift is fine: we mask 4 bits
    q = (nibbles - INT4_OFFSET).astype(xp.int8)
    return q.reshape(*packed.shape[:-1], packed.shape[-1] * PACK_FACTOR)


def dequantize_int4(packed, scale, dtype=jnp.float32) -> jax.Array:
    """packed int32 [..., O, I/8], scale [..., O, I/G] -> weight [..., O, I] in ``dtype``."""
    q = unpack_int4(packed)
    group = q.shape[-1] // scale.shape[-1]
    xp = np if isinstance(packed, np.ndarray) and isinstance(scale, np.ndarray) else jnp
    qf = q.reshape(*q.shape[:-1], scale.shape[-1], group).astype(xp.float32)
    w = qf * scale.astype(xp.float32)[..., None]
    return w.reshape(q.shape).astype(dtype)


def quantize_int4(w, group_size: int = 32):
    """Symmetric group quantization of w [..., O, I] (numpy or jax): returns (packed int32, scale f32).

    Our own quantizer (tests, trained-model export): s = max|w| / 7 per group, q = clamp(round(w/s), -8, 7).
    """
    xp = np if isinstance(w, np.ndarray) else jnp
    w = w.astype(xp.float32)
    if w.shape[-1] % group_size:
        raise ValueError(f"in-dim {w.shape[-1]} is not a multiple of group_size {group_size}")
    g = w.reshape(*w.shape[:-1], w.shape[-1] // group_size, group_size)
    scale = xp.abs(g).max(-1) / 7.0
    scale = xp.where(scale == 0, 1.0, scale).astype(xp.float32)
    q = xp.clip(xp.round(g / scale[..., None]), -8, 7).astype(xp.int8).reshape(w.shape)
    return pack_int4(q), scale


# ----------------------------------------------------------------------------------------------
# The quantized-array pytree consumed by the expert matmuls
# ----------------------------------------------------------------------------------------------
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantArray:
    """INT4 weight stack in the compressed-tensors layout.

    packed int32 [..., O, I/8]; scale [..., O, I/G] (bf16 in checkpoints). ``shape`` is the logical
    [..., O, I] shape. Leading dims (e.g. experts) index both arrays alike.
    """

    packed: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.packed.shape[:-1]) + (self.packed.shape[-1] * PACK_FACTOR,)

    @property
    def group_size(self) -> int:
        return self.shape[-1] // self.scale.shape[-1]

    @property
    def nbytes(self) -> int:
        return self.packed.size * 4 + self.scale.size * self.scale.dtype.itemsize

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return dequantize_int4(self.packed, self.scale, dtype)


def expert_slice(w, e, dtype) -> jax.Array:
    """The [O, I] weight of expert ``e`` (a traced index) of a float stack, a QuantArray, or a
    kernel-layout stack (``pallas_kernels.int4_moe.PlanarInt4``: same values), in ``dtype``."""
    if isinstance(w, QuantArray):
        return dequantize_int4(w.packed[e], w.scale[e], dtype)
    if hasattr(w, "dequantize_expert"):
        return w.dequantize_expert(e, dtype)
    return w[e].astype(dtype)


def quantize_array(w, group_size: int = 32, scale_dtype=jnp.bfloat16) -> QuantArray:
    """Float weight [..., O, I] -> QuantArray (our symmetric group quantizer)."""
    scale = quantize_int4(w, group_size)[1].astype(scale_dtype)
    # quantize against the stored (rounded) scale so dequantisation reproduces exactly what we packed
    xp = np if isinstance(w, np.ndarray) else jnp
    g = w.astype(xp.float32).reshape(*w.shape[:-1], scale.shape[-1], group_size)
    q = xp.clip(xp.round(g / scale.astype(xp.float32)[..., None]), -8, 7).astype(xp.int8).reshape(w.shape)
    return QuantArray(jnp.asarray(pack_int4(q)), jnp.asarray(scale))
