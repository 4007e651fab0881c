"""Engine invariants: AR greedy output == greedy decoding over the plain causal forward (a reference
outside the engine); DDTree / DFlash greedy output == AR greedy output token for token; streams stop
cleanly (EOS, token limit, cache capacity); sampling is lossless; sharded == unsharded; bad budgets;
tokens/s counts only the decoded tokens."""

import collections
import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ddtree_jax.config import QuantConfig, tiny_config
from ddtree_jax.drafter import DFlashDrafter, tiny_drafter_config
from ddtree_jax.engine import (CACHE_FULL, EOS, MAX_TOKENS, NO_TOKEN, NO_TOKEN_ID, RUNNING, STOP_SEQUENCE, STOP_STRING,
                               STOP_TOKEN, Engine, EngineConfig, check_seed, required_capacity, summarize)
from ddtree_jax.stopping import check_id_sequences, stop_and_emit
from ddtree_jax.stream_settings import stream_sequences
from ddtree_jax.cache import init_cache
from ddtree_jax.model import KimiModel, causal_mask
from ddtree_jax.scores import TokenScores
from ddtree_jax.sharding import DEFAULT_RULES, make_mesh
from ddtree_jax.model import Runtime
from ddtree_jax.tree import PAD
from tests.test_moe_kernel_model import forward as causal_forward  # plain causal forward, empty cache

VOCAB = 64  # small, so that trees of 8..128 nodes cover a real share of the target's choices
NEW = 10


@pytest.fixture(scope="module")
def models():
    return build_models()


def build_models():
    """A tiny target (peaked next-token distributions) and its drafter, both random."""
    cfg = tiny_config(vocab_size=VOCAB, quant=QuantConfig(group_size=32), eos_token_ids=())
    target = KimiModel(cfg, nnx.Rngs(0))
    target.lm_head.value = target.lm_head.value * 8  # peaked next-token distributions, like a trained model
    drafter = DFlashDrafter(tiny_drafter_config(cfg), nnx.Rngs(1))
    return target, drafter


def make_prompts(n, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, int(rng.integers(2, 20))).tolist() for _ in range(n)]


def generate_all(target, drafter, ecfg, prompts, streams, temperature=0.0, runtime=Runtime()):
    engine = Engine(target, drafter if ecfg.mode != "ar" else None, ecfg, runtime=runtime)
    out = []
    for i in range(0, len(prompts), streams):
        res = engine.generate(prompts[i:i + streams], temperature)
        out.extend(res["tokens"])
    return out


PROMPTS = make_prompts(96, seed=0)


@pytest.fixture(scope="module")
def ar_reference(models):
    target, _ = models
    return generate_all(target, None, EngineConfig(mode="ar", max_new_tokens=NEW, capacity=64), PROMPTS, 16)


def test_ar_equals_greedy_over_the_full_forward(models, ar_reference):
    """The engine's AR mode against a reference that shares none of its decode path (no cache writes, no
    rounds, no tree positions): each next token is the argmax of the plain causal forward over the prompt
    and the tokens so far, all 96 prompts right-padded in one batch (causal, so the padding is never seen)."""
    target, _ = models
    seqs = [list(p) for p in PROMPTS]
    width = max(map(len, seqs)) + NEW
    for _ in range(NEW):
        tokens = np.zeros((len(seqs), width), np.int32)
        for i, seq in enumerate(seqs):
            tokens[i, :len(seq)] = seq
        logits = np.asarray(causal_forward(target, tokens))
        for i, seq in enumerate(seqs):
            seq.append(int(np.argmax(logits[i, len(seq) - 1])))
    for i, (seq, got) in enumerate(zip(seqs, ar_reference)):
        assert got == seq[len(PROMPTS[i]):], f"prompt {i}: engine AR {got} != full-forward greedy"


# 272 prompt decodes in all compared token for token with AR (96 distinct prompts).
@pytest.mark.parametrize("mode,budget,streams,count", [
    ("ddtree", 32, 4, 96), ("dflash", 0, 4, 48),
    ("ddtree", 1, 4, 24), ("ddtree", 8, 4, 24), ("ddtree", 128, 4, 32),
    ("ddtree", 8, 1, 16), ("ddtree", 128, 1, 16), ("dflash", 0, 1, 16),
])
def test_greedy_equals_ar(models, ar_reference, mode, budget, streams, count):
    target, drafter = models
    ecfg = EngineConfig(mode=mode, budget=max(budget, 1), max_new_tokens=NEW, capacity=64)
    got = generate_all(target, drafter, ecfg, PROMPTS[:count], streams)
    for i, (a, b) in enumerate(zip(got, ar_reference[:count])):
        assert a == b, f"prompt {i}: {mode} budget {budget} streams {streams}: {a} != AR {b}"


def test_trees_accept_something(models):
    """Sanity: with a 64-token vocabulary, budget-128 trees accept drafted tokens (tau > 1)."""
    target, drafter = models
    engine = Engine(target, drafter, EngineConfig(mode="ddtree", budget=128, max_new_tokens=NEW, capacity=64))
    res = engine.generate(PROMPTS[:8])
    assert res["tau_mean"] > 1.3, res["tau_mean"]  # 1.47 in session 31


def test_the_round_builds_ddtree_over_the_drafts_log_probabilities(models):
    """The first round's tree (``inspect_round``) is DDTree over the drafter's log-softmax at the prefill's
    state, computed here outside the engine: not over raw logits, whose per-depth offsets reorder prefixes
    of different lengths (a change that greedy output, lossless whatever the tree, cannot show)."""
    from ddtree_jax.drafter import draft_logits
    from ddtree_jax.engine import inspect_round
    from ddtree_jax.tree import build_tree
    target, drafter = models
    engine = Engine(target, drafter, EngineConfig(mode="ddtree", budget=32, max_new_tokens=NEW, capacity=64))
    prompts = PROMPTS[5:6]
    tree, _ = inspect_round(engine, prompts)
    state = engine.prefill(prompts)
    logits = draft_logits(drafter, target, state.draft_cache, state.bonus, state.cache.lengths)
    want = jax.jit(build_tree, static_argnums=2)(jax.nn.log_softmax(logits, axis=-1), state.bonus, 32)
    assert tree["tokens"].tolist() == np.asarray(want.tokens[0]).tolist()
    assert tree["parents"].tolist() == np.asarray(want.parents[0]).tolist()
    assert tree["depths"].max() > 1  # deeper than one level: the ranking across depths was exercised


@pytest.mark.parametrize("after_norm", [False, True], ids=["pre-norm-last-tap", "hf-last-tap"])
def test_draft_cache_holds_the_committed_text_at_its_positions(models, after_norm):
    """After DDTree rounds the drafter's cache equals, row for row, one append of the committed text's target
    features from a plain causal forward at positions 0..n-1: each round's context rows reach the drafter at
    the right positions, from the accepted target rows, none skipped or repeated (an off-by-one there costs
    only acceptance, which the greedy-equality tests cannot see). The tiny drafter taps the target's last layer:
    with ``last_tap_after_norm`` (HF drafters) that feature is the layer's output after the final norm, as the
    reference reads transformers' hidden_states[-1]; before, it was the output before the norm for every drafter."""
    target, drafter = models
    if after_norm:
        drafter = DFlashDrafter(tiny_drafter_config(target.cfg, last_tap_after_norm=True), nnx.Rngs(1))
    last = target.cfg.num_layers - 1
    assert last in drafter.cfg.target_layer_ids
    want_taps = tuple(last + 1 if after_norm and i == last else i for i in drafter.cfg.target_layer_ids)
    prompts = PROMPTS[:4]
    engine = Engine(target, drafter, EngineConfig(mode="ddtree", budget=16, max_new_tokens=NEW, capacity=64))
    state = engine.run(engine.prefill(prompts))
    out, num_out, cache = np.asarray(state.out_tokens), np.asarray(state.num_out), state.draft_cache
    lengths = np.asarray(cache.lengths)
    width = int(lengths.max())
    tokens = np.zeros((len(prompts), width), np.int32)  # right-padded: causal, so the padding is never seen
    for b, prompt in enumerate(prompts):
        assert len(prompt) + 1 < lengths[b] <= len(prompt) + num_out[b]  # rounds appended rows; they lag the output
        tokens[b, :lengths[b]] = list(prompt) + out[b, :lengths[b] - len(prompt)].tolist()
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), tokens.shape)
    ref = target(jnp.asarray(tokens), positions, init_cache(target.cfg, len(prompts), width),
                 causal_mask(len(prompts), width), tap_layers=want_taps, runtime=Runtime())
    k, v = drafter.context_kv(ref.taps, positions)
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(cache.k[:, b, :n], k[:, b, :n], rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(cache.v[:, b, :n], v[:, b, :n], rtol=1e-4, atol=1e-4)


def test_streams_stop_independently(models):
    target, drafter = models
    prompts = PROMPTS[:3]
    ar = generate_all(target, None, EngineConfig(mode="ar", max_new_tokens=NEW, capacity=64), prompts, 3)
    eos = ar[1][3]  # stream 1 emits this token 4th; make it the EOS id
    ecfg = EngineConfig(mode="ddtree", budget=16, max_new_tokens=NEW, capacity=64, eos_ids=(eos,))
    res = Engine(target, drafter, ecfg).generate(prompts)
    for b in range(3):
        expect = ar[b][: ar[b].index(eos) + 1] if eos in ar[b] else ar[b]
        assert res["tokens"][b] == expect
        assert res["status"][b] == ("eos" if eos in ar[b] else "max_new_tokens")


@pytest.mark.parametrize("mode,temperature", [("ddtree", 0.0), ("ddtree", 1.0), ("dflash", 0.0), ("ar", 0.0)])
def test_stream_reports_generate_round_by_round(models, mode, temperature):
    """``Engine.stream`` at one round a dispatch: the first update holds each stream's prefill token, then one
    update a round; a stopped stream gets no more tokens and keeps its status and rounds; joined, the updates
    are ``generate``'s tokens (same seed), and the last one has its statuses and rounds."""
    target, drafter = models
    prompts = PROMPTS[:3]
    ar = generate_all(target, None, EngineConfig(mode="ar", max_new_tokens=NEW, capacity=64), prompts, 3)
    eos = ar[1][3]  # stream 1 stops early (greedy), the others run to the token limit unless they meet it too
    ecfg = EngineConfig(mode=mode, budget=16, max_new_tokens=NEW, capacity=64, eos_ids=(eos,), rounds_per_dispatch=1)
    engine = Engine(target, drafter if mode != "ar" else None, ecfg)
    res = engine.generate(prompts, temperature, seed=3)
    updates = list(engine.stream(prompts, temperature, seed=3))
    assert [len(t) for t in updates[0].new_tokens] == [1, 1, 1] and updates[0].rounds == [0, 0, 0]
    assert len(updates) == 1 + max(res["rounds"])
    assert [sum((u.new_tokens[b] for u in updates), []) for b in range(3)] == res["tokens"]
    assert updates[-1].status == res["status"] and updates[-1].rounds == res["rounds"]
    if temperature == 0:
        assert res["status"][1] == "eos" and res["tokens"] == [t[:len(r)] for t, r in zip(ar, res["tokens"])]
    for before, after in zip(updates, updates[1:]):
        assert "running" in before.status
        for b in range(3):
            if before.status[b] == "running":
                assert after.rounds[b] == before.rounds[b] + 1 and after.new_tokens[b]
            else:
                assert (after.new_tokens[b], after.status[b], after.rounds[b]) == ([], before.status[b],
                                                                                   before.rounds[b])


@pytest.mark.parametrize("mode", ["ar", "ddtree"])  # DFlash: a chain, the tree's special case
def test_per_stream_temperatures(models, ar_reference, mode):
    """One batch of greedy and sampled streams: a greedy stream emits AR's greedy tokens; a sampled one what it
    emits in a batch sampled throughout at its temperature, with the same seed (a stream's draws depend on the
    key and its place, not on the others' temperatures)."""
    target, drafter = models
    engine = Engine(target, drafter if mode != "ar" else None,
                    EngineConfig(mode=mode, budget=16, max_new_tokens=NEW, capacity=64))
    prompts = PROMPTS[:4]
    mixed = engine.generate(prompts, temperature=[0.0, 1.0, 0.0, 0.7], seed=3)["tokens"]
    state = engine.prefill(prompts, [0.0, 1.0, 0.0, 0.7], seed=3)  # the state carries them into every round
    assert np.asarray(state.temperature).tolist() == pytest.approx([0.0, 1.0, 0.0, 0.7])
    assert summarize(engine.run(state), 0.0, 0.0)["tokens"] == mixed
    assert [mixed[0], mixed[2]] == [ar_reference[0], ar_reference[2]]
    assert mixed[1] == engine.generate(prompts, temperature=1.0, seed=3)["tokens"][1] != ar_reference[1]
    assert mixed[3] == engine.generate(prompts, temperature=np.full(4, 0.7), seed=3)["tokens"][3] != ar_reference[3]
    joined = [sum(t, []) for t in zip(*(u.new_tokens for u in engine.stream(prompts, (0.0, 1.0, 0.0, 0.7), 3)))]
    assert joined == mixed


@pytest.mark.parametrize("mode", ["ar", "ddtree"])  # DFlash: a chain, the tree's special case
def test_per_stream_seeds_make_a_streams_draws_independent_of_its_batch(models, mode):
    """``seed=[one per stream]``: a sampled stream emits the same tokens alone, in a batch of four, or in another
    place of another batch (the others' prompts, temperatures and seeds changed), and other tokens under another
    seed; one seed for the batch gives each stream its own draws (streams with one prompt differ)."""
    target, drafter = models
    engine = Engine(target, drafter if mode != "ar" else None,
                    EngineConfig(mode=mode, budget=16, max_new_tokens=NEW, capacity=64))
    prompts = PROMPTS[:4]
    batch = engine.generate(prompts, 1.0, seed=[11, 12, 13, 14])["tokens"]
    for b in range(4):
        assert engine.generate([prompts[b]], 1.0, seed=[11 + b])["tokens"][0] == batch[b], b
    moved = engine.generate([PROMPTS[9], prompts[2], prompts[0]], [0.0, 1.0, 1.0], seed=(5, 13, 11))["tokens"]
    assert moved[1:] == [batch[2], batch[0]]
    assert engine.generate([prompts[0]], 1.0, seed=[99])["tokens"][0] != batch[0]
    same_prompt = engine.generate([prompts[0]] * 4, 1.0, seed=11)["tokens"]
    assert len({tuple(t) for t in same_prompt}) > 1 and same_prompt[0] == batch[0]  # stream 0: s as [s]


@pytest.mark.parametrize("mode", ["ar", "ddtree"])  # DFlash: a chain, the tree's special case
def test_per_stream_token_limits(models, ar_reference, mode):
    """Each stream stops at its own limit (one for all, or one per stream, at most the config's): its tokens are
    AR's first ones, with status max_new_tokens, and one compiled program serves every limit."""
    from experiments import bench_util

    target, drafter = models
    engine = Engine(target, drafter if mode != "ar" else None,
                    EngineConfig(mode=mode, budget=16, max_new_tokens=NEW, capacity=64))
    prompts = PROMPTS[:4]
    engine.generate(prompts)  # compiles
    cases = [([1, NEW, 4, 7], [1, NEW, 4, 7]), (5, [5] * 4), (jnp.asarray([3, 3, 2, 1]), [3, 3, 2, 1])]
    with bench_util.counting_compiles() as compiles:
        for limits, per_stream in cases:
            res = engine.generate(prompts, max_new_tokens=limits)
            for b, limit in enumerate(per_stream):
                assert res["tokens"][b] == ar_reference[b][:limit] and res["status"][b] == "max_new_tokens"
        updates = engine.stream(prompts, max_new_tokens=[2, 3, 1, 9])
        joined = [sum(t, []) for t in zip(*(u.new_tokens for u in updates))]
        assert joined == [ar_reference[b][:n] for b, n in enumerate([2, 3, 1, 9])]
    assert compiles == []


def teacher_forced_logits(target, prompts, outputs, log_softmax=False) -> list[np.ndarray]:
    """Each output token's logits [tokens, W] (or their log_softmax) from the plain causal forward over prompt +
    output (right-padded, one batch), outside the engine: the row at the position before the token."""
    seqs = [list(p) + list(o) for p, o in zip(prompts, outputs)]
    width = -(-max(map(len, seqs)) // 32) * 32  # rounded up: calls of nearby lengths share one compile
    tokens = np.zeros((len(seqs), width), np.int32)
    for i, seq in enumerate(seqs):
        tokens[i, :len(seq)] = seq
    logits = causal_forward(target, tokens).astype(jnp.float32)
    rows = np.asarray(jax.nn.log_softmax(logits, axis=-1) if log_softmax else logits)
    return [rows[i, len(p) - 1 + np.arange(len(o))] for i, (p, o) in enumerate(zip(prompts, outputs))]


def teacher_forced_logprobs(target, prompts, outputs) -> list[np.ndarray]:
    """Each output token's log-probabilities [tokens, W] under the plain causal forward (``teacher_forced_logits``)."""
    return teacher_forced_logits(target, prompts, outputs, log_softmax=True)


@pytest.mark.parametrize("mode", ["ar", "ddtree"])  # DFlash: a chain, the tree's special case
def test_logprobs_are_the_full_forwards(models, ar_reference, mode):
    """``EngineConfig(logprobs=True, top_logprobs=5)``: each emitted token's log-probability, and the 5 likeliest
    tokens with theirs, equal the plain causal forward's over the prompt and the tokens before it, in greedy and
    sampled streams (the model's own distribution, whatever the temperature and filters), cut with the tokens at
    each stream's limit; ``stream`` reports the same values as they come; the tokens are those decoded without
    them."""
    target, drafter = models
    ecfg = EngineConfig(mode=mode, budget=16, max_new_tokens=NEW, capacity=64, top_k=8, logprobs=True,
                        top_logprobs=5)
    engine = Engine(target, drafter if mode != "ar" else None, ecfg)
    prompts, temperatures, limits = PROMPTS[:4], [0.0, 1.0, 0.0, 0.7], [NEW, NEW, 6, 3]
    res = engine.generate(prompts, temperatures, seed=5, max_new_tokens=limits)
    plain = Engine(target, drafter if mode != "ar" else None, dataclasses.replace(ecfg, logprobs=False,
                                                                                   top_logprobs=0))
    assert res["tokens"] == plain.generate(prompts, temperatures, seed=5, max_new_tokens=limits)["tokens"]
    assert [len(t) for t in res["tokens"]] == limits and res["tokens"][0] == ar_reference[0]
    want = teacher_forced_logprobs(target, prompts, res["tokens"])
    for b in range(len(prompts)):
        assert len(res["logprobs"][b]) == len(res["top_logprobs"][b]) == limits[b]
        tokens = res["tokens"][b]
        np.testing.assert_allclose(res["logprobs"][b], want[b][np.arange(len(tokens)), tokens], rtol=1e-5,
                                   atol=1e-4, err_msg=f"stream {b}")
        for i, pairs in enumerate(res["top_logprobs"][b]):  # by value, then each id's own: robust to near-ties
            ids, values = np.array([p[0] for p in pairs]), np.array([p[1] for p in pairs])
            np.testing.assert_allclose(values, np.sort(want[b][i])[::-1][:5], rtol=1e-5, atol=1e-4)
            np.testing.assert_allclose(values, want[b][i][ids], rtol=1e-5, atol=1e-4)
            assert len(set(ids.tolist())) == 5 and (np.diff(values) <= 0).all()
    assert max(-min(lp) for lp in res["logprobs"]) > 0.1  # the sampled streams drew unlikely tokens too
    updates = list(engine.stream(prompts, temperatures, 5, limits))
    assert [sum(t, []) for t in zip(*(u.new_logprobs for u in updates))] == res["logprobs"]
    assert [sum(t, []) for t in zip(*(u.new_top_logprobs for u in updates))] == res["top_logprobs"]
    assert plain.generate(prompts)["logprobs"] is None and plain.generate(prompts)["top_logprobs"] is None
    assert all(u.new_logprobs is None and u.new_top_logprobs is None for u in plain.stream(prompts))


def cut_at_stop(tokens, stop_sequences):
    """Plain reference: tokens up to and including the first one that ends a stop sequence, and the status."""
    for n in range(1, len(tokens) + 1):
        if any(tokens[:n][-len(seq):] == list(seq) for seq in stop_sequences if len(seq) <= n):
            return tokens[:n], "stop_sequence"
    return tokens, "max_new_tokens"


@pytest.mark.parametrize("mode", ["ar", "ddtree"])  # DFlash: a chain, the tree's special case
def test_stop_sequences_cut_ar_output(models, ar_reference, mode):
    """``EngineConfig(stop_sequences=...)``: each stream's output is AR's cut after the first generated token that
    ends any stop sequence (one taken from another stream's output can stop this one too; a single-token one can
    stop a stream at the prefill's token), with status stop_sequence; streams without one run to their limit."""
    target, drafter = models
    prompts = PROMPTS[:8]
    stops = (tuple(ar_reference[0][4:6]), tuple(ar_reference[1][2:5]), (ar_reference[3][0],),
             tuple(ar_reference[5][6:10]))
    engine = Engine(target, drafter if mode != "ar" else None,
                    EngineConfig(mode=mode, budget=16, max_new_tokens=NEW, capacity=64, stop_sequences=stops))
    res = engine.generate(prompts)
    want = [cut_at_stop(ar_reference[b], stops) for b in range(len(prompts))]
    assert list(zip(res["tokens"], res["status"])) == want
    assert sum(status == "stop_sequence" for _, status in want) >= 4 and len(want[3][0]) == 1
    joined = [sum(t, []) for t in zip(*(u.new_tokens for u in engine.stream(prompts)))]
    assert joined == res["tokens"]


@pytest.mark.parametrize("limits,message", [
    ([4, 4], r"max_new_tokens must be one integer or a sequence of one per stream \(3\), got \[4, 4\]"),
    ([4, NEW + 1, 4], rf"stream 1's max_new_tokens must be in \[1, {NEW}\] \(EngineConfig.max_new_tokens\), "
                      rf"got {NEW + 1}"),
    ([4, 4, 0], "stream 2's max_new_tokens must be in"), ([4, 4.0, 4], "stream 1's max_new_tokens must be an integer"),
    (0, r"^max_new_tokens must be in \[1, 10\]"), (True, "max_new_tokens must be an integer"),
    ([[4, 4, 4]], "one per stream")])
def test_bad_token_limits_refused(models, limits, message):
    target, drafter = models
    engine = Engine(target, drafter, EngineConfig(mode="ddtree", budget=8, max_new_tokens=NEW, capacity=64))
    with pytest.raises(ValueError, match=message):
        engine.generate(PROMPTS[:3], max_new_tokens=limits)


@pytest.mark.parametrize("temperature,message", [
    ([0.0, 1.0], r"one number or a sequence of one per stream \(3\), got \[0.0, 1.0\]"),
    ([[0.0, 1.0, 1.0]], "one per stream"), ([0.0, [1.0], 1.0], "one per stream"),
    ([0.0, -1.0, 1.0], r"stream 1's temperature must be finite and >= 0 \(0: greedy\), got -1.0"),
    ((1.0, 1.0, float("nan")), "stream 2's temperature must be finite"),
    ([1.0, "hot", 1.0], "stream 1's temperature must be a number"),
    ("hot", "temperature must be a number")])
def test_bad_per_stream_temperatures_refused(models, temperature, message):
    target, drafter = models
    engine = Engine(target, drafter, EngineConfig(mode="ddtree", budget=8, max_new_tokens=4, capacity=64))
    with pytest.raises(ValueError, match=message):
        engine.generate(PROMPTS[:3], temperature)


def test_stream_ends_after_the_prefill_when_its_token_is_the_last(models):
    """max_new_tokens = 1: the prefill's token ends every stream, and ``stream`` reports it alone (no dispatch)."""
    target, drafter = models
    engine = Engine(target, drafter, EngineConfig(mode="ddtree", budget=8, max_new_tokens=1, capacity=64))
    updates = list(engine.stream(PROMPTS[:2]))
    assert len(updates) == 1 and updates[0].status == ["max_new_tokens"] * 2 and updates[0].rounds == [0, 0]
    assert updates[0].new_tokens == engine.generate(PROMPTS[:2])["tokens"]


def test_a_stopped_batch_compiles_the_round_loop(models):
    """``run`` dispatches at least once, also when every stream has stopped (a loop of no rounds):
    ``run_decode.warm_up`` compiles the round loop so, and a decode after it compiles nothing."""
    from experiments import bench_util, run_decode

    target, drafter = models
    engine = Engine(target, drafter, EngineConfig(mode="ddtree", budget=6, max_new_tokens=5, capacity=48))
    batches = [PROMPTS[:3], PROMPTS[3:5]]
    run_decode.warm_up(engine, batches, 0.0)
    with bench_util.counting_compiles() as compiles:
        tokens = [engine.generate(batch)["tokens"] for batch in batches]
    assert compiles == [] and all(len(t) == 5 for batch in tokens for t in batch)


def test_stream_checks_its_inputs_when_called(models):
    """Bad input is refused by ``stream`` itself, not at the first ``next``."""
    target, drafter = models
    engine = Engine(target, drafter, EngineConfig(mode="ddtree", budget=8, max_new_tokens=4, capacity=64))
    with pytest.raises(ValueError, match="temperature"):
        engine.stream(PROMPTS[:2], temperature=-1.0)
    with pytest.raises(ValueError, match="seed"):
        engine.stream(PROMPTS[:2], seed=-1)


def test_cache_capacity_ends_stream_with_status(models):
    target, drafter = models
    prompts = [PROMPTS[0][:4], PROMPTS[1][:12]]
    ecfg = EngineConfig(mode="ddtree", budget=8, max_new_tokens=40, capacity=24)
    res = Engine(target, drafter, ecfg).generate(prompts)
    assert res["status"] == ["cache_full", "cache_full"]
    ar = generate_all(target, None, EngineConfig(mode="ar", max_new_tokens=40, capacity=64), prompts, 2)
    for b in range(2):  # what was generated before stopping is still exact
        assert res["tokens"][b] == ar[b][: len(res["tokens"][b])]
        assert len(prompts[b]) + len(res["tokens"][b]) <= 24


def test_ar_counts_and_capacity_are_exact(models):
    """AR commits one row and emits one token a round, so every count is known: the prefill commits the prompt
    and emits one token, each round needs one free slot, so a stream gets min(N, capacity - prompt + 1) tokens
    in as many rounds less one, and stops at max_new_tokens exactly when required_capacity fits. One round a
    dispatch: streams that stop in different dispatches keep their own counts and the others run on."""
    target, _ = models
    capacity, new = 9, 7
    prompts = [PROMPTS[0][:5], PROMPTS[1][:3], PROMPTS[2][:4], PROMPTS[3][:8]]
    engine = Engine(target, None, EngineConfig(mode="ar", max_new_tokens=new, capacity=capacity, rounds_per_dispatch=1))
    res = engine.generate(prompts)
    counts = [min(new, capacity - len(p) + 1) for p in prompts]
    assert [len(t) for t in res["tokens"]] == counts
    assert res["status"] == ["max_new_tokens" if required_capacity(len(p), new, 0) <= capacity else "cache_full"
                             for p in prompts]
    assert len(set(res["status"])) == 2  # both sides of the bound occur
    assert res["rounds"] == [c - 1 for c in counts]
    assert res["tau_hist"] == [0, sum(counts) - len(prompts)]  # AR: every round emits exactly one token
    with pytest.raises(ValueError, match="does not fit the cache capacity 9"):
        engine.generate([[1] * capacity])  # a round needs one free slot after the prompt


def ref_stop_and_emit(out, out_logprobs, num_out, status, emitted, emitted_logprobs, n_emit, active, eos_ids,
                      max_new, stop_sequences=(), min_new_tokens=0, string_ends=None, stop_ids=()):
    """One stream, token by token: an active stream appends this round's first n_emit tokens (and their
    log-probabilities) until it has appended an EOS (status eos) or one of its ``stop_ids`` (status stop_token), or,
    as its (min_new_tokens + 1)-th token or
    later, a token with which its generated tokens end in one of ``stop_sequences`` (status stop_sequence) or that
    ``string_ends`` marks (status stop_string), or reaches max_new tokens (status max_new_tokens), and stops without
    appending it at a NO_TOKEN_ID (status no_token); others are unchanged."""
    out, out_logprobs = list(out), list(out_logprobs)
    if not active:
        return out, out_logprobs, num_out, status
    for e, (token, logprob) in enumerate(zip(emitted[:n_emit], emitted_logprobs)):
        if token == NO_TOKEN_ID:
            return out, out_logprobs, num_out, NO_TOKEN
        out[num_out], out_logprobs[num_out] = token, logprob
        num_out += 1
        if token in eos_ids:
            return out, out_logprobs, num_out, EOS
        if token in stop_ids:
            return out, out_logprobs, num_out, STOP_TOKEN
        past_min = num_out > min_new_tokens
        if past_min and any(list(out[:num_out][-len(seq):]) == list(seq) for seq in stop_sequences
                            if len(seq) <= num_out):
            return out, out_logprobs, num_out, STOP_SEQUENCE
        if past_min and string_ends is not None and string_ends[e]:
            return out, out_logprobs, num_out, STOP_STRING
        if num_out == max_new:
            return out, out_logprobs, num_out, MAX_TOKENS
    return out, out_logprobs, num_out, status


def test_stop_and_emit_equals_a_token_by_token_reference():
    """The engine's vectorised truncation at EOS / stop sequences / each stream's token limit against
    ``ref_stop_and_emit`` on random streams over 8 token ids: EOS early, late, past the limit or absent, stop
    sequences ending in this round after starting in earlier ones, overlapping or sharing an end with an EOS,
    inactive streams holding EOS tokens, each stream's own stop token ids (0-3 of them, some also EOS ids), own
    stop sequences (0-3 of a case's) and own EOS ids (0-2), and entries past n_emit that must be ignored; each kept
    token's log-probability lands beside it."""
    rng = np.random.default_rng(0)
    b, width, max_new = 200, 5, 8
    cases = [((), (), 0, False), ((3,), (), 0, False), ((3, 5), (), 0, False), ((), ((2, 4),), 0, False),
             ((3,), ((1, 1, 1), (6,), (0, 3)), 0, False), ((), ((7, 2, 7), (2, 7)), 0, False),
             ((3,), ((2, 4),), 3, False), ((), (), 0, True), ((5,), ((6,),), 4, True)]
    cases += [((), (), 0, False, True), ((3,), ((2, 4),), 2, True, True)]  # with each stream's own stop ids
    # with each stream's own stop sequences (the case's compiled out)
    cases += [((3,), ((1, 1, 1), (6,), (0, 3), (7, 2, 7), (2, 4)), 0, False, False, True),
              ((), ((2, 4, 6, 1), (5,), (6, 6)), 2, True, True, True)]
    cases += [((), ((2, 4),), 0, False, False, False, True)]  # with each stream's own EOS ids (the case's compiled out)
    cases += [((3,), ((2, 4),), 2, True, True, False, False, True)]  # with places where no token was left
    for eos_ids, stop_sequences, min_new_tokens, strings, *flags in cases:
        own, own_sequences, own_eos, no_token = (flags + [False] * 4)[:4]
        per_stream = [stop_sequences] * b
        if own_sequences:
            per_stream = [tuple(stop_sequences[j] for j in rng.choice(len(stop_sequences), n, replace=False))
                          for n in rng.integers(0, 4, b)]
        active = rng.random(b) < 0.7
        limit = rng.integers(1, max_new + 1, b)  # per stream, at most the buffer's max_new
        num_out = np.where(active, rng.integers(0, limit), rng.integers(0, limit + 1))
        status = np.where(active, RUNNING, rng.choice([EOS, MAX_TOKENS, CACHE_FULL], b))
        n_emit = rng.integers(1, width + 1, b)
        emitted = rng.integers(0, 8, (b, width))
        for s in np.flatnonzero(rng.random(b) < 0.4) if no_token else ():
            emitted[s, rng.integers(n_emit[s])] = NO_TOKEN_ID
        emitted_logprobs = -rng.random((b, width), np.float32)
        kept = np.arange(max_new) < num_out[:, None]
        out = np.where(kept, rng.integers(0, 8, (b, max_new)), PAD)
        out_logprobs = np.where(kept, -rng.random((b, max_new), np.float32), np.nan).astype(np.float32)
        for s in rng.choice(b, b // 3, replace=False) if stop_sequences else ():  # plant one across the boundary
            if not per_stream[s]:
                continue
            seq = per_stream[s][rng.integers(len(per_stream[s]))]
            first = rng.integers(max(num_out[s] - len(seq) + 1, 0), num_out[s] + width - len(seq) + 1)
            for p, token in enumerate(seq, first):
                if p < num_out[s]:
                    out[s, p] = token
                else:
                    emitted[s, p - num_out[s]] = token
        state = types.SimpleNamespace(out_tokens=jnp.asarray(out, jnp.int32),
                                      out_scores=TokenScores(jnp.asarray(out_logprobs), None, None),
                                      num_out=jnp.asarray(num_out, jnp.int32), status=jnp.asarray(status, jnp.int32),
                                      limit=jnp.asarray(limit, jnp.int32))
        string_ends = rng.random((b, width)) < 0.15 if strings else None
        stop_ids = np.full((b, 4), 8)  # 8: past the 8 ids, padding
        for row, count in zip(stop_ids, rng.integers(0, 4, b)) if own else ():
            row[:count] = rng.choice(8, count, replace=False)
        stream_eos = np.full((b, 2), 8)
        for row, count in zip(stream_eos, rng.integers(0, 3, b)) if own_eos else ():
            row[:count] = rng.choice(8, count, replace=False)
        own_table = (jax.tree.map(jnp.asarray, stream_sequences([list(map(list, p)) for p in per_stream], b, 8, (),
                                                                check_id_sequences, "stop_sequences"))
                     if own_sequences else None)
        got = stop_and_emit(state, jnp.asarray(emitted, jnp.int32), jnp.asarray(n_emit), jnp.asarray(active),
                             eos_ids, TokenScores(jnp.asarray(emitted_logprobs), None, None),
                             () if own_sequences else stop_sequences, min_new_tokens,
                             None if string_ends is None else jnp.asarray(string_ends),
                             jnp.asarray(stop_ids, jnp.int32) if own else None, own_table,
                             jnp.asarray(stream_eos, jnp.int32) if own_eos else None)
        got_out, got_num, got_status = map(np.asarray, (got[0], got[2], got[3]))
        got_logprobs = np.asarray(got[1].logprob)
        statuses = collections.Counter()
        for s in range(b):
            stream_eos_ids = stream_eos[s][stream_eos[s] < 8].tolist() if own_eos else eos_ids
            want = ref_stop_and_emit(out[s], out_logprobs[s], num_out[s], status[s], emitted[s], emitted_logprobs[s],
                                     n_emit[s], active[s], stream_eos_ids, limit[s], per_stream[s], min_new_tokens,
                                     None if string_ends is None else string_ends[s], stop_ids[s].tolist())
            case = (eos_ids, stop_sequences, min_new_tokens, strings, s)
            assert got_out[s].tolist() == want[0] and (int(got_num[s]), int(got_status[s])) == want[2:], case
            np.testing.assert_array_equal(got_logprobs[s], np.asarray(want[1], np.float32), err_msg=str(case))
            statuses[want[3]] += active[s] and want[3] != RUNNING
        if stop_sequences:
            assert statuses[STOP_SEQUENCE] >= (5 if min_new_tokens else 10), statuses  # the case exercised it
        if strings:
            assert statuses[STOP_STRING] >= (5 if min_new_tokens else 10), statuses
        if own:
            assert statuses[STOP_TOKEN] >= 10, statuses
        if own_eos or eos_ids:
            assert statuses[EOS] >= 10, statuses
        if no_token:
            assert statuses[NO_TOKEN] >= 10, statuses
        spanning = [s for s in range(b) if got_status[s] == STOP_SEQUENCE and active[s]
                    and any(got_num[s] - num_out[s] < len(seq) and list(got_out[s][:got_num[s]][-len(seq):]) ==
                            list(seq) for seq in per_stream[s])]
        if any(len(seq) > 1 for seq in stop_sequences):
            assert spanning, "no stop sequence began before this round"


def test_tokens_per_s_excludes_the_prefill_token():
    """The prefill samples each stream's first token (its time is prefill_s): tokens_per_s divides only the
    tokens of the rounds by decode_s, like tau; new_tokens still counts every token."""
    state = types.SimpleNamespace(out_tokens=np.arange(12).reshape(2, 6), out_scores=None, num_out=np.array([5, 3]),
                                  rounds=np.array([2, 1]), tau_hist=np.zeros((2, 5), int), status=np.array([2, 2]))
    res = summarize(state, prefill_s=7.0, decode_s=2.0)
    assert res["new_tokens"] == 8
    assert res["tokens_per_s"] == (4 + 2) / 2.0
    assert res["tau_mean"] == (4 + 2) / 3
    from experiments.run_decode import merge_results  # run_decode's tok/s (and speedup_vs_ar) over batches

    other = dict(res, tokens=[[1]], new_tokens=1, round_tokens=0, rounds=[0], batch_rounds=0, decode_s=1.0,
                 prefill_s=1.0, tau_hist=[0] * 5)
    _, _, metrics = merge_results([res, other])  # a stream that stopped after its prefill token adds none
    assert metrics["new_tokens"] == 9 and metrics["decode_s"] == 3.0
    assert metrics["tokens_per_s"] == 6 / 3.0 and metrics["tau"] == 6 / 3 and metrics["round_tokens"] == 6
    assert res["batch_rounds"] == 2 and metrics["tokens_per_round_batch"] == 9 / 2


def test_tau_over_one_round_and_over_none():
    """tau = tokens of the rounds / rounds, also when the batch ran exactly one round (a single stream that
    emitted 3 tokens in it: tau 3), and 0 (not a division by zero) when no stream ran a round."""
    def state(num_out, rounds):
        n = len(num_out)
        return types.SimpleNamespace(out_tokens=np.zeros((n, 6), int), out_scores=None, num_out=np.array(num_out),
                                     rounds=np.array(rounds), tau_hist=np.zeros((n, 5), int), status=np.full(n, 2))
    one = summarize(state([4], [1]), prefill_s=1.0, decode_s=1.0)
    assert one["tau_mean"] == 3.0 and one["tau_per_stream"] == [3.0]
    none = summarize(state([1, 1], [0, 0]), prefill_s=1.0, decode_s=1.0)
    assert none["tau_mean"] == 0.0 and none["tau_per_stream"] == [0.0, 0.0]
    no_token = summarize(state([0, 6], [0, 5]), prefill_s=1.0, decode_s=1.0)  # stopped at the prefill with no token
    assert no_token["tau_mean"] == 1.0 and no_token["tau_per_stream"] == [0.0, 1.0]
    assert no_token["round_tokens"] == 5 and no_token["tokens_per_s"] == 5.0


@pytest.mark.parametrize("mode,budget", [("dflash", 1), ("ddtree", 16)])
def test_tau_hist_counts_the_tokens_each_round_emitted(models, mode, budget):
    """tau_hist[k] counts stream-rounds that emitted k tokens, after the cut at the token limit: with 2 new tokens a
    stream, every stream's one round emits 1 whatever the walk accepted, so the histogram agrees with tau."""
    target, drafter = models
    res = Engine(target, drafter, EngineConfig(mode=mode, budget=budget, max_new_tokens=2, capacity=64)).generate(
        PROMPTS[:16])
    assert sum(k * n for k, n in enumerate(res["tau_hist"])) == res["round_tokens"] == 16
    assert res["tau_hist"][1] == sum(res["rounds"]) == 16


def test_bad_budget_refused():
    for bad in (0, -3, 10**9):
        with pytest.raises(ValueError, match="budget"):
            EngineConfig(mode="ddtree", budget=bad)


def test_prompt_past_capacity_refused(models):
    target, drafter = models
    engine = Engine(target, drafter, EngineConfig(mode="ddtree", budget=8, capacity=16))
    with pytest.raises(ValueError, match="does not fit the cache capacity 16"):
        engine.generate([[1] * 14])  # 14 + one tree of depth 3 does not fit 16 slots
    with pytest.raises(ValueError, match="does not fit the cache capacity 16"):
        engine.generate([[1] * 13])  # the tree's root row is one slot more than its depth


def test_seed_outside_32_bits_refused(models):
    """``jax.random.key`` keeps 32 bits without x64 (seed 2**32 gave seed 0's key, -1 gave 2**32 - 1's), so the
    engine takes seeds in [0, 2**32) only, checked before anything compiles."""
    target, drafter = models
    engine = Engine(target, drafter, EngineConfig(mode="ddtree", budget=8, capacity=16))
    for bad in (-1, 2**32, 2**63 - 1):
        with pytest.raises(ValueError, match=rf"seed must be in \[0, 4294967296\) \(a 32-bit key\), got {bad}"):
            engine.generate([[1, 2]], temperature=1.0, seed=bad)
    for bad in (1.5, True, "3", None):
        with pytest.raises(ValueError, match="seed must be an integer"):
            engine.prefill([[1, 2]], seed=bad)
    with pytest.raises(ValueError, match=r"stream 1's seed must be in \[0, 4294967296\) \(a 32-bit key\), got -1"):
        engine.prefill([[1, 2], [3]], seed=[0, -1])
    with pytest.raises(ValueError, match=r"seed must be one integer or a sequence of one per stream \(2\)"):
        engine.prefill([[1, 2], [3]], seed=[0, 1, 2])
    for good in (0, 2**32 - 1, np.uint32(7), np.int64(2**32 - 1)):
        assert check_seed(good) == int(good) and type(check_seed(good)) is int


@pytest.mark.parametrize("mode", ["ar", "ddtree"])
def test_a_chunked_prefill_gives_the_one_block_prefills_caches_and_tokens(models, ar_reference, mode):
    """Prompts of 2-19 tokens (padded to 16 or 32) prefilled 5 tokens a block, the last block padded: the target's
    and the drafter's caches, the first tokens and the greedy outputs equal the one-block prefill's (and AR's)."""
    target, drafter = models
    ecfg = EngineConfig(mode=mode, budget=16, max_new_tokens=NEW, capacity=64, prefill_chunk=5)
    drafter = drafter if mode != "ar" else None
    chunked = Engine(target, drafter, ecfg)
    whole = Engine(target, drafter, dataclasses.replace(ecfg, prefill_chunk=None))
    prompts = PROMPTS[:8]
    assert max(map(len, prompts)) > 16
    got, want = chunked.prefill(prompts), whole.prefill(prompts)
    np.testing.assert_array_equal(np.asarray(got.bonus), np.asarray(want.bonus))
    caches = [(got.cache, want.cache)] + ([(got.draft_cache, want.draft_cache)] if drafter else [])
    for got_cache, want_cache in caches:
        np.testing.assert_array_equal(np.asarray(got_cache.lengths), [len(p) for p in prompts])
        np.testing.assert_array_equal(np.asarray(got_cache.lengths), np.asarray(want_cache.lengths))
        for got_rows, want_rows in zip(jax.tree.leaves(got_cache), jax.tree.leaves(want_cache)):
            np.testing.assert_allclose(np.asarray(got_rows), np.asarray(want_rows), rtol=1e-5, atol=1e-5)
    assert chunked.generate(prompts)["tokens"] == ar_reference[:8]


def test_sharded_engine_matches(models, host_devices):
    target, drafter = models
    mesh = make_mesh(data=4, model=2, devices=host_devices)  # the tiny drafter has 2 kv heads
    runtime = Runtime(mesh=mesh, rules=DEFAULT_RULES)
    ecfg = EngineConfig(mode="ddtree", budget=16, max_new_tokens=NEW, capacity=64)
    prompts = PROMPTS[:4]
    plain = generate_all(target, drafter, ecfg, prompts, 4)  # greedy, no processing: what the options change
    # the log-probabilities and the logit processing over a split vocabulary, per-stream seeds sampled
    options = dataclasses.replace(ecfg, logprobs=True, top_logprobs=3, repetition_penalty=1.6, frequency_penalty=-0.5,
                                  presence_penalty=0.3, logit_bias={2: -100.0, 5: 1.0}, eos_ids=(0,),
                                  min_new_tokens=3, prefill_chunk=5)  # 5-17 tokens padded to 32: 7 blocks
    options = dataclasses.replace(options, stop_strings=("ba", "\n\n"))  # over a tokenizer of one or two bytes an id
    tokenizer = types.SimpleNamespace(token_bytes=lambda w: [bytes([97 + i % 3] * (1 + i % 2)) for i in range(w)])
    want = Engine(target, drafter, options, tokenizer=tokenizer).generate(prompts, [0.0, 1.0, 0.0, 0.7],
                                                                          seed=[3, 4, 5, 6])
    engine = Engine(target, drafter, options, runtime=runtime, tokenizer=tokenizer)
    got = engine.generate(prompts, [0.0, 1.0, 0.0, 0.7], seed=[3, 4, 5, 6])
    split = [leaf for leaf in jax.tree.leaves(engine.target_state) if not leaf.sharding.is_fully_replicated]
    assert len(split) > 10, len(split)  # it was sharded: the weights and the cache
    assert "data" in engine.prefill(prompts).cache.kv.sharding.spec
    assert "stop_string" in want["status"] and got["status"] == want["status"]
    assert got["tokens"] == want["tokens"] and got["tokens"] != plain
    # and per-stream filters, penalties, stop strings and sequences, logit biases, EOS and stop token ids, allowed
    # ids and bad words
    per_stream = dict(top_k=[0, 5, 0, 12], top_p=[1.0, 0.9, 1.0, 0.8], min_p=[0.0, 0.0, 0.0, 0.05],
                      repetition_penalty=[1.6, 1.0, 1.3, 1.6], frequency_penalty=[-0.5, 0.0, 0.2, 0.0],
                      stop_strings=[("ba",), ("\n\n",), (), ("ba", "\n\n")],
                      logit_bias=[{3: 2.0}, None, {}, {7: -1.0, 40: 3.0}], stop_token_ids=[[9], None, [4, 5], []],
                      allowed_token_ids=[None, list(range(1, 40)), [], None], bad_words=[[[2]], None, [[5, 6, 7]], []],
                      stop_sequences=[[[9, 9]], None, [[1, 2, 3], [4]], []], eos_ids=[None, [], [11], [0, 12]])
    plain_per_stream = Engine(target, drafter, options, tokenizer=tokenizer).generate(
        prompts, [0.0, 1.0, 0.0, 0.7], seed=[3, 4, 5, 6], **per_stream)
    sharded_per_stream = Engine(target, drafter, options, runtime=runtime, tokenizer=tokenizer).generate(
        prompts, [0.0, 1.0, 0.0, 0.7], seed=[3, 4, 5, 6], **per_stream)
    assert sharded_per_stream["tokens"] == plain_per_stream["tokens"] != want["tokens"]
    assert sharded_per_stream["status"] == plain_per_stream["status"]
    for b in range(len(prompts)):
        np.testing.assert_allclose(got["logprobs"][b], want["logprobs"][b], rtol=1e-5, atol=1e-5)
    # a batch the mesh's 4 ways cannot split is refused by name (before, JAX's IndivisibleError from placing the
    # caches); served in slots, any number runs
    with pytest.raises(ValueError, match="3 streams must be a multiple of the 4 ways the mesh splits the streams"):
        engine.generate(prompts[:3])
    alone = Engine(target, drafter, options, tokenizer=tokenizer).generate(prompts[:3])
    assert engine.generate(prompts[:3], slots=4)["tokens"] == alone["tokens"]


def chi2_two_sample_pvalue(a, b, categories):
    """Two-sample chi-squared homogeneity test over integer categories; returns the p-value."""
    from jax.scipy.special import gammaincc

    ca = np.bincount(a, minlength=categories).astype(float)
    cb = np.bincount(b, minlength=categories).astype(float)
    rare = (ca + cb) < 10  # pool rare categories so every expected count is reasonable
    ca = np.append(ca[~rare], ca[rare].sum())
    cb = np.append(cb[~rare], cb[rare].sum())
    keep = (ca + cb) > 0
    ca, cb = ca[keep], cb[keep]
    na, nb = ca.sum(), cb.sum()
    total = ca + cb
    ea, eb = total * na / (na + nb), total * nb / (na + nb)
    stat = ((ca - ea) ** 2 / ea).sum() + ((cb - eb) ** 2 / eb).sum()
    dof = keep.sum() - 1
    return float(gammaincc(dof / 2.0, stat / 2.0))


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (4, 0.8)])
def test_sampling_distribution_equals_ar(models, top_k, top_p):
    """T=1: the 2nd and 3rd generated tokens (the first ones speculation decides) have the same
    distribution under DDTree as under AR sampling (two-sample chi-squared, many streams), also truncated."""
    target, drafter = models
    prompt = PROMPTS[5]
    streams, calls = 256, 6

    def samples(mode):
        ecfg = EngineConfig(mode=mode, budget=32, max_new_tokens=3, capacity=64, top_k=top_k, top_p=top_p)
        engine = Engine(target, drafter if mode != "ar" else None, ecfg)
        toks = []
        for seed in range(calls):
            res = engine.generate([prompt] * streams, temperature=1.0, seed=100 + seed + (0 if mode == "ar" else 50))
            toks.extend(res["tokens"])
        return np.asarray(toks)

    ar, dd = samples("ar"), samples("ddtree")
    for position in (1, 2):
        p = chi2_two_sample_pvalue(ar[:, position], dd[:, position], VOCAB)
        assert p > 1e-3, f"token {position}: p = {p}"
    # and their joint distribution (token 3 given token 2 is decided by the same tree)
    p = chi2_two_sample_pvalue(ar[:, 1] * VOCAB + ar[:, 2], dd[:, 1] * VOCAB + dd[:, 2], VOCAB * VOCAB)
    assert p > 1e-3, f"tokens 2 and 3 jointly: p = {p}"
    shuffled = np.random.default_rng(0).permutation(dd[:, 2])  # same marginals, dependence broken: rejected
    assert chi2_two_sample_pvalue(ar[:, 1] * VOCAB + ar[:, 2], dd[:, 1] * VOCAB + shuffled, VOCAB * VOCAB) < 1e-6
    # the drafts were actually used: most rounds accepted something
    engine = Engine(target, drafter, EngineConfig(mode="ddtree", budget=32, max_new_tokens=3, capacity=64,
                                                  top_k=top_k, top_p=top_p))
    assert engine.generate([prompt] * 64, temperature=1.0, seed=7)["tau_mean"] > 1.2


@pytest.mark.parametrize("mode", ["ar", "ddtree"])  # DFlash: a chain, the tree's special case
@pytest.mark.parametrize("top_k,top_p,min_p", [(1, 1.0, 0.0), (0, 1e-6, 0.0), (0, 1.0, 1.0)])
def test_sampling_that_keeps_only_the_argmax_is_greedy(models, ar_reference, mode, top_k, top_p, min_p):
    """top_k = 1, a top_p below any second token's share, or min_p = 1, leaves one token to sample: at temperature 1
    every mode then emits AR's greedy tokens (the filters reach the prefill's sample and every round's)."""
    target, drafter = models
    ecfg = EngineConfig(mode=mode, budget=16, max_new_tokens=NEW, capacity=64, top_k=top_k, top_p=top_p,
                        min_p=min_p)
    engine = Engine(target, drafter if mode != "ar" else None, ecfg)
    assert engine.generate(PROMPTS[:8], temperature=1.0, seed=5)["tokens"] == ar_reference[:8]


def test_bad_truncation_refused(models):
    target, drafter = models
    for bad, message in ((dict(top_k=-1), "top_k must be >= 0"), (dict(top_k=2.5), "top_k must be an integer"),
                         (dict(top_p=0.0), "top_p must be in"), (dict(top_p=float("nan")), "top_p must be in"),
                         (dict(min_p=-0.5), "min_p must be in"), (dict(min_p="0.1"), "min_p must be a number")):
        with pytest.raises(ValueError, match=message):
            EngineConfig(**bad)
    with pytest.raises(ValueError, match=f"top_k must be at most the vocabulary's {VOCAB} tokens"):
        Engine(target, drafter, EngineConfig(top_k=VOCAB + 1))


def test_trained_pair_greedy_equals_ar():
    """The shipped trained target + DFlash drafter on held-out prompts: DFlash and DDTree greedy
    outputs equal AR token for token, and the trees accept far more than a random drafter."""
    import os

    from ddtree_jax.checkpoint import restore_drafter, restore_model
    from ddtree_jax.tokenizer import load_tokenizer
    from experiments import data as data_lib

    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checkpoints")
    target = restore_model(os.path.join(root, "target"))
    drafter = restore_drafter(os.path.join(root, "drafter"), dtype=target.cfg.dtype)
    tokenizer = load_tokenizer(os.path.join(root, "target"), target.cfg.vocab_size)
    held, _ = data_lib.load_texts("heldout", allow_mismatch=True)
    prompts = [q["ids"] for q in data_lib.eval_prompts(tokenizer, held, n=8, min_tokens=32, max_tokens=96, seed=3)]
    new = 24
    ar = generate_all(target, None, EngineConfig(mode="ar", max_new_tokens=new, capacity=256), prompts, 8)
    for mode, budget in (("dflash", 1), ("ddtree", 8), ("ddtree", 64)):
        ecfg = EngineConfig(mode=mode, budget=budget, max_new_tokens=new, capacity=256)
        engine = Engine(target, drafter, ecfg)
        res = [engine.generate(prompts[i:i + 4]) for i in (0, 4)]
        assert [t for r in res for t in r["tokens"]] == ar, f"{mode} budget {budget}"
        assert np.mean([r["tau_mean"] for r in res]) > 1.5, (mode, budget)
