"""Exact top-k along the last axis, as ``lax.top_k`` (largest first, equal values lower index first),
in three ways, because XLA's GPU TopK is a full sort of each row once k > 16.

Shapes: M rows, N values a row, K kept, C chunks a row, S values a chunk (N padded to C * S).

* "sort":    ``lax.top_k``. On the H200 a whole-row sort: 5.6 us for the 384 router scores of one
             token (session 9), ~100 us for 7 rows of K2.6's 163 840-token vocabulary at K = 32, and a
             segmented radix sort of ~1.1 ms at 28 rows (session 32, inside the engine's round).
* "compare": each value's rank is the number of values that beat it, from [M, N, N] comparisons, then
             one match per kept rank; no sort, so XLA fuses it into a few kernels. For short rows.
* "chunked": for long rows and small K. Each chunk of S values is represented by its best value; the
             K best chunks (by their best value, then the lower chunk) hold the K best values, since a
             value outside them is beaten by K chunk bests. Their K * S values, in index order, then
             give the top K. Two small top-k's and one pass over the row instead of a sort of it.
* "auto":    "compare" while M * N^2 <= ``COMPARE_MAX_COMPARISONS``, "chunked" from
             ``CHUNKED_MIN_VALUES`` values a row while K * ``CHUNK`` <= N / 4, else "sort".

None of them is for NaN (a NaN compares false with everything); callers map NaN first. Nor do they agree on
signed zeros: ``lax.top_k`` ranks +0.0 above -0.0, "compare" and "chunked" tie them; a caller that needs one
order maps -0.0 to +0.0 first, with ``jnp.where`` (XLA folds ``x + 0.0`` away under jit, -0.0 and all).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

METHODS = ("auto", "sort", "compare", "chunked")
COMPARE_MAX_COMPARISONS = 16 * 384 * 384
"""16 tokens of K2.6's router: compare beat the sort up to there on the H200 (session 10: the router
9.0 against 11.4 us at one token, 30.2 against 30.8 at 33, 39.0 against 37.1 at 65)."""
CHUNKED_MIN_VALUES = 8192
CHUNK = 128


def descending_rank(values: jax.Array) -> jax.Array:
    """values [M, N] -> int32 [M, N]: each value's place in the row ordered largest first, equal
    values lower index first (0 = the top). [M, N, N] comparisons."""
    n = values.shape[-1]
    idx = jnp.arange(n, dtype=jnp.int32)
    mine, other = values[:, :, None], values[:, None, :]
    beats = (other > mine) | ((other == mine) & (idx[None, None, :] < idx[None, :, None]))
    return jnp.sum(beats, axis=-1, dtype=jnp.int32)


def resolve_method(rows: int, n: int, k: int, method: str = "auto") -> str:
    """The method "auto" picks for [rows, n] values and k kept (others are returned as given)."""
    if method not in METHODS:
        raise ValueError(f"top-k method must be one of {METHODS}, got {method!r}")
    if method != "auto":
        return method
    if rows * n * n <= COMPARE_MAX_COMPARISONS:
        return "compare"
    if n >= CHUNKED_MIN_VALUES and 4 * k * CHUNK <= n:
        return "chunked"
    return "sort"


def top_k(values: jax.Array, k: int, method: str = "auto", chunk: int = CHUNK):
    """values [M, N] -> (top values [M, K], their indices int32 [M, K]), exactly as ``lax.top_k``.

    method: one of ``METHODS`` (module docstring); chunk: S, the values a chunk for "chunked".
    Raises ValueError for a bad method, k outside [1, N], a chunk below 1, or values not [M, N].
    """
    if values.ndim != 2:
        raise ValueError(f"top_k takes values [M, N], got shape {values.shape}")
    m, n = values.shape
    if not 0 < k <= n:
        raise ValueError(f"k={k} must be in [1, {n}] (the values per row)")
    if chunk < 1:
        raise ValueError(f"chunk must be at least 1, got {chunk}")
    method = resolve_method(m, n, k, method)
    if method == "sort":
        top, indices = jax.lax.top_k(values, k)
        return top, indices.astype(jnp.int32)
    if method == "compare":
        rank = descending_rank(values)
        at_rank = rank[:, None, :] == jnp.arange(k, dtype=jnp.int32)[None, :, None]  # [M, K, N]
        indices = jnp.sum(jnp.where(at_rank, jnp.arange(n, dtype=jnp.int32), 0), axis=-1, dtype=jnp.int32)
        return jnp.take_along_axis(values, indices, axis=1), indices
    return _chunked_top_k(values, k, chunk)


def _chunked_top_k(values: jax.Array, k: int, chunk: int):
    m, n = values.shape
    c = -(-n // chunk)
    low = -jnp.inf if jnp.issubdtype(values.dtype, jnp.floating) else jnp.iinfo(values.dtype).min
    # Padding sits past every real index, so it only fills in after equal real values (-inf rows).
    padded = jnp.pad(values, ((0, 0), (0, c * chunk - n)), constant_values=low).reshape(m, c, chunk)
    kc = min(k, c)
    _, best_chunks = top_k(jnp.max(padded, axis=-1), kc)  # [M, kc]: the chunks holding the top K
    best_chunks = jnp.sort(best_chunks, axis=-1)  # index order, so the next top-k's ties go lower index first
    candidates = jnp.take_along_axis(padded, best_chunks[:, :, None], axis=1).reshape(m, kc * chunk)
    top, position = top_k(candidates, k)
    indices = jnp.take_along_axis(best_chunks, position // chunk, axis=1) * chunk + position % chunk
    return top, indices.astype(jnp.int32)
