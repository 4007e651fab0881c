"""Truncated sampling: the top-k and top-p (nucleus) filters over temperature-scaled logits.

Applied as transformers' ``TopKLogitsWarper`` and ``TopPLogitsWarper`` apply them, after the temperature, top-k
first: top-k keeps the ``top_k`` largest logits of a row; top-p then keeps the fewest most likely tokens whose
probabilities (over what top-k kept) add up to at least ``top_p``. One difference: every token tied with the
last one kept is kept too, so the result never depends on how a sort orders equal values. The argmax always
survives, so greedy decoding is unchanged by either filter.

Losslessness does not depend on the filters: the acceptance walk draws one target token per tree node, from the
same truncated distribution that plain sampling would draw from.

Shapes: R rows, W vocabulary, K = top_k.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax import topk


def check_top_k(top_k, vocab_size: int | None = None) -> int:
    """top_k as an int: 0 (off) or in [1, vocab_size]; ValueError otherwise."""
    if isinstance(top_k, (bool, np.bool_)) or not isinstance(top_k, (int, np.integer)):
        raise ValueError(f"top_k must be an integer (0: off), got {top_k!r}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0: off), got {top_k}")
    if vocab_size is not None and top_k > vocab_size:
        raise ValueError(f"top_k must be at most the vocabulary's {vocab_size} tokens (0: off), got {top_k}")
    return int(top_k)


def check_top_p(top_p) -> float:
    """top_p as a float in (0, 1] (1: off); ValueError otherwise (NaN included)."""
    if isinstance(top_p, (bool, np.bool_)) or not isinstance(top_p, (int, float, np.integer, np.floating)):
        raise ValueError(f"top_p must be a number in (0, 1] (1: off), got {top_p!r}")
    if not (0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1] (1: off), got {top_p}")
    return float(top_p)


def truncate(scaled: jax.Array, top_k: int = 0, top_p: float = 1.0) -> jax.Array:
    """scaled [..., W] float (logits over the temperature) -> the same with the tokens that top-k and then top-p
    drop set to -inf. ``top_k`` (0: off) and ``top_p`` (1: off) are Python numbers: they pick what is compiled."""
    top_k = check_top_k(top_k, scaled.shape[-1])
    top_p = check_top_p(top_p)
    if top_k == 0 and top_p == 1:
        return scaled
    shape = scaled.shape
    rows = scaled.reshape(-1, shape[-1])  # [R, W]
    neg_inf = jnp.array(-jnp.inf, rows.dtype)
    if top_k:
        best, _ = topk.top_k(rows, top_k)  # [R, K], largest first
        rows = jnp.where(rows >= best[:, -1:], rows, neg_inf)
    else:
        best = -jnp.sort(-rows, axis=-1)  # [R, W], largest first
    if top_p < 1:
        # Mass of the tokens ranked before each of the best ones, over everything still kept (ties past the
        # K-th included): a token is in the nucleus while that mass is below top_p. The first always is.
        probs = jnp.exp(best - jax.nn.logsumexp(rows, axis=-1, keepdims=True))
        before = jnp.cumsum(probs, axis=-1) - probs
        n_kept = jnp.maximum(jnp.sum(before < top_p, axis=-1, keepdims=True), 1)
        last = jnp.take_along_axis(best, n_kept - 1, axis=-1)
        rows = jnp.where(rows >= last, rows, neg_inf)
    return rows.reshape(shape)

