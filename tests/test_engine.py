"""Engine invariants: DDTree / DFlash greedy output == AR greedy output token for token; streams stop
cleanly (EOS, token limit, cache capacity); sampling is lossless; sharded == unsharded; bad budgets."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from ddtree_jax.config import QuantConfig, tiny_config
from ddtree_jax.drafter import DFlashDrafter, tiny_drafter_config
from ddtree_jax.engine import Engine, EngineConfig
from ddtree_jax.model import KimiModel
from ddtree_jax.sharding import DEFAULT_RULES, make_mesh
from ddtree_jax.model import Runtime

VOCAB = 64  # small, so that trees of 8..128 nodes cover a real share of the target's choices
NEW = 10


@pytest.fixture(scope="module")
def models():
    cfg = tiny_config(vocab_size=VOCAB, quant=QuantConfig(group_size=32), eos_token_ids=())
    target = KimiModel(cfg, nnx.Rngs(0))
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
    assert res["tau_mean"] > 1.05, res["tau_mean"]


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


def test_bad_budget_refused():
    for bad in (0, -3, 10**9):
        with pytest.raises(ValueError, match="budget"):
            EngineConfig(mode="ddtree", budget=bad)


def test_prompt_past_capacity_refused(models):
    target, drafter = models
    engine = Engine(target, drafter, EngineConfig(mode="ddtree", budget=8, capacity=16))
    with pytest.raises(ValueError, match="does not fit the cache capacity 16"):
        engine.generate([[1] * 12])


def test_sharded_engine_matches(models):
    target, drafter = models
    mesh = make_mesh(data=2, model=4)
    runtime = Runtime(mesh=mesh, rules=DEFAULT_RULES)
    ecfg = EngineConfig(mode="ddtree", budget=16, max_new_tokens=NEW, capacity=64)
    prompts = PROMPTS[:4]
    plain = generate_all(target, drafter, ecfg, prompts, 4)
    sharded = generate_all(target, drafter, ecfg, prompts, 4, runtime=runtime)
    assert plain == sharded
