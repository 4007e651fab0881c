"""Each stream's own numbers: its temperature, seed and token limit, and beside them its filters (top_k, top_p,
min_p), penalties (repetition, frequency, presence) and min_new_tokens. They are given to ``Engine.prefill`` as one
value for every stream or a sequence of one per stream, checked here on the host, and carried in the decode state
as [B] arrays, so one compiled program serves any values. So are a stream's own token sets, given the same ways:
its logit bias (``StreamBias``: (token id, amount) pairs, [B, M]), EOS and stop token ids ([B, M]), allowed token ids
(``StreamAllowed``), and bad words and stop sequences (``StreamWords``: [B, NW, L] right-aligned ids).

What a program compiles is read from the values once, at the prefill (``Switches`` and
``processors.processing_for``, static parts of the state): a filter or penalty that no stream of the batch uses
costs nothing, and a batch of greedy streams takes no random draws. A per-stream top_k takes one top-k of
``Switches.top_k_ceiling`` values, the batch's largest k rounded up to a power of two (so batches of different k
share few programs).

Shapes: B streams.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from ddtree_jax.checks import is_integer, is_number
from ddtree_jax.sampling import check_hot_temperature

PENALTIES = ("repetition_penalty", "frequency_penalty", "presence_penalty")
NUMBERS = ("top_k", "top_p", "min_p") + PENALTIES + ("min_new_tokens",)
"""The numbers of ``StreamSettings``, each also an ``EngineConfig`` field: the value for streams not given one."""
OFF = {"top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0, "frequency_penalty": 0.0,
       "presence_penalty": 0.0, "min_new_tokens": 0}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StreamSettings:
    """Each stream's filters, penalties and min_new_tokens: [B] arrays (numpy on the host, traced on the device)."""

    top_k: jax.Array  # [B] int32: keep the top_k likeliest tokens (0: all)
    top_p: jax.Array  # [B] float32: then the fewest likeliest whose mass reaches top_p (1: all)
    min_p: jax.Array  # [B] float32: then those at least min_p times as likely as the likeliest (0: all)
    repetition_penalty: jax.Array  # [B] float32 (1: off)
    frequency_penalty: jax.Array  # [B] float32 (0: off)
    presence_penalty: jax.Array  # [B] float32 (0: off)
    min_new_tokens: jax.Array  # [B] int32 (0: off)
    logit_bias: StreamBias | None = None  # each stream's own logit bias (``stream_logit_bias``); None: the config's
    stop_ids: jax.Array | None = None  # [B, M] int32: each stream's own stop token ids (``stream_stop_ids``)
    eos_ids: jax.Array | None = None  # [B, M] int32: each stream's own EOS ids (``stream_eos_ids``); None: the config's
    allowed: StreamAllowed | None = None  # each stream's own allowed token ids (``stream_allowed_ids``); None: the
    # config's
    bad_words: StreamWords | None = None  # each stream's own bad words (``stream_sequences``); None: the config's
    stop_sequences: StreamWords | None = None  # each stream's own stop sequences (``stream_sequences``); None: the
    # config's


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StreamBias:
    """Each stream's logit bias: M (token id, amount) pairs a stream, M a power of two >= the batch's most pairs;
    a stream's unused pairs hold an id past the vocabulary (their amounts are dropped) and amount 0."""

    ids: jax.Array  # [B, M] int32
    amounts: jax.Array  # [B, M] float32


def stream_logit_bias(logit_bias, streams: int, vocab_size: int, default, check_one) -> StreamBias | None:
    """Each stream's logit bias as a StreamBias (numpy), or None where ``logit_bias`` is None (every stream takes
    the config's, compiled in as constants). ``logit_bias``: one mapping {token id: amount} (or a sequence of
    (id, amount) pairs) for every stream, or a sequence of one mapping or None per stream (None: ``default``, the
    config's); each checked by ``check_one`` (``processors.check_logit_bias``), its ids below ``vocab_size``."""
    if logit_bias is None:
        return None
    pairs = []
    for where, item in stream_items(logit_bias, streams, "logit_bias",
                                    "one mapping {token id: amount} (e.g. {13: -100.0})",
                                    lambda item: isinstance(item, dict)):
        try:
            pairs.append(check_one(default if item is None else item, vocab_size))
        except ValueError as e:
            raise ValueError(f"{where}{e}") from None
    width = 1 << max(max(map(len, pairs)) - 1, 0).bit_length()
    ids = np.full((streams, width), vocab_size, np.int32)
    amounts = np.zeros((streams, width), np.float32)
    for b, stream_pairs in enumerate(pairs):
        if stream_pairs:
            ids[b, :len(stream_pairs)], amounts[b, :len(stream_pairs)] = zip(*stream_pairs)
    return StreamBias(ids=ids, amounts=amounts)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StreamAllowed:
    """Each stream's own allowed token ids: M ids a stream (M a power of two; unused places hold an id past the
    vocabulary), and whether the stream is restricted to them at all (False: every token)."""

    ids: jax.Array  # [B, M] int32
    restricted: jax.Array  # [B] bool


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StreamWords:
    """Each stream's own token-id sequences (bad words or stop sequences): NW of them a stream, each right-aligned in
    L places (its last token at L - 1, PAD before its first), NW and L powers of two; a stream's unused ones have
    length 0."""

    tokens: jax.Array  # [B, NW, L] int32
    lengths: jax.Array  # [B, NW] int32


def stream_stop_ids(stop_token_ids, streams: int, vocab_size: int) -> np.ndarray | None:
    """Each stream's own stop token ids, int32 [streams, M] (``padded_ids``), or None where no stream has any.
    ``stop_token_ids``: None, one sequence of token ids for every stream, or a sequence of one sequence (or None:
    none) per stream; every id in [0, vocab_size). ValueError naming the stream otherwise."""
    if stop_token_ids is None:
        return None
    rows = stream_id_lists(stop_token_ids, streams, vocab_size, "stop_token_ids", ())
    return padded_ids(rows, vocab_size) if any(rows) else None


def stream_eos_ids(eos_ids, streams: int, vocab_size: int, default) -> np.ndarray | None:
    """Each stream's own EOS ids, int32 [streams, M] (``padded_ids``; a row of padding alone: no EOS, vLLM's
    ``ignore_eos``), or None where ``eos_ids`` is None (every stream takes the config's, compiled in). ``eos_ids``:
    one sequence of token ids for every stream, or a sequence of one sequence (or None: ``default``, the config's)
    per stream; every id in [0, vocab_size). ValueError naming the stream otherwise."""
    if eos_ids is None:
        return None
    return padded_ids(stream_id_lists(eos_ids, streams, vocab_size, "eos_ids", default), vocab_size)


def stream_allowed_ids(allowed_token_ids, streams: int, vocab_size: int, default) -> StreamAllowed | None:
    """Each stream's own allowed token ids (a StreamAllowed of numpy arrays), or None where ``allowed_token_ids``
    is None (every stream takes the config's, compiled in). ``allowed_token_ids``: one sequence of token ids for
    every stream, or a sequence of one sequence (or None: ``default``, the config's) per stream; an empty one allows
    every token. ValueError naming the stream otherwise."""
    if allowed_token_ids is None:
        return None
    rows = stream_id_lists(allowed_token_ids, streams, vocab_size, "allowed_token_ids", default)
    return StreamAllowed(ids=padded_ids(rows, vocab_size), restricted=np.array([bool(row) for row in rows]))


def stream_sequences(value, streams: int, vocab_size: int, default, check_one, name: str) -> StreamWords | None:
    """Each stream's own token-id sequences (bad words, stop sequences) as a StreamWords of numpy arrays, or None
    where ``value`` is None (every stream takes the config's, ``default``, compiled in). ``value``: one sequence of
    token-id sequences for every stream (e.g. ``[[13, 13], [42]]``), or a sequence of one such sequence (or None:
    ``default``) per stream; each checked by ``check_one`` (``stopping.check_id_sequences``) under ``name``, its ids
    below ``vocab_size``."""
    if value is None:
        return None
    value = _numpy_as_lists(value)
    rows = []
    for where, item in stream_items(value, streams, name, "one sequence of token-id sequences (e.g. [[13, 13], [42]])",
                                    lambda item: isinstance(item, (list, tuple))
                                    and all(isinstance(seq, (list, tuple)) for seq in item)):
        try:
            sequences = check_one(default if item is None else item, name)
        except ValueError as e:
            raise ValueError(f"{where}{e}") from None
        outside = [seq for seq in sequences if max(seq) >= vocab_size]
        if outside:
            raise ValueError(f"{where}{name} {outside} hold ids outside the vocabulary [0, {vocab_size})")
        rows.append(sorted(set(sequences)))
    return sequence_table(rows)


def sequence_table(rows: list[list[tuple[int, ...]]], round_up: bool = True) -> StreamWords:
    """A StreamWords (numpy) of each row's token-id sequences; ``round_up``: NW and L rounded up to powers of two
    (else NW the most sequences a row has, L the longest's length)."""
    count = max(max(map(len, rows)), 1)
    longest = max((len(seq) for sequences in rows for seq in sequences), default=1)
    if round_up:
        count, longest = 1 << (count - 1).bit_length(), 1 << (longest - 1).bit_length()
    tokens = np.full((len(rows), count, longest), -1, np.int32)
    lengths = np.zeros(tokens.shape[:2], np.int32)
    for b, sequences in enumerate(rows):
        for j, seq in enumerate(sequences):
            tokens[b, j, tokens.shape[2] - len(seq):] = seq
            lengths[b, j] = len(seq)
    return StreamWords(tokens=tokens, lengths=lengths)


def stream_id_lists(value, streams: int, vocab_size: int, name: str, default) -> list[list[int]]:
    """Each stream's token ids (ascending, distinct) from ``value``: one sequence of ids for every stream, or a
    sequence of one sequence (or None: ``default``) per stream; every id in [0, vocab_size). ValueError naming
    ``name`` and the stream otherwise."""
    one = "one sequence of token ids (e.g. [13, 42])"
    value = _numpy_as_lists(value, sets=True)
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be {one} or a sequence of one per stream, got {value!r}")
    rows = []
    for where, item in stream_items(value, streams, name, one, lambda item: isinstance(item, (list, tuple))):
        item = default if item is None else item
        bad = [t for t in item if not (is_integer(t) and 0 <= t < vocab_size)]
        if bad:
            raise ValueError(f"{where}{name} must be token ids in [0, {vocab_size}), got {bad[0]!r}")
        rows.append(sorted({int(t) for t in item}))
    return rows


def _numpy_as_lists(value, sets: bool = False):
    """``value`` with numpy arrays (it, or its items) as nested lists of Python ints, the forms the parsers read;
    ``sets``: Python sets too (of token ids, unordered as ``EngineConfig`` takes them; never a sequence's order)."""
    def as_list(item):
        if isinstance(item, np.ndarray):
            return item.tolist()
        return list(item) if sets and isinstance(item, (set, frozenset)) else item
    value = as_list(value)
    return [as_list(item) for item in value] if isinstance(value, (list, tuple)) else value


def stream_items(value, streams: int, name: str, one: str, is_item) -> list[tuple[str, object]]:
    """``value`` as one item per stream: the sequence itself where it holds one item (``is_item``) or None per
    stream, else ``value`` for every stream; each with the prefix its errors take ("stream i's ", or none).
    ValueError where a sequence of items does not hold one per stream (``one`` describes an item)."""
    per = (isinstance(value, (list, tuple)) and len(value) > 0
           and all(item is None or is_item(item) for item in value))
    if per and len(value) != streams:
        raise ValueError(f"{name} must be {one} or a sequence of one per stream ({streams}), got {len(value)} of them")
    return [(f"stream {i}'s " if per else "", item) for i, item in enumerate(value if per else [value] * streams)]


def padded_ids(rows: list[list[int]], vocab_size: int) -> np.ndarray:
    """int32 [len(rows), M]: each row's ids, then ``vocab_size`` (no token) up to M, the longest row's length
    rounded up to a power of two (at least 1)."""
    most = max(max(map(len, rows)), 1)
    ids = np.full((len(rows), 1 << (most - 1).bit_length()), vocab_size, np.int32)
    for b, row in enumerate(rows):
        ids[b, :len(row)] = row
    return ids


def uniform_settings(streams: int, **numbers) -> StreamSettings:
    """Every stream with the same numbers (``NUMBERS``; the others off): numpy [streams] arrays, unchecked."""
    unknown = sorted(set(numbers) - set(NUMBERS))
    if unknown:
        raise ValueError(f"unknown stream settings {unknown}; they are {list(NUMBERS)}")
    values = {**OFF, **numbers}
    return StreamSettings(**{name: np.full((streams,), values[name], _dtype(name)) for name in NUMBERS})


def _dtype(name: str):
    return np.int32 if name in ("top_k", "min_new_tokens") else np.float32


@dataclasses.dataclass(frozen=True)
class Switches:
    """What a decoding program's sampling compiles, read from the batch's settings (static: part of the program's
    key; the penalties' part is ``processors.processing_for``'s)."""

    greedy: bool = True  # every stream decodes greedily: no random draws, no filters
    top_k_ceiling: int = 0  # a power of two >= every stream's top_k (0: no stream has one)
    top_k_in_every_row: bool = False  # every stream has a top_k
    top_p: bool = False  # some stream has top_p < 1
    min_p: bool = False  # some stream has min_p > 0

    def filters(self, settings: StreamSettings) -> dict:
        """``sampling.truncate``'s filter arguments for the batch: each filter's [B] values where some stream uses
        it, its off value otherwise (then it is not compiled)."""
        if not self.top_k_ceiling:
            top_k = {"top_k": 0}
        else:
            top_k = {"top_k": settings.top_k, "top_k_ceiling": self.top_k_ceiling,
                     "top_k_in_every_row": self.top_k_in_every_row}
        return {**top_k, "top_p": settings.top_p if self.top_p else 1.0,
                "min_p": settings.min_p if self.min_p else 0.0}


def switches_of(temperature: np.ndarray, settings: StreamSettings, vocab_size: int) -> Switches:
    """The Switches of a batch from its host values: temperature [B] and numpy settings. A filter is compiled only
    where a stream that samples uses it (greedy decoding ignores them)."""
    hot = np.asarray(temperature) > 0
    top_k = np.asarray(settings.top_k)
    sampled_top_k = top_k[hot].max(initial=0) > 0  # the ceiling also covers greedy streams' k: an index to read
    most = int(top_k.max(initial=0)) if sampled_top_k else 0
    return Switches(
        greedy=not hot.any(),
        top_k_ceiling=min(1 << (most - 1).bit_length(), vocab_size) if most else 0,
        top_k_in_every_row=bool(most) and bool((top_k[hot] > 0).all()),
        top_p=bool((np.asarray(settings.top_p)[hot] < 1).any()),
        min_p=bool((np.asarray(settings.min_p)[hot] > 0).any()),
    )


def check_settings(streams: int, given: dict, defaults: dict, checks: dict) -> StreamSettings:
    """The batch's StreamSettings (numpy): ``given[name]`` (None: ``defaults[name]``, the config's) is one value for
    every stream or a sequence of one (or None: the config's) per stream, each passed through ``checks[name]``;
    ValueError naming the setting and the stream otherwise."""
    values = {}
    for name in NUMBERS:
        value = given.get(name)
        value = defaults[name] if value is None else value
        if isinstance(value, (list, tuple)):  # a stream's None: the config's, as for the per-stream token sets
            value = [defaults[name] if item is None else item for item in value]
        values[name] = np.asarray(per_stream(value, streams, name, "one number", checks[name]), _dtype(name))
    return StreamSettings(**values)


def per_stream(value, streams: int, name: str, one: str, check_one) -> list:
    """``value`` (one for every stream, or a sequence of one per stream) as a list of ``streams`` values, each
    passed through ``check_one``; a ValueError names the stream whose value it refuses."""
    try:
        ndim = np.ndim(value)
    except ValueError:  # a ragged nesting
        ndim = -1
    if ndim == 0:
        return [check_one(_as_python(value))] * streams
    if ndim != 1 or len(value) != streams:
        raise ValueError(f"{name} must be {one} or a sequence of one per stream ({streams}), got {value!r}")
    checked = []
    for i, item in enumerate(np.asarray(value) if hasattr(value, "__array__") else value):
        try:
            checked.append(check_one(_as_python(item)))
        except ValueError as e:
            raise ValueError(f"stream {i}'s {e}") from None
    return checked


def _as_python(value):
    """A numpy or JAX scalar as the Python number it holds (its type checked as that); anything else as given."""
    return np.asarray(value).item() if isinstance(value, (np.generic, jax.Array)) else value


def check_temperature(temperature) -> float:
    """The sampling temperature as a float: 0 (greedy) or in ``sampling.TEMPERATURE_RANGE``; ValueError otherwise."""
    if not is_number(temperature):
        raise ValueError(f"temperature must be a number, got {temperature!r}")
    if not np.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be finite and >= 0 (0: greedy), got {temperature}")
    return check_hot_temperature(temperature) if temperature > 0 else 0.0


def check_temperatures(temperature, streams: int) -> np.ndarray:
    """Each stream's sampling temperature, float32 [streams]: ``temperature`` is one number for every stream or a
    sequence of one per stream, each finite and >= 0 (0: that stream decodes greedily); ValueError otherwise."""
    return np.asarray(per_stream(temperature, streams, "temperature", "one number", check_temperature), np.float32)


def check_token_limits(max_new_tokens, streams: int, most: int) -> np.ndarray:
    """Each stream's token limit, int32 [streams]: ``max_new_tokens`` is None (``most``, the config's), one
    integer for every stream or a sequence of one per stream, each in [1, most]; ValueError otherwise."""
    if max_new_tokens is None:
        return np.full((streams,), most, np.int32)

    def check_one(value) -> int:
        if not is_integer(value):
            raise ValueError(f"max_new_tokens must be an integer, got {value!r}")
        if not 1 <= value <= most:
            raise ValueError(f"max_new_tokens must be in [1, {most}] (EngineConfig.max_new_tokens), got {value}")
        return int(value)

    return np.asarray(per_stream(max_new_tokens, streams, "max_new_tokens", "one integer", check_one), np.int32)


SEED_LIMIT = 2**32
"""Seeds are ints in [0, SEED_LIMIT): ``jax.random.key`` keeps 32 bits without x64, so 2**32 would alias 0 and -1
would alias 2**32 - 1."""


def check_seed(seed) -> int:
    """The sampling seed as an int in [0, SEED_LIMIT); ValueError otherwise."""
    if not is_integer(seed):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    if not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"seed must be in [0, {SEED_LIMIT}) (a 32-bit key), got {seed}")
    return int(seed)


def stream_keys(seed, streams: int) -> jax.Array:
    """Each stream's PRNG key, [streams] typed keys: ``seed`` is one seed for the batch (stream b's key is its key
    folded with b) or a sequence of one per stream (stream b's key is its own seed's folded with 0, so its draws do
    not depend on the batch around it, and one stream draws alike under ``s`` and ``[s]``); each in
    [0, SEED_LIMIT) (``check_seed``); ValueError otherwise."""
    seeds = per_stream(seed, streams, "seed", "one integer", check_seed)
    one = np.ndim(seed) == 0
    return _fold_keys(np.asarray(seeds, np.uint32), np.arange(streams) if one else np.zeros(streams, np.int32))


@jax.jit
def _fold_keys(seeds, folds):
    return jax.vmap(lambda seed, fold: jax.random.fold_in(jax.random.key(seed), fold))(seeds, folds)
