"""How a stream stops: an EOS, one of its own stop token ids, a stop sequence of ids, a stop string
(``stop_strings``), its token limit, a full cache, or a place where its logit processing left no token (its allowed
ids all banned there by its bad words or held back by min_new_tokens); and the cut of a round's emitted tokens at
the first of them (``stop_and_emit``).

Shapes: B streams, E tokens emitted this round, N output slots (max_new_tokens), M stop token ids a stream.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax.checks import is_token_id
from ddtree_jax.scores import append_scores
from ddtree_jax.stream_settings import sequence_table
from ddtree_jax.tree import PAD

RUNNING, EOS, MAX_TOKENS, CACHE_FULL, STOP_SEQUENCE, STOP_STRING, STOP_TOKEN, NO_TOKEN = 0, 1, 2, 3, 4, 5, 6, 7
STATUS_NAMES = {RUNNING: "running", EOS: "eos", MAX_TOKENS: "max_new_tokens", CACHE_FULL: "cache_full",
                STOP_SEQUENCE: "stop_sequence", STOP_STRING: "stop_string", STOP_TOKEN: "stop_token",
                NO_TOKEN: "no_token"}
NO_TOKEN_ID = -2  # the target's "token" at a place whose processed logits are all -inf: never emitted, never matched


def check_stop_sequences(stop_sequences) -> tuple[tuple[int, ...], ...]:
    """Stop sequences as a tuple of non-empty tuples of token ids >= 0 (e.g. ``((13, 13), (42,))``); ValueError
    otherwise (a flat sequence of ids included: give ``((id,),)`` for one single-token stop, or use eos_ids)."""
    return check_id_sequences(stop_sequences, "stop_sequences")


def check_id_sequences(sequences, name: str) -> tuple[tuple[int, ...], ...]:
    """``name``'s value as a tuple of non-empty tuples of token ids >= 0; ValueError naming it otherwise."""
    example = "e.g. ((13, 13), (42,))"
    if isinstance(sequences, (str, bytes)) or not isinstance(sequences, (list, tuple)):
        raise ValueError(f"{name} must be a sequence of token-id sequences ({example}), got {sequences!r}")
    checked = []
    for i, seq in enumerate(sequences):
        if isinstance(seq, (str, bytes)) or not isinstance(seq, (list, tuple)) or not seq:
            raise ValueError(f"{name}[{i}] must be a non-empty sequence of token ids ({example}), got {seq!r}")
        if not all(is_token_id(t) for t in seq):
            raise ValueError(f"{name}[{i}] must hold token ids >= 0, got {seq!r}")
        checked.append(tuple(int(t) for t in seq))
    return tuple(checked)


def stop_and_emit(state, emitted, n_emit, active, eos_ids, emitted_scores=None, stop_sequences=(),
                   min_new_tokens=0, string_ends=None, stop_ids=None, stream_stop_sequences=None, stream_eos_ids=None):
    """``state`` holds out_tokens [B, N], out_scores (TokenScores or None), num_out, limit and status [B] (the
    engine's DecodeState). Appends each active stream's first n_emit emitted tokens [B, E] (and their TokenScores,
    where the state keeps them) to its output, cut after the first that is an EOS (of the static ``eos_ids``, and of
    each stream's own ``stream_eos_ids`` [B, M], where given), one of the stream's own stop
    token ids (``stop_ids`` [B, M], where given; an id no token has pads a row), ends a stop sequence (its tokens in
    a row among the stream's generated ones, earlier rounds' included; the static ``stop_sequences``, and each
    stream's own ``stream_stop_sequences``, a ``stream_settings.StreamWords``, where given) or a stop string
    (``string_ends`` [B, E], where given), the last two not within the first min_new_tokens generated (one number,
    or [B]: each stream's), or that reaches the stream's token limit; cut before a ``NO_TOKEN_ID`` (status
    NO_TOKEN); and updates status. Returns (out_tokens, out_scores, num_out, status)."""
    b, width = emitted.shape
    k = jnp.arange(width)[None, :]
    in_round = k < n_emit[:, None]
    room = state.limit - state.num_out
    is_eos = _is_one_of(emitted, np.asarray([eos_ids], np.int32) if eos_ids else None)
    is_eos |= _is_one_of(emitted, stream_eos_ids)
    is_stop_token = _is_one_of(emitted, stop_ids)
    least = jnp.asarray(min_new_tokens)
    past_min = state.num_out[:, None] + k >= (least[:, None] if least.ndim else least)
    is_stop = ends_stop_sequence(state.out_tokens, state.num_out, emitted, stop_sequences)
    if stream_stop_sequences is not None:
        is_stop |= ends_stream_stop_sequence(state.out_tokens, state.num_out, emitted, stream_stop_sequences)
    is_stop &= past_min
    is_string = jnp.zeros((b, width), bool) if string_ends is None else string_ends & past_min
    no_token = emitted == NO_TOKEN_ID
    ends = ((is_eos | is_stop_token | is_stop | is_string) & ~no_token | no_token) & in_round
    first_end = jnp.argmax(ends, axis=1)
    hit_end = ends.any(1) & (first_end < room)  # an end past the token limit is never emitted
    ended_by_eos, ended_by_token, ended_by_sequence, ended_by_no_token = (
        jnp.take_along_axis(x, first_end[:, None], axis=1)[:, 0] for x in (is_eos, is_stop_token, is_stop, no_token))
    n_emit = jnp.where(hit_end, first_end + 1 - ended_by_no_token, n_emit)  # the end emitted, unless it is no token
    hit_limit = n_emit >= room
    n_emit = jnp.where(active, jnp.minimum(n_emit, room), 0)
    slots = jnp.where(k < n_emit[:, None], state.num_out[:, None] + k, state.out_tokens.shape[1])  # else dropped
    rows = jnp.arange(b)[:, None]
    out = state.out_tokens.at[rows, slots].set(emitted, mode="drop")
    out_scores = state.out_scores
    if out_scores is not None:
        if emitted_scores is None:
            raise ValueError("the state keeps scores: emitted_scores is needed")
        out_scores = append_scores(out_scores, emitted_scores, rows, slots)
    end_status = jnp.select([ended_by_no_token, ended_by_eos, ended_by_token, ended_by_sequence],
                            [NO_TOKEN, EOS, STOP_TOKEN, STOP_SEQUENCE], STOP_STRING)
    status = jnp.where(active & hit_end, end_status, jnp.where(active & hit_limit, MAX_TOKENS, state.status))
    return out, out_scores, state.num_out + n_emit, status


def _is_one_of(emitted, ids) -> jax.Array:
    """[B, E] bool: emitted[:, e] is one of its stream's ``ids`` [B or 1, M] (all False where ids is None)."""
    if ids is None:
        return jnp.zeros(emitted.shape, bool)
    return (emitted[:, :, None] == ids[:, None, :]).any(-1)


def ends_stop_sequence(out_tokens, num_out, emitted, stop_sequences) -> jax.Array:
    """[B, E] bool: emitted[:, e] ends one of ``stop_sequences`` (static) over the stream's generated tokens
    (out_tokens[:, :num_out], then emitted): every stream's as its own (``ends_stream_stop_sequence``)."""
    if not stop_sequences:
        return jnp.zeros(emitted.shape, bool)
    return ends_stream_stop_sequence(out_tokens, num_out, emitted,
                                     sequence_table([list(stop_sequences)], round_up=False))


def ends_stream_stop_sequence(out_tokens, num_out, emitted, sequences) -> jax.Array:
    """[B, E] bool: emitted[:, e] ends one of its stream's own sequences (a StreamWords: [B or 1, NS, L]
    right-aligned, their lengths [B or 1, NS], 0 for none) over the stream's generated tokens (out_tokens[:, :num_out],
    then emitted). Tokens before the first generated one read as PAD, which no id equals."""
    width = emitted.shape[1]
    length = sequences.tokens.shape[2]
    window = _generated_window(out_tokens, num_out, emitted, length - 1)  # [B, L - 1 + E]
    ends = (sequences.lengths > 0)[:, None, :]  # [B, 1 -> E, NS]
    for k in range(length):  # the sequence's k-th last token against the k-th last generated one at each e
        reaches = (sequences.lengths > k)[:, None, :]
        generated = window[:, length - 1 - k: length - 1 - k + width, None]  # [B, E, 1]
        ends = ends & (~reaches | (generated == sequences.tokens[:, None, :, length - 1 - k]))
    return ends.any(-1)


def _generated_window(out_tokens, num_out, emitted, back: int) -> jax.Array:
    """[B, back + E]: each stream's last ``back`` generated tokens (PAD before its first), then ``emitted``."""
    before = num_out[:, None] - back + jnp.arange(back)[None, :]  # the last ``back`` generated tokens' slots
    tail = jnp.where(before >= 0, jnp.take_along_axis(out_tokens, jnp.maximum(before, 0), axis=1), PAD)
    return jnp.concatenate([tail, emitted], axis=1)
