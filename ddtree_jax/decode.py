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
from ddtree_jax.checks import as_int32, check_int
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
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (Sequence, np.ndarray)):
        raise ValueError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError("no prompts given")
    prompts = [_token_ids(p, i) for i, p in enumerate(prompts)]
    lengths = np.array([len(p) for p in prompts], np.int32)
    if (lengths == 0).any():
        raise ValueError(f"empty prompt at index {int(np.argmin(lengths))}")
    too_long = np.nonzero(lengths + reserve > capacity)[0]
    if too_long.size:
        i = int(too_long[0])
        raise ValueError(f"prompt {i} has {lengths[i]} tokens; with {reserve} reserved slots it does not fit "
                         f"the cache capacity {capacity}")
    for p in prompts:
        check_tokens(p.astype(np.int64), vocab_size)
    return pad_checked(prompts, capacity=capacity, pad_id=pad_id)


def pad_checked(prompts: Sequence[np.ndarray], *, capacity: int, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``pad_prompts``' padding alone, of prompts it has checked (1-D id arrays that fit): tokens [B, P] int32
    (P the longest's bucket, at most ``capacity``) and lengths [B] int32."""
    lengths = np.array([len(p) for p in prompts], np.int32)
    width = min(bucket_length(int(lengths.max())), capacity)
    tokens = np.full((len(prompts), width), pad_id, np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    return tokens, lengths


def _token_ids(prompt, index: int) -> np.ndarray:
    """One prompt as a 1-D integer array; ValueError for text, floats, bools or nesting (never truncated)."""
    problem = f"prompt {index} must be a list of integer token ids (a list of lists for several prompts), got "
    if isinstance(prompt, (str, bytes)):
        raise ValueError(problem + f"{prompt!r:.80}")
    try:
        ids = np.asarray(prompt)
    except ValueError:  # ragged nesting
        raise ValueError(problem + f"{prompt!r:.80}") from None
    if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
        raise ValueError(problem + f"{prompt!r:.80}")
    return ids


def prefill(graphdef: nnx.GraphDef, state: nnx.State, cache: LatentCache, tokens: jax.Array, lengths: jax.Array,
            *, runtime: Runtime = Runtime(), tap_layers: tuple[int, ...] = ()):
    """Runs padded prompts [B, P] on top of ``cache`` and commits the first lengths[b] rows per stream.

    Returns (last_logits [B, W] f32 at each prompt's last token, cache, overflow [B] bool,
    taps [n_taps, B, P, D] or None). ``pad_prompts`` makes valid inputs. Every id of ``tokens``, padding
    included, must lie in [0, W): host ids (numpy, lists) are checked here (``check_tokens``, ValueError).
    Device arrays are not read back (that would stall a decode loop) and traced ones cannot raise: a stream
    with an id outside [0, W), negative ones included, gets NaN logits (its rows are written, as NaN), and
    a stream whose length lies outside [1, P] is flagged in ``overflow``, not written, and gets NaN logits.
    """
    if np.ndim(tokens) != 2 or np.shape(tokens)[0] != cache.batch:
        raise ValueError(f"tokens must be [B, P] with B = {cache.batch} (the cache's streams), got {np.shape(tokens)}")
    check_int("tokens", tokens)
    lengths = as_int32("lengths", lengths, (cache.batch,))
    _check_concrete_tokens(tokens, state)
    return _prefill(graphdef, state, cache, tokens, lengths, runtime=runtime, tap_layers=tap_layers)


def decode_step(graphdef: nnx.GraphDef, state: nnx.State, cache: LatentCache, tokens: jax.Array,
                *, runtime: Runtime = Runtime()):
    """One token per stream: tokens [B] -> (logits [B, W] f32, cache, overflow [B] bool).

    Token ids must lie in [0, W): host ids are checked here (ValueError, as in ``prefill``); on a device
    array or traced, an id outside [0, W), negative ones included, gives NaN logits (its row is committed,
    as NaN).
    """
    check_int("tokens", tokens, (cache.batch,))
    _check_concrete_tokens(tokens, state)
    return _decode_step(graphdef, state, cache, tokens, runtime=runtime)


def _check_concrete_tokens(tokens, state: nnx.State) -> None:
    """``check_tokens`` against the embedding's vocabulary for host ids; a jax array (on a device, or traced)
    is left to ``_nan_if_outside_vocab``, as reading it back would wait for the device."""
    if not isinstance(tokens, jax.Array):
        check_tokens(tokens, state["embed"].shape[0])


def _nan_if_outside_vocab(tokens: jax.Array, vocab_size: int) -> jax.Array:
    """Ids outside [0, W) -> W, which the embedding lookup (``jnp.take``'s fill mode) turns into a NaN row;
    without this, ids in [-W, 0) would wrap silently to real tokens."""
    return jnp.where((tokens >= 0) & (tokens < vocab_size), tokens, vocab_size)


@functools.partial(jax.jit, static_argnames=("graphdef", "runtime", "tap_layers"), donate_argnames=("cache",))
def _prefill(graphdef, state, cache, tokens, lengths, *, runtime, tap_layers):
    model = nnx.merge(graphdef, state)
    b, p = tokens.shape
    tokens = _nan_if_outside_vocab(tokens, model.cfg.vocab_size)
    positions = cache.lengths[:, None] + jnp.arange(p)[None, :]
    out = model(tokens, positions, cache, causal_mask(b, p), tap_layers=tap_layers, runtime=runtime)
    rows = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    bad_length = (lengths < 1) | (lengths > p)
    cache, overflow = commit(cache, out.block_kv, rows, jnp.where(bad_length, -1, lengths))  # -1: refused
    last = jnp.take_along_axis(out.logits, jnp.clip(lengths - 1, 0, p - 1)[:, None, None], axis=1)[:, 0]
    last = jnp.where(bad_length[:, None], jnp.nan, last)
    return last, cache, overflow, out.taps


@functools.partial(jax.jit, static_argnames=("graphdef", "runtime"), donate_argnames=("cache",))
def _decode_step(graphdef, state, cache, tokens, *, runtime):
    model = nnx.merge(graphdef, state)
    b = tokens.shape[0]
    tokens = _nan_if_outside_vocab(tokens, model.cfg.vocab_size)
    out = model(tokens[:, None], cache.lengths[:, None], cache, causal_mask(b, 1), runtime=runtime)
    cache, overflow = commit(cache, out.block_kv, jnp.zeros((b, 1), jnp.int32), jnp.ones((b,), jnp.int32))
    return out.logits[:, 0], cache, overflow
