"""Top-k / top-p truncation (``ddtree_jax.sampling``): the kept tokens equal transformers' ``TopKLogitsWarper`` then
``TopPLogitsWarper`` on rows without ties, and a plain float64 reference (``sampling_reference``, ties kept) on
rows with them; samples follow the truncated distribution; greedy is unchanged; bad settings are refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from ddtree_jax import sampling, tree as tr
from sampling_reference import truncated_probs


def hf_kept(scaled, top_k, top_p):
    scores = torch.from_numpy(np.asarray(scaled, np.float32))
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return torch.isfinite(scores).numpy()


SETTINGS = [(0, 1.0), (1, 1.0), (5, 1.0), (40, 1.0), (0, 0.9), (0, 0.5), (0, 1e-6), (8, 0.7), (3, 0.95), (60, 0.3)]


@pytest.mark.parametrize("top_k,top_p", SETTINGS)
def test_kept_tokens_equal_transformers_warpers(top_k, top_p):
    rng = np.random.default_rng([7, top_k, int(top_p * 1000)])
    logits = (rng.normal(size=(64, 96)) * rng.uniform(0.3, 4.0, size=(64, 1))).astype(np.float32)
    for temperature in (1.0, 0.6):
        scaled = logits / np.float32(temperature)
        got = np.isfinite(np.asarray(sampling.truncate(jnp.asarray(scaled), top_k, top_p)))
        np.testing.assert_array_equal(got, hf_kept(scaled, top_k, top_p), err_msg=f"T={temperature}")
        assert got.any(axis=-1).all() and got[np.arange(64), scaled.argmax(-1)].all()  # the argmax survives
        kept_values = np.asarray(sampling.truncate(jnp.asarray(scaled), top_k, top_p))[got]
        np.testing.assert_array_equal(kept_values, scaled[got])  # kept logits are untouched


@pytest.mark.parametrize("top_k,top_p", [(2, 1.0), (3, 1.0), (0, 0.5), (0, 0.6), (2, 0.5), (4, 0.3)])
def test_ties_at_the_boundary_are_all_kept(top_k, top_p):
    """Rows of few distinct values, ties everywhere: the kept set is the reference's (whole tie groups)."""
    rng = np.random.default_rng([3, top_k])
    logits = rng.integers(0, 4, size=(200, 12)).astype(np.float32)
    got = np.isfinite(np.asarray(sampling.truncate(jnp.asarray(logits), top_k, top_p)))
    want = np.stack([truncated_probs(row, 1.0, top_k, top_p) > 0 for row in logits])
    np.testing.assert_array_equal(got, want)
    for row, kept in zip(logits, got):  # a tie group is kept or dropped whole
        for value in np.unique(row):
            assert len(set(kept[row == value])) == 1


def test_long_rows_take_the_chunked_top_k():
    """A vocabulary-sized row (the chunked top-k: `topk.resolve_method`), with -inf entries, against the reference."""
    rng = np.random.default_rng(5)
    logits = rng.normal(size=(6, 40960)).astype(np.float32) * 3
    logits[:, ::7] = -np.inf
    from ddtree_jax.topk import resolve_method

    assert resolve_method(6, 40960, 50) == "chunked"
    for top_k, top_p in ((50, 1.0), (50, 0.8), (0, 0.95)):
        got = np.isfinite(np.asarray(sampling.truncate(jnp.asarray(logits), top_k, top_p)))
        want = np.stack([truncated_probs(row, 1.0, top_k, top_p) > 0 for row in logits])
        np.testing.assert_array_equal(got, want, err_msg=f"{top_k}, {top_p}")


def test_samples_follow_the_truncated_distribution():
    """sample_target_tokens draws from softmax(truncate(logits / T)): frequencies within a few sigma of the
    reference, no dropped token ever drawn; per-stream temperatures (traced) take the same filters."""
    rng = np.random.default_rng(1)
    logits = (rng.normal(size=(2, 3, 10)) * 2).astype(np.float32)
    n = 40_000
    keys = jax.random.split(jax.random.key(0), n)
    for top_k, top_p, temperature in ((3, 1.0, 0.8), (0, 0.7, 1.3), (5, 0.8, 1.0)):
        draw = jax.jit(jax.vmap(lambda k: tr.sample_target_tokens(jnp.asarray(logits), temperature, k, top_k, top_p)))
        traced = jax.jit(jax.vmap(lambda k, t: tr.sample_target_tokens(jnp.asarray(logits), t, k, top_k, top_p),
                                  in_axes=(0, None)))
        for samples in (np.asarray(draw(keys)), np.asarray(traced(keys, jnp.full((2,), temperature)))):
            for b in range(2):
                for t in range(3):
                    want = truncated_probs(logits[b, t], temperature, top_k, top_p)
                    freq = np.bincount(samples[:, b, t], minlength=10) / n
                    assert (freq[want == 0] == 0).all(), (top_k, top_p, b, t)
                    sigma = np.sqrt(want * (1 - want) / n)
                    assert (np.abs(freq - want) <= 5 * sigma + 1e-12).all(), (top_k, top_p, b, t, freq, want)


def test_greedy_ignores_the_filters():
    logits = jnp.asarray(np.random.default_rng(2).normal(size=(3, 4, 30)), jnp.float32)
    key = jax.random.key(0)
    argmax = np.asarray(jnp.argmax(logits, -1))
    np.testing.assert_array_equal(tr.sample_target_tokens(logits, 0.0, key, 5, 0.5), argmax)
    mixed = tr.sample_target_tokens(logits, jnp.array([0.0, 1.0, 0.0]), key, 1, 1.0)  # top_k 1: the argmax too
    np.testing.assert_array_equal(mixed, argmax)
    np.testing.assert_array_equal(tr.sample_target_tokens(logits, 1.0, key, 0, 1e-9), argmax)


@pytest.mark.parametrize("top_k,message", [(-1, r"top_k must be >= 0 \(0: off\), got -1"),
                                           (31, "top_k must be at most the vocabulary's 30 tokens"),
                                           (2.0, "top_k must be an integer"), (True, "top_k must be an integer")])
def test_bad_top_k_refused(top_k, message):
    with pytest.raises(ValueError, match=message):
        sampling.truncate(jnp.zeros((2, 30)), top_k, 1.0)


@pytest.mark.parametrize("top_p", [0.0, -0.1, 1.5, float("nan"), True, "0.9"])
def test_bad_top_p_refused(top_p):
    with pytest.raises(ValueError, match="top_p must be"):
        sampling.truncate(jnp.zeros((2, 30)), 0, top_p)
