"""INT4 weights in the compressed-tensors ``pack-quantized`` layout (what K2.6 ships).

Layout of one linear with PyTorch weight W [O, I] (out, in):
  weight_packed  int32 [O, I/8]   eight 4-bit values per word along I, element j at bits 4j..4j+3
                                  (least significant first), each stored as the unsigned value q + 8
  weight_scale   bf16  [O, I/G]   one scale per group of G=32 consecutive inputs
  dequantised    w[o, i] = q[o, i] * scale[o, i // G],  q in [-8, 7]

Routed experts keep this layout in memory, stacked over experts: packed [E, O, I/8], scale [E, O, I/G].
"""

from __future__ import annotations

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
    if group.get("input_activations") is not None:
        raise ConfigError("activation quantization is not supported (weight-only INT4 expected)")
    num_bits = weights.get("num_bits")
    if num_bits != 4 or weights.get("type", "int") != "int":
        raise ConfigError(f"unsupported weight quantization num_bits={num_bits} type={weights.get('type')!r}")
    if not weights.get("symmetric", False):
        raise ConfigError("asymmetric INT4 (zero points) is not supported")
    if weights.get("strategy") != "group":
        raise ConfigError(f"unsupported quantization strategy {weights.get('strategy')!r}: only 'group'")
    group_size = int(weights.get("group_size") or 0)
    if group_size <= 0 or group_size % PACK_FACTOR:
        raise ConfigError(f"group_size {group_size} must be a positive multiple of {PACK_FACTOR}")
    return QuantConfig(num_bits=4, group_size=group_size, symmetric=True)


# ----------------------------------------------------------------------------------------------
# Pack / unpack (numpy on the host, jnp on the device: same bit layout)
# ----------------------------------------------------------------------------------------------
def pack_int4(q: np.ndarray) -> np.ndarray:
    """Packs int values in [-8, 7] of shape [..., I] (I % 8 == 0) into int32 [..., I/8]."""
    q = np.asarray(q)
    if q.shape[-1] % PACK_FACTOR:
        raise ValueError(f"last dim {q.shape[-1]} is not a multiple of {PACK_FACTOR}")
    if q.size and (q.min() < -8 or q.max() > 7):
        raise ValueError(f"int4 values must lie in [-8, 7], got [{q.min()}, {q.max()}]")
    u = (q.astype(np.int64) + INT4_OFFSET).astype(np.uint32)
    u = u.reshape(*q.shape[:-1], q.shape[-1] // PACK_FACTOR, PACK_FACTOR)
    shifts = (4 * np.arange(PACK_FACTOR, dtype=np.uint32))
    words = np.bitwise_or.reduce(u << shifts, axis=-1)
    return words.view(np.int32)


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


def quantize_int4(w: np.ndarray, group_size: int = 32):
    """Symmetric group quantization of w [..., O, I]: returns (packed int32, scale float32).

    scale = max|w| / 7.5 rounded as compressed-tensors does is not needed here: this is our own
    quantizer (used for tests and for training-to-INT4), q = clamp(round(w / s), -8, 7), s = max|w|/7.
    """
    w = np.asarray(w, np.float32)
    if w.shape[-1] % group_size:
        raise ValueError(f"in-dim {w.shape[-1]} is not a multiple of group_size {group_size}")
    g = w.reshape(*w.shape[:-1], w.shape[-1] // group_size, group_size)
    scale = np.abs(g).max(-1) / 7.0
    scale = np.where(scale == 0, 1.0, scale).astype(np.float32)
    q = np.clip(np.round(g / scale[..., None]), -8, 7).astype(np.int8).reshape(w.shape)
    return pack_int4(q), scale
