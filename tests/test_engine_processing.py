"""The engine's logit processing (logit bias, min_new_tokens, repetition / frequency / presence penalties): greedy
decoding in every mode equals a processed plain-forward reference token for token; sampled streams never draw a
banned token or an early EOS; bad settings are refused."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.engine import Engine, EngineConfig
from ddtree_jax.processors import LogitProcessing, check_logit_bias
from test_processors import reference_row, stream_numbers
from sampling_reference import truncated_probs
from tests.test_engine import NEW, PROMPTS, VOCAB, build_models, causal_forward, generate_all, teacher_forced_logits

EOS_IDS = (0, 19)
STOPS = ((58, 4),)
SETS = dict(logit_bias=((2, -100.0), (58, 1.5)), eos_ids=EOS_IDS)
NUMBERS = dict(min_new_tokens=4, repetition_penalty=1.2, frequency_penalty=-0.7, presence_penalty=0.4)


def greedy_with_processing(target, prompts, sets, numbers, steps) -> list[list[int]]:
    """Reference outside the engine: each next token the argmax of the plain causal forward's last logits after
    ``test_processors.reference_row`` (transformers' processors, then the frequency and presence penalties) over the
    prompt and the tokens so far. ``sets``: LogitProcessing's token sets; ``numbers``: the penalties,
    min_new_tokens and a logit bias of the stream's own, each one for every stream or a list of one per stream."""
    processing = LogitProcessing(**sets)
    numbers = stream_numbers(len(prompts), numbers)
    for stream in numbers:  # a stream's own logit bias, allowed ids, bad words and EOS ids (None: the sets')
        if "logit_bias" in stream:
            own = stream["logit_bias"]
            stream["logit_bias"] = check_logit_bias(sets.get("logit_bias", ()) if own is None else own)
        for name in ("allowed_token_ids", "bad_words", "eos_ids"):
            if stream.get(name, ()) is None:
                stream[name] = sets.get(name, ())
    seqs = [list(p) for p in prompts]
    width = max(map(len, seqs)) + steps  # one shape for every step: one compile (causal, so the padding is unseen)
    for _ in range(steps):
        tokens = np.zeros((len(seqs), width), np.int32)
        for i, seq in enumerate(seqs):
            tokens[i, :len(seq)] = seq
        logits = np.asarray(causal_forward(target, tokens).astype(jnp.float32))
        for i, (seq, prompt) in enumerate(zip(seqs, prompts)):
            row = reference_row(logits[i, len(seq) - 1], processing, numbers[i], prompt, seq[len(prompt):])
            seq.append(int(np.argmax(row)))
    return [seq[len(p):] for seq, p in zip(seqs, prompts)]


def cut_at_end(tokens, eos_ids, stop_sequences, min_new_tokens, stop_ids=()):
    """Plain reference: tokens up to and including the first EOS, stop id or end of a stop sequence at index >=
    min_new_tokens, and the status."""
    for n, token in enumerate(tokens):
        if n < min_new_tokens:
            continue
        if token in eos_ids:
            return tokens[:n + 1], "eos"
        if token in stop_ids:
            return tokens[:n + 1], "stop_token"
        if any(tokens[:n + 1][-len(seq):] == list(seq) for seq in stop_sequences if len(seq) <= n + 1):
            return tokens[:n + 1], "stop_sequence"
    return tokens, "max_new_tokens"


@pytest.fixture(scope="module")
def models():
    return build_models()


@pytest.fixture(scope="module")
def ar_reference(models):
    return generate_all(models[0], None, EngineConfig(mode="ar", max_new_tokens=NEW, capacity=64), PROMPTS[:8], 8)


@pytest.fixture(scope="module")
def processed_reference(models):
    return greedy_with_processing(models[0], PROMPTS[:8], SETS, NUMBERS, NEW)


def processing_config(mode, budget, sets=SETS, numbers=NUMBERS, **kw):
    return EngineConfig(mode=mode, budget=budget, max_new_tokens=NEW, capacity=64, stop_sequences=STOPS,
                        **sets, **numbers, **kw)


@pytest.mark.parametrize("mode,budget", [("ar", 1), ("dflash", 1), ("ddtree", 16), ("ddtree", 64)])
def test_processed_greedy_equals_the_processed_full_forward(models, ar_reference, processed_reference, mode, budget):
    """Logit bias (a ban and a boost), min_new_tokens = 4 over two EOS ids and a stop sequence, and the repetition,
    frequency (negative: it favours repeats, so a token counted once too often shows) and presence penalties:
    greedy decoding in every mode equals the processed plain-forward reference cut at its first EOS or stop
    sequence past the first 4 tokens, token for token, so each tree node's target token was chosen over its own
    context (prompt, output so far and the node's path in the tree). The processing changed most outputs;
    min_new_tokens held back a stop sequence a stream reached early."""
    target, drafter = models
    engine = Engine(target, drafter if mode != "ar" else None, processing_config(mode, budget))
    res = engine.generate(PROMPTS[:8])
    want = [cut_at_end(tokens, EOS_IDS, STOPS, 4) for tokens in processed_reference]
    assert list(zip(res["tokens"], res["status"])) == want
    assert sum(tokens != a for (tokens, _), a in zip(want, ar_reference[:8])) >= 6
    statuses = [status for _, status in want]
    assert statuses.count("eos") >= 2 and statuses.count("stop_sequence") >= 2
    early = [cut_at_end(tokens, EOS_IDS, STOPS, 0) for tokens in processed_reference]
    assert sum(len(e) < len(w) for (e, _), (w, _) in zip(early, want)) >= 1  # a stop sequence held back
    assert not any(2 in tokens for tokens in processed_reference)  # banned, though AR's stream 2 is all 2s


ALLOWED = dict(allowed_token_ids=tuple(range(0, VOCAB, 3)))


@pytest.mark.parametrize("mode,budget", [("ar", 1), ("ddtree", 16)])
def test_allowed_token_ids_greedy_equals_the_processed_full_forward(models, ar_reference, mode, budget):
    """``allowed_token_ids`` (every third id) with a presence penalty: greedy decoding equals the processed
    plain-forward reference token for token and generates allowed tokens only, where plain AR does not."""
    target, drafter = models
    want = greedy_with_processing(target, PROMPTS[:8], ALLOWED, dict(presence_penalty=0.5), NEW)
    ecfg = EngineConfig(mode=mode, budget=budget, max_new_tokens=NEW, capacity=64, presence_penalty=0.5, **ALLOWED)
    assert Engine(target, drafter if mode != "ar" else None, ecfg).generate(PROMPTS[:8])["tokens"] == want
    assert all(t % 3 == 0 for tokens in want for t in tokens)
    assert sum(t % 3 != 0 for tokens in ar_reference for t in tokens) >= 20


def holds(tokens, word) -> bool:
    return any(tuple(tokens[i:i + len(word)]) == tuple(word) for i in range(len(tokens) - len(word) + 1))


@pytest.mark.parametrize("mode,budget", [("ar", 1), ("ddtree", 64)])
def test_bad_words_greedy_equals_the_processed_full_forward(models, ar_reference, mode, budget):
    """``bad_words`` cut from AR's own output (two and three tokens, and (2, 2) against a stream of 2s): greedy
    decoding equals the processed plain-forward reference token for token, so each tree node read its own context's
    last tokens, up its path and across the root into the stream's; no output holds a bad word, as AR's did."""
    target, drafter = models
    words = ((ar_reference[0][2], ar_reference[0][3]), tuple(ar_reference[3][:3]), (2, 2))
    want = greedy_with_processing(target, PROMPTS[:8], dict(bad_words=words), {}, NEW)
    ecfg = EngineConfig(mode=mode, budget=budget, max_new_tokens=NEW, capacity=64, bad_words=words)
    assert Engine(target, drafter if mode != "ar" else None, ecfg).generate(PROMPTS[:8])["tokens"] == want
    assert not any(holds(tokens, word) for tokens in want for word in words)
    assert all(holds(ar_reference[i], word) for i, word in zip((0, 3, 2), words))


@pytest.mark.parametrize("mode,budget", [("ar", 1), ("ddtree", 32)])
def test_sampled_streams_never_draw_a_banned_token_or_an_early_eos(models, mode, budget):
    """At temperature 1.5 over 16 prompts with half the vocabulary's ids as EOS: no stream draws an EOS within its
    first 5 tokens or the banned token anywhere, and many streams stop on an EOS right after."""
    target, drafter = models
    eos_ids = tuple(range(1, VOCAB, 2))
    ecfg = processing_config(mode, budget, dict(logit_bias=((2, -100.0),), eos_ids=eos_ids),
                             dict(min_new_tokens=5, frequency_penalty=0.3))
    engine = Engine(target, drafter if mode != "ar" else None, ecfg)
    res = engine.generate(PROMPTS[:16], 1.5, seed=7)
    for tokens, status in zip(res["tokens"], res["status"]):
        assert not set(tokens[:5]) & set(eos_ids) and 2 not in tokens
        assert (status == "eos") == (tokens[-1] in eos_ids and len(tokens) > 5)
    assert [status for status in res["status"]].count("eos") >= 8
    assert any(len(tokens) == 6 for tokens in res["tokens"])


@pytest.mark.parametrize("mode,budget", [("ddtree", 16)])  # the prefill's token and the rounds'
def test_processed_logprobs_are_those_of_the_distribution_each_token_was_taken_from(models, mode, budget):
    """``logprobs_mode="processed"``: each token's log-probability, and its 3 likeliest tokens', are those of what
    it was taken from: the teacher-forced forward's row processed over the stream's context (``reference_row``),
    then, where the stream samples, over its temperature and through top-k 8 and min-p 0.3 (``truncated_probs``;
    filtered tokens -inf); greedy streams' stay at temperature 1, unfiltered. The tokens are the raw mode's."""
    target, drafter = models
    sets = dict(logit_bias=((2, -100.0), (58, 1.5)))
    numbers = dict(repetition_penalty=1.2, frequency_penalty=0.4, presence_penalty=0.2)
    processing, (stream_number,) = LogitProcessing(**sets), stream_numbers(1, numbers)
    ecfg = dataclasses.replace(processing_config(mode, budget, sets, numbers), stop_sequences=(), top_k=8,
                               min_p=0.3, logprobs=True, top_logprobs=3, logprobs_mode="processed")
    prompts, temperatures = PROMPTS[:4], [0.0, 1.0, 0.0, 0.7]
    res = Engine(target, drafter if mode != "ar" else None, ecfg).generate(prompts, temperatures, seed=5)
    raw = Engine(target, drafter if mode != "ar" else None, dataclasses.replace(ecfg, logprobs_mode="raw"))
    assert res["tokens"] == raw.generate(prompts, temperatures, seed=5)["tokens"]
    rows = teacher_forced_logits(target, prompts, res["tokens"])
    for b, (prompt, tokens, temperature) in enumerate(zip(prompts, res["tokens"], temperatures)):
        for k, token in enumerate(tokens):
            row = reference_row(rows[b][k], processing, stream_number, prompt, tokens[:k]).astype(np.float64)
            if temperature:
                with np.errstate(divide="ignore"):
                    want = np.log(truncated_probs(row, temperature, top_k=8, min_p=0.3))
            else:
                want = row - np.log(np.sum(np.exp(row - row.max()))) - row.max()
            np.testing.assert_allclose(res["logprobs"][b][k], want[token], rtol=1e-5, atol=1e-4,
                                       err_msg=f"stream {b}, token {k}")
            values = [value for _, value in res["top_logprobs"][b][k]]
            np.testing.assert_allclose(values, np.sort(want)[::-1][:3], rtol=1e-5, atol=1e-4)
    sampled = [lp for b in (1, 3) for lp in res["logprobs"][b]]
    assert np.isfinite(sampled).all() and max(-min(sampled), 0) > 0.05  # drawn from the kept tokens, not always 1
    assert any(np.isneginf([v for _, v in pairs]).any() for b in (1, 3) for pairs in res["top_logprobs"][b])


def test_processing_settings_refused(models):
    target, drafter = models
    with pytest.raises(ValueError, match=rf"logit_bias's token id {VOCAB} is outside the vocabulary \[0, {VOCAB}\)"):
        Engine(target, drafter, EngineConfig(capacity=64, logit_bias={VOCAB: 1.0}))
    with pytest.raises(ValueError, match="min_new_tokens=5 holds back EOS ids, stop token ids and stop sequences: "
                                         "give eos_ids"):
        EngineConfig(min_new_tokens=5)
    with pytest.raises(ValueError, match="min_new_tokens=9 passes max_new_tokens=8"):
        EngineConfig(min_new_tokens=9, max_new_tokens=8, eos_ids=(1,))
    with pytest.raises(ValueError, match=r"presence_penalty must be a number in \[-2, 2\] \(0: off\), got nan"):
        EngineConfig(presence_penalty=float("nan"))
    with pytest.raises(ValueError, match="logprobs_mode='processed' says which log-probabilities to keep: give "
                                         "logprobs=True too"):
        EngineConfig(logprobs_mode="processed")
    with pytest.raises(ValueError, match=r"logprobs_mode must be one of \('raw', 'processed'\), got 'sampled'"):
        EngineConfig(logprobs=True, logprobs_mode="sampled")
    with pytest.raises(ValueError, match=r"min_new_tokens=2 holds back every allowed token \[1, 3\]: they are all EOS"):
        EngineConfig(min_new_tokens=2, eos_ids=(1, 3, 5), allowed_token_ids=(3, 1))
    with pytest.raises(ValueError, match=rf"allowed_token_ids \[{VOCAB}\] are outside the vocabulary"):
        Engine(target, drafter, EngineConfig(capacity=64, allowed_token_ids=(1, VOCAB)))
    with pytest.raises(ValueError, match=rf"bad_words \[\(1, {VOCAB}\)\] hold ids outside the target's vocabulary"):
        Engine(target, drafter, EngineConfig(capacity=64, bad_words=((1, VOCAB), (2,))))
    with pytest.raises(ValueError, match=r"bad_words\[0\] must be a non-empty sequence of token ids"):
        EngineConfig(bad_words=((),))
    with pytest.raises(ValueError, match="logit_bias gives token 3 twice"):
        EngineConfig(logit_bias=[(3, 1.0), (3, 2.0)])
    # the config keeps the bias as sorted pairs, so equal settings hash alike (one compiled program)
    assert EngineConfig(logit_bias={5: 1, 3: -2.0}) == EngineConfig(logit_bias=[(3, -2), (5, 1.0)])
    assert EngineConfig(logit_bias={5: 1}).processing == LogitProcessing(logit_bias=((5, 1.0),))
    assert EngineConfig(presence_penalty=0.5).processing == LogitProcessing(presence_penalty=True)


@pytest.mark.parametrize("mode,budget,temperature", [("ar", 1, 0.0), ("dflash", 1, 1.0), ("ddtree", 16, 0.0),
                                                     ("ddtree", 16, 1.0)])
def test_a_place_where_every_allowed_token_is_banned_stops_the_stream_there(models, ar_reference, mode, budget,
                                                                            temperature):
    """Streams 0-3 may emit only 5 and 9, and their bad words ban 9 always and 5 after a 5: they emit one 5 (none
    where the prompt ends with 5) and stop with status "no_token", greedy or sampled, where the argmax or a draw
    over a row of -inf would have emitted a banned token. Streams 4-7, in the same batch, decode as plain AR."""
    target, drafter = models
    contradictory = 4
    allowed = [(5, 9)] * contradictory + [None] * 4
    bad_words = [((5, 5), (9,))] * contradictory + [None] * 4
    engine = Engine(target, drafter if mode != "ar" else None,
                    EngineConfig(mode=mode, budget=budget, max_new_tokens=NEW, capacity=64))
    res = engine.generate(PROMPTS[:8], temperature, seed=3, allowed_token_ids=allowed, bad_words=bad_words)
    for prompt, tokens, status in zip(PROMPTS[:contradictory], res["tokens"], res["status"]):
        assert (tokens, status) == ([] if prompt[-1] == 5 else [5], "no_token")
    if temperature == 0.0:
        assert res["tokens"][contradictory:] == ar_reference[contradictory:8]
    assert res["status"][contradictory:] == ["max_new_tokens"] * 4
