"""The Mosaic GPU attention kernels' inputs, prepared in XLA (outside the kernels): the tree latents padded to
whole key blocks, the tree mask packed into per-row mask words, and the checks of both kernels' common inputs
(``mla_attention_mgpu.split_attention``, ``mla_attention_narrow.split_attention_narrow``; the prefix lengths' also
for ``tree_attention``).

Dimension letters: B streams, T tree nodes, S cache slots, C latent+rope width, R (Np) query rows,
TP tree keys padded to whole blocks of BK keys, K keys.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

WORD = 32  # tree keys per mask word

__all__ = ["pad_tree_latents", "tree_inputs", "check_in_place_inputs", "check_prefix_len", "pack_bits", "unpack_bits",
           "WORD"]


def pad_tree_latents(tree_kv, block_k: int = 64):
    """tree_kv [B, T, C] -> [B, TP, C], zero-padded to TP = T rounded up to whole ``block_k`` blocks, which the
    kernels read in place. The model pads its block latents this way, inside the fusion that produces them."""
    T = tree_kv.shape[1]
    return tree_kv if T % block_k == 0 else jnp.pad(tree_kv, ((0, 0), (0, -T % block_k), (0, 0)))


def tree_inputs(tree_kv, tree_mask, heads: int, rows: int, block_k: int = 64):
    """The tree's keys and mask words for the kernels (XLA, small; none of it per layer in the model).

    tree_kv [B, T', C] (T' >= T: the T latents, then padding rows, which must be finite), tree_mask
    [B, T, T] bool (diagonal True), ``heads`` H, ``rows`` R >= T*H query rows. Returns tree_keys [B, TP, C],
    TP = T rounded up to whole blocks (``tree_kv`` itself when T' == TP, else its first T rows and zeros), and
    tree_bits int32 [B, TP/32, R]: bit k of word w of row r says whether row r (node r // H) may see tree key
    32 w + k (padding rows see none). tree_bits depends on the mask alone, so in the model XLA computes it
    once per step for all layers; at T = 1 it is a constant (rows < H see key 0: the only mask a one-node
    tree may have)."""
    B, T, _ = tree_mask.shape
    TP = -(-T // block_k) * block_k
    if tree_kv.shape[1] != TP:
        tree_kv = jnp.pad(tree_kv[:, :T], ((0, 0), (0, TP - T), (0, 0)))
    row = np.arange(rows)
    if T == 1:
        words = np.zeros((B, TP // WORD, rows), np.int32)
        words[:, 0, :] = row < heads
        return tree_kv, jnp.asarray(words)
    sees = jnp.swapaxes(tree_mask, 1, 2)[:, :, np.minimum(row // heads, T - 1)] & (row < T * heads)  # [B, T, R]
    return tree_kv, pack_bits(jnp.pad(sees, ((0, 0), (0, TP - T), (0, 0))))


def check_prefix_len(prefix_len, B: int, S: int, name: str) -> None:
    """prefix_len must be [B] integers; where it is concrete, each in [0, S] (a traced one is clamped to it by the
    kernels and twins, as they cannot raise). Otherwise a ValueError naming ``name``."""
    if not (hasattr(prefix_len, "shape") and hasattr(prefix_len, "dtype")):
        raise ValueError(f"{name}: prefix_len must be an integer array [B]={B}, got a {type(prefix_len).__name__}")
    if prefix_len.shape != (B,):
        raise ValueError(f"{name}: prefix_len must be [B]={B}, got {prefix_len.shape}")
    if not jnp.issubdtype(prefix_len.dtype, jnp.integer):
        raise ValueError(f"{name}: prefix_len must be integers, got {prefix_len.dtype}")
    if not isinstance(prefix_len, jax.core.Tracer):
        plen = np.asarray(prefix_len)
        if plen.min(initial=0) < 0 or plen.max(initial=0) > S:
            raise ValueError(f"{name}: prefix_len must lie in [0, S={S}], got {plen.tolist()}")


def check_in_place_inputs(q_rows, cache_kv, prefix_len, tree_kv, tree_bits, block_k: int, name: str):
    """Checks of the kernels' common inputs (q_rows [B, R, C], cache_kv [B, S, C], prefix_len [B] integers in
    [0, S] (``check_prefix_len``), tree_kv [B, TP, C] with TP a positive multiple of ``block_k``, tree_bits int32
    [B, TP/32, R]): (B, R, C, S, TP) or a ValueError."""
    B, R, C = q_rows.shape
    S, TP = cache_kv.shape[1], tree_kv.shape[1]
    if cache_kv.shape != (B, S, C):
        raise ValueError(f"{name}: cache_kv {cache_kv.shape} must be [B, S, C] for B={B}, C={C}")
    check_prefix_len(prefix_len, B, S, name)
    if tree_kv.shape != (B, TP, C) or TP % block_k or TP == 0 or tree_bits.shape != (B, TP // WORD, R) \
            or tree_bits.dtype != jnp.int32:
        raise ValueError(f"{name}: tree_kv {tree_kv.shape} / tree_bits {tree_bits.dtype}{tree_bits.shape} must be "
                         f"[B, TP, C] with TP a positive multiple of block_k={block_k} and int32 [B, TP/{WORD}, {R}] "
                         f"for B={B}, C={C} (``tree_inputs``)")
    return B, R, C, S, TP


def pack_bits(visible):
    """visible bool [B, K, Np] (K % 32 == 0; key-major, so the bit sum writes its result as it is) -> int32
    [B, K/32, Np]: bit k of word w of row r is visible[:, 32 w + k, r]."""
    B, K, rows = visible.shape
    bits = visible.reshape(B, K // WORD, WORD, rows).astype(jnp.uint32) \
        << jnp.arange(WORD, dtype=jnp.uint32)[:, None]
    return lax.bitcast_convert_type(bits.sum(2, dtype=jnp.uint32), jnp.int32)


def unpack_bits(bits, keys: int):
    """Inverse of :func:`pack_bits`: int32 [B, K/32, Np] -> bool [B, Np, K] (row-major)."""
    k = jnp.arange(keys)
    bit = lax.shift_right_logical(bits[:, k // WORD, :], (k % WORD)[None, :, None]) & 1  # [B, K, Np]
    return jnp.swapaxes(bit == 1, 1, 2)
