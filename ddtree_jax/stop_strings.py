"""Stop strings on the device: a stream stops once its generated text contains one of them.

The text is the join of the generated tokens' bytes (``token_bytes``, as the tokenizer decodes them), so a string
may span tokens and may end inside a token (that token is the last one kept, as with transformers'
``StopStringCriteria``). Each string is matched by its Knuth-Morris-Pratt automaton over bytes: state q = how many
of its leading bytes the text ends with. On the host, for every state and token, the state after the token's bytes
and whether the string was completed inside them are tabled once (``build_stop_tables``, vectorised over the
vocabulary); on the device each emitted token is then two gathers per string (``advance``). Only generated text is
searched: each stream starts in state 0 after its prompt.

Shapes: B streams, E emitted tokens, S stop strings, Q = longest string's bytes + 1 states, W vocabulary.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StopTables:
    """next_state [S, Q, W] int16 (int32 past 32767 states): string s's state after a token's bytes from state q;
    completes [S, Q, W] bool: whether string s was completed inside them. States past a string's own are never
    reached."""

    next_state: jax.Array
    completes: jax.Array


def check_stop_strings(stop_strings) -> tuple[str, ...]:
    """Stop strings as a tuple of non-empty str (e.g. ``("\\n\\n", "</s>")``); ValueError otherwise."""
    if isinstance(stop_strings, (str, bytes)) or not isinstance(stop_strings, (list, tuple)):
        raise ValueError(f"stop_strings must be a sequence of strings (e.g. ('\\n\\n',)), got {stop_strings!r}")
    for i, text in enumerate(stop_strings):
        if not isinstance(text, str) or not text:
            raise ValueError(f"stop_strings[{i}] must be a non-empty string, got {text!r}")
        try:
            text.encode("utf-8")  # its bytes are what the tables match
        except UnicodeEncodeError:
            raise ValueError(f"stop_strings[{i}] cannot be encoded as UTF-8 (a lone surrogate?), got {text!r}"
                             ) from None
    return tuple(stop_strings)


def check_stream_stop_strings(stop_strings, streams: int, default: Sequence[str] = ()) -> list[tuple[str, ...]]:
    """Each stream's stop strings: ``stop_strings`` is one sequence of strings for every stream (e.g.
    ``("\\n\\n",)``) or a sequence of one such (or None: ``default``, the config's) per stream (e.g.
    ``[("\\n",), (), None, ("</s>", "User:")]``); ValueError otherwise."""
    if isinstance(stop_strings, (list, tuple)) and stop_strings and all(
            isinstance(item, (list, tuple)) or item is None for item in stop_strings):
        stop_strings = [default if item is None else item for item in stop_strings]
        if len(stop_strings) != streams:
            raise ValueError(f"stop_strings must be one sequence of strings or one per stream ({streams}), got "
                             f"{len(stop_strings)} sequences")
        checked = []
        for i, strings in enumerate(stop_strings):
            try:
                checked.append(check_stop_strings(strings))
            except ValueError as e:
                raise ValueError(f"stream {i}'s {e}") from None
        return checked
    return [check_stop_strings(stop_strings)] * streams


def kmp_automaton(pattern: bytes) -> np.ndarray:
    """[n + 1, 256] int32 for a pattern of n bytes: the state after a byte, state = the pattern's leading bytes the
    text ends with (n: it has just been found; the next byte continues from its longest proper border)."""
    n = len(pattern)
    dfa = np.zeros((n + 1, 256), np.int32)
    dfa[0, pattern[0]] = 1
    border = 0  # the state after the pattern's bytes 1..j-1 from state 0
    for j in range(1, n + 1):
        dfa[j] = dfa[border]
        if j < n:
            dfa[j, pattern[j]] = j + 1
            border = dfa[border, pattern[j]]
    return dfa


class StopStringTabler:
    """Tables stop strings over one vocabulary, whose token i decodes to ``token_bytes[i]``: each string's tables
    are built once and kept (host numpy; the last STRINGS_KEPT strings', so that a server taking its users' strings
    holds a bounded number), and a batch's strings are stacked into one StopTables (``tables``)."""

    def __init__(self, token_bytes: Sequence[bytes]):
        self.vocab_size = w = len(token_bytes)
        lengths = np.array([len(b) for b in token_bytes], np.int64)
        self._order = np.argsort(-lengths, kind="stable")  # longest first: byte j is read from the first active[j]
        self._padded = np.zeros((w, max(int(lengths.max(initial=0)), 1)), np.uint8)
        for row, i in enumerate(self._order):
            self._padded[row, :lengths[i]] = np.frombuffer(token_bytes[i], np.uint8)
        self._active = (lengths[:, None] > np.arange(self._padded.shape[1])[None, :]).sum(0)  # tokens with byte j
        self._kept: collections.OrderedDict = collections.OrderedDict()  # the last STRINGS_KEPT strings' tables
        self._stacked: collections.OrderedDict = collections.OrderedDict()  # the last STACKS_KEPT batches' tables

    def string_tables(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """One string's (next_state [n + 1, W] int32, completes [n + 1, W] bool) for its n bytes."""
        if text not in self._kept:
            pattern = text.encode("utf-8")
            dfa = kmp_automaton(pattern)
            w = self.vocab_size
            state = np.broadcast_to(np.arange(len(pattern) + 1)[:, None], (len(pattern) + 1, w)).copy()
            found = np.zeros(state.shape, bool)
            for j, k in enumerate(self._active):  # byte j of every token that has one, from every state at once
                after = dfa[state[:, :k], self._padded[None, :k, j]]
                state[:, :k] = after
                found[:, :k] |= after == len(pattern)
            next_state, completes = np.empty_like(state), np.empty_like(found)
            next_state[:, self._order], completes[:, self._order] = state, found
            self._kept[text] = (next_state, completes)
            if len(self._kept) > STRINGS_KEPT:
                self._kept.popitem(last=False)
        self._kept.move_to_end(text)
        return self._kept[text]

    def tables(self, stop_strings: Sequence[str], round_up: bool = False) -> StopTables:
        """The StopTables of ``stop_strings`` (S of them, Q = the longest's bytes + 1 states). ``round_up``: S and Q
        rounded up to powers of two (padding strings are never completed), so that batches of other strings share
        compiled programs."""
        strings = check_stop_strings(stop_strings)
        if not strings:
            raise ValueError("no stop strings to table")
        key = (strings, round_up)
        if key not in self._stacked:
            count, q = len(strings), max(len(s.encode("utf-8")) for s in strings) + 1
            if round_up:
                count, q = _power_of_two(count), _power_of_two(q)
            next_state = np.zeros((count, q, self.vocab_size), np.int16 if q <= np.iinfo(np.int16).max else np.int32)
            completes = np.zeros((count, q, self.vocab_size), bool)
            for s, text in enumerate(strings):
                states, found = self.string_tables(text)
                next_state[s, :len(states)], completes[s, :len(found)] = states, found
            self._stacked[key] = (next_state, completes)
            if len(self._stacked) > STACKS_KEPT:
                self._stacked.popitem(last=False)
        self._stacked.move_to_end(key)
        next_state, completes = self._stacked[key]
        return StopTables(next_state=jnp.asarray(next_state), completes=jnp.asarray(completes))


STACKS_KEPT = 4
STRINGS_KEPT = 64
"""A tabler keeps the stacked tables of the last 4 batches' strings (host numpy), for batches that repeat them."""


def _power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def build_stop_tables(stop_strings: Sequence[str], token_bytes: Sequence[bytes]) -> StopTables:
    """The tables of ``stop_strings`` over a vocabulary whose token i decodes to ``token_bytes[i]``."""
    return StopStringTabler(token_bytes).tables(stop_strings)


def start_states(tables: StopTables | None, streams: int) -> jax.Array | None:
    """Every string's state before any generated text: [B, S] zeros (None without tables)."""
    return None if tables is None else jnp.zeros((streams, tables.next_state.shape[0]), jnp.int32)


def advance(tables: StopTables, states: jax.Array, tokens: jax.Array, counts: jax.Array,
            applies: jax.Array | None = None):
    """Feeds each stream's first counts[b] of tokens [B, E] to the automata in states [B, S]. Returns (completes
    [B, E] bool: token e completes a stop string that applies to the stream (``applies`` [B, S] bool; None: every
    string), read for e < counts[b]; the states [B, S] after the first counts[b] tokens)."""
    b, width = tokens.shape
    strings = jnp.arange(tables.next_state.shape[0])[None, :]
    completes, after = [], [states]
    for e in range(width):
        token = jnp.maximum(tokens[:, e], 0)[:, None]  # PAD past the counts: read, never kept
        found = tables.completes[strings, states, token]  # [B, S]
        completes.append((found if applies is None else found & applies).any(-1))
        states = tables.next_state[strings, states, token].astype(jnp.int32)
        after.append(states)
    kept = jnp.take_along_axis(jnp.stack(after, 1), counts[:, None, None], axis=1)[:, 0]  # [B, S]
    return jnp.stack(completes, 1), kept
