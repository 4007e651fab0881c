"""Logit processing: what the target's raw logits at a place go through before the temperature and the filters
(``sampling.truncate``), greedy decoding included. In vLLM's order:

0. ``allowed_token_ids``: every other token at -inf (vLLM's ``allowed_token_ids``; the config's for every stream, or
   each stream's own); ``bad_words``: a sequence's last token at -inf where the context ends with the rest of it
   (transformers' ``NoBadWordsLogitsProcessor``; the config's, or each stream's own).
1. ``logit_bias``: a fixed amount added to chosen tokens' logits (OpenAI's ``logit_bias``; transformers'
   ``SequenceBiasLogitsProcessor`` for one-token sequences).
2. ``min_new_tokens``: the EOS ids (the config's or the stream's own) and the stream's own stop token ids at -inf
   while the stream has generated fewer than min_new_tokens tokens (transformers' ``MinNewTokensLengthLogitsProcessor``;
   vLLM's ``min_tokens``).
3. ``repetition_penalty`` over the prompt and the output: a negative logit times the penalty, any other over it
   (transformers' ``RepetitionPenaltyLogitsProcessor``).
4. ``frequency_penalty`` and ``presence_penalty`` over the output: logit - frequency * count - presence * (count > 0)
   (OpenAI's and vLLM's).

A tree node's place is the one after its path: its context is the stream's prompt and output (whose last token is
the tree's root, the bonus) and the tokens of the node's ancestors below the root and its own; the token drawn there
would be output token num_out + depth. Bad words read the context's last tokens: the node's path up the parents,
then the stream's last tokens (``TokenHistory.recent``). So each node is processed as plain decoding would process
that place, and the acceptance walk stays lossless. The log-probabilities kept with ``EngineConfig(logprobs=True)``
are the raw model's unless ``logprobs_mode="processed"``.

Shapes: B streams, T places (tree nodes; 1 for the place after the history), W vocabulary, L tokens, K = the
longest bad word's length - 1.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax.checks import is_integer, is_number, is_token_id
from ddtree_jax.stopping import NO_TOKEN_ID
from ddtree_jax.stream_settings import StreamSettings, sequence_table
from ddtree_jax.tree import PAD, Tree


@dataclasses.dataclass(frozen=True)
class LogitProcessing:
    """The static part of the processing (part of a compiled program's key): the token sets, and which of the
    per-stream numbers (``StreamSettings``: the penalties and min_new_tokens) some stream uses. The defaults change
    nothing."""

    allowed_token_ids: tuple[int, ...] = ()  # ascending; empty: all
    stream_allowed: bool = False  # some stream is restricted to its own allowed ids (``StreamSettings.allowed``)
    bad_words: tuple[tuple[int, ...], ...] = ()  # token-id sequences whose last token is banned after the rest
    stream_bad_words: int = 0  # L of each stream's own bad words (``StreamSettings.bad_words``), where some has one
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, amount) pairs, ids ascending
    stream_logit_bias: bool = False  # each stream's own pairs (``StreamSettings.logit_bias``) hold some token
    eos_ids: tuple[int, ...] = ()  # held back by min_new_tokens
    stream_stop_ids: bool = False  # some stream has its own stop token ids (``StreamSettings.stop_ids``), held back too
    stream_eos: bool = False  # the streams have their own EOS ids (``StreamSettings.eos_ids``; ``eos_ids`` then empty)
    repetition_penalty: bool = False  # some stream's is not 1
    frequency_penalty: bool = False  # some stream's is not 0
    presence_penalty: bool = False  # some stream's is not 0
    min_new_tokens: bool = False  # some stream's is > 0

    @property
    def penalises(self) -> bool:
        """Whether the penalties read the stream's history (``TokenHistory``)."""
        return self.repetition_penalty or self.frequency_penalty or self.presence_penalty

    @property
    def window(self) -> int:
        """K: the context's last tokens the bad words read (0: none)."""
        return max(max((len(w) - 1 for w in self.bad_words), default=0), self.stream_bad_words - 1)

    @property
    def holds_eos(self) -> bool:
        """Whether min_new_tokens holds EOS ids or streams' stop token ids back (it also holds back stop sequences:
        ``stopping``)."""
        return self.min_new_tokens and (bool(self.eos_ids) or self.stream_stop_ids or self.stream_eos)

    @property
    def bans(self) -> bool:
        """Whether a place's logits may all end at -inf (``mark_no_token``): where the allowed ids are few, the bad
        words and min_new_tokens' hold-back may ban every one of them."""
        return (bool(self.allowed_token_ids) or self.stream_allowed or bool(self.bad_words)
                or bool(self.stream_bad_words) or self.holds_eos)

    @property
    def changes_logits(self) -> bool:
        return (bool(self.allowed_token_ids) or bool(self.bad_words) or bool(self.logit_bias) or self.holds_eos
                or self.penalises or self.stream_logit_bias or self.stream_allowed or bool(self.stream_bad_words))


def processing_for(settings: StreamSettings, *, allowed_token_ids=(), bad_words=(), logit_bias=(),
                   eos_ids=()) -> LogitProcessing:
    """The LogitProcessing of a batch: the token sets (checked) and the numbers its host settings (numpy) use.
    ``logit_bias``, ``allowed_token_ids`` and ``bad_words`` (every stream's, compiled in) are left out where the
    streams have their own (``settings.logit_bias``, ``settings.allowed``, ``settings.bad_words``)."""
    own, own_allowed, own_words = settings.logit_bias, settings.allowed, settings.bad_words
    return LogitProcessing(
        allowed_token_ids=check_allowed_token_ids(allowed_token_ids) if own_allowed is None else (),
        stream_allowed=own_allowed is not None and bool(np.asarray(own_allowed.restricted).any()),
        bad_words=tuple(map(tuple, bad_words)) if own_words is None else (),
        stream_bad_words=(np.shape(own_words.tokens)[2] if own_words is not None
                          and bool((np.asarray(own_words.lengths) > 0).any()) else 0),
        logit_bias=check_logit_bias(logit_bias) if own is None else (),
        eos_ids=tuple(eos_ids) if settings.eos_ids is None else (), stream_eos=settings.eos_ids is not None,
        stream_stop_ids=settings.stop_ids is not None,
        stream_logit_bias=own is not None and bool((np.asarray(own.amounts) != 0).any()),
        repetition_penalty=bool((np.asarray(settings.repetition_penalty) != 1).any()),
        frequency_penalty=bool((np.asarray(settings.frequency_penalty) != 0).any()),
        presence_penalty=bool((np.asarray(settings.presence_penalty) != 0).any()),
        min_new_tokens=bool((np.asarray(settings.min_new_tokens) > 0).any()))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenHistory:
    """What the penalties read of a stream's tokens."""

    prompt_seen: jax.Array | None  # [B, W] bool: the prompt's tokens (repetition penalty); else None
    out_counts: jax.Array | None  # [B, W] int32: how often each token is in the output (penalties); else None
    recent: jax.Array | None  # [B, K] int32: the prompt's and output's last K tokens, PAD before the first (bad words)


PENALTY_RANGE = 2.0  # frequency and presence penalties lie in [-2, 2], as vLLM and OpenAI's API take them
LOGIT_BIAS_RANGE = 100.0  # logit bias amounts in [-100, 100], as OpenAI's API takes them


# A seen token's logit is divided (positive) or multiplied (negative) by the penalty in float32: within this range
# any logit below 2^107 in size stays finite (a penalty of 1e-38 made positive logits +inf, picked as a tie).
REPETITION_PENALTY_RANGE = (2.0**-20, 2.0**20)


def check_repetition_penalty(penalty) -> float:
    """repetition_penalty as a float in REPETITION_PENALTY_RANGE (1: off); ValueError naming the range otherwise
    (NaN included)."""
    low, high = REPETITION_PENALTY_RANGE
    if not is_number(penalty) or not low <= penalty <= high:
        raise ValueError(f"repetition_penalty must be a number in [2^-20, 2^20] (1: off; > 1 discourages repeats), "
                         f"got {penalty!r}")
    return float(penalty)


def check_additive_penalty(name: str, penalty) -> float:
    """frequency_penalty or presence_penalty as a float in [-2, 2] (0: off; negative ones favour repeats)."""
    if not is_number(penalty) or not -PENALTY_RANGE <= penalty <= PENALTY_RANGE:
        raise ValueError(f"{name} must be a number in [-{PENALTY_RANGE:g}, {PENALTY_RANGE:g}] (0: off), "
                         f"got {penalty!r}")
    return float(penalty)


def check_allowed_token_ids(allowed, vocab_size: int | None = None) -> tuple[int, ...]:
    """allowed_token_ids as ascending distinct ids >= 0 (below ``vocab_size`` where given; empty: every token);
    ValueError otherwise."""
    if isinstance(allowed, (str, bytes)) or not isinstance(allowed, (list, tuple, set, frozenset)):
        raise ValueError(f"allowed_token_ids must be a sequence of token ids (empty: all), got {allowed!r}")
    bad = [t for t in allowed if not is_token_id(t)]
    if bad:
        raise ValueError(f"allowed_token_ids must be token ids >= 0, got {bad[0]!r}")
    if vocab_size is not None and any(t >= vocab_size for t in allowed):
        raise ValueError(f"allowed_token_ids {sorted(t for t in allowed if t >= vocab_size)} are outside the "
                         f"vocabulary [0, {vocab_size})")
    return tuple(sorted({int(t) for t in allowed}))


def check_min_new_tokens(min_new_tokens) -> int:
    if not is_integer(min_new_tokens):
        raise ValueError(f"min_new_tokens must be an integer (0: off), got {min_new_tokens!r}")
    if min_new_tokens < 0:
        raise ValueError(f"min_new_tokens must be >= 0 (0: off), got {min_new_tokens}")
    return int(min_new_tokens)


def check_logit_bias(logit_bias, vocab_size: int | None = None) -> tuple[tuple[int, float], ...]:
    """A mapping {token id: amount} or a sequence of (token id, amount) pairs -> the pairs, ids ascending. Ids are
    integers >= 0 (below ``vocab_size`` where given), each at most once; amounts numbers in [-100, 100] (a ban:
    -100). ValueError otherwise."""
    example = "e.g. {13: -100.0, 42: 2.5}"
    if isinstance(logit_bias, dict):
        pairs = list(logit_bias.items())
    elif isinstance(logit_bias, (list, tuple)):
        pairs = list(logit_bias)
    else:
        raise ValueError(f"logit_bias must be a mapping of token id to amount ({example}), got {logit_bias!r}")
    checked = {}
    for pair in pairs:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ValueError(f"logit_bias must hold (token id, amount) pairs ({example}), got {pair!r}")
        token, amount = pair
        if not is_token_id(token):
            raise ValueError(f"logit_bias's token ids must be integers >= 0, got {token!r}")
        if vocab_size is not None and token >= vocab_size:
            raise ValueError(f"logit_bias's token id {token} is outside the vocabulary [0, {vocab_size})")
        if not is_number(amount) or not -LOGIT_BIAS_RANGE <= amount <= LOGIT_BIAS_RANGE:
            raise ValueError(f"logit_bias[{token}] must be a number in [-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}] "
                             f"(a ban: -100), got {amount!r}")
        if int(token) in checked:
            raise ValueError(f"logit_bias gives token {token} twice")
        checked[int(token)] = float(amount)
    return tuple(sorted(checked.items()))


def start_history(processing: LogitProcessing, prompts: jax.Array, lengths: jax.Array,
                  vocab_size: int) -> TokenHistory | None:
    """The history after the prompts [B, P] (each stream's first lengths[b] tokens) and no output; None where
    nothing reads it."""
    k = processing.window
    if not processing.penalises and not k:
        return None
    b = prompts.shape[0]
    prompt_seen = out_counts = recent = None
    if processing.repetition_penalty:
        prompt_seen = _scatter(jnp.zeros((b, vocab_size), bool), prompts, lengths, True)
    if processing.penalises:
        out_counts = jnp.zeros((b, vocab_size), jnp.int32)
    if k:
        recent = _last_tokens(jnp.full((b, k), PAD, jnp.int32), prompts, lengths)
    return TokenHistory(prompt_seen=prompt_seen, out_counts=out_counts, recent=recent)


def extend_history(history: TokenHistory | None, tokens: jax.Array, counts: jax.Array) -> TokenHistory | None:
    """The history with each stream's first counts[b] of tokens [B, L] appended to its output."""
    if history is None:
        return None
    out_counts = None if history.out_counts is None else _scatter(history.out_counts, tokens, counts, 1)
    recent = None if history.recent is None else _last_tokens(history.recent, tokens, counts)
    return dataclasses.replace(history, out_counts=out_counts, recent=recent)


def _last_tokens(recent, tokens, counts):
    """recent [B, K] then each stream's first counts[b] of tokens [B, L]: the last K of them."""
    k = recent.shape[1]
    joined = jnp.concatenate([recent, tokens.astype(recent.dtype)], axis=1)  # [B, K + L]
    return jnp.take_along_axis(joined, counts[:, None] + jnp.arange(k)[None, :], axis=1)


def _scatter(table, tokens, counts, value):
    """table [B, W] with each stream's first counts[b] of tokens [B, L] set to ``value`` (bool) or counted (int)."""
    b, length = tokens.shape
    ids = jnp.where(jnp.arange(length)[None, :] < counts[:, None], tokens, table.shape[1])  # past counts: dropped
    rows = jnp.arange(b)[:, None]
    if table.dtype == bool:
        return table.at[rows, ids].set(value, mode="drop")
    return table.at[rows, ids].add(value, mode="drop")


def node_counts(out_counts: jax.Array, tokens: jax.Array, visibility: jax.Array, depths: jax.Array) -> jax.Array:
    """Each node's output counts: out_counts [B, W] (the root, the stream's last output token, included) plus the
    tokens of the node's ancestors below the root and its own (tokens [B, T], visibility [B, T, T]: node j an
    ancestor of node i or i itself, depths [B, T]) -> [B, T, W] int32. Padding nodes (negative ids) add nothing."""
    b, t = tokens.shape
    w = out_counts.shape[-1]
    counted = visibility & ((depths > 0) & (tokens >= 0))[:, None, :]  # [B, T(i), T(j)]
    ids = jnp.where(counted, tokens[:, None, :], w)  # w: not in i's context, dropped
    rows = jnp.arange(b)[:, None, None]
    nodes = jnp.arange(t)[None, :, None]
    return jnp.broadcast_to(out_counts[:, None, :], (b, t, w)).at[rows, nodes, ids].add(1, mode="drop")


def node_windows(recent: jax.Array, tree: Tree | None) -> jax.Array:
    """Each place's last K context tokens, the last first: recent [B, K] (the stream's, whose last is the root) and
    the tree's parents [B, T] -> [B, T, K]: a node itself, its ancestors up to the root, then the stream's tokens
    before the root. Without a tree, the place after the history: [B, 1, K]."""
    k = recent.shape[1]
    back = recent[:, ::-1]  # [B, K], the last first
    if tree is None:
        return back[:, None, :]
    b, t = tree.tokens.shape
    rows = jnp.arange(b)[:, None]
    node = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    above_root = jnp.zeros((b, t), jnp.int32)  # tokens taken from the stream once the walk passed the root
    columns = []
    for _ in range(k):
        in_tree = node >= 0
        from_stream = jnp.take_along_axis(back, jnp.minimum(above_root + 1, k - 1), axis=1)  # back[0]: the root
        columns.append(jnp.where(in_tree, tree.tokens[rows, jnp.maximum(node, 0)], from_stream))
        above_root = jnp.where(in_tree, above_root, above_root + 1)
        node = jnp.where(in_tree, tree.parents[rows, jnp.maximum(node, 0)], -1)
    return jnp.stack(columns, axis=-1)


def apply_repetition_penalty(logits: jax.Array, seen: jax.Array, penalty) -> jax.Array:
    """logits [..., W] -> float32 logits with every token of ``seen`` [..., W] (bool: in the context) penalised as
    transformers' ``RepetitionPenaltyLogitsProcessor`` does: a negative logit times ``penalty``, any other over it
    (``penalty``: a number, or an array that broadcasts against the logits)."""
    logits = logits.astype(jnp.float32)
    penalised = jnp.where(logits < 0, logits * penalty, logits / penalty)
    return jnp.where(seen, penalised, logits)


def process_logits(logits: jax.Array, processing: LogitProcessing, settings: StreamSettings,
                   history: TokenHistory | None, num_out: jax.Array, tree: Tree | None = None) -> jax.Array:
    """logits [B, T, W] at T places -> the processed logits (float32; unchanged where ``processing`` changes
    nothing). ``settings``: each stream's penalties and min_new_tokens ([B]; read where ``processing`` says some
    stream uses them). num_out [B]: tokens each stream has generated, the root's included. Without a tree, T = 1
    and the place is the one after the history; with one, each node's (see the module's docstring)."""
    if not processing.changes_logits:
        return logits
    b, t, w = logits.shape
    if tree is None and t != 1:
        raise ValueError(f"without a tree there is one place to process, got {t}")
    depths = jnp.zeros((b, 1), jnp.int32) if tree is None else tree.depths
    if (processing.penalises or processing.window) and history is None:
        raise ValueError("the penalties and bad words read the stream's history: a TokenHistory is needed")
    per_stream = functools.partial(jnp.reshape, shape=(b, 1, 1))
    logits = logits.astype(jnp.float32)
    if processing.allowed_token_ids:
        allowed = np.zeros(w, bool)
        allowed[list(processing.allowed_token_ids)] = True
        logits = jnp.where(allowed, logits, -jnp.inf)
    if processing.stream_allowed:  # a row's padding names no token: dropped
        own = settings.allowed
        allowed = jnp.zeros((b, w), bool).at[jnp.arange(b)[:, None], own.ids].set(True, mode="drop")
        logits = jnp.where((allowed | ~own.restricted[:, None])[:, None, :], logits, -jnp.inf)
    windows = node_windows(history.recent, tree) if processing.window else None
    if processing.bad_words:
        logits = _ban_bad_words(logits, processing.bad_words, windows)
    if processing.stream_bad_words:
        logits = _ban_stream_bad_words(logits, settings.bad_words, windows)
    # The biases are added as dense rows, which fuse into the logits' next reader; a scatter into the [B, T, W]
    # logits would write them anew.
    if processing.logit_bias:
        ids, amounts = zip(*processing.logit_bias)
        row = np.zeros(w, np.float32)
        row[list(ids)] = amounts
        logits = logits + row
    if processing.stream_logit_bias:  # a stream's unused pairs name no token: dropped
        own = settings.logit_bias
        rows = jnp.zeros((b, w), jnp.float32).at[jnp.arange(b)[:, None], own.ids].add(
            own.amounts.astype(jnp.float32), mode="drop")
        logits = logits + rows[:, None, :]
    if processing.holds_eos:
        early = num_out[:, None] + depths < settings.min_new_tokens[:, None]  # [B, T]: the place's output index
        held = np.zeros((1, w), bool)
        held[0, list(processing.eos_ids)] = True
        own = [ids for ids, has in ((settings.stop_ids, processing.stream_stop_ids),
                                    (settings.eos_ids, processing.stream_eos)) if has]
        if own:  # a row's padding (the vocabulary's size) names no token: dropped
            held = jnp.asarray(held).repeat(b, 0).at[jnp.arange(b)[:, None], jnp.concatenate(own, axis=1)].set(
                True, mode="drop")
        logits = jnp.where(early[:, :, None] & held[:, None, :], -jnp.inf, logits)
    if processing.penalises:
        counts = history.out_counts[:, None, :] if tree is None else node_counts(history.out_counts, tree.tokens,
                                                                                 tree.visibility, tree.depths)
        if processing.repetition_penalty:
            seen = (counts > 0) | history.prompt_seen[:, None, :]
            logits = apply_repetition_penalty(logits, seen, per_stream(settings.repetition_penalty))
        if processing.frequency_penalty:
            logits = logits - per_stream(settings.frequency_penalty) * counts.astype(jnp.float32)
        if processing.presence_penalty:
            logits = logits - jnp.where(counts > 0, per_stream(settings.presence_penalty), 0.0)
    return logits


def mark_no_token(tokens: jax.Array, processed: jax.Array, processing: LogitProcessing) -> jax.Array:
    """tokens [B, T] taken from the processed logits [B, T, W], with ``stopping.NO_TOKEN_ID`` where a row holds no
    finite logit: the processing banned every token there, so the argmax or a draw would be a banned token (the
    stream then stops there, status NO_TOKEN). Unchanged where the processing bans nothing."""
    if not processing.bans:
        return tokens
    return jnp.where((processed > -jnp.inf).any(-1), tokens, NO_TOKEN_ID)


def _ban_bad_words(logits, bad_words, windows):
    """logits [B, T, W] with each bad word's last token at -inf where the place's context ends with the rest of it
    (windows [B, T, K]: the last K context tokens, the last first; None where every word is one token): the
    one-token words as one constant mask, the others as every stream's own (``_ban_stream_bad_words``)."""
    single = [word[0] for word in bad_words if len(word) == 1]
    if single:
        logits = jnp.where(np.isin(np.arange(logits.shape[-1]), single), -jnp.inf, logits)
    longer = [word for word in bad_words if len(word) > 1]
    return _ban_stream_bad_words(logits, sequence_table([longer], round_up=False), windows) if longer else logits


def _ban_stream_bad_words(logits, words, windows):
    """``_ban_bad_words`` for each stream's own words (a StreamWords: [B or 1, NW, L] right-aligned, their lengths
    [B or 1, NW]); windows [B, T, K >= L - 1] (None where L = 1). The bans are elementwise, so they fuse into the
    logits' next reader."""
    b, t, w = logits.shape
    count, length = words.tokens.shape[1:]
    if length - 1 > (0 if windows is None else windows.shape[2]):
        raise ValueError(f"words of {length} tokens need the context's last {length - 1} tokens, the windows hold "
                         f"{0 if windows is None else windows.shape[2]}")
    ends_with_prefix = jnp.broadcast_to((words.lengths > 0)[:, None, :], (b, t, count))  # [B, T, NW]
    for back in range(length - 1):  # the context's back-th last token against the word's token before that
        reaches = (words.lengths > back + 1)[:, None, :]
        ends_with_prefix &= ~reaches | (windows[:, :, back, None] == words.tokens[:, None, :, length - 2 - back])
    banned = jnp.where(ends_with_prefix, words.tokens[:, None, :, -1], w)  # [B, T, NW]; w: no token
    vocab = jnp.arange(w)
    for j in range(count):
        logits = jnp.where(vocab == banned[:, :, j, None], -jnp.inf, logits)
    return logits
