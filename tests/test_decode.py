"""ddtree_jax.decode's prefill / decode_step with token ids outside the vocabulary: host ids raise, ids on a
device or traced give that stream NaN logits (negative ones included, never a wrapped real token)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ddtree_jax.cache import init_cache
from ddtree_jax.config import tiny_config
from ddtree_jax.decode import decode_step, prefill
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
