"""The speculative decoding engine: draft -> build -> verify -> accept, many rounds per dispatch.

One round (``_round``) for B streams:
  1. the drafter appends last round's accepted target features to its context cache and drafts
     the next block in one pass: [bonus, MASK x (b-1)] -> per-position logits [B, Dp, W];
  2. the tree: DDTree's best ``budget`` prefixes, the DFlash chain (argmax per position), or for
     AR just the bonus token;
  3. one target forward over the tree (ancestor-only mask) on top of the latent cache;
  4. the lossless walk (greedy or one target sample per node); the accepted path's latents are
     committed to contiguous cache slots, its tapped features become the drafter's next context,
     and the target token at the last accepted node is the next bonus.

``_run_rounds`` wraps rounds in ``lax.while_loop``: up to ``rounds_per_dispatch`` rounds per jit
call with the whole state donated, so there is no host round-trip between rounds. Streams stop
independently (EOS, a stop sequence or string, token limit, cache capacity: ``stopping``) and carry their
status.

Shapes: B streams, P padded prompt, T tree nodes, Dp = block_size - 1 draft depth, D tree depth,
NT tapped layers, Dm model width, W vocab, N max new tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ddtree_jax.cache import CACHE_AXES, LatentCache, commit, init_cache
from ddtree_jax.decode import check_prompt_list, pad_checked, pad_prompts, prefill_blocks
from ddtree_jax.engine_config import (LOGPROBS_MODES, MODES, EngineConfig, required_capacity,  # noqa: F401
                                      tree_depth)
from ddtree_jax.drafter import (DFlashDrafter, DraftCache, check_drafter_target, draft_cache_axes, draft_logits,
                                init_draft_cache, target_taps)
from ddtree_jax.model import KimiModel, Runtime
from ddtree_jax.processors import (LogitProcessing, TokenHistory, check_additive_penalty, check_allowed_token_ids,
                                   check_logit_bias, check_min_new_tokens, check_repetition_penalty, extend_history,
                                   mark_no_token, process_logits, start_history)
from ddtree_jax.sampling import check_min_p, check_top_k, check_top_p, sampled_logits
from ddtree_jax.stream_settings import (NUMBERS, SEED_LIMIT, StreamSettings, Switches, check_seed,  # noqa: F401
                                        check_settings, check_temperature, check_temperatures, check_token_limits,
                                        stream_allowed_ids, stream_eos_ids, stream_keys, stream_logit_bias,
                                        stream_sequences, stream_stop_ids, switches_of, uniform_settings)
from ddtree_jax.scores import (TokenScores, empty_scores, per_stream_slices, scores_lists,
                               token_scores)
from ddtree_jax.serving import Finished, ServeUpdate, check_split, serve, serve_updates, stream_shards
from ddtree_jax.summary import summarize, summary
from ddtree_jax.sharding import named_sharding, place, shard_state
from ddtree_jax.stopping import (CACHE_FULL, EOS, MAX_TOKENS, NO_TOKEN, NO_TOKEN_ID, RUNNING,  # noqa: F401
                                 STATUS_NAMES, STOP_SEQUENCE, STOP_STRING, STOP_TOKEN, check_id_sequences,
                                 check_stop_sequences, stop_and_emit)
from ddtree_jax.stop_strings import (StopStringTabler, StopTables, advance, check_stream_stop_strings, start_states)
from ddtree_jax.tree import PAD, accept_tokens, build_tree, chain_tree, check_budget, sample_target_tokens

@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """Everything that changes between rounds (donated across dispatches)."""

    cache: LatentCache
    draft_cache: DraftCache | None
    bonus: jax.Array  # [B] int32: sampled by the target, not yet in the cache (sits at position lengths)
    ctx_taps: jax.Array  # [NT, B, D+1, Dm]: target features of last round's accepted rows
    ctx_counts: jax.Array  # [B]
    ctx_start: jax.Array  # [B]: position of the first pending context row
    out_tokens: jax.Array  # [B, N] int32 generated tokens
    out_scores: TokenScores | None  # [B, N] (and [B, N, n]): their scores (``scores``); None: not kept
    num_out: jax.Array  # [B] int32
    limit: jax.Array  # [B] int32: the stream's token limit (at most EngineConfig.max_new_tokens, N)
    temperature: jax.Array  # [B] float32: the stream's sampling temperature (0: greedy)
    settings: StreamSettings  # [B] each: the stream's filters, penalties and min_new_tokens
    history: TokenHistory | None  # what the penalties read of the prompt and the output; None: no penalty
    stop_tables: StopTables | None  # every stop string of the batch (``stop_strings``); None: no stream has one
    stop_applies: jax.Array | None  # [B, S] bool: the strings each stream stops on
    stop_states: jax.Array | None  # [B, S] int32: each stop string's automaton state
    status: jax.Array  # [B] int32 (``stopping.STATUS_NAMES``' keys)
    rounds: jax.Array  # [B] int32: rounds in which the stream was active
    tau_hist: jax.Array  # [B, D+2] int32: histogram of tokens emitted per round
    key: jax.Array  # [B] typed keys: each stream's own (``stream_keys``)
    # Static (part of the programs' key), read from the batch's settings by the prefill:
    switches: Switches = dataclasses.field(default=Switches(), metadata=dict(static=True))
    processing: LogitProcessing = dataclasses.field(default=LogitProcessing(), metadata=dict(static=True))


@dataclasses.dataclass(frozen=True)
class Requests:
    """N requests checked on the host (``Engine.check_requests``): each one's prompt and numbers, and what the
    programs of any batch of them compile, read from all N (so a batch of some of them, ``rows``, runs the same
    programs as all of them together)."""

    prompts: list[np.ndarray]  # N prompts of token ids
    temperature: np.ndarray  # [N] float32
    keys: jax.Array  # [N] typed keys (``stream_keys``)
    limits: np.ndarray  # [N] int32 token limits
    settings: StreamSettings  # [N] numpy
    stop_tables: StopTables | None  # every stop string of the N requests
    stop_applies: np.ndarray | None  # [N, S] bool
    switches: Switches
    processing: LogitProcessing

    def __len__(self) -> int:
        return len(self.prompts)

    def rows(self, index: Sequence[int]) -> Requests:
        """The requests at ``index`` (repeats allowed), compiled for as all N are."""
        index = np.asarray(index, np.int64)
        return dataclasses.replace(
            self, prompts=[self.prompts[i] for i in index], temperature=self.temperature[index],
            keys=self.keys[index], limits=self.limits[index],
            settings=jax.tree.map(lambda x: x[index], self.settings),
            stop_applies=None if self.stop_applies is None else self.stop_applies[index])


@dataclasses.dataclass(frozen=True)
class StreamUpdate:
    """What ``Engine.stream`` reports after the prefill and after each dispatch, per stream: the tokens emitted
    since the last update (empty for a stream that had stopped), its status (``STATUS_NAMES``' values) and the
    rounds it has run so far; with ``EngineConfig(logprobs=True)`` also the new tokens' log-probabilities, and
    with ``top_logprobs=n`` their top [token, log-probability] pairs (``scores.scores_lists``), else None."""

    new_tokens: list[list[int]]
    status: list[str]
    rounds: list[int]
    new_logprobs: list[list[float]] | None = None
    new_top_logprobs: list[list[list]] | None = None


def place_caches(cache: LatentCache, draft_cache: DraftCache | None, runtime: Runtime):
    """The latent cache's kv and the drafter's K/V laid out on the runtime's mesh by their logical axes
    (``CACHE_AXES``, ``draft_cache_axes``: streams over "data", the drafter's kv heads over "model"), as
    ``memory_plan`` counts them; unchanged without a mesh. Abstract caches get the shardings attached."""
    if runtime.mesh is None:
        return cache, draft_cache
    rules = runtime.rules  # set whenever a mesh is (Runtime's default: DEFAULT_RULES)
    cache = dataclasses.replace(cache, kv=place(cache.kv, named_sharding(runtime.mesh, rules, CACHE_AXES)))
    if draft_cache is not None:
        draft_cache = jax.tree.map(lambda x, axes: place(x, named_sharding(runtime.mesh, rules, axes)),
                                   draft_cache, draft_cache_axes(), is_leaf=lambda x: isinstance(x, tuple))
    return cache, draft_cache


class Engine:
    """Holds the split target (and drafter) and the compiled programs for one EngineConfig.

    ``generate(prompts, temperature, seed, max_new_tokens)`` runs prefill then rounds until every stream stops;
    ``stream`` (same arguments) reports each stream's new tokens after the prefill and after every dispatch.
    ``temperature``: one for every stream, or one per stream (``check_temperatures``; 0 decodes that stream
    greedily), fixed by ``prefill`` in the state for every round after it. Where every stream is greedy, the
    programs compiled take no random draws; otherwise one program serves every temperature. ``seed``: one for the
    batch, or one per stream, whose draws then do not depend on the batch it is in (``stream_keys``).
    ``max_new_tokens``: the config's (None), or a smaller limit for every stream or for each
    (``check_token_limits``); the same programs serve any limits. ``top_k``, ``top_p``, ``min_p``, the three
    penalties and ``min_new_tokens`` (keywords): the config's (None), or one for every stream or one per stream
    (``stream_settings``); one program serves any values, and a filter or penalty no stream uses is not compiled.
    ``logit_bias`` (keyword): the config's (None), or one mapping for every stream or one per stream.
    ``stop_token_ids`` (keyword): token ids that end a stream beside the EOS ids (status "stop_token"), one
    sequence for every stream or one per stream. ``allowed_token_ids`` and ``bad_words`` (keywords): the config's
    (None), or one set for every stream or one per stream; so are ``stop_sequences`` and ``eos_ids``.
    ``EngineConfig(logprobs=True, top_logprobs=n)`` also keeps each emitted token's log-probability under the target
    and its n likeliest tokens (``scores``), from the rows the forwards computed. The token sets (allowed ids, bad
    words, logit bias), min_new_tokens and the penalties process every place's logits before the temperature and
    the filters (``processors``), each tree node's over its own context.
    ``tokenizer``: needed for stop strings, the config's (tabled here) or a batch's (``prefill``'s ``stop_strings``:
    each string tabled at its first use and kept; its ``token_bytes``).
    ``serve(prompts, ..., slots=B)`` (and ``generate(..., slots=B)``): continuous batching, more prompts than
    streams (``serving``).
    """

    def __init__(self, target: KimiModel, drafter: DFlashDrafter | None, ecfg: EngineConfig, *,
                 runtime: Runtime = Runtime(), tokenizer=None):
        if ecfg.mode != "ar" and drafter is None:
            raise ValueError(f"mode {ecfg.mode!r} needs a drafter")
        if drafter is not None:
            check_drafter_target(drafter.cfg, target.cfg)
        check_top_k(ecfg.top_k, target.cfg.vocab_size)
        if ecfg.top_logprobs > target.cfg.vocab_size:
            raise ValueError(f"top_logprobs={ecfg.top_logprobs} passes the target's vocabulary of "
                             f"{target.cfg.vocab_size} tokens")
        bad_eos = [i for i in ecfg.eos_ids if i >= target.cfg.vocab_size]
        if bad_eos:
            raise ValueError(f"eos_ids {bad_eos} outside the target's vocabulary [0, {target.cfg.vocab_size})")
        check_logit_bias(ecfg.logit_bias, target.cfg.vocab_size)
        check_allowed_token_ids(ecfg.allowed_token_ids, target.cfg.vocab_size)
        for name in ("stop_sequences", "bad_words"):
            outside = [seq for seq in getattr(ecfg, name) if max(seq) >= target.cfg.vocab_size]
            if outside:
                raise ValueError(f"{name} {outside} hold ids outside the target's vocabulary "
                                 f"[0, {target.cfg.vocab_size})")
        self.tokenizer, self._tabler = tokenizer, None
        if ecfg.stop_strings:
            self._stop_tabler(ecfg.stop_strings, target.cfg.vocab_size).tables(ecfg.stop_strings)  # built once here
        if ecfg.capacity > target.cfg.max_position_embeddings:
            raise ValueError(f"capacity={ecfg.capacity} passes the target's max_position_embeddings="
                             f"{target.cfg.max_position_embeddings}: positions past it were never trained")
        self.target_def, target_state = nnx.split(target)
        self.target_state = shard_state(target_state, runtime.mesh, runtime.rules)
        self.drafter_def, self.drafter_state = None, None
        if drafter is not None:
            self.drafter_def, drafter_state = nnx.split(drafter)
            self.drafter_state = shard_state(drafter_state, runtime.mesh, runtime.rules)
        self.cfg = target.cfg
        self.dcfg = drafter.cfg if drafter is not None else None
        self.ecfg = ecfg
        self.runtime = runtime
        self.block_size = self.dcfg.block_size if self.dcfg else 1
        self.depth = tree_depth(ecfg, self.block_size)
        if ecfg.mode == "ddtree":
            check_budget(ecfg.budget, self.block_size - 1, self.cfg.vocab_size)
        self.taps = target_taps(self.dcfg, self.cfg.num_layers) if self.dcfg and ecfg.mode != "ar" else ()

    def _stop_tabler(self, strings, vocab_size: int) -> StopStringTabler:
        """The tabler of stop strings over the tokenizer's bytes (made at the first use)."""
        if self._tabler is None:
            if self.tokenizer is None:
                raise ValueError(f"stop_strings {list(strings)} are matched in the decoded text: give "
                                 "Engine(..., tokenizer=...)")
            token_bytes = self.tokenizer.token_bytes(vocab_size)
            if len(token_bytes) != vocab_size:
                raise ValueError(f"the tokenizer's token_bytes gave {len(token_bytes)} tokens' bytes for the target's "
                                 f"vocabulary of {vocab_size}")
            self._tabler = StopStringTabler(token_bytes)
        return self._tabler

    def _batch_stop_strings(self, per_stream: list[tuple[str, ...]]):
        """(StopTables of every string some stream stops on, S and Q rounded up to powers of two; applies [B, S]
        bool: the strings each stream stops on), or (None, None) where no stream has one."""
        union = sorted(set().union(*per_stream))
        if not union:
            return None, None
        tables = self._stop_tabler(union, self.cfg.vocab_size).tables(union, round_up=True)
        applies = np.zeros((len(per_stream), tables.next_state.shape[0]), bool)
        for b, strings in enumerate(per_stream):
            applies[b, [union.index(text) for text in strings]] = True
        return tables, applies

    # ------------------------------------------------------------------ prefill
    def prefill(self, prompts: Sequence[Sequence[int]], temperature=0.0, seed=0, max_new_tokens=None, *,
                top_k=None, top_p=None, min_p=None, repetition_penalty=None, frequency_penalty=None,
                presence_penalty=None, min_new_tokens=None, logit_bias=None, stop_strings=None,
                stop_token_ids=None, allowed_token_ids=None, bad_words=None, stop_sequences=None,
                eos_ids=None) -> DecodeState:
        """The prompts' prefill and each stream's first token. From ``top_k`` on: one value for every stream or a
        sequence of one per stream (None: the config's), fixed in the state for every round after it;
        ``logit_bias`` one mapping {token id: amount} for every stream or a sequence of one (or None: the config's)
        per stream (``stream_settings.stream_logit_bias``); ``stop_strings`` one sequence of strings for every
        stream or one (or None: the config's) per stream (``check_stream_stop_strings``; they need the engine's
        tokenizer);
        ``stop_token_ids`` one sequence of token ids for every stream or one (or None) per stream, each a token that
        ends its stream (status "stop_token") beside the config's EOS ids and, like them, is held back by
        min_new_tokens (``stream_settings.stream_stop_ids``); ``allowed_token_ids`` one sequence of token ids for
        every stream or one (or None: the config's) per stream, the only tokens the stream may emit (empty: all;
        ``stream_settings.stream_allowed_ids``); ``bad_words`` one sequence of token-id sequences for every stream or
        one (or None: the config's) per stream (``stream_settings.stream_sequences``); so are ``stop_sequences``;
        ``eos_ids`` one sequence of ids for every stream or one (or None: the config's) per stream, the stream's EOS
        ids in place of the config's (empty: none, vLLM's ``ignore_eos``)."""
        return self.prefill_requests(self.check_requests(
            prompts, temperature, seed, max_new_tokens, top_k=top_k, top_p=top_p, min_p=min_p,
            repetition_penalty=repetition_penalty, frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty, min_new_tokens=min_new_tokens, logit_bias=logit_bias,
            stop_strings=stop_strings, stop_token_ids=stop_token_ids, allowed_token_ids=allowed_token_ids,
            bad_words=bad_words, stop_sequences=stop_sequences, eos_ids=eos_ids))

    def check_requests(self, prompts: Sequence[Sequence[int]], temperature=0.0, seed=0, max_new_tokens=None, *,
                       top_k=None, top_p=None, min_p=None, repetition_penalty=None, frequency_penalty=None,
                       presence_penalty=None, min_new_tokens=None, logit_bias=None, stop_strings=None,
                       stop_token_ids=None, allowed_token_ids=None, bad_words=None, stop_sequences=None,
                       eos_ids=None) -> Requests:
        """``prefill``'s arguments checked on the host, with what the programs compile for them (``Requests``)."""
        ecfg = self.ecfg
        prompts = check_prompt_list(prompts)
        n = len(prompts)
        temperature, keys = check_temperatures(temperature, n), stream_keys(seed, n)
        limits = check_token_limits(max_new_tokens, n, ecfg.max_new_tokens)
        given = dict(top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty,
                     frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                     min_new_tokens=min_new_tokens)
        settings = dataclasses.replace(
            check_settings(n, given, ecfg.settings, self._setting_checks),
            logit_bias=stream_logit_bias(logit_bias, n, self.cfg.vocab_size, ecfg.logit_bias, check_logit_bias),
            stop_ids=stream_stop_ids(stop_token_ids, n, self.cfg.vocab_size),
            eos_ids=stream_eos_ids(eos_ids, n, self.cfg.vocab_size, ecfg.eos_ids),
            allowed=stream_allowed_ids(allowed_token_ids, n, self.cfg.vocab_size, ecfg.allowed_token_ids),
            bad_words=stream_sequences(bad_words, n, self.cfg.vocab_size, ecfg.bad_words, check_id_sequences,
                                       "bad_words"),
            stop_sequences=stream_sequences(stop_sequences, n, self.cfg.vocab_size, ecfg.stop_sequences,
                                            check_id_sequences, "stop_sequences"))
        strings = check_stream_stop_strings(ecfg.stop_strings if stop_strings is None else stop_strings, n,
                                            ecfg.stop_strings)
        own_least = ([False] * n if min_new_tokens is None else [True] * n if np.ndim(min_new_tokens) == 0
                     else [item is not None for item in min_new_tokens])
        for i, (least, limit) in enumerate(zip(settings.min_new_tokens.tolist(), limits.tolist())):
            sets = self._own_sets(settings, i)
            if least and not own_least[i] and not ecfg.holds_back(strings[i], sets["stop_ids"],
                                                                  sets["stop_sequences"], sets["eos_ids"]):
                settings.min_new_tokens[i] = least = 0  # the config's, for a stream with nothing to hold back
            try:
                ecfg.check_min_new_tokens(least, limit, strings[i], **sets)
            except ValueError as e:
                raise ValueError(f"stream {i}'s {e}") from None
        stop_tables, stop_applies = self._batch_stop_strings(strings)
        tokens, lengths = pad_prompts(prompts, vocab_size=self.cfg.vocab_size, capacity=ecfg.capacity,
                                      reserve=self.depth + 1)  # checks every prompt here, before any is prefilled
        return Requests(prompts=[row[:length] for row, length in zip(tokens, lengths)], temperature=temperature,
                        keys=keys, limits=limits, settings=settings, stop_tables=stop_tables,
                        stop_applies=stop_applies, switches=switches_of(temperature, settings, self.cfg.vocab_size),
                        processing=ecfg.processing_of(settings))

    def prefill_requests(self, requests: Requests) -> DecodeState:
        """The prefill of checked requests (``check_requests``; or some of them: ``Requests.rows``), one stream
        each, compiled for ``requests.switches`` and ``requests.processing``."""
        # Caches are made outside jit: zeros built inside would be constant-folded through attention.
        return self._prefill_program(_prefill, requests, *place_caches(*self._empty_caches(len(requests)),
                                                                        self.runtime))

    def lower_prefill(self, requests: Requests) -> jax.stages.Lowered:
        """``prefill_requests``' program lowered, not run (its caches abstract), for compiling ahead of time:
        ``.compile()``, then its ``memory_analysis()`` or ``abstract_outputs``. It also lowers where the engine
        holds abstract weights (ShapeDtypeStruct leaves, e.g. ``nnx.eval_shape``'s model) on a mesh of devices this
        process cannot address, so a program's compile time and bytes per device can be had without them."""
        caches = jax.eval_shape(lambda: self._empty_caches(len(requests)))
        return self._prefill_program(_prefill.lower, requests, *place_caches(*caches, self.runtime))

    def lower_dispatch(self, state: DecodeState) -> jax.stages.Lowered:
        """``dispatch``'s program lowered for ``state`` (arrays, or ShapeDtypeStructs with their shardings:
        ``abstract_outputs(engine.lower_prefill(requests).compile())``), not run."""
        return self._dispatch_program(_run_rounds.lower, state, 0)

    def _empty_caches(self, b: int) -> tuple[LatentCache, DraftCache | None]:
        # before, JAX's IndivisibleError from placing the caches, naming neither
        check_split(f"{b} streams", b, stream_shards(self.runtime), "; generate(..., slots=...) takes any number")
        cache = init_cache(self.cfg, b, self.ecfg.capacity)
        return cache, init_draft_cache(self.dcfg, b, self.ecfg.capacity) if self.taps else None

    def _prefill_program(self, program, requests: Requests, cache: LatentCache, draft_cache: DraftCache | None):
        """``program`` (``_prefill``, or its ``.lower``) called on the requests and the placed caches."""
        ecfg = self.ecfg
        tokens, lengths = pad_checked(requests.prompts, capacity=ecfg.capacity)  # checked by check_requests
        stop_applies = None if requests.stop_applies is None else jnp.asarray(requests.stop_applies)
        return program(self.target_def, self.target_state, self.drafter_def, self.drafter_state, cache, draft_cache,
                       jnp.asarray(tokens), jnp.asarray(lengths), jnp.asarray(requests.temperature), requests.keys,
                       jnp.asarray(requests.limits), jax.tree.map(jnp.asarray, requests.settings),
                       requests.stop_tables, stop_applies, max_new_tokens=ecfg.max_new_tokens,
                       eos_ids=_static_eos_ids(ecfg, requests.settings),
                       runtime=self.runtime, taps=self.taps, depth=self.depth, switches=requests.switches,
                       logprobs=ecfg.kept_logprobs, top_logprobs=ecfg.top_logprobs,
                       stop_sequences=_static_stop_sequences(ecfg, requests.settings), processing=requests.processing,
                       prefill_chunk=ecfg.prefill_chunk)

    def _own_sets(self, settings: StreamSettings, i: int) -> dict:
        """Stream i's own stop token ids, allowed token ids (None: the config's; empty: all), stop sequences and EOS
        ids (None: the config's), from host settings, as ``EngineConfig.check_min_new_tokens`` takes them."""
        def real(ids):
            return [int(t) for t in ids if t < self.cfg.vocab_size]
        stop = [] if settings.stop_ids is None else real(settings.stop_ids[i])
        eos = None if settings.eos_ids is None else real(settings.eos_ids[i])
        own, sequences = settings.allowed, settings.stop_sequences
        allowed = None if own is None else real(own.ids[i]) if own.restricted[i] else []
        if sequences is not None:
            sequences = [tuple(real(seq[seq >= 0])) for seq, n in zip(sequences.tokens[i], sequences.lengths[i]) if n]
        return dict(stop_ids=stop, allowed=allowed, stop_sequences=sequences, eos_ids=eos)

    @functools.cached_property
    def _setting_checks(self) -> dict:
        return {"top_k": functools.partial(check_top_k, vocab_size=self.cfg.vocab_size), "top_p": check_top_p,
                "min_p": check_min_p, "repetition_penalty": check_repetition_penalty,
                "frequency_penalty": functools.partial(check_additive_penalty, "frequency_penalty"),
                "presence_penalty": functools.partial(check_additive_penalty, "presence_penalty"),
                "min_new_tokens": check_min_new_tokens}

    def run(self, state: DecodeState) -> DecodeState:
        """Dispatches rounds (``rounds_per_dispatch`` per call) until every stream has stopped, each stream at the
        temperature its prefill fixed (``DecodeState.temperature``)."""
        for state in self._dispatches(state):
            pass
        return state

    def dispatch(self, state: DecodeState, running_floor: int = 0) -> DecodeState:
        """One dispatch of rounds (``_run_rounds``; the state is donated). ValueError for a state this engine did
        not prefill (another mode or depth) or one already donated to an earlier dispatch."""
        self._check_state(state)
        return self._dispatch_program(_run_rounds, state, running_floor)

    def _check_state(self, state: DecodeState) -> None:
        if (state.draft_cache is None) != (not self.taps) or state.tau_hist.shape[1] != self.depth + 2:
            raise ValueError(f"this DecodeState was prefilled by another engine (draft depth "
                             f"{state.tau_hist.shape[1] - 2}, drafter {'none' if state.draft_cache is None else 'yes'}"
                             f"), not by this {self.ecfg.mode} engine of depth {self.depth}")
        if any(isinstance(leaf, jax.Array) and leaf.is_deleted() for leaf in jax.tree.leaves(state)):
            raise ValueError("this DecodeState was donated to an earlier run or dispatch, which returned the state to "
                             "go on with")

    def _dispatch_program(self, program, state: DecodeState, running_floor: int):
        """``program`` (``_run_rounds``, or its ``.lower``) called on the state."""
        return program(self.target_def, self.target_state, self.drafter_def, self.drafter_state, state,
                       np.int32(running_floor), ecfg=self.ecfg, runtime=self.runtime, taps=self.taps, depth=self.depth)

    def _dispatches(self, state: DecodeState):
        """Yields the state after each dispatch (each one donates the state before it): the first whatever the
        streams' status (a round loop whose streams have all stopped runs no round; ``run_decode.warm_up`` compiles
        it so), the next ones while any stream runs."""
        while True:
            state = self.dispatch(state)
            yield state
            if not _any_running(state):
                return

    def stream(self, prompts: Sequence[Sequence[int]], temperature=0.0, seed=0, max_new_tokens=None,
               **settings) -> Iterator[StreamUpdate]:
        """``generate``'s decoding, reported as it goes: an iterator of StreamUpdates, one after the prefill (each
        stream's first token) and one after every dispatch of ``rounds_per_dispatch`` rounds (the config's
        granularity: 1 reports every round), until every stream has stopped. Joined over the updates, each
        stream's ``new_tokens`` are ``generate``'s tokens for the same prompts, temperature and seed. The inputs
        are checked and the prompts prefilled in this call, not at the first ``next``."""
        state = self.prefill(prompts, temperature, seed, max_new_tokens, **settings)
        return self._updates(state)

    def _updates(self, state: DecodeState) -> Iterator[StreamUpdate]:
        sent = np.zeros(state.num_out.shape[0], np.int64)

        def update(state: DecodeState) -> StreamUpdate:  # read before the next dispatch donates the state
            num = np.asarray(state.num_out)
            new = per_stream_slices(state.out_tokens, sent, num)
            scores = (None, None) if state.out_scores is None else scores_lists(state.out_scores, sent, num)
            sent[:] = num
            return StreamUpdate(new, [STATUS_NAMES[int(s)] for s in np.asarray(state.status)],
                                np.asarray(state.rounds).tolist(), *scores)

        yield update(state)
        if _any_running(state):  # else the prefill's token was each stream's last
            for state in self._dispatches(state):
                yield update(state)

    def serve(self, prompts: Sequence[Sequence[int]], temperature=0.0, seed=0, max_new_tokens=None, *, slots: int,
              timing: dict | None = None, **settings) -> Iterator[Finished]:
        """Continuous batching (``serving``): the prompts decoded in ``slots`` streams, each stream taking the next
        prompt as soon as it stops; yields each prompt's ``serving.Finished`` as its stream stops. Arguments as
        ``generate``'s, one per prompt where per stream; each prompt's tokens are the ones ``generate`` gives it
        (for every prompt at once). Everything is checked before the first prefill."""
        return serve(self, self.check_requests(prompts, temperature, seed, max_new_tokens, **settings), slots, timing)

    def serve_updates(self, prompts: Sequence[Sequence[int]], temperature=0.0, seed=0, max_new_tokens=None, *,
                      slots: int, timing: dict | None = None, **settings) -> Iterator[ServeUpdate]:
        """``serve``'s decoding, reported as it goes (``serving.serve_updates``): each prompt's new tokens after
        each admission and dispatch, and the prompts finished since."""
        requests = self.check_requests(prompts, temperature, seed, max_new_tokens, **settings)
        return serve_updates(self, requests, slots, timing)

    def generate(self, prompts: Sequence[Sequence[int]], temperature=0.0, seed=0, max_new_tokens=None, *,
                 slots: int | None = None, **settings) -> dict:
        """Returns per-stream tokens, statuses and metrics. prefill_s and decode_s (and the rates from them) are this
        call's wall times: a first call at new shapes or settings includes their compilation (``run_decode.warm_up``
        or ``serving.warm_up`` first, to time decoding alone). ``settings``:
        ``prefill``'s per-stream ones (top_k, top_p, min_p, the penalties, min_new_tokens, logit_bias, stop_strings,
        stop_token_ids, allowed_token_ids, bad_words, stop_sequences, eos_ids).
        ``slots``: None decodes every prompt at once; a number decodes them in that many streams (``serve``), with
        the same tokens, in the prompts' order (prefill_s: every admission's time; decode_s: the dispatches')."""
        if slots is not None:
            timing = {}
            done = sorted(self.serve(prompts, temperature, seed, max_new_tokens, slots=slots, timing=timing,
                                     **settings), key=lambda f: f.index)
            kept = self.ecfg.logprobs
            return summary([f.tokens for f in done], [f.status for f in done], np.array([f.rounds for f in done]),
                           np.array([f.tau_hist for f in done]), timing["prefill_s"], timing["decode_s"],
                           batch_rounds=timing["batch_rounds"],
                           logprobs=[f.logprobs for f in done] if kept else None,
                           top_logprobs=[f.top_logprobs for f in done] if self.ecfg.top_logprobs else None)
        t0 = time.perf_counter()
        state = self.prefill(prompts, temperature, seed, max_new_tokens, **settings)
        jax.block_until_ready(state.bonus)
        t1 = time.perf_counter()
        state = self.run(state)
        jax.block_until_ready(state.out_tokens)
        t2 = time.perf_counter()
        return summarize(state, prefill_s=t1 - t0, decode_s=t2 - t1)


def abstract_outputs(compiled: jax.stages.Compiled):
    """A compiled program's outputs as ShapeDtypeStructs with the shardings it gives them: the abstract state that
    ``Engine.lower_dispatch`` takes from ``Engine.lower_prefill(...).compile()``."""
    return jax.tree.map(place, compiled.out_info, compiled.output_shardings)


def _any_running(state: DecodeState) -> bool:
    return bool((state.status == RUNNING).any())


def _static_stop_sequences(ecfg: EngineConfig, settings: StreamSettings) -> tuple[tuple[int, ...], ...]:
    """The config's stop sequences, compiled in, unless the streams have their own (``settings.stop_sequences``)."""
    return ecfg.stop_sequences if settings.stop_sequences is None else ()


def _static_eos_ids(ecfg: EngineConfig, settings: StreamSettings) -> tuple[int, ...]:
    """The config's EOS ids, compiled in, unless the streams have their own (``settings.eos_ids``)."""
    return ecfg.eos_ids if settings.eos_ids is None else ()


def _split_per_stream(keys):
    """[B] keys -> (the [B] keys to carry, [B] keys to draw with now), each stream's from its own key."""
    pairs = jax.vmap(jax.random.split)(keys)  # [B, 2]
    return pairs[:, 0], pairs[:, 1]


def _static_if_greedy(temperature, greedy: bool):
    """The temperature a jitted step samples with: the Python 0.0 when ``greedy`` (a static flag: the argmax
    alone is compiled, no random draws), else the traced value (one program for every temperature)."""
    return 0.0 if greedy else temperature


@functools.partial(jax.jit, static_argnames=("target_def", "drafter_def", "max_new_tokens", "eos_ids", "runtime",
                                             "taps", "depth", "switches", "logprobs", "top_logprobs", "stop_sequences",
                                             "processing", "prefill_chunk"),
                   donate_argnames=("cache", "draft_cache"))
def _prefill(target_def, target_state, drafter_def, drafter_state, cache, draft_cache, tokens, lengths, temperature,
             key, limits, settings, stop_tables, stop_applies, *, max_new_tokens: int, eos_ids: tuple[int, ...],
             runtime: Runtime, taps: tuple[int, ...], depth: int, switches: Switches, logprobs: str | None,
             top_logprobs: int, stop_sequences: tuple[tuple[int, ...], ...],
             processing: LogitProcessing, prefill_chunk: int | None) -> DecodeState:
    # logprobs: the scores kept (EngineConfig.kept_logprobs: None, "raw" or "processed").
    # Keyed on its static arguments, not on the EngineConfig: mode and budget enter only through depth
    # (= tree_depth, the shapes of ctx_taps / tau_hist), taps and drafter_def, so engines that agree on
    # those (e.g. dflash and ddtree with budget >= Dp) and on the other static arguments share one program.
    temperatures, temperature = temperature, _static_if_greedy(temperature, switches.greedy)
    filters = switches.filters(settings)
    target = nnx.merge(target_def, target_state)
    cfg = target.cfg
    b = tokens.shape[0]
    drafter = None if draft_cache is None else nnx.merge(drafter_def, drafter_state)

    def to_drafter(draft_cache, block_taps, positions, counts, offset):  # the prompt's context, block by block
        return drafter.append_context(draft_cache, block_taps, positions, counts)[0]

    last, cache, _, draft_cache = prefill_blocks(  # lengths and capacity checked on the host
        target, cache, tokens, lengths, chunk=prefill_chunk, runtime=runtime, tap_layers=taps if drafter else (),
        on_taps=to_drafter if drafter else None, taps_carry=draft_cache)
    key, sub = _split_per_stream(key)
    history = start_history(processing, tokens, lengths, cfg.vocab_size)
    processed = process_logits(last[:, None], processing, settings, history, jnp.zeros((b,), jnp.int32))  # [B, 1, W]
    bonus = mark_no_token(sample_target_tokens(processed, temperature, sub, **filters), processed, processing)[:, 0]
    history = extend_history(history, bonus[:, None], (bonus != NO_TOKEN_ID).astype(jnp.int32))
    dm = cfg.hidden_size
    n_taps = max(len(taps), 1)
    state = DecodeState(
        cache=cache, draft_cache=draft_cache, bonus=_a_token(bonus),
        ctx_taps=jnp.zeros((n_taps, b, depth + 1, dm), jnp.dtype(cfg.dtype)),
        ctx_counts=jnp.zeros((b,), jnp.int32), ctx_start=lengths,
        out_tokens=jnp.full((b, max_new_tokens), PAD, jnp.int32),
        out_scores=empty_scores(b, max_new_tokens, top_logprobs) if logprobs else None,
        num_out=jnp.zeros((b,), jnp.int32), limit=limits,
        temperature=temperatures, settings=settings, history=history, stop_tables=stop_tables,
        stop_applies=stop_applies, stop_states=start_states(stop_tables, b),
        status=jnp.full((b,), RUNNING, jnp.int32), rounds=jnp.zeros((b,), jnp.int32),
        tau_hist=jnp.zeros((b, depth + 2), jnp.int32), key=key, switches=switches, processing=processing,
    )
    bonus_scores = _scores_of(last[:, None], processed, bonus[:, None], temperature, logprobs, top_logprobs, filters)
    string_ends, stop_states = _advance_stop_strings(state, bonus[:, None], jnp.ones((b,), jnp.int32))
    out_tokens, out_scores, num_out, status = stop_and_emit(state, bonus[:, None], jnp.ones((b,), jnp.int32),
                                                             jnp.ones((b,), bool), eos_ids, bonus_scores,
                                                             stop_sequences, settings.min_new_tokens, string_ends,
                                                             settings.stop_ids, settings.stop_sequences,
                                                             settings.eos_ids)
    return dataclasses.replace(state, out_tokens=out_tokens, out_scores=out_scores, num_out=num_out,
                               status=status, stop_states=stop_states)


def _advance_stop_strings(state: DecodeState, tokens, counts):
    """``stop_strings.advance`` where some stream has stop strings: (ends [B, E] or None, the new states)."""
    if state.stop_tables is None:
        return None, state.stop_states
    return advance(state.stop_tables, state.stop_states, tokens, counts, state.stop_applies)


def _draft_tree(target, drafter, state: DecodeState, start, active, ecfg: EngineConfig, depth: int):
    """Steps 1-2 of a round: returns (tree, draft_cache)."""
    b = state.bonus.shape[0]
    if ecfg.mode == "ar":
        return chain_tree(jnp.zeros((b, 0), jnp.int32), state.bonus), state.draft_cache
    positions = state.ctx_start[:, None] + jnp.arange(depth + 1, dtype=jnp.int32)[None, :]
    draft_cache, _ = drafter.append_context(state.draft_cache, state.ctx_taps, positions,
                                            jnp.where(active, state.ctx_counts, 0))
    logits = draft_logits(drafter, target, draft_cache, state.bonus, start)  # [B, Dp, W]
    if ecfg.mode == "dflash":
        tree = chain_tree(jnp.argmax(logits, -1).astype(jnp.int32), state.bonus)
    else:
        tree = build_tree(jax.nn.log_softmax(logits, axis=-1), state.bonus, ecfg.budget)
    return tree, draft_cache


def _target_tokens(logits, tree, state: DecodeState, temperature, key):
    """The target's token at every node [B, T] from the verify's logits [B, T, W]: after the logit processing of
    each node's place (``processors``), the argmax or a draw (``sample_target_tokens``) at ``temperature``
    (``_static_if_greedy``'s). Returns (tokens, the processed logits)."""
    processed = process_logits(logits, state.processing, state.settings, state.history, state.num_out, tree)
    tokens = sample_target_tokens(processed, temperature, key, **state.switches.filters(state.settings))
    return mark_no_token(tokens, processed, state.processing), processed


def _a_token(bonus):
    """The next round's root: a stream that stopped at NO_TOKEN_ID keeps a real id there (its rounds are masked)."""
    return jnp.where(bonus == NO_TOKEN_ID, 0, bonus)


def _scores_of(raw, processed, tokens, temperature, logprobs: str | None, top_logprobs: int,
               filters: dict) -> TokenScores | None:
    """The TokenScores of tokens [B, R] taken at R rows of logits [B, R, W]: under the model's own distribution
    (``logprobs`` "raw": the raw rows at temperature 1), or under the one each token was taken from ("processed":
    the processed rows, over the stream's temperature and through the filters where it samples:
    ``sampling.sampled_logits``); None where ``logprobs`` is None."""
    if logprobs is None:
        return None
    if logprobs == "processed":
        return token_scores(sampled_logits(processed, temperature, **filters), tokens, top_logprobs)
    return token_scores(raw, tokens, top_logprobs)


def _round(target, drafter, state: DecodeState, ecfg: EngineConfig, runtime: Runtime, taps: tuple[int, ...],
           depth: int) -> DecodeState:
    b = state.bonus.shape[0]
    temperature = _static_if_greedy(state.temperature, state.switches.greedy)
    start = state.cache.lengths  # position of the bonus token = committed length
    room_target = start + depth + 1 <= state.cache.capacity
    room_draft = True if state.draft_cache is None else (
        state.draft_cache.lengths + depth + 1 <= state.draft_cache.k.shape[2])
    status = jnp.where((state.status == RUNNING) & ~(room_target & room_draft), CACHE_FULL, state.status)
    active = status == RUNNING

    tree, draft_cache = _draft_tree(target, drafter, state, start, active, ecfg, depth)
    out = target(tree.tokens, tree.positions(start), state.cache, tree.visibility, tap_layers=taps, runtime=runtime)
    key, sub = _split_per_stream(state.key)
    target_tokens, processed = _target_tokens(out.logits, tree, state, temperature, sub)
    acc = accept_tokens(tree, target_tokens)

    n_commit = jnp.where(active, acc.num_accepted + 1, 0)
    rows = jnp.maximum(acc.path, 0)
    cache, _ = commit(state.cache, out.block_kv, rows, n_commit)  # room was checked above
    if taps:
        ctx_taps = jnp.take_along_axis(out.taps, rows[None, :, :, None], axis=2).astype(state.ctx_taps.dtype)
    else:
        ctx_taps = state.ctx_taps
    # The k-th emitted token is the target's token at the path's k-th node, so its log-probability is that row's.
    path_rows = functools.partial(jnp.take_along_axis, indices=rows[:, :, None], axis=1)
    emitted_scores = _scores_of(path_rows(out.logits), path_rows(processed), acc.emitted, temperature,
                                ecfg.kept_logprobs, ecfg.top_logprobs, state.switches.filters(state.settings))
    string_ends, stop_states = _advance_stop_strings(state, acc.emitted, jnp.where(active, acc.num_accepted + 1, 0))
    out_tokens, out_scores, num_out, status = stop_and_emit(
        dataclasses.replace(state, status=status), acc.emitted, acc.num_accepted + 1, active,
        _static_eos_ids(ecfg, state.settings), emitted_scores, _static_stop_sequences(ecfg, state.settings),
        state.settings.min_new_tokens, string_ends, state.settings.stop_ids, state.settings.stop_sequences,
        state.settings.eos_ids)
    # the tokens the round emitted, after stop_and_emit's cut (an EOS, a stop, the token limit, no token)
    tau_hist = state.tau_hist.at[jnp.arange(b), num_out - state.num_out].add(active.astype(jnp.int32))
    return dataclasses.replace(
        state, cache=cache, draft_cache=draft_cache, bonus=jnp.where(active, _a_token(acc.next_token), state.bonus),
        ctx_taps=ctx_taps, ctx_counts=n_commit, ctx_start=start, out_tokens=out_tokens, out_scores=out_scores,
        num_out=num_out, history=extend_history(state.history, acc.emitted, num_out - state.num_out),
        stop_states=stop_states, status=status, rounds=state.rounds + active.astype(jnp.int32), tau_hist=tau_hist,
        key=key,
    )


@functools.partial(jax.jit, static_argnames=("target_def", "drafter_def", "ecfg", "runtime", "taps", "depth"),
                   donate_argnames=("state",))
def _run_rounds(target_def, target_state, drafter_def, drafter_state, state: DecodeState, running_floor, *,
                ecfg: EngineConfig, runtime: Runtime, taps: tuple[int, ...], depth: int) -> DecodeState:
    """Up to ``rounds_per_dispatch`` rounds, while some stream runs and at least ``running_floor`` (an int32
    scalar; 0: no floor) do: a server with requests waiting passes the count running now, so that the dispatch
    ends at the round in which a stream stops and its slot can take the next request."""
    target = nnx.merge(target_def, target_state)
    drafter = nnx.merge(drafter_def, drafter_state) if drafter_def is not None else None

    def cond(carry):
        i, st = carry
        running = (st.status == RUNNING).sum()
        return (i < ecfg.rounds_per_dispatch) & (running > 0) & (running >= running_floor)

    def body(carry):
        i, st = carry
        return i + 1, _round(target, drafter, st, ecfg, runtime, taps, depth)

    _, state = jax.lax.while_loop(cond, body, (jnp.int32(0), state))
    return state


def inspect_round(engine: Engine, prompts: Sequence[Sequence[int]], temperature=0.0, seed=0):
    """Prefill, then one round whose tree and acceptance are returned (numpy) for display."""
    state = engine.prefill(prompts, temperature, seed)
    tree, acc = _inspect(engine.target_def, engine.target_state, engine.drafter_def, engine.drafter_state, state,
                         ecfg=engine.ecfg, runtime=engine.runtime, taps=engine.taps, depth=engine.depth)
    tree = {"tokens": np.asarray(tree.tokens[0]), "parents": np.asarray(tree.parents[0]),
            "depths": np.asarray(tree.depths[0])}
    return tree, {"path": np.asarray(acc.path[0]), "num_accepted": int(acc.num_accepted[0])}


@functools.partial(jax.jit, static_argnames=("target_def", "drafter_def", "ecfg", "runtime", "taps", "depth"))
def _inspect(target_def, target_state, drafter_def, drafter_state, state, *, ecfg, runtime, taps, depth):
    temperature = _static_if_greedy(state.temperature, state.switches.greedy)
    target = nnx.merge(target_def, target_state)
    drafter = nnx.merge(drafter_def, drafter_state) if drafter_def is not None else None
    start = state.cache.lengths
    active = state.status == RUNNING
    tree, _ = _draft_tree(target, drafter, state, start, active, ecfg, depth)
    out = target(tree.tokens, tree.positions(start), state.cache, tree.visibility, runtime=runtime)
    _, sub = _split_per_stream(state.key)  # the draws of the state's next round
    acc = accept_tokens(tree, _target_tokens(out.logits, tree, state, temperature, sub)[0])
    return tree, acc
