"""Continuous batching (``serving``): requests decoded in fewer slots than requests give each request the tokens,
status, rounds and log-probabilities that ``generate`` gives it among all of them at once; a stopped stream's slot
takes the next request in the round it stops; ``admit`` writes each stream of a prefill at its slot and nowhere
else; everything is checked before the first prefill."""

import dataclasses
import types

import jax
import numpy as np
import pytest

from ddtree_jax.engine import Engine, EngineConfig
from ddtree_jax.model import Runtime
from ddtree_jax import serving
from ddtree_jax.serving import admission_size, admit
from ddtree_jax.sharding import DEFAULT_RULES, make_mesh
from tests.test_engine import NEW, PROMPTS, build_models

TEMPERATURES = [1.0, 0.0, 0.7, 1.0, 0.0, 1.3, 1.0]
LIMITS = [10, 3, 7, 1, 10, 5, 2]  # 1: the prefill's token is the stream's last
PER_STREAM = dict(top_k=[0, 0, 5, 0, 0, 12, 0], repetition_penalty=[1.3, 1.0, 1.0, 1.0, 1.6, 1.0, 1.0],
                  frequency_penalty=[0.0, 0.4, 0.0, 0.0, 0.0, 0.0, -0.3],
                  stop_strings=[("ba",), (), ("ca", "bb"), (), ("ab",), ("ba",), ()],
                  logit_bias=[{5: 2.0}, None, {}, {8: -100.0, 9: 1.0, 10: 0.5}, None, {3: -2.0}, {}],
                  stop_token_ids=[[7], None, [], [2, 6], None, [4, 11, 12], [1]],
                  allowed_token_ids=[None, list(range(40, 64)), None, [], None, None, [14, 44, 2, 3]],
                  bad_words=[[[32, 36]], None, [[2, 2, 2]], None, [], None, [[14, 3]]],
                  stop_sequences=[None, [[49, 19]], [], None, [[54, 49]], None, None],
                  eos_ids=[None, [], None, [16], None, None, [44, 1]])
TOKENIZER = types.SimpleNamespace(token_bytes=lambda w: [bytes([97 + i % 3] * (1 + i % 2)) for i in range(w)])


@pytest.fixture(scope="module")
def models():
    return build_models()


def config(mode, **kw):
    return EngineConfig(**{**dict(mode=mode, budget=16, max_new_tokens=NEW, capacity=64, eos_ids=(3,), logprobs=True,
                                  top_logprobs=2), **kw})


@pytest.mark.parametrize("mode,slots", [("ddtree", 3)])  # AR: the tests below; DFlash: the sharded one
def test_served_requests_get_what_generate_gives_them(models, mode, slots):
    """Seven requests (greedy and sampled, each its own seed, limit and numbers) in 2 or 3 slots: each gets the
    tokens, status, rounds, tau histogram and log-probabilities that ``generate`` gives it among all seven (some
    stopped by their own stop strings and stop token ids)."""
    target, drafter = models
    engine = Engine(target, drafter if mode != "ar" else None, config(mode), tokenizer=TOKENIZER)
    args = (PROMPTS[:7], TEMPERATURES, [21, 22, 23, 24, 25, 26, 27], LIMITS)
    want = engine.generate(*args, **PER_STREAM)
    got = engine.generate(*args, slots=slots, **PER_STREAM)
    for name in ("tokens", "status", "rounds", "tau_hist"):
        assert got[name] == want[name], name
    assert {"max_new_tokens", "stop_string", "stop_token"} <= set(want["status"]), want["status"]
    for a, b in zip(got["logprobs"], want["logprobs"]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    for a, b in zip(got["top_logprobs"], want["top_logprobs"]):  # per token its [id, log-probability] pairs
        a, b = np.array(a).reshape(-1, 2), np.array(b).reshape(-1, 2)
        np.testing.assert_array_equal(a[:, 0], b[:, 0])
        np.testing.assert_allclose(a[:, 1], b[:, 1], rtol=1e-5, atol=1e-5)
    assert len({tuple(t) for t in want["tokens"]}) == 7
    assert got["new_tokens"] == want["new_tokens"] and got["prefill_s"] > 0 and got["decode_s"] > 0


def test_a_stopped_streams_slot_takes_the_next_request_in_that_round(models):
    """Two slots, 64 rounds a dispatch, AR (one token a round): request 0 stops after one round and request 2 takes
    its slot then, so it stops (one round later) long before request 1 (nine rounds); without the dispatch's floor
    request 2 would wait for request 1. With more slots than requests, the slots without one stop at once."""
    target, _ = models
    engine = Engine(target, None, config("ar", rounds_per_dispatch=64))
    done = list(engine.serve(PROMPTS[:3], 0.0, max_new_tokens=[2, 10, 2], slots=2))
    assert [f.index for f in done] == [0, 2, 1]
    assert [(f.rounds, len(f.tokens), f.status) for f in sorted(done, key=lambda f: f.index)] == [
        (1, 2, "max_new_tokens"), (9, 10, "max_new_tokens"), (1, 2, "max_new_tokens")]
    want = engine.generate(PROMPTS[:3], 0.0, max_new_tokens=[2, 10, 2])
    got = engine.generate(PROMPTS[:3], 0.0, max_new_tokens=[2, 10, 2], slots=4)
    assert (got["tokens"], got["status"], got["rounds"]) == (want["tokens"], want["status"], want["rounds"])
    assert got["batch_rounds"] == want["batch_rounds"] == 9


def test_serve_updates_report_each_requests_tokens_as_they_come(models):
    """``serve_updates``: each admission's update holds its requests' first tokens; joined, a request's new tokens
    are its Finished tokens, each request finishes once, and a stream stopped by a full cache (in a round that emits
    nothing) is reported too."""
    target, _ = models
    engine = Engine(target, None, config("ar", capacity=24, max_new_tokens=40, eos_ids=(), rounds_per_dispatch=1))
    prompts = [PROMPTS[0][:4], PROMPTS[1][:12], PROMPTS[2][:6]]
    updates = list(engine.serve_updates(prompts, 0.0, max_new_tokens=[40, 3, 40], slots=2))
    joined, finished = {}, []
    for update in updates:
        for index, tokens in update.new_tokens.items():
            joined.setdefault(index, []).extend(tokens)
        finished += update.finished
    want = engine.generate(prompts, 0.0, max_new_tokens=[40, 3, 40])
    assert sorted(f.index for f in finished) == [0, 1, 2] and updates[0].finished == []
    assert [len(t) for t in updates[0].new_tokens.values()] == [1, 1]  # the prefill's token of requests 0 and 1
    for f in finished:
        assert joined[f.index] == f.tokens == want["tokens"][f.index] and f.status == want["status"][f.index]
    assert sorted(want["status"]) == ["cache_full", "cache_full", "max_new_tokens"]
    assert any(u.finished and not u.new_tokens for u in updates)  # the full cache's round: a stop, no token


def test_warm_up_compiles_every_program_a_serve_runs(models):
    """After ``serving.warm_up``, serving the same requests (prompts of two widths, five of them in three slots, so
    admissions of 1, 2 and 3 streams) compiles nothing."""
    from experiments import bench_util

    target, _ = models
    engine = Engine(target, None, config("ar", eos_ids=()))
    prompts = [PROMPTS[0][:5], list(PROMPTS[1]) * 3, PROMPTS[2][:7], PROMPTS[3][:3], PROMPTS[4][:6]]
    requests = engine.check_requests(prompts, [0.0, 1.0, 0.0, 1.0, 1.0], [1, 2, 3, 4, 5], [3, 9, 4, 2, 5])
    assert {len(p) > 16 for p in prompts} == {True, False}  # two prompt widths
    serving.warm_up(engine, requests, 3)
    with bench_util.counting_compiles() as compiles:
        done = list(serving.serve(engine, requests, 3))
    assert compiles == [] and sorted(f.index for f in done) == [0, 1, 2, 3, 4]


def test_admit_writes_each_stream_at_its_slot_and_nowhere_else(models):
    """``admit`` against a plain numpy reference, leaf by leaf (caches, drafter context, scores, history, settings,
    keys, status): stream i of the prefill lands at slots[i], a slot past the batch is dropped, every other stream
    keeps its own values; the stop tables stay the batch's."""
    target, drafter = models
    engine = Engine(target, drafter, config("ddtree", repetition_penalty=1.2, frequency_penalty=0.1))
    requests = engine.check_requests(PROMPTS[:8], 1.0, seed=[1, 2, 3, 4, 5, 6, 7, 8])
    state = engine.dispatch(engine.prefill_requests(requests.rows(range(4))))  # a round in: nothing is at its start
    fresh = engine.prefill_requests(requests.rows([4, 5, 6]))
    slots = np.array([2, 0, 4])  # 4: past the batch of 4
    host = lambda tree: jax.tree.map(np.asarray, tree)  # noqa: E731
    before, rows = host(jax.tree.map(lambda k: jax.random.key_data(k) if _is_key(k) else k, (state, fresh)))
    merged = admit(state, fresh, jax.numpy.asarray(slots))
    after = host(jax.tree.map(lambda k: jax.random.key_data(k) if _is_key(k) else k, merged))
    checked = 0
    for field in dataclasses.fields(after):
        if field.metadata.get("static") or field.name == "stop_tables":
            continue
        for path, got in jax.tree_util.tree_leaves_with_path(getattr(after, field.name)):
            old = _at(getattr(before, field.name), path)
            new = _at(getattr(rows, field.name), path)
            axis = 1 if field.name == "ctx_taps" or (field.name.endswith("cache") and got.ndim > 1) else 0
            want = np.moveaxis(old.copy(), axis, 0)
            want[slots[:2]] = np.moveaxis(new, axis, 0)[:2]
            np.testing.assert_array_equal(got, np.moveaxis(want, 0, axis), err_msg=f"{field.name}{path}")
            checked += 1
    assert checked >= 20, checked
    assert merged.stop_tables is None and merged.switches == requests.switches
    with pytest.raises(ValueError, match="the same Requests"):
        other = engine.prefill_requests(engine.check_requests(PROMPTS[:1], 0.0))
        admit(merged, other, jax.numpy.asarray([1]))


def _is_key(x):
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _at(tree, path):
    for entry in path:
        tree = getattr(tree, entry.name) if hasattr(entry, "name") else tree[entry.idx]
    return tree


@pytest.mark.parametrize("waiting,free,shards,size", [
    (1, 1, 1, 1), (3, 5, 1, 4), (9, 5, 1, 5), (2, 2, 1, 2), (5, 8, 1, 8), (1, 3, 2, 2), (3, 3, 2, 4), (3, 6, 4, 4),
    (7, 6, 4, 8)])
def test_admission_size(waiting, free, shards, size):
    """min(waiting, free) rounded up to a power of two and to the shards, at most free rounded up to the shards."""
    assert admission_size(waiting, free, shards) == size


def test_serve_checks_everything_before_the_first_prefill(models, host_devices):
    target, _ = models
    engine = Engine(target, None, config("ar"))
    with pytest.raises(ValueError, match="prompt 2 must be a list of integer token ids"):
        engine.serve([[1, 2], [3], "text"], slots=2)
    with pytest.raises(ValueError, match=r"stream 1's min_new_tokens=4 passes max_new_tokens=3"):
        engine.serve([[1, 2], [3]], max_new_tokens=[5, 3], min_new_tokens=4, slots=1)
    for slots in (0, 1.5, True, None):
        with pytest.raises(ValueError, match="slots must be an integer >= 1"):
            engine.serve([[1, 2], [3]], slots=slots)
    mesh = make_mesh(data=2, model=2, devices=host_devices)
    sharded = Engine(target, None, config("ar"), runtime=Runtime(mesh=mesh, rules=DEFAULT_RULES))
    with pytest.raises(ValueError, match="slots=3 must be a multiple of the 2 ways the mesh splits the streams"):
        sharded.serve([[1, 2], [3]], slots=3)


def test_sharded_serving_matches(models, host_devices):
    """Five requests in two slots over a mesh of 2 stream shards x 2 (each admission of one request prefills two
    streams, one a repeat that is dropped; the drafter's cache split over its heads) give generate's tokens
    unsharded."""
    target, drafter = models
    mesh = make_mesh(data=2, model=2, devices=host_devices)
    ecfg = config("dflash")
    args = (PROMPTS[:5], [0.0, 1.0, 0.0, 0.8, 1.0], [1, 2, 3, 4, 5], [10, 4, 7, 10, 2])
    want = Engine(target, drafter, ecfg).generate(*args)
    sharded = Engine(target, drafter, ecfg, runtime=Runtime(mesh=mesh, rules=DEFAULT_RULES))
    got = sharded.generate(*args, slots=2)
    assert (got["tokens"], got["status"]) == (want["tokens"], want["status"])


def test_run_decode_continuous_gives_each_prompt_its_batched_tokens(models):
    """``run_decode --streams 2 --continuous`` samples each prompt's tokens (its seed --seed + i) as consecutive
    batches of two do, and counts the rounds the slots ran."""
    from experiments import run_decode

    target, _ = models
    prompts = [list(p) for p in PROMPTS[:5]]
    argv = ["--target", "random", "--mode", "ar", "--streams", "2", "--temperature", "1",
            "--max-new-tokens", str(NEW), "--capacity", "64", "--seed", "7"]
    for p in prompts:
        argv += ["--prompt-ids", " ".join(map(str, p))]
    tokenizer = None  # no stop strings, and an AR run draws no tree
    runs = {}
    for name, args in (("batched", run_decode.parse_args(argv)),
                       ("served", run_decode.parse_args(argv + ["--continuous"]))):
        engine = run_decode.build_engine(target, None, "ar", args, tokenizer, ())
        runs[name] = run_decode.run_mode(engine, "ar", args, prompts, tokenizer)
    batched, served = runs["batched"], runs["served"]
    assert (served["tokens"], served["status"]) == (batched["tokens"], batched["status"])
    metrics = served["metrics"]
    assert metrics["continuous"] and not batched["metrics"]["continuous"]
    assert metrics["rounds"] == batched["metrics"]["rounds"] and metrics["compile_s"] > 0
    assert metrics["new_tokens"] / metrics["rounds"] * 2 >= metrics["tokens_per_round_batch"] > 0
