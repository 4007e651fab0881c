"""The latent KV cache of absorbed MLA, as an explicit pytree with a fixed capacity.

Per layer and token it stores C = L + R values: the normalised KV latent (L = 512 for K2.6) and the
rotated shared rope key (R = 64). Shapes: NL layers, B streams, S capacity, T new tokens.

Writes never clamp: a stream whose write would pass the capacity is not written at all and is
reported in the returned ``overflow`` flags (``dynamic_update_slice`` would silently clamp; the
scatter here uses mode="drop" and the flags make the condition visible to the caller).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ddtree_jax.checks import as_int32
from ddtree_jax.config import ModelConfig

CACHE_AXES = ("layers", "batch", "seq", "kv_lora")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LatentCache:
    kv: jax.Array  # [NL, B, S, C]
    lengths: jax.Array  # [B] int32: committed tokens per stream

    @property
    def capacity(self) -> int:
        return self.kv.shape[2]

    @property
    def batch(self) -> int:
        return self.kv.shape[1]


def init_cache(cfg: ModelConfig, batch: int, capacity: int, dtype=None) -> LatentCache:
    if batch < 1 or capacity < 1:
        raise ValueError(f"cache needs batch >= 1 and capacity >= 1, got batch={batch} capacity={capacity}")
    dtype = jnp.dtype(dtype or cfg.dtype)
    kv = jnp.zeros((cfg.num_layers, batch, capacity, cfg.latent_dim), dtype)
    return LatentCache(kv=kv, lengths=jnp.zeros((batch,), jnp.int32))


def commit(cache: LatentCache, new_kv: jax.Array, rows: jax.Array, counts: jax.Array):
    """Appends chosen rows of a block's latents to each stream.

    new_kv [NL, B, T, C]: the latents the forward computed for the T block tokens.
    rows [B, R] int32 in [0, T): for stream b, rows[b, i] (i < counts[b]) is the block row written to
      slot lengths[b] + i (identity rows for prefill/decode; the accepted path for a verified tree).
    counts [B] int32 in [0, R].
    Returns (cache, overflow [B] bool): True for a stream whose write would pass the capacity, whose count
    lies outside [0, R], or whose rows[b, :counts[b]] leave [0, T) (traced, so it cannot raise); such a stream
    is left unchanged.
    """
    nl, b, s, c = cache.kv.shape
    if new_kv.ndim != 4 or new_kv.shape[:2] != (nl, b) or new_kv.shape[3] != c:
        raise ValueError(f"new_kv must be [NL, B, T, C] = [{nl}, {b}, T, {c}] like the cache, got {new_kv.shape}")
    rows = as_int32("rows", rows)
    if rows.ndim != 2 or rows.shape[0] != b:
        raise ValueError(f"rows must be [B, R] with B = {b}, got {rows.shape}")
    r, t = rows.shape[1], new_kv.shape[2]
    counts = as_int32("counts", counts, (b,))
    i = jnp.arange(r)[None, :]
    used = i < counts[:, None]  # [B, R]
    bad_rows = (used & ((rows < 0) | (rows >= t))).any(axis=1)
    overflow = (counts < 0) | (counts > r) | (cache.lengths + counts > cache.capacity) | bad_rows
    write = used & ~overflow[:, None]  # [B, R]
    slots = jnp.where(write, cache.lengths[:, None] + i, cache.capacity)  # out of range -> dropped
    safe_rows = jnp.where(write, rows, 0).astype(jnp.int32)  # unwritten entries may hold any value
    gathered = jnp.take_along_axis(new_kv, safe_rows[None, :, :, None], axis=2)  # [NL,B,R,C]
    batch_idx = jnp.broadcast_to(jnp.arange(b)[:, None], (b, r))
    kv = cache.kv.at[:, batch_idx, slots].set(gathered.astype(cache.kv.dtype), mode="drop")
    lengths = jnp.where(overflow, cache.lengths, cache.lengths + counts)
    return LatentCache(kv=kv, lengths=lengths.astype(jnp.int32)), overflow
