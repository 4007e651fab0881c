"""Host-facing target steps: validated prefill of ragged prompts and one-token decode.

These are the jit boundaries of the plain target model: the model crosses as ``nnx.split`` state
(a pytree of arrays), the graph definition and runtime are static, and the cache is donated.
``prefill_blocks`` is the prompt's forward both they and the engine run: the prompt in blocks of at most
``chunk`` tokens, so that what a prefill holds at once (the attention's scores, the MoE's activations) is bounded
by the chunk, not by the prompt.
Shapes: B streams, P padded prompt length, Pc chunk, W vocab, D model, n taps.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ddtree_jax.cache import LatentCache, commit
from ddtree_jax.checks import as_int32, check_int
from ddtree_jax.model import KimiModel, Runtime, causal_mask, check_tokens

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
    prompts = [_token_ids(p, i) for i, p in enumerate(check_prompt_list(prompts))]
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


def check_prompt_list(prompts):
    """``prompts`` as a non-empty sequence of prompts (a list, tuple or array of them; a JAX array is read to the
    host); ValueError for a string, a generator, None or an empty one (each prompt is checked by ``pad_prompts``)."""
    if isinstance(prompts, jax.Array):
        prompts = np.asarray(prompts)
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (Sequence, np.ndarray)):
        raise ValueError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError("no prompts given")
    return prompts


def _token_ids(prompt, index: int) -> np.ndarray:
    """One prompt as a 1-D integer array; ValueError for text, floats, bools or nesting (never truncated)."""
    problem = f"prompt {index} must be a list of integer token ids (a list of lists for several prompts), got "
    if isinstance(prompt, (str, bytes)):
        raise ValueError(problem + f"{prompt!r:.80}")
    if isinstance(prompt, (list, tuple)) and any(isinstance(t, (bool, np.bool_)) or getattr(t, "dtype", None) == bool
                                                 for t in prompt):
        raise ValueError(problem + f"{prompt!r:.80}")  # numpy would read [5, True] as [5, 1]
    try:
        ids = np.asarray(prompt)
    except ValueError:  # ragged nesting
        raise ValueError(problem + f"{prompt!r:.80}") from None
    if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
        raise ValueError(problem + f"{prompt!r:.80}")
    return ids


def check_prefill_chunk(chunk) -> int | None:
    """A prefill's block size: an integer >= 1, or None for the whole prompt in one block."""
    if chunk is None:
        return None
    if isinstance(chunk, (bool, np.bool_)) or not isinstance(chunk, (int, np.integer)):
        raise ValueError(f"prefill_chunk must be an integer (tokens a block) or None (the whole prompt), got {chunk!r}")
    if chunk < 1:
        raise ValueError(f"prefill_chunk must be >= 1 (tokens a block) or None (the whole prompt), got {chunk}")
    return int(chunk)


def prefill_block_shape(p: int, chunk: int | None) -> tuple[int, int]:
    """(tokens a block, blocks) of a prefill of P padded tokens in blocks of ``chunk`` (None: one block)."""
    size = p if chunk is None else min(check_prefill_chunk(chunk), p)
    return size, -(-p // size)


def prefill_blocks(model: KimiModel, cache: LatentCache, tokens: jax.Array, lengths: jax.Array, *,
                   chunk: int | None, runtime: Runtime, tap_layers: tuple[int, ...] = (),
                   on_taps: Callable[[Any, jax.Array, jax.Array, jax.Array, jax.Array], Any] | None = None,
                   taps_carry: Any = None):
    """The forward of padded prompts [B, P] on top of each stream's cache, ``chunk`` tokens a block (None: one
    block), in a ``fori_loop``; commits the first lengths[b] rows of each stream.

    Each block's queries see the stream's cache (its earlier blocks included) and the block's own causal past,
    so the result is the one-block forward's up to float rounding. Only each prompt's last row reaches the head.
    A stream whose length lies outside [1, P], or whose prompt would pass the cache's capacity, is flagged in
    ``overflow``, not written (no block of it, whatever ``chunk``), and gets NaN logits. The
    last block is padded with id 0 where P is not a multiple of ``chunk``. ``on_taps(carry, taps [n, B, Pc, D],
    positions [B, Pc], counts [B], offset)`` folds each block's tapped outputs (rows counts[b].. are padding) into
    ``taps_carry``, e.g. the drafter's context.
    Returns (last_logits [B, W] f32 at each prompt's last token, cache, overflow [B] bool, taps_carry).
    """
    b, p = tokens.shape
    size, blocks = prefill_block_shape(p, chunk)
    tokens = jnp.pad(tokens, ((0, 0), (0, blocks * size - p)))
    start = cache.lengths
    bad_length = (lengths < 1) | (lengths > p) | (start + lengths > cache.capacity)  # refused in every block
    last_row = jnp.clip(lengths - 1, 0, p - 1)
    rows = jnp.broadcast_to(jnp.arange(size, dtype=jnp.int32), (b, size))

    def block(k, carry):
        cache, last, overflow, taps_carry = carry
        offset = k * size
        block_tokens = jax.lax.dynamic_slice_in_dim(tokens, offset, size, axis=1)
        positions = start[:, None] + offset + rows
        here = last_row - offset  # the prompt's last row within this block, where 0 <= here < size
        out = model(block_tokens, positions, cache, causal_mask(b, size), tap_layers=tap_layers, runtime=runtime,
                    logit_rows=jnp.clip(here, 0, size - 1)[:, None])
        counts = jnp.clip(lengths - offset, 0, size)
        cache, refused = commit(cache, out.block_kv, rows, jnp.where(bad_length, -1, counts))  # -1: refused
        last = jnp.where(((here >= 0) & (here < size))[:, None], out.logits[:, 0], last)
        if on_taps is not None:
            taps_carry = on_taps(taps_carry, out.taps, positions, jnp.where(bad_length, 0, counts), offset)
        return cache, last, overflow | refused, taps_carry

    carry = (cache, jnp.zeros((b, model.cfg.vocab_size), jnp.float32), jnp.zeros((b,), bool), taps_carry)
    carry = block(0, carry) if blocks == 1 else jax.lax.fori_loop(0, blocks, block, carry)
    cache, last, overflow, taps_carry = carry
    return jnp.where(bad_length[:, None], jnp.nan, last), cache, overflow, taps_carry


def prefill(graphdef: nnx.GraphDef, state: nnx.State, cache: LatentCache, tokens: jax.Array, lengths: jax.Array,
            *, runtime: Runtime = Runtime(), tap_layers: tuple[int, ...] = (), chunk: int | None = None):
    """Runs padded prompts [B, P] on top of ``cache`` and commits the first lengths[b] rows per stream, ``chunk``
    tokens a block (``prefill_blocks``; None: one block).

    Returns (last_logits [B, W] f32 at each prompt's last token, cache, overflow [B] bool,
    taps [n_taps, B, P, D] or None). ``pad_prompts`` makes valid inputs. Every id of ``tokens``, padding
    included, must lie in [0, W): host ids (numpy, lists) are checked here (``check_tokens``, ValueError).
    Device arrays are not read back (that would stall a decode loop) and traced ones cannot raise: a stream
    with an id outside [0, W), negative ones included, gets NaN logits (its rows are written, as NaN), and
    a stream whose length lies outside [1, P], or whose prompt would pass the capacity, is flagged in
    ``overflow``, not written, and gets NaN logits.
    """
    if np.ndim(tokens) != 2 or np.shape(tokens)[0] != cache.batch:
        raise ValueError(f"tokens must be [B, P] with B = {cache.batch} (the cache's streams), got {np.shape(tokens)}")
    check_int("tokens", tokens)
    lengths = as_int32("lengths", lengths, (cache.batch,))
    _check_concrete_tokens(tokens, state)
    return _prefill(graphdef, state, cache, tokens, lengths, runtime=runtime, tap_layers=tap_layers,
                    chunk=check_prefill_chunk(chunk))


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


@functools.partial(jax.jit, static_argnames=("graphdef", "runtime", "tap_layers", "chunk"), donate_argnames=("cache",))
def _prefill(graphdef, state, cache, tokens, lengths, *, runtime, tap_layers, chunk):
    model = nnx.merge(graphdef, state)
    b, p = tokens.shape
    tokens = _nan_if_outside_vocab(tokens, model.cfg.vocab_size)
    taps = None
    if tap_layers:  # every row's taps, [n, B, P, D]: the last block's padding rows cut off at the end
        size, blocks = prefill_block_shape(p, chunk)
        taps = jnp.zeros((len(tap_layers), b, blocks * size, model.cfg.hidden_size), jnp.dtype(model.cfg.dtype))

    def keep_taps(taps, block_taps, positions, counts, offset):
        return jax.lax.dynamic_update_slice_in_dim(taps, block_taps.astype(taps.dtype), offset, axis=2)

    last, cache, overflow, taps = prefill_blocks(model, cache, tokens, lengths, chunk=chunk, runtime=runtime,
                                                 tap_layers=tap_layers, on_taps=keep_taps if tap_layers else None,
                                                 taps_carry=taps)
    return last, cache, overflow, None if taps is None else taps[:, :, :p]


@functools.partial(jax.jit, static_argnames=("graphdef", "runtime"), donate_argnames=("cache",))
def _decode_step(graphdef, state, cache, tokens, *, runtime):
    model = nnx.merge(graphdef, state)
    b = tokens.shape[0]
    tokens = _nan_if_outside_vocab(tokens, model.cfg.vocab_size)
    out = model(tokens[:, None], cache.lengths[:, None], cache, causal_mask(b, 1), runtime=runtime)
    cache, overflow = commit(cache, out.block_kv, jnp.zeros((b, 1), jnp.int32), jnp.ones((b,), jnp.int32))
    return out.logits[:, 0], cache, overflow
