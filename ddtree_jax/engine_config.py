"""The engine's static configuration: ``EngineConfig`` (decoding mode, budget, limits, stopping, sampling and
logit processing, kept log-probabilities), validated on construction, and the cache sizes it implies.

Shapes and names as in ``ddtree_jax.engine``, which re-exports everything here.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from ddtree_jax.checks import is_integer, is_token_id
from ddtree_jax.decode import check_prefill_chunk
from ddtree_jax.processors import (LogitProcessing, check_additive_penalty, check_allowed_token_ids, check_logit_bias,
                                   check_min_new_tokens, check_repetition_penalty, processing_for)
from ddtree_jax.sampling import check_min_p, check_top_k, check_top_p
from ddtree_jax.stop_strings import check_stop_strings
from ddtree_jax.stopping import check_id_sequences, check_stop_sequences
from ddtree_jax.stream_settings import NUMBERS, StreamSettings, uniform_settings
from ddtree_jax.tree import check_budget

MODES = ("ar", "dflash", "ddtree")
LOGPROBS_MODES = ("raw", "processed")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Static decoding choices (part of the compiled program's key)."""

    mode: str = "ddtree"
    budget: int = 32  # DDTree node budget (tree has budget + 1 nodes); ignored by ar/dflash
    max_new_tokens: int = 64
    capacity: int = 1024  # target / draft cache slots per stream (a multiple of 8 for the Mosaic GPU attention)
    rounds_per_dispatch: int = 64
    prefill_chunk: int | None = 2048  # a prompt's prefill runs in blocks of this many tokens (None: one block)
    eos_ids: tuple[int, ...] = ()
    stop_sequences: tuple[tuple[int, ...], ...] = ()  # a stream stops after generating any of these in a row
    stop_strings: tuple[str, ...] = ()  # or once its generated text holds one (``stop_strings``; needs a tokenizer)
    # top_k, top_p, min_p, min_new_tokens and the three penalties are every stream's unless ``prefill`` (``stream``,
    # ``generate``) gives its own: one for every stream, or one per stream (``stream_settings``).
    top_k: int = 0  # sampling keeps the top_k likeliest tokens (0: all); greedy decoding ignores it
    top_p: float = 1.0  # then the fewest likeliest whose mass reaches top_p (1: all); ``sampling.truncate``
    min_p: float = 0.0  # then those at least min_p times as likely as the likeliest (0: all)
    # Before the temperature and the filters, greedy decoding too (``processors``):
    allowed_token_ids: tuple[int, ...] = ()  # only these may be generated (empty: all)
    bad_words: tuple[tuple[int, ...], ...] = ()  # a sequence's last token is never generated right after the rest
    logit_bias: tuple[tuple[int, float], ...] = ()  # amounts added to tokens' logits: {id: amount} or pairs
    min_new_tokens: int = 0  # no EOS and no stop sequence ends a stream within its first min_new_tokens tokens
    repetition_penalty: float = 1.0  # on the prompt's and the output's tokens (1: off)
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output (0: off)
    presence_penalty: float = 0.0  # subtracted once for a token in the output (0: off)
    logprobs: bool = False  # also keep each emitted token's log-probability under the target (``scores``)
    top_logprobs: int = 0  # and, with logprobs, the target's top_logprobs likeliest tokens at each place
    logprobs_mode: str = "raw"  # "raw": the model's distribution; "processed": the one each token was taken from

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        for name in ("budget", "max_new_tokens", "capacity", "rounds_per_dispatch"):
            value = getattr(self, name)
            if not is_integer(value):
                raise ValueError(f"{name} must be an integer, got {value!r}")
            object.__setattr__(self, name, int(value))
        if self.mode == "ddtree":
            check_budget(self.budget)
        for name in ("max_new_tokens", "capacity", "rounds_per_dispatch"):  # int32 on the device
            if not 1 <= getattr(self, name) < 2**31:
                raise ValueError(f"{name} must be in [1, 2**31 - 1], got {getattr(self, name)}")
        eos_ids = tuple(self.eos_ids) if isinstance(self.eos_ids, (list, tuple)) else None
        if eos_ids is None or not all(is_token_id(i) for i in eos_ids):
            raise ValueError(f"eos_ids must be a sequence of token ids >= 0, got {self.eos_ids!r}")
        object.__setattr__(self, "eos_ids", tuple(int(i) for i in eos_ids))
        object.__setattr__(self, "prefill_chunk", check_prefill_chunk(self.prefill_chunk))
        object.__setattr__(self, "stop_sequences", check_stop_sequences(self.stop_sequences))
        object.__setattr__(self, "stop_strings", check_stop_strings(self.stop_strings))
        object.__setattr__(self, "top_k", check_top_k(self.top_k))
        object.__setattr__(self, "top_p", check_top_p(self.top_p))
        object.__setattr__(self, "min_p", check_min_p(self.min_p))
        object.__setattr__(self, "allowed_token_ids", check_allowed_token_ids(self.allowed_token_ids))
        object.__setattr__(self, "bad_words", check_id_sequences(self.bad_words, "bad_words"))
        object.__setattr__(self, "logit_bias", check_logit_bias(self.logit_bias))
        object.__setattr__(self, "min_new_tokens", check_min_new_tokens(self.min_new_tokens))
        self.check_min_new_tokens(self.min_new_tokens, self.max_new_tokens)
        object.__setattr__(self, "repetition_penalty", check_repetition_penalty(self.repetition_penalty))
        for name in ("frequency_penalty", "presence_penalty"):
            object.__setattr__(self, name, check_additive_penalty(name, getattr(self, name)))
        if not isinstance(self.logprobs, (bool, np.bool_)):
            raise ValueError(f"logprobs must be True or False, got {self.logprobs!r}")
        object.__setattr__(self, "logprobs", bool(self.logprobs))
        if not is_integer(self.top_logprobs) or self.top_logprobs < 0:
            raise ValueError(f"top_logprobs must be an integer >= 0 (0: none), got {self.top_logprobs!r}")
        if self.top_logprobs and not self.logprobs:
            raise ValueError(f"top_logprobs={self.top_logprobs} is kept beside the log-probabilities: "
                             "give logprobs=True too")
        object.__setattr__(self, "top_logprobs", int(self.top_logprobs))
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}")
        if self.logprobs_mode != "raw" and not self.logprobs:
            raise ValueError(f"logprobs_mode={self.logprobs_mode!r} says which log-probabilities to keep: "
                             "give logprobs=True too")

    @property
    def kept_logprobs(self) -> str | None:
        """The log-probabilities kept: None, or ``logprobs_mode``."""
        return self.logprobs_mode if self.logprobs else None

    def check_min_new_tokens(self, min_new_tokens: int, limit: int, stop_strings: tuple[str, ...] | None = None,
                             stop_ids: Sequence[int] = (), allowed: Sequence[int] | None = None,
                             stop_sequences: Sequence[Sequence[int]] | None = None,
                             eos_ids: Sequence[int] | None = None):
        """ValueError where a stream's min_new_tokens cannot hold: past its token limit, with nothing it holds back,
        or holding back every allowed token. ``stop_strings``, ``stop_sequences``: the stream's (None: the config's);
        ``stop_ids``: its own stop token ids; ``allowed``: its allowed token ids (None: the config's; empty: all);
        ``eos_ids``: its EOS ids (None: the config's)."""
        allowed = self.allowed_token_ids if allowed is None else allowed
        if min_new_tokens > limit:
            raise ValueError(f"min_new_tokens={min_new_tokens} passes max_new_tokens={limit}")
        held = set(self.eos_ids if eos_ids is None else eos_ids) | set(stop_ids)
        if min_new_tokens and allowed and set(allowed) <= held:
            raise ValueError(f"min_new_tokens={min_new_tokens} holds back every allowed token "
                             f"{list(allowed)}: they are all EOS ids or stop token ids")
        if min_new_tokens and not self.holds_back(stop_strings, stop_ids, stop_sequences, eos_ids):
            raise ValueError(f"min_new_tokens={min_new_tokens} holds back EOS ids, stop token ids and stop sequences: "
                             "give eos_ids, stop_token_ids, stop_sequences or stop_strings")

    def holds_back(self, stop_strings: tuple[str, ...] | None = None, stop_ids: Sequence[int] = (),
                   stop_sequences: Sequence[Sequence[int]] | None = None, eos_ids: Sequence[int] | None = None) -> bool:
        """Whether a stream with these stop settings (None: the config's) has anything min_new_tokens holds back."""
        stop_strings = self.stop_strings if stop_strings is None else stop_strings
        stop_sequences = self.stop_sequences if stop_sequences is None else stop_sequences
        held = set(self.eos_ids if eos_ids is None else eos_ids) | set(stop_ids)
        return bool(held or stop_sequences or stop_strings)

    @property
    def settings(self) -> dict:
        """The config's numbers for the streams not given their own (``stream_settings.NUMBERS``)."""
        return {name: getattr(self, name) for name in NUMBERS}

    def processing_of(self, settings: StreamSettings) -> LogitProcessing:
        """The LogitProcessing of a batch with these host settings (numpy)."""
        return processing_for(settings, allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
                              logit_bias=self.logit_bias, eos_ids=self.eos_ids)

    @property
    def processing(self) -> LogitProcessing:
        """The LogitProcessing of a batch with the config's own numbers."""
        return self.processing_of(uniform_settings(1, **self.settings))



def required_capacity(longest_prompt: int, max_new_tokens: int, depth: int) -> int:
    """Cache slots a stream needs so that it never stops at ``cache_full``: a round starts with at most
    ``max_new_tokens - 1`` tokens out (all but the pending bonus token committed after the prompt) and
    needs room for its tree of ``depth + 1`` rows (``tree_depth``); prefill alone keeps ``depth + 1`` free."""
    return longest_prompt + depth + max(max_new_tokens - 1, 1)


def tree_depth(ecfg: EngineConfig, block_size: int) -> int:
    if ecfg.mode == "ar":
        return 0
    if ecfg.mode == "dflash":
        return block_size - 1
    return min(block_size - 1, ecfg.budget)
