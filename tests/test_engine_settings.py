"""Per-stream settings (``stream_settings``): top_k, top_p, min_p, the penalties and min_new_tokens given to
``generate`` one per stream reach their own stream and no other. Greedy decoding with per-stream penalties equals
the processed plain-forward reference with each stream's numbers; a sampled stream emits the same tokens in a mixed
batch as alone under a config holding its numbers; one compiled program serves any values; bad values name their
stream."""

import numpy as np
import pytest
from flax import nnx

from ddtree_jax.engine import Engine, EngineConfig
from ddtree_jax.stream_settings import NUMBERS, OFF, Switches, switches_of, uniform_settings
from test_engine_processing import EOS_IDS, STOPS, cut_at_end, greedy_with_processing
from tests.test_engine import NEW, PROMPTS, build_models

SETS = dict(logit_bias=((2, -100.0), (58, 1.5)), eos_ids=EOS_IDS)
PER_STREAM = dict(min_new_tokens=[4, 0, 6, 2, 0, 5, 1, 3], repetition_penalty=[1.2, 1.0, 0.7, 1.5, 1.0, 1.2, 2.0, 1.0],
                  frequency_penalty=[-0.7, 0.0, 0.3, 0.0, 0.5, -0.2, 0.0, 0.0],
                  presence_penalty=[0.4, 0.0, 0.0, -0.5, 0.3, 0.0, 0.0, 0.0],
                  logit_bias=[None, {2: -100.0, 7: 3.0}, {}, None, {58: 4.0, 19: 2.5}, {11: -1.5}, None, {}],
                  allowed_token_ids=[None, [], list(range(0, 64, 2)), None, None, None, [5, 19, 0, 58, 8], None],
                  bad_words=[None, [[58]], None, [[5, 18], [49, 19]], [], None, [[58, 58], [8, 5, 5]], None])


@pytest.fixture(scope="module")
def models():
    return build_models()


def config(mode, budget, **kw):
    return EngineConfig(mode=mode, budget=budget, max_new_tokens=NEW, capacity=64, stop_sequences=STOPS, **SETS, **kw)


@pytest.mark.parametrize("mode,budget", [("ar", 1), ("dflash", 1), ("ddtree", 64)])
def test_per_stream_processing_greedy_equals_the_processed_full_forward(models, mode, budget):
    """Eight streams, each its own penalties, min_new_tokens, logit bias, allowed ids and bad words (some off, some the
    config's; stream 7 none at all): greedy decoding equals the processed plain-forward reference with each stream's
    numbers, cut at its first EOS or stop sequence past its own min_new_tokens, token for token."""
    target, drafter = models
    engine = Engine(target, drafter if mode != "ar" else None, config(mode, budget))
    res = engine.generate(PROMPTS[:8], **PER_STREAM)
    reference = greedy_with_processing(target, PROMPTS[:8], SETS, PER_STREAM, NEW)
    want = [cut_at_end(tokens, EOS_IDS, STOPS, least) for tokens, least in zip(reference, PER_STREAM["min_new_tokens"])]
    assert list(zip(res["tokens"], res["status"])) == want
    uniform = greedy_with_processing(target, PROMPTS[:8], SETS, dict(repetition_penalty=1.2), NEW)
    assert sum(r != u for r, u in zip(reference, uniform)) >= 4  # the streams' numbers changed their tokens
    if mode == "ar":  # and their own logit biases and bad words did (against the config's for every stream)
        for name in ("logit_bias", "bad_words"):
            configs = greedy_with_processing(target, PROMPTS[:8], SETS,
                                             {k: v for k, v in PER_STREAM.items() if k != name}, NEW)
            assert sum(r != c for r, c in zip(reference, configs)) >= 2, name


@pytest.mark.parametrize("mode,budget", [("ar", 1), ("ddtree", 64)])
def test_per_stream_stops_greedy_equal_the_processed_full_forward(models, mode, budget):
    """Five streams, each its own stop token ids (one's held back by its min_new_tokens, so its tokens change before
    they may end it; one's is the prefill's token), stop sequences (stream 0 none, stream 1 its own, the others
    the config's) and EOS ids (stream 2 none, so it runs past the config's; stream 4 its own, held back): greedy
    decoding equals the processed plain-forward reference cut at the first EOS, own stop id or stop sequence, token
    for token, and the streams report "stop_token", "stop_sequence" and "eos"."""
    target, drafter = models
    plain = greedy_with_processing(target, PROMPTS[:5], SETS, {}, NEW)
    own = [[plain[0][0]], None, None, [plain[3][0], plain[3][1]], None]  # stream 0: its prefill's token
    sequences = [[], [plain[1][:2], [7, 7, 7]], None, None, None]
    eos = [None, None, [], None, [plain[4][1], plain[4][4]]]
    numbers = dict(min_new_tokens=[0, 0, 0, 3, 2], stop_token_ids=own, eos_ids=eos)
    engine = Engine(target, drafter if mode != "ar" else None, config(mode, budget))
    res = engine.generate(PROMPTS[:5], **numbers, stop_sequences=sequences)
    reference = greedy_with_processing(target, PROMPTS[:5], SETS, numbers, NEW)
    want = [cut_at_end(tokens, EOS_IDS if eos_ids is None else eos_ids, STOPS if seqs is None else seqs, least,
                       stop_ids or ())
            for tokens, least, stop_ids, seqs, eos_ids in zip(reference, numbers["min_new_tokens"], own, sequences,
                                                             eos)]
    assert list(zip(res["tokens"], res["status"])) == want
    assert res["status"][:2] == ["stop_token", "stop_sequence"] and res["status"][4] == "eos", res["status"]
    assert reference[3][:3] != plain[3][:3]  # stream 3's ids were held back
    assert cut_at_end(plain[2], EOS_IDS, STOPS, 0)[1] == "eos" and len(res["tokens"][2]) > len(
        cut_at_end(plain[2], EOS_IDS, STOPS, 0)[0])  # stream 2 ran past the config's EOS


SAMPLED = [  # each stream's temperature, seed and numbers
    dict(temperature=1.0, seed=11, top_k=5, top_p=1.0, min_p=0.0, repetition_penalty=1.3),
    dict(temperature=0.0, seed=12, top_k=0, top_p=0.5, min_p=0.0, frequency_penalty=0.4),
    dict(temperature=0.8, seed=13, top_k=0, top_p=0.8, min_p=0.05, presence_penalty=-0.3, min_new_tokens=3),
    dict(temperature=1.2, seed=14, top_k=40, top_p=0.9, min_p=0.0),
    dict(temperature=1.0, seed=15, top_k=0, top_p=1.0, min_p=0.2, min_new_tokens=6),
]


@pytest.mark.parametrize("mode", ["ddtree"])  # AR's one place a round: the processors' tests without a tree
def test_a_streams_settings_give_it_the_tokens_it_has_alone(models, mode):
    """Five streams of different temperatures, seeds, filters and penalties in one batch: each emits the tokens it
    emits alone under a config holding its numbers (its seed its own: its draws do not depend on the batch), with
    the same status; the batch compiles top-k, top-p and min-p once for all (top_k's ceiling 64)."""
    target, drafter = models
    drafter = drafter if mode != "ar" else None
    per_stream = {name: [s.get(name, OFF[name]) for s in SAMPLED] for name in NUMBERS}
    batch = Engine(target, drafter, config(mode, 16)).generate(
        PROMPTS[:5], [s["temperature"] for s in SAMPLED], [s["seed"] for s in SAMPLED], **per_stream)
    for b, settings in enumerate(SAMPLED):
        numbers = {name: per_stream[name][b] for name in NUMBERS}
        alone = Engine(target, drafter, config(mode, 16, **numbers)).generate(
            [PROMPTS[b]], settings["temperature"], [settings["seed"]])
        assert (alone["tokens"][0], alone["status"][0]) == (batch["tokens"][b], batch["status"][b]), b
    assert len({tuple(t) for t in batch["tokens"]}) == 5


def test_one_program_serves_any_values(models):
    """After one batch compiles, batches of other per-stream values under the same switches compile nothing; a
    batch that turns on a filter no stream used before compiles anew."""
    from experiments import bench_util

    target, drafter = models
    engine = Engine(target, drafter, config("ddtree", 16))
    prompts = PROMPTS[:4]
    engine.generate(prompts, 1.0, seed=1, top_p=[0.9, 1.0, 0.5, 0.7], repetition_penalty=[1.1, 1.0, 1.0, 1.3])
    with bench_util.counting_compiles() as compiles:
        engine.generate(prompts, [1.0, 0.5, 1.0, 2.0], seed=2, top_p=0.3, repetition_penalty=[0.9, 1.2, 1.0, 1.0])
        engine.generate(prompts, 0.7, seed=3, top_p=[0.95, 0.9, 0.2, 0.6], repetition_penalty=2.0)
    assert compiles == []
    with bench_util.counting_compiles() as compiles:
        engine.generate(prompts, 1.0, seed=4, top_p=0.9, min_p=[0.0, 0.1, 0.0, 0.0], repetition_penalty=1.1)
    assert compiles != []


def test_switches_read_what_the_sampled_streams_use():
    settings = uniform_settings(4, top_k=0, top_p=0.9)
    settings.top_k[:] = [3, 0, 100, 17]
    hot = np.array([1.0, 0.5, 0.0, 1.0])
    assert switches_of(hot, settings, 64) == Switches(greedy=False, top_k_ceiling=64, top_k_in_every_row=False,
                                                      top_p=True, min_p=False)
    assert switches_of(np.array([1.0, 0.0, 0.0, 1.0]), settings, 1000).top_k_ceiling == 128  # greedy stream 2's k
    assert switches_of(np.array([1.0, 0.0, 0.0, 1.0]), settings, 1000).top_k_in_every_row
    assert switches_of(np.array([0.0, 1.0, 0.0, 0.0]), settings, 1000) == Switches(greedy=False, top_p=True)
    assert switches_of(np.zeros(4), settings, 1000) == Switches()


@pytest.mark.parametrize("settings,message", [
    (dict(top_p=[0.9, 0.0, 1.0, 1.0]), r"stream 1's top_p must be in \(0, 1\]"),
    (dict(top_k=[1, 2, -3, 0]), r"stream 2's top_k must be >= 0"),
    (dict(top_k=[1, 2, 3, 10_000]), r"stream 3's top_k must be at most the vocabulary's"),
    (dict(min_p=[0.1, 0.2]), r"min_p must be one number or a sequence of one per stream \(4\)"),
    (dict(repetition_penalty=[1.0, 1.0, 0.0, 1.0]), r"stream 2's repetition_penalty must be a number in"),
    (dict(frequency_penalty=float("inf")), r"frequency_penalty must be a number in \[-2, 2\]"),
    (dict(presence_penalty=[0, 0, "x", 0]), r"stream 2's presence_penalty must be a number in \[-2, 2\]"),
    (dict(min_new_tokens=[0, NEW + 1, 0, 0]), rf"stream 1's min_new_tokens={NEW + 1} passes max_new_tokens={NEW}"),
    (dict(min_new_tokens=[0, 3, 0, 0], max_new_tokens=[4, 2, 4, 4]), r"stream 1's min_new_tokens=3 passes "
                                                                    r"max_new_tokens=2"),
    (dict(min_new_tokens=[0, 1.5, 0, 0]), r"stream 1's min_new_tokens must be an integer"),
    (dict(logit_bias=[{1: 2.0}, None]), r"logit_bias must be one mapping \{token id: amount\} .* one per stream "
                                        r"\(4\), got 2 of them"),
    (dict(logit_bias=[None, {1: 2.0}, {64: 1.0}, {}]), r"stream 2's logit_bias's token id 64 is outside the "
                                                       r"vocabulary \[0, 64\)"),
    (dict(logit_bias=[None, None, None, {3: float("nan")}]), r"stream 3's logit_bias\[3\] must be a number in \[-100"),
    (dict(logit_bias={-1: 2.0}), r"logit_bias's token ids must be integers >= 0, got -1"),
    (dict(logit_bias=[(1, 2.0), 3]), r"logit_bias must hold \(token id, amount\) pairs"),
    (dict(stop_token_ids=[[1], None]), r"stop_token_ids must be one sequence of token ids .* one per stream \(4\), "
                                       r"got 2 of them"),
    (dict(stop_token_ids=[None, [2], [64], []]), r"stream 2's stop_token_ids must be token ids in \[0, 64\), got 64"),
    (dict(stop_token_ids=[1, -2]), r"stop_token_ids must be token ids in \[0, 64\), got -2"),
    (dict(stop_token_ids=7), r"stop_token_ids must be one sequence of token ids"),
    (dict(allowed_token_ids=[None, [3, 2], [1, 64], None]), r"stream 2's allowed_token_ids must be token ids in "
                                                            r"\[0, 64\), got 64"),
    (dict(allowed_token_ids=[[0, 19], None, None, None], min_new_tokens=[1, 0, 0, 0]),
     r"stream 0's min_new_tokens=1 holds back every allowed token \[0, 19\]"),
    (dict(bad_words=[None, [[3, 2]], [[1, 64]], None]), r"stream 2's bad_words \[\(1, 64\)\] hold ids outside the "
                                                         r"vocabulary \[0, 64\)"),
    (dict(bad_words=[None, [[3, 2]]]), r"bad_words must be one sequence of token-id sequences .* one per stream \(4\), "
                                       r"got 2 of them"),
    (dict(bad_words=[[], None, None, None]), None),  # stream 0: none (not an empty word), the others the config's
    (dict(bad_words=[[3, 2], []]), r"bad_words\[1\] must be a non-empty sequence of token ids"),
    (dict(bad_words=[None, [[3, -2]], None, None]), r"stream 1's bad_words\[0\] must hold token ids >= 0"),
    (dict(eos_ids=[None, [64], None, None]), r"stream 1's eos_ids must be token ids in \[0, 64\), got 64"),
    (dict(eos_ids=[[], None, None, None], min_new_tokens=[2, 0, 0, 0], stop_sequences=[[], None, None, None]),
     r"stream 0's min_new_tokens=2 holds back EOS ids, stop token ids and stop sequences"),
    (dict(stop_sequences=[None, None, [[70]], None]), r"stream 2's stop_sequences \[\(70,\)\] hold ids outside"),
    (dict(stop_sequences=[[[1]], [[2]]]), r"stop_sequences must be one sequence of token-id sequences .* \(4\), got 2"),
])
def test_bad_per_stream_settings_refused(models, settings, message):
    target, drafter = models
    engine = Engine(target, drafter, config("ddtree", 16))
    if message is None:  # accepted
        engine.check_requests(PROMPTS[:4], 1.0, **settings)
        return
    with pytest.raises(ValueError, match=message):
        engine.generate(PROMPTS[:4], 1.0, **settings)


def test_token_sets_read_numpy_arrays_as_lists():
    """The per-stream token sets take numpy arrays where they take lists: one array for every stream, or one per
    stream (None beside them), with the same tables."""
    from ddtree_jax.stream_settings import stream_allowed_ids, stream_sequences, stream_stop_ids
    from ddtree_jax.stopping import check_id_sequences
    assert np.array_equal(stream_stop_ids(np.array([5, 3]), 2, 64), stream_stop_ids([5, 3], 2, 64))
    as_arrays = stream_allowed_ids([np.array([1, 2, 3]), None], 2, 64, (4,))
    as_lists = stream_allowed_ids([[1, 2, 3], None], 2, 64, (4,))
    assert all(np.array_equal(a, b) for a, b in zip(as_arrays.__dict__.values(), as_lists.__dict__.values()))
    as_sets = stream_allowed_ids([{3, 1, 2}, None], 2, 64, (4,))  # sets, as EngineConfig takes them
    assert all(np.array_equal(a, b) for a, b in zip(as_sets.__dict__.values(), as_lists.__dict__.values()))
    assert np.array_equal(stream_stop_ids(frozenset({5, 3}), 2, 64), stream_stop_ids([5, 3], 2, 64))
    with pytest.raises(ValueError, match="must be a non-empty sequence"):  # a sequence's order is not a set's
        stream_sequences([{3, 59}], 3, 64, (), check_id_sequences, "bad_words")
    words = stream_sequences(np.array([[5, 6], [7, 8]]), 3, 64, (), check_id_sequences, "bad_words")
    assert words.lengths.tolist() == [[2, 2]] * 3 and words.tokens[0].tolist() == [[5, 6], [7, 8]]


def test_the_configs_min_new_tokens_spares_a_stream_with_nothing_to_hold_back(models):
    """vLLM takes min_tokens beside ignore_eos: a stream given ``eos_ids=[]`` (and no stops) under the config's
    min_new_tokens decodes as with its own 0; a value the caller gave that stream is still refused."""
    target, drafter = models
    engine = Engine(target, drafter, EngineConfig(mode="ddtree", budget=8, max_new_tokens=NEW, capacity=64,
                                                  eos_ids=(0,), min_new_tokens=4))
    requests = engine.check_requests(PROMPTS[:2], eos_ids=[[], None])
    assert requests.settings.min_new_tokens.tolist() == [0, 4]
    spared = engine.generate(PROMPTS[:2], eos_ids=[[], None])
    own_zero = engine.generate(PROMPTS[:2], eos_ids=[[], None], min_new_tokens=[0, None])
    assert spared["tokens"] == own_zero["tokens"] and spared["status"] == own_zero["status"]
    with pytest.raises(ValueError, match="stream 0's min_new_tokens=4 holds back EOS ids"):
        engine.check_requests(PROMPTS[:2], eos_ids=[[], None], min_new_tokens=[4, None])
    with pytest.raises(ValueError, match="stream 0's min_new_tokens=3 holds back EOS ids"):
        engine.check_requests(PROMPTS[:2], eos_ids=[[], None], min_new_tokens=3)


def test_min_new_tokens_per_stream_needs_something_to_hold_back(models):
    target, drafter = models
    engine = Engine(target, drafter, EngineConfig(max_new_tokens=NEW, capacity=64))
    with pytest.raises(ValueError, match="stream 0's min_new_tokens=2 holds back EOS ids, stop token ids and stop "
                                         "sequences"):
        engine.prefill(PROMPTS[:2], min_new_tokens=[2, 0])
    engine.prefill(PROMPTS[:2], min_new_tokens=[2, 0], stop_token_ids=[[5], None])  # its own stop id to hold back
    engine.prefill(PROMPTS[:2], min_new_tokens=[2, 0], stop_sequences=[[[5, 5]], None])  # or its own stop sequence
    with pytest.raises(ValueError, match="stream 1's min_new_tokens=2 holds back EOS ids"):
        engine.prefill(PROMPTS[:2], min_new_tokens=[2, 2], stop_sequences=[[[5, 5]], []])
    with pytest.raises(ValueError, match="stream 1's min_new_tokens=1 holds back EOS ids"):
        engine.prefill(PROMPTS[:2], min_new_tokens=[2, 1], stop_token_ids=[[5], None])
    only_stops = Engine(target, drafter, EngineConfig(max_new_tokens=NEW, capacity=64, allowed_token_ids=(5, 6)))
    with pytest.raises(ValueError, match="stream 0's min_new_tokens=2 holds back every allowed token"):
        only_stops.prefill(PROMPTS[:2], min_new_tokens=[2, 0], stop_token_ids=[6, 5])
    with pytest.raises(TypeError, match="top_n"):
        engine.generate(PROMPTS[:2], top_n=3)


def test_a_streams_none_among_per_stream_numbers_is_the_configs(models):
    """top_k=[None, 5, ...]: the None stream takes the config's number, as a None does among the per-stream token
    sets (logit_bias, allowed_token_ids, ...); before, it was refused as not a number."""
    target, drafter = models
    engine = Engine(target, drafter, config("ddtree", 8, top_k=3, top_p=0.9, repetition_penalty=1.3,
                                            min_new_tokens=2))
    given = dict(top_k=[None, 5], top_p=[0.5, None], min_p=(None, 0.1), repetition_penalty=[None, 1.1],
                 frequency_penalty=[0.2, None], presence_penalty=[None, None], min_new_tokens=[None, 1])
    want = dict(top_k=[3, 5], top_p=[0.5, 0.9], min_p=[0.0, 0.1], repetition_penalty=[1.3, 1.1],
                frequency_penalty=[0.2, 0.0], presence_penalty=[0.0, 0.0], min_new_tokens=[2, 1])
    got = engine.check_requests(PROMPTS[:2], **given).settings
    for name, values in want.items():
        np.testing.assert_allclose(np.asarray(getattr(got, name)), values, rtol=1e-6, err_msg=name)
    with pytest.raises(ValueError, match="stream 1's top_k must be an integer"):
        engine.check_requests(PROMPTS[:2], top_k=[2, "5"])


def test_misused_inputs_get_named_errors(models):
    """A donated state run again, another engine's state, a generator of prompts, a bool among a prompt's ids and
    a length past int32 (which a cast wrapped: 2**32 + 3 prefilled 3 tokens) are refused by name."""
    from ddtree_jax.cache import init_cache
    from ddtree_jax.decode import pad_prompts, prefill

    target, drafter = models
    engine = Engine(target, drafter, config("ddtree", 8))
    state = engine.prefill(PROMPTS[:2])
    done = engine.run(state)
    with pytest.raises(ValueError, match="donated to an earlier run or dispatch"):
        engine.run(state)
    ar = Engine(target, drafter, EngineConfig(mode="ar", max_new_tokens=NEW, capacity=64))
    with pytest.raises(ValueError, match="prefilled by another engine"):
        ar.run(engine.prefill(PROMPTS[:2]))
    assert done.out_tokens.shape[0] == 2
    with pytest.raises(ValueError, match="prompts must be a list of token-id lists, got generator"):
        engine.generate(p for p in PROMPTS[:2])
    with pytest.raises(ValueError, match="prompts must be a list of token-id lists, got NoneType"):
        engine.generate(None)
    for flag in (True, np.bool_(True), np.array(True)):
        with pytest.raises(ValueError, match="prompt 0 must be a list of integer token ids"):
            pad_prompts([[5, flag, 7]], vocab_size=64, capacity=64)
    tokens = np.array([[5, 6, 7, 8]], np.int32)
    for lengths in (np.array([2**32 + 3]), [2**32 + 3]):
        with pytest.raises(ValueError, match=r"lengths must lie in int32's range"):
            prefill(*nnx.split(target), init_cache(target.cfg, 1, 16), tokens, lengths)
