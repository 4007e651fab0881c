"""ddtree_jax.decode's prefill / decode_step with token ids outside the vocabulary: host ids raise, ids on a
device or traced give that stream NaN logits (negative ones included, never a wrapped real token); a prefill on
top of a filled cache continues each stream; prompts are padded to the smallest bucket that holds them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ddtree_jax.cache import init_cache
from ddtree_jax.config import tiny_config
from ddtree_jax.decode import PROMPT_BUCKETS, decode_step, pad_prompts, prefill
from ddtree_jax.model import KimiModel


@pytest.fixture(scope="module")
def split_model():
    cfg = tiny_config()
    graphdef, state = nnx.split(KimiModel(cfg, nnx.Rngs(0)))
    return cfg, graphdef, state


def test_host_ids_outside_the_vocabulary_raise(split_model):
    cfg, graphdef, state = split_model
    w = cfg.vocab_size
    for bad in (-1, -w, w):
        with pytest.raises(ValueError, match=rf"token ids must lie in \[0, {w}\)"):
            decode_step(graphdef, state, init_cache(cfg, 2, 16), np.array([3, bad], np.int32))
        # a device array is not read back (a decode loop would wait on it): NaN logits instead
        logits = decode_step(graphdef, state, init_cache(cfg, 2, 16), jnp.array([3, bad], jnp.int32))[0]
        assert np.isnan(np.asarray(logits[1])).all() and np.isfinite(np.asarray(logits[0])).all()
        tokens = np.array([[1, 2, 3], [4, bad, 6]], np.int32)
        with pytest.raises(ValueError, match=rf"token ids must lie in \[0, {w}\)"):
            prefill(graphdef, state, init_cache(cfg, 2, 16), tokens, jnp.array([3, 3]))


def test_traced_ids_outside_the_vocabulary_give_nan_logits(split_model):
    """Under an outer jit nothing can raise: -1 used to decode silently as token W-1 (jnp.take wraps
    negative ids); now every id outside [0, W) gives its stream NaN logits and leaves the others alone."""
    cfg, graphdef, state = split_model
    w = cfg.vocab_size
    step = jax.jit(lambda tokens: decode_step(graphdef, state, init_cache(cfg, 2, 16), tokens)[0])
    last_token = np.asarray(step(jnp.array([3, w - 1], jnp.int32)))
    assert np.isfinite(last_token).all()
    for bad in (-1, -w, w, w + 5, -w - 1):
        logits = np.asarray(step(jnp.array([3, bad], jnp.int32)))
        assert np.isnan(logits[1]).all(), bad
        np.testing.assert_array_equal(logits[0], last_token[0])  # the other stream is unaffected

    run = jax.jit(lambda tokens: prefill(graphdef, state, init_cache(cfg, 2, 16), tokens, jnp.array([3, 3]))[0])
    good = np.asarray(run(jnp.array([[1, 2, 3], [4, w - 1, 6]], jnp.int32)))
    assert np.isfinite(good).all()
    for bad in (-1, w):
        last = np.asarray(run(jnp.array([[1, 2, 3], [4, bad, 6]], jnp.int32)))
        assert np.isnan(last[1]).all(), bad
        np.testing.assert_array_equal(last[0], good[0])


def test_prefill_on_top_of_a_cache_continues_each_stream(split_model):
    """A prompt prefilled in two ragged pieces gives the last logits and cache rows of the whole prompt prefilled
    at once: the second piece's positions start at each stream's committed length."""
    cfg, graphdef, state = split_model
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 8)).astype(np.int32)
    whole, whole_cache, _, _ = prefill(graphdef, state, init_cache(cfg, 2, 16), ids, jnp.array([8, 8]))
    first, second = np.zeros((2, 8), np.int32), np.zeros((2, 8), np.int32)  # one block shape: one compile
    first[0, :5], first[1, :3] = ids[0, :5], ids[1, :3]
    second[0, :3], second[1, :5] = ids[0, 5:], ids[1, 3:]
    _, cache, _, _ = prefill(graphdef, state, init_cache(cfg, 2, 16), first, jnp.array([5, 3]))
    last, cache, overflow, _ = prefill(graphdef, state, cache, second, jnp.array([3, 5]))
    assert not overflow.any() and cache.lengths.tolist() == [8, 8]
    np.testing.assert_allclose(np.asarray(last), np.asarray(whole), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(cache.kv), np.asarray(whole_cache.kv), rtol=1e-4, atol=1e-4)


def test_prompts_are_padded_to_the_smallest_bucket_that_holds_them():
    # (12, 12): with no reserve a prompt may fill the cache; a bucket longer than the capacity is cut to it
    for longest, capacity in [(1, 64), (16, 64), (17, 64), (33, 64), (40, 50), (12, 12)]:
        tokens, lengths = pad_prompts([[1] * longest, [2, 3]], vocab_size=8, capacity=capacity)
        assert tokens.shape == (2, min(min(b for b in PROMPT_BUCKETS if b >= longest), capacity)), (longest, capacity)
        assert lengths.tolist() == [longest, 2] and tokens[1, :3].tolist() == [2, 3, 0]


@pytest.mark.parametrize("chunk", [1, 3, 5, 8, 16, 64])
def test_a_chunked_prefill_equals_the_one_block_prefill(split_model, chunk):
    """Prompts prefilled ``chunk`` tokens a block (the last block padded where 16 is not a multiple of it) give the
    one-block prefill's last logits, cache rows, lengths and taps, on a fresh cache and on top of a filled one; a
    stream whose length lies outside [1, P], or whose prompt would pass the capacity, is refused alike (flagged,
    unwritten, NaN logits)."""
    cfg, graphdef, state = split_model
    rng = np.random.default_rng(chunk)
    ids = rng.integers(0, cfg.vocab_size, (5, 16)).astype(np.int32)
    lengths = jnp.array([1, 7, 13, 16, 0])  # the last: refused
    taps = (1, 0)

    def host(result):  # the cache is donated to the next prefill: keep what is compared
        last, cache, overflow, block_taps = result
        return dict(last=np.asarray(last), kv=np.asarray(cache.kv), lengths=np.asarray(cache.lengths),
                    overflow=np.asarray(overflow), taps=None if block_taps is None else np.asarray(block_taps))

    whole = prefill(graphdef, state, init_cache(cfg, 5, 40), ids, lengths, tap_layers=taps)
    got = prefill(graphdef, state, init_cache(cfg, 5, 40), ids, lengths, tap_layers=taps, chunk=chunk)
    pairs = [(host(got), host(whole))]
    # on top of each one's cache: positions start at each stream's length
    whole_on_top = prefill(graphdef, state, whole[1], ids[::-1], lengths[::-1])
    got_on_top = prefill(graphdef, state, got[1], ids[::-1], lengths[::-1], chunk=chunk)
    pairs.append((host(got_on_top), host(whole_on_top)))
    # a third prompt on top: stream 2's (26 + 16 rows) would pass the capacity of 40, so no block of it is written
    # (before, blocks that still fit were, and its length moved on)
    full = np.full((5,), 16, np.int32)
    pairs.append((host(prefill(graphdef, state, got_on_top[1], ids, full, chunk=chunk)),
                  host(prefill(graphdef, state, whole_on_top[1], ids, full))))
    for got_here, want in pairs:
        np.testing.assert_array_equal(got_here["overflow"], want["overflow"])
        np.testing.assert_array_equal(got_here["lengths"], want["lengths"])
        np.testing.assert_array_equal(np.isnan(got_here["last"]), np.isnan(want["last"]))
        for name in ("last", "kv"):
            np.testing.assert_allclose(got_here[name], want[name], rtol=1e-5, atol=1e-5, err_msg=name)
    (got_taps, want_taps), n = (pairs[0][0]["taps"], pairs[0][1]["taps"]), np.asarray(lengths)
    assert got_taps.shape == want_taps.shape == (2, 5, 16, cfg.hidden_size)
    for b in range(4):  # the prompts' own rows (padding rows see other padding in one block than in several)
        np.testing.assert_allclose(got_taps[:, b, :n[b]], want_taps[:, b, :n[b]], rtol=1e-5, atol=1e-5)
    assert pairs[0][0]["overflow"].tolist() == [False] * 4 + [True] and np.isnan(pairs[0][0]["last"][4]).all()
    assert pairs[1][0]["overflow"].tolist() == [True] + [False] * 4 and np.isnan(pairs[1][0]["last"][0]).all()
    assert pairs[2][0]["overflow"].tolist() == [False, False, True, False, False]
    assert pairs[2][0]["lengths"].tolist() == [17, 39, 26, 39, 17] and np.isnan(pairs[2][0]["last"][2]).all()
    np.testing.assert_array_equal(pairs[2][0]["kv"][:, 2], pairs[1][0]["kv"][:, 2])  # stream 2 untouched


@pytest.mark.parametrize("chunk,message", [(0, ">= 1"), (-4, ">= 1"), (2.5, "an integer"), (True, "an integer"),
                                           ("8", "an integer")])
def test_bad_prefill_chunks_refused(split_model, chunk, message):
    from ddtree_jax.engine import EngineConfig

    cfg, graphdef, state = split_model
    with pytest.raises(ValueError, match=f"prefill_chunk must be {message}"):
        prefill(graphdef, state, init_cache(cfg, 1, 8), np.array([[1, 2]], np.int32), jnp.array([2]), chunk=chunk)
    with pytest.raises(ValueError, match=f"prefill_chunk must be {message}"):
        EngineConfig(prefill_chunk=chunk)
