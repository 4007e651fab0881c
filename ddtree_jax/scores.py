"""What the engine can keep beside each generated token: its log-probability under the target and the target's
likeliest tokens at that place (``EngineConfig(logprobs=True, top_logprobs=n)``).

Both are read from the target's logits of the row that produced the token (the prefill's last row, or the verify
forward's row of the accepted node before it): by default the model's own distribution, at temperature 1 and before
any logit processing or top-k / top-p / min-p filter, whatever the stream samples with; with
``EngineConfig(logprobs_mode="processed")`` the distribution the token was taken from (the engine passes those rows
through ``sampling.sampled_logits`` first). No forward is added.

Shapes: B streams, R rows (a round's emitted tokens, or the output's slots N), W vocabulary, n = top_logprobs.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax import topk
from ddtree_jax.tree import PAD


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenScores:
    """Per token: ``logprob`` [B, R] float32; ``top_tokens`` [B, R, n] int32 (likeliest first, equal values lower id
    first) and ``top_logprobs`` [B, R, n] float32, or both None where no top tokens are kept."""

    logprob: jax.Array
    top_tokens: jax.Array | None
    top_logprobs: jax.Array | None


def empty_scores(streams: int, slots: int, top: int) -> TokenScores:
    """The output's scores before any token: NaN log-probabilities and PAD top tokens, [B, N] and [B, N, n]."""
    return TokenScores(
        logprob=jnp.full((streams, slots), jnp.nan, jnp.float32),
        top_tokens=jnp.full((streams, slots, top), PAD, jnp.int32) if top else None,
        top_logprobs=jnp.full((streams, slots, top), jnp.nan, jnp.float32) if top else None)


def token_scores(logits, tokens, top: int) -> TokenScores:
    """logits [B, R, W] (any float), tokens [B, R] int -> their TokenScores, in float32: log_softmax(logits)[token]
    and the ``top`` likeliest (0: none). A negative token (PAD) reads token 0's log-probability."""
    logits = logits.astype(jnp.float32)
    log_norm = jax.nn.logsumexp(logits, axis=-1)  # [B, R]
    picked = jnp.take_along_axis(logits, jnp.maximum(tokens, 0)[..., None], axis=-1)[..., 0]
    if not top:
        return TokenScores(picked - log_norm, None, None)
    b, r, w = logits.shape
    # one zero (-0.0 as +0.0, not "+ 0.0", which jit folds away) so that ties go lower id first for every method
    values, ids = topk.top_k(jnp.where(logits == 0.0, 0.0, logits).reshape(b * r, w), top)
    return TokenScores(picked - log_norm, ids.reshape(b, r, top),
                       values.reshape(b, r, top) - log_norm[..., None])


def append_scores(out: TokenScores, scores: TokenScores, rows, slots) -> TokenScores:
    """``out`` with scores [B, E, ...] written at slots [B, E] of the streams ``rows`` [B, 1]; slots past the
    output's end are dropped."""
    return jax.tree.map(lambda buf, new: buf.at[rows, slots].set(new, mode="drop"), out, scores)


def per_stream_slices(values, start, stop) -> list[list]:
    """values [B, N] (device or host) -> row b's values[start[b]:stop[b]] as a list, for each stream."""
    values = np.asarray(values)
    return [values[b, start[b]: stop[b]].tolist() for b in range(values.shape[0])]


def scores_lists(scores: TokenScores, start, stop) -> tuple[list[list[float]], list[list[list]] | None]:
    """Each stream b's slots start[b]:stop[b] as Python lists: (log-probabilities, and per token its top
    [token, log-probability] pairs, or None where no top tokens are kept)."""
    logprobs = per_stream_slices(scores.logprob, start, stop)
    if scores.top_tokens is None:
        return logprobs, None
    ids, values = np.asarray(scores.top_tokens), np.asarray(scores.top_logprobs)
    top = [[[[int(i), float(v)] for i, v in zip(ids[b, s], values[b, s])] for s in range(start[b], stop[b])]
           for b in range(ids.shape[0])]
    return logprobs, top
