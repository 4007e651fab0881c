"""Truncated sampling: the top-k, top-p (nucleus) and min-p filters over temperature-scaled logits.

Applied as transformers' ``TopKLogitsWarper``, ``TopPLogitsWarper`` and ``MinPLogitsWarper`` apply them, after the
temperature, in that order: top-k keeps the ``top_k`` largest logits of a row; top-p then keeps the fewest most
likely tokens whose probabilities (over what top-k kept) add up to at least ``top_p``; min-p then keeps the tokens
at least ``min_p`` times as likely as the likeliest. One difference: every token tied with the last one kept is
kept too, so the result never depends on how a sort orders equal values. The argmax always survives, so greedy
decoding is unchanged by any filter.

Losslessness does not depend on the filters: the acceptance walk draws one target token per tree node, from the
same truncated distribution that plain sampling would draw from.

The logits come here after ``processors.process_logits`` (logit bias, min_new_tokens and the penalties), which
changes greedy decoding too.

Rows must hold no NaN (as for ``topk``). Shapes: R rows, W vocabulary, K = top_k.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax import topk
from ddtree_jax.checks import is_integer, is_number


def check_top_k(top_k, vocab_size: int | None = None) -> int:
    """top_k as an int: 0 (off) or in [1, vocab_size]; ValueError otherwise."""
    if not is_integer(top_k):
        raise ValueError(f"top_k must be an integer (0: off), got {top_k!r}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0: off), got {top_k}")
    if vocab_size is not None and top_k > vocab_size:
        raise ValueError(f"top_k must be at most the vocabulary's {vocab_size} tokens (0: off), got {top_k}")
    return int(top_k)


def check_top_p(top_p) -> float:
    """top_p as a float in (0, 1] (1: off); ValueError otherwise (NaN included)."""
    return _check_share("top_p", top_p, zero_allowed=False, off="1: off")


def check_min_p(min_p) -> float:
    """min_p as a float in [0, 1] (0: off); ValueError otherwise (NaN included)."""
    return _check_share("min_p", min_p, zero_allowed=True, off="0: off")


def _check_share(name: str, value, zero_allowed: bool, off: str) -> float:
    interval = f"{'[' if zero_allowed else '('}0, 1] ({off})"
    if not is_number(value):
        raise ValueError(f"{name} must be a number in {interval}, got {value!r}")
    if not (0 <= value <= 1 and (zero_allowed or value > 0)):
        raise ValueError(f"{name} must be in {interval}, got {value}")
    return float(value)


TOP_P_METHODS = ("auto", "sort", "search")
SORT_MAX_VALUES = 8192
"""Top-p's "auto" sorts rows up to this long (and the K values top-k keeps); longer ones, a vocabulary, search."""
SEARCH_FANOUT = 16
"""Thresholds per pass of top-p's "search": 16 cuts the 2^32 float keys to one in 8 passes."""


def truncate(scaled: jax.Array, top_k=0, top_p=1.0, top_p_method: str = "auto", min_p=0.0, *,
             top_k_ceiling: int = 0, top_k_in_every_row: bool = False) -> jax.Array:
    """scaled [B, ..., W] float (logits over the temperature) -> the same with the tokens that top-k, then top-p,
    then min-p drop set to -inf. ``top_k`` (0: off), ``top_p`` (1: off) and ``min_p`` (0: off) are each a Python
    number, which picks what is compiled, or a [B] array (per stream: one value for every row of scaled[b]; may be
    traced), whose filter is always compiled and keeps every token of a row whose value is the off one.

    A [B] top_k takes ``top_k_ceiling``, a Python int >= every stream's k: the one top-k taken is of that many
    values. ``top_k_in_every_row``: no stream's k is 0, so top-p's "auto" may rank the K best alone, as it does
    for a Python top_k. A traced array cannot be checked here: the caller checks its values on the host
    (``check_top_k``, ``check_top_p``, ``check_min_p``); a concrete one is checked here.

    Top-p finds the nucleus's last value ("the edge") by ``top_p_method``: "sort" ranks the row (after top-k: its K
    values, already ranked) and sums the masses in order; "search" needs no sort (``nucleus_edge_by_search``);
    "auto" sorts rows of at most SORT_MAX_VALUES and the top-k's, else searches. Both give the same edge up to the
    rounding of the masses' sums (which can move a flat row's edge by a token).

    Min-p keeps a token where exp(its logit - the row's largest) >= min_p: its probability over the likeliest's,
    which no earlier filter changes."""
    shape = scaled.shape
    vocab = shape[-1]
    per_stream = {name: isinstance(value, (jax.Array, np.ndarray)) for name, value in
                  (("top_k", top_k), ("top_p", top_p), ("min_p", min_p))}
    if any(per_stream.values()) and len(shape) < 2:
        raise ValueError(f"per-stream filters need logits [B, ..., W], got shape {shape}")
    if per_stream["top_k"]:
        top_k_ceiling = check_top_k(top_k_ceiling, vocab)
        if top_k_ceiling == 0:
            raise ValueError("a per-stream top_k needs top_k_ceiling >= 1: the most any stream keeps")
        _check_concrete(top_k, lambda k: _check_under_ceiling(check_top_k(k), top_k_ceiling), "top_k")
    else:
        top_k = check_top_k(top_k, vocab)
        if top_k_ceiling:
            raise ValueError(f"top_k_ceiling={top_k_ceiling} is for a per-stream top_k; top_k is {top_k}")
    if per_stream["top_p"]:
        _check_concrete(top_p, check_top_p, "top_p")
    else:
        top_p = check_top_p(top_p)
    if per_stream["min_p"]:
        _check_concrete(min_p, check_min_p, "min_p")
    else:
        min_p = check_min_p(min_p)
    if top_p_method not in TOP_P_METHODS:
        raise ValueError(f"top_p_method must be one of {TOP_P_METHODS}, got {top_p_method!r}")
    filters_top_k, filters_top_p = per_stream["top_k"] or top_k > 0, per_stream["top_p"] or top_p < 1
    if not (filters_top_k or filters_top_p or per_stream["min_p"] or min_p > 0):
        return scaled
    rows = scaled.reshape(-1, vocab)  # [R, W]
    neg_inf = jnp.array(-jnp.inf, rows.dtype)

    def row_values(values, dtype):  # [B] -> [R, 1]: each row its stream's value
        values = jnp.asarray(values, dtype)
        if values.shape != shape[:1]:
            raise ValueError(f"a per-stream filter has one value per stream ({shape[0]}), got shape {values.shape}")
        return jnp.broadcast_to(values.reshape(shape[:1] + (1,) * (len(shape) - 2)), shape[:-1]).reshape(-1, 1)

    best = None  # the row's K largest values, largest first, -inf past the row's own top-k
    k = None  # [R, 1]: each row's per-stream top_k
    if per_stream["top_k"]:
        k = row_values(top_k, jnp.int32)
        best, _ = topk.top_k(rows, top_k_ceiling)  # [R, K]
        kth = jnp.take_along_axis(best, jnp.maximum(k, 1) - 1, axis=-1)
        edge = jnp.where(k > 0, kth, neg_inf)
        rows = jnp.where(rows >= edge, rows, neg_inf)
        best = jnp.where(best >= edge, best, neg_inf)
    elif top_k:
        best, _ = topk.top_k(rows, top_k)  # [R, K], largest first
        rows = jnp.where(rows >= best[:, -1:], rows, neg_inf)
    if filters_top_p:
        p = row_values(top_p, jnp.float32) if per_stream["top_p"] else top_p
        ranked_in_some_rows = k is not None and not top_k_in_every_row
        if top_p_method == "auto" and ranked_in_some_rows and rows.shape[-1] > SORT_MAX_VALUES:
            # each row as it would go alone: its K best ranked where its top_k is on, else the search; the rows'
            # edges can differ by a token between the two (the masses' sums round differently)
            edge = jnp.where(k > 0, nucleus_edge_by_sort(rows, p, best), nucleus_edge_by_search(rows, p))
        elif top_p_method == "search" or (top_p_method == "auto" and best is None and rows.shape[-1] > SORT_MAX_VALUES):
            edge = nucleus_edge_by_search(rows, p)
        else:
            edge = nucleus_edge_by_sort(rows, p, None if ranked_in_some_rows else best)
        if per_stream["top_p"]:
            edge = jnp.where(p < 1, edge, neg_inf)  # top_p = 1 keeps every token, whatever the sums' rounding
        rows = jnp.where(rows >= edge, rows, neg_inf)
    if per_stream["min_p"] or min_p > 0:
        m = row_values(min_p, jnp.float32) if per_stream["min_p"] else min_p
        largest = jnp.max(rows, axis=-1, keepdims=True)
        rows = jnp.where(jnp.exp(rows - largest) >= m, rows, neg_inf)
    return rows.reshape(shape)


def _is_python_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_under_ceiling(top_k: int, ceiling: int) -> int:
    if top_k > ceiling:
        raise ValueError(f"top_k={top_k} passes top_k_ceiling={ceiling}")
    return top_k


def _check_concrete(values, check_one, name: str) -> None:
    """Checks each of a per-stream filter's values with ``check_one`` where they are known (not traced)."""
    try:
        known = np.asarray(values)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return
    for value in known.reshape(-1).tolist():
        try:
            check_one(value)
        except ValueError as e:
            raise ValueError(f"per-stream {name}: {e}") from None


TEMPERATURE_RANGE = (2.0**-126, 2.0**126)
"""The temperatures > 0 that sample: float32 holds each and its reciprocal as normal numbers. Below, float32 has
only subnormals or 0 (flushed on devices); above, XLA's x / T as x * (1 / T) turned a banned token's -inf into NaN,
which the draw then picked."""


def check_hot_temperature(temperature: float) -> float:
    """A sampling temperature > 0 in TEMPERATURE_RANGE, as a float; ValueError naming the range otherwise."""
    low, high = TEMPERATURE_RANGE
    if not low <= temperature <= high:
        raise ValueError(f"temperature must be 0 (greedy) or in [{low:.3g}, {high:.3g}] (float32 and its reciprocal "
                         f"normal), got {temperature}")
    return float(temperature)


def scaled_logits(logits: jax.Array, temperature) -> jax.Array:
    """logits [B, ..., W] f32 over ``temperature`` (a Python float, or [B, 1, ..., 1]; each > 0), each row less its
    largest finite value first: the same softmax and filters, and no logit overflows to +inf at a small temperature
    (40 / 1e-37 did, and the draw then took the first +inf token, not the argmax). -inf stays -inf."""
    largest = jnp.max(logits, axis=-1, keepdims=True)
    return (logits - jnp.where(jnp.isfinite(largest), largest, 0.0)) / temperature


def sampled_logits(logits: jax.Array, temperature, top_k=0, top_p=1.0, min_p=0.0, **per_stream_top_k) -> jax.Array:
    """logits [B, R, W] -> the logits each row's token is taken from: ``truncate(logits / temperature)`` where the
    stream's temperature (a Python number, or [B] and maybe traced) is > 0, the logits themselves where it is <= 0
    (greedy: their argmax, which every filter keeps). The filters are ``truncate``'s, with its ``top_k_ceiling``
    and ``top_k_in_every_row`` for a per-stream top_k. A Python temperature > 0 must lie in TEMPERATURE_RANGE; the
    logits are scaled less each row's largest (``scaled_logits``)."""
    logits = logits.astype(jnp.float32)
    if _is_python_number(temperature):
        if temperature <= 0:
            return logits
        scaled = scaled_logits(logits, jnp.float32(check_hot_temperature(temperature)))
        return truncate(scaled, top_k, top_p, min_p=min_p, **per_stream_top_k)
    temp = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), logits.shape[:1])[:, None, None]
    hot = temp > 0
    return jnp.where(hot, truncate(scaled_logits(logits, jnp.where(hot, temp, 1.0)), top_k, top_p, min_p=min_p,
                                   **per_stream_top_k), logits)


def nucleus_edge_by_sort(rows: jax.Array, top_p, best: jax.Array | None = None) -> jax.Array:
    """rows [R, W] -> [R, 1]: the value of the last token in the nucleus, the tokens ranked by value whose mass
    before them (over the whole row) is below top_p (a float, or [R, 1]: each row's). ``best``: the row's largest
    values in order, if known (top-k's K: the tokens past them, ties of the K-th included, are never before a kept
    one); else the row is sorted."""
    if best is None:
        best = -jnp.sort(-rows, axis=-1)  # [R, W], largest first
    probs = jnp.exp(best - jax.nn.logsumexp(rows, axis=-1, keepdims=True))
    before = jnp.cumsum(probs, axis=-1) - probs
    n_kept = jnp.maximum(jnp.sum(before < top_p, axis=-1, keepdims=True), 1)  # the first is always in
    return jnp.take_along_axis(best, n_kept - 1, axis=-1)


def nucleus_edge_by_search(rows: jax.Array, top_p, fanout: int = SEARCH_FANOUT) -> jax.Array:
    """``nucleus_edge_by_sort`` without a sort: rows [R, W] -> [R, 1], in ``search_passes(fanout)`` passes over
    the row, unrolled (a device loop would cost a host round trip a pass on a GPU).

    Let mass(t) be the probability of the tokens above t, a non-increasing function. The nucleus's last value is
    the smallest t with mass(t) < top_p: it is below no other row value with that property, and every t under it
    has the last kept value's own mass above it, which reaches top_p (else the next value down would be kept too).
    It is searched for over the floats' order-preserving integer keys: each pass cuts the keys left, [lo, hi], into
    ``fanout`` pieces, takes mass(t) at the last key of all but the last piece in one masked sum, and keeps the
    first piece whose last key has mass(t) < top_p (hi itself always has)."""
    if fanout < 2:
        raise ValueError(f"fanout must be >= 2, got {fanout}")
    rows = rows.astype(jnp.float32)
    probs = jnp.exp(rows - jax.nn.logsumexp(rows, axis=-1, keepdims=True))
    keys = _order_keys(rows)
    lo = jnp.min(keys, axis=-1, keepdims=True)  # [R, 1]
    hi = jnp.max(keys, axis=-1, keepdims=True)  # mass above the largest value: 0 < top_p
    ends = jnp.arange(1, fanout, dtype=jnp.uint32)  # pieces 0 .. fanout - 2 end at lo + ends * piece - 1
    for _ in range(search_passes(fanout)):
        span = _as_uint(hi) - _as_uint(lo)  # keys left - 1, < 2^32
        piece = span // fanout + 1  # ceil((span + 1) / fanout): (fanout - 1) * piece - 1 fits in 32 bits
        last = _as_int(_as_uint(lo) + jnp.minimum(ends * piece - 1, span))  # [R, fanout - 1]
        above = jnp.sum(jnp.where(keys[:, :, None] > last[:, None, :], probs[:, :, None], 0.0), axis=1)
        first = jnp.sum(above >= top_p, axis=-1, keepdims=True).astype(jnp.uint32)  # the edge's piece
        edge_in_last_piece = first == fanout - 1
        hi = jnp.where(edge_in_last_piece, hi, jnp.take_along_axis(last, jnp.minimum(first, fanout - 2), -1))
        lo = _as_int(_as_uint(lo) + first * piece)
    return _from_order_keys(hi)


def search_passes(fanout: int) -> int:
    """Passes of ``nucleus_edge_by_search`` that leave one of 2^32 keys: each keeps ceil(keys / fanout)."""
    passes, keys = 0, 1 << 32
    while keys > 1:
        passes, keys = passes + 1, -(-keys // fanout)
    return passes


def _as_uint(x: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, jnp.uint32)


def _as_int(x: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, jnp.int32)


def _order_keys(values: jax.Array) -> jax.Array:
    """float32 -> int32 in the same order (-0.0 taken as +0.0): sign-magnitude bits with negatives' magnitudes
    flipped."""
    bits = jax.lax.bitcast_convert_type(jnp.where(values == 0, 0.0, values), jnp.int32)
    return jnp.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


def _from_order_keys(keys: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(jnp.where(keys >= 0, keys, keys ^ 0x7FFFFFFF), jnp.float32)
