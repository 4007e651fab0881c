"""Host-facing target steps: validated prefill of ragged prompts and one-token decode.

These are the jit boundaries of the plain target model: the model crosses as ``nnx.split`` state
(a pytree of arrays), the graph definition and runtime are static, and the cache is donated.
Shapes: B streams, P padded prompt length, W vocab.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ddtree_jax.cache import LatentCache, commit
from ddtree_jax.model import Runtime, causal_mask, check_tokens

PROMPT_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144)


def bucket_length(n: int, buckets: Sequence[int] = PROMPT_BUCKETS) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"prompt length {n} exceeds the largest bucket {buckets[-1]}")


def pad_prompts(prompts: Sequence[Sequence[int]], *, vocab_size: int, capacity: int,
                reserve: int = 0, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Validates and right-pads prompts to a bucketed length.

    Returns tokens [B, P] int32 and lengths [B] int32. ``reserve`` cache slots must remain free after
    the prompt (e.g. one decode block); a prompt that does not fit is refused, never truncated.
    """
    if not prompts:
        raise ValueError("no prompts given")
    lengths = np.array([len(p) for p in prompts], np.int32)
    if (lengths == 0).any():
        raise ValueError(f"empty prompt at index {int(np.argmin(lengths))}")
    too_long = np.nonzero(lengths + reserve > capacity)[0]
    if too_long.size:
        i = int(too_long[0])
        raise ValueError(f"prompt {i} has {lengths[i]} tokens; with {reserve} reserved slots it does not fit "
                         f"the cache capacity {capacity}")
    for i, p in enumerate(prompts):
        check_tokens(np.asarray(p, np.int64), vocab_size) if len(p) else None
    width = min(bucket_length(int(lengths.max())), capacity)
    tokens = np.full((len(prompts), width), pad_id, np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    return tokens, lengths


@functools.partial(jax.jit, static_argnames=("graphdef", "runtime", "tap_layers"), donate_argnames=("cache",))
def prefill(graphdef: nnx.GraphDef, state: nnx.State, cache: LatentCache, tokens: jax.Array, lengths: jax.Array,
            *, runtime: Runtime = Runtime(), tap_layers: tuple[int, ...] = ()):
    """Runs padded prompts [B, P] on top of ``cache`` and commits the first lengths[b] rows per stream.

    Returns (last_logits [B, W] f32 at each prompt's last token, cache, overflow [B] bool,
    taps [n_taps, B, P, D] or None).
    """
    model = nnx.merge(graphdef, state)
    b, p = tokens.shape
    positions = cache.lengths[:, None] + jnp.arange(p)[None, :]
    out = model(tokens, positions, cache, causal_mask(b, p), tap_layers=tap_layers, runtime=runtime)
    rows = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    cache, overflow = commit(cache, out.block_kv, rows, lengths)
    last = jnp.take_along_axis(out.logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
    return last, cache, overflow, out.taps


@functools.partial(jax.jit, static_argnames=("graphdef", "runtime"), donate_argnames=("cache",))
def decode_step(graphdef: nnx.GraphDef, state: nnx.State, cache: LatentCache, tokens: jax.Array,
                *, runtime: Runtime = Runtime()):
    """One token per stream: tokens [B] -> (logits [B, W] f32, cache, overflow [B] bool)."""
    model = nnx.merge(graphdef, state)
    b = tokens.shape[0]
    out = model(tokens[:, None], cache.lengths[:, None], cache, causal_mask(b, 1), runtime=runtime)
    cache, overflow = commit(cache, out.block_kv, jnp.zeros((b, 1), jnp.int32), jnp.ones((b,), jnp.int32))
    return out.logits[:, 0], cache, overflow
