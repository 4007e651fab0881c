"""``ddtree_jax.topk``: every method against ``lax.top_k`` bit for bit (values and indices, ties lower index
first), the "auto" choice, the refusals, and DDTree's build over a large vocabulary with each method
against the best-first heap of ``tests/test_tree.py``."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax import topk
from ddtree_jax.tree import build_tree
from tests.test_tree import ref_build


def tied_values(rng, m, n, dtype=np.float32):
    """Few distinct values (many ties), masked entries, and a row with nothing but masks."""
    values = rng.integers(0, 6, (m, n)).astype(dtype)
    if np.issubdtype(dtype, np.floating):
        values[:, rng.random(n) < 0.3] = -np.inf
        values[0] = -np.inf
        values[-1, rng.integers(0, n)] = 9.0  # one value above all others, anywhere in the row
    return values


CASES = [  # m, n, k, chunk
    (3, 384, 8, 128),      # the router's shape
    (4, 1000, 32, 128),    # n not a multiple of the chunk: a padded last chunk
    (2, 300, 32, 16),      # 19 chunks, fewer than k: every chunk is a candidate
    (2, 70, 5, 128),       # one chunk longer than the row
    (3, 20000, 32, 128),   # a vocabulary-sized row
    (5, 4096, 64, 64),
    (1, 33, 33, 4),        # k = n
]


@pytest.mark.parametrize("method", ["sort", "compare", "chunked"])
@pytest.mark.parametrize("m,n,k,chunk", CASES)
def test_every_method_is_lax_top_k(method, m, n, k, chunk):
    if method == "compare" and m * n * n > 50_000_000:
        pytest.skip("[M, N, N] comparisons too large for a CPU test")
    rng = np.random.default_rng(m * n + k)
    for values in (tied_values(rng, m, n), rng.standard_normal((m, n)).astype(np.float32)):
        want = jax.lax.top_k(jnp.asarray(values), k)
        got = jax.jit(functools.partial(topk.top_k, k=k, method=method, chunk=chunk))(jnp.asarray(values))
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
        assert got[1].dtype == jnp.int32


@pytest.mark.parametrize("method", ["compare", "chunked"])
def test_integer_values(method):
    rng = np.random.default_rng(0)
    for low, high in ((-5, 5), (-9, -1)):  # all negative: the padding of the last chunk must not rank
        values = jnp.asarray(rng.integers(low, high, (3, 500)), jnp.int32)
        want = jax.lax.top_k(values, 20)
        got = topk.top_k(values, 20, method, chunk=32)
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))


def test_descending_rank_is_the_inverse_of_a_stable_descending_sort():
    values = tied_values(np.random.default_rng(1), 4, 200)
    order = np.argsort(-values, axis=1, kind="stable")  # equal values keep index order
    want = np.empty_like(order)
    np.put_along_axis(want, order, np.arange(200)[None, :], axis=1)
    np.testing.assert_array_equal(np.asarray(topk.descending_rank(jnp.asarray(values))), want)


def test_auto_choice():
    assert topk.resolve_method(16, 384, 8) == "compare"  # the router up to 16 tokens, as before
    assert topk.resolve_method(17, 384, 8) == "sort"
    assert topk.resolve_method(7, 163840, 32) == "chunked"  # the draft's vocabulary
    assert topk.resolve_method(4, 130, 32) == "compare"  # a DDTree beam
    assert topk.resolve_method(7, 10000, 32) == "sort"  # K * chunk too close to N
    assert topk.resolve_method(7, 163840, 32, "sort") == "sort"
    # "chunked"'s two bounds: from CHUNKED_MIN_VALUES values a row, while 4 * K * CHUNK <= N
    n = topk.CHUNKED_MIN_VALUES
    assert topk.resolve_method(7, n, 1) == "chunked" and topk.resolve_method(7, n - 1, 1) == "sort"
    k = 2 * n // (4 * topk.CHUNK)
    assert topk.resolve_method(7, 2 * n, k) == "chunked" and topk.resolve_method(7, 2 * n, k + 1) == "sort"


def test_refusals():
    values = jnp.zeros((2, 10))
    with pytest.raises(ValueError, match="top-k method"):
        topk.top_k(values, 3, "heap")
    with pytest.raises(ValueError, match="must be in"):
        topk.top_k(values, 11)
    with pytest.raises(ValueError, match="must be in"):
        topk.top_k(values, 0)
    with pytest.raises(ValueError, match="chunk"):
        topk.top_k(values, 3, "chunked", chunk=0)
    with pytest.raises(ValueError, match=r"\[M, N\]"):
        topk.top_k(jnp.zeros((2, 3, 10)), 3)


def test_build_tree_over_a_large_vocabulary_with_every_method():
    """W = 20 000 (the "auto" build takes the chunked top-k there), budget 32, two streams: the same tree by
    every method, and the heap's tree. Quantised logits give ties between tokens of one depth."""
    rng = np.random.default_rng(5)
    w, budget = 20000, 32
    logits = np.round(rng.normal(size=(2, 7, w)) * 3) / 2
    logits[0, 0, :100] = 6.0  # one hundred tokens tied for first place at depth 1
    lp = np.asarray(jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1))
    roots = jnp.asarray([3, 4], jnp.int32)
    assert topk.resolve_method(2 * 7, w, budget) == "chunked"
    trees = {m: jax.jit(build_tree, static_argnums=(2, 3))(jnp.asarray(lp), roots, budget, m)
             for m in ("auto", "sort", "chunked")}
    for m in ("sort", "chunked"):
        for field in ("tokens", "parents", "depths", "logprob", "visibility"):
            np.testing.assert_array_equal(np.asarray(getattr(trees[m], field)),
                                          np.asarray(getattr(trees["auto"], field)))
    r_tok, r_par, r_dep, r_lp = ref_build(lp[0], 3, budget)
    np.testing.assert_array_equal(np.asarray(trees["auto"].tokens[0]), r_tok)
    np.testing.assert_array_equal(np.asarray(trees["auto"].parents[0]), r_par)
    np.testing.assert_array_equal(np.asarray(trees["auto"].depths[0]), r_dep)
    np.testing.assert_array_equal(np.asarray(trees["auto"].logprob[0]), r_lp)


@pytest.mark.parametrize("vocab", [16, 1000, 9000])  # top_k's "auto" takes each method at some size
def test_token_scores_rank_signed_zeros_as_one_value_lower_id_first(vocab):
    """``scores.token_scores``' top tokens: equal values lower id first, -0.0 and +0.0 included (lax.top_k ranks
    +0.0 first, so at 1000 tokens they came out [5, 2]); jitted too, where "+ 0.0" would be folded away."""
    from ddtree_jax.scores import token_scores

    logits = np.full((3, 1, vocab), -5.0, np.float32)
    logits[:, 0, 2], logits[:, 0, 5] = -0.0, 0.0
    tokens = jnp.zeros((3, 1), jnp.int32)
    for fn in (token_scores, jax.jit(token_scores, static_argnums=2)):
        scores = fn(jnp.asarray(logits), tokens, 2)
        assert np.asarray(scores.top_tokens).reshape(3, 2).tolist() == [[2, 5]] * 3
