"""Top-k / top-p / min-p truncation (``ddtree_jax.sampling``): the kept tokens equal transformers'
``TopKLogitsWarper``, ``TopPLogitsWarper`` then ``MinPLogitsWarper`` on rows without ties, and a plain float64
reference (``sampling_reference``, ties kept) on rows with them; samples follow the truncated distribution; greedy
is unchanged; bad settings are refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from ddtree_jax import sampling, tree as tr
from sampling_reference import truncated_probs


def hf_kept(scaled, top_k, top_p, min_p=0.0):
    scores = torch.from_numpy(np.asarray(scaled, np.float32))
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    if min_p > 0:
        scores = MinPLogitsWarper(min_p)(None, scores)
    return torch.isfinite(scores).numpy()


SETTINGS = [(0, 1.0, 0.0), (1, 1.0, 0.0), (5, 1.0, 0.0), (40, 1.0, 0.0), (0, 0.9, 0.0), (0, 0.5, 0.0),
            (0, 1e-6, 0.0), (8, 0.7, 0.0), (3, 0.95, 0.0), (60, 0.3, 0.0),
            (0, 1.0, 0.05), (0, 1.0, 0.3), (0, 1.0, 1.0), (10, 1.0, 0.1), (0, 0.8, 0.2), (20, 0.9, 0.02)]


@pytest.mark.parametrize("method", ["sort", "search"])
@pytest.mark.parametrize("top_k,top_p,min_p", SETTINGS)
def test_kept_tokens_equal_transformers_warpers(top_k, top_p, min_p, method):
    rng = np.random.default_rng([7, top_k, int(top_p * 1000), int(min_p * 1000)])
    logits = (rng.normal(size=(64, 96)) * rng.uniform(0.3, 4.0, size=(64, 1))).astype(np.float32)
    for temperature in (1.0, 0.6):
        scaled = logits / np.float32(temperature)
        truncated = np.asarray(sampling.truncate(jnp.asarray(scaled), top_k, top_p, method, min_p))
        got = np.isfinite(truncated)
        np.testing.assert_array_equal(got, hf_kept(scaled, top_k, top_p, min_p), err_msg=f"T={temperature}")
        assert got.any(axis=-1).all() and got[np.arange(64), scaled.argmax(-1)].all()  # the argmax survives
        np.testing.assert_array_equal(truncated[got], scaled[got])  # kept logits are untouched


@pytest.mark.parametrize("method", ["sort", "search"])
@pytest.mark.parametrize("top_k,top_p,min_p", [(2, 1.0, 0.0), (3, 1.0, 0.0), (0, 0.5, 0.0), (0, 0.6, 0.0),
                                               (2, 0.5, 0.0), (4, 0.3, 0.0), (0, 1.0, 0.3), (0, 1.0, 1.0),
                                               (3, 0.9, 0.1)])
def test_ties_at_the_boundary_are_all_kept(top_k, top_p, min_p, method):
    """Rows of few distinct values, ties everywhere: the kept set is the reference's (whole tie groups)."""
    rng = np.random.default_rng([3, top_k])
    logits = rng.integers(0, 4, size=(200, 12)).astype(np.float32)
    logits[::3, ::2] = -logits[::3, ::2]  # signed zeros among the ties
    got = np.isfinite(np.asarray(sampling.truncate(jnp.asarray(logits), top_k, top_p, method, min_p)))
    want = np.stack([truncated_probs(row, 1.0, top_k, top_p, min_p) > 0 for row in logits])
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
    for top_k, top_p, min_p in ((50, 1.0, 0.0), (50, 0.8, 0.0), (0, 0.95, 0.0), (0, 1.0, 1e-3), (50, 0.95, 0.05)):
        got = np.isfinite(np.asarray(sampling.truncate(jnp.asarray(logits), top_k, top_p, min_p=min_p)))
        want = np.stack([truncated_probs(row, 1.0, top_k, top_p, min_p) > 0 for row in logits])
        np.testing.assert_array_equal(got, want, err_msg=f"{top_k}, {top_p}, {min_p}")


@pytest.mark.parametrize("fanout", [2, 3, 16, 64])
def test_search_and_sort_find_the_same_edge(fanout):
    """Both top-p methods on rows of every kind: wide and narrow spreads, -inf entries, huge and tiny magnitudes,
    negatives only, one finite value; the edge is the same row value, at any fanout of the search."""
    rng = np.random.default_rng(9)
    n = 301  # no top_p below is a multiple of 1 / n: a flat row's edge is not left to the sums' rounding
    rows = [rng.normal(size=n) * scale for scale in (0.01, 1.0, 30.0)]
    rows += [np.where(rng.random(n) < 0.5, -np.inf, rng.normal(size=n)), -np.abs(rng.normal(size=n)) - 1e4,
             np.r_[5.0, np.full(n - 1, -np.inf)], rng.normal(size=n) * 1e-30, np.r_[rng.normal(size=n - 1), 80.0],
             np.r_[np.full(n - 1, 2.0), 3.0], np.full(n, -7.0)]
    rows = jnp.asarray(np.stack(rows), jnp.float32)
    for top_p in (1e-7, 0.05, 0.5, 0.9, 0.999, 1 - 1e-7):
        by_sort = np.asarray(sampling.nucleus_edge_by_sort(rows, top_p))
        by_search = np.asarray(sampling.nucleus_edge_by_search(rows, top_p, fanout))
        np.testing.assert_array_equal(by_search, by_sort, err_msg=f"top_p={top_p}")
        assert all(edge in row for edge, row in zip(by_search[:, 0], np.asarray(rows)))


def test_search_passes_leave_one_key():
    assert [sampling.search_passes(f) for f in (2, 3, 4, 16, 64, 1 << 16)] == [32, 21, 16, 8, 6, 2]
    with pytest.raises(ValueError, match="fanout must be >= 2"):
        sampling.nucleus_edge_by_search(jnp.zeros((1, 4)), 0.5, 1)


def test_order_keys_sort_floats():
    """The search's keys order float32 values as the floats (-0.0 equal to +0.0), infinities included, and map
    back exactly. (Subnormals are left out: XLA may flush them to zero, as it does on this CPU.)"""
    f32 = np.finfo(np.float32)
    values = np.r_[np.random.default_rng(4).normal(size=200) * 10.0 ** np.arange(-20, 20, 0.2),
                   [0.0, -0.0, np.inf, -np.inf, f32.tiny, -f32.tiny, f32.max, -f32.max]]
    values = values.astype(np.float32)
    keys = np.asarray(sampling._order_keys(jnp.asarray(values)))
    order = np.argsort(values, kind="stable")
    assert (np.diff(keys[order]) >= 0).all()
    assert ((np.diff(keys[order]) == 0) == (np.diff(values[order]) == 0)).all()
    back = np.asarray(sampling._from_order_keys(jnp.asarray(keys)))
    np.testing.assert_array_equal(back, np.where(values == 0, 0, values))


def test_samples_follow_the_truncated_distribution():
    """sample_target_tokens draws from softmax(truncate(logits / T)): frequencies within a few sigma of the
    reference, no dropped token ever drawn; per-stream temperatures (traced) take the same filters."""
    rng = np.random.default_rng(1)
    logits = (rng.normal(size=(2, 3, 10)) * 2).astype(np.float32)
    n = 40_000
    keys = jax.random.split(jax.random.key(0), n)
    for top_k, top_p, min_p, temperature in ((3, 1.0, 0.0, 0.8), (0, 0.7, 0.0, 1.3), (5, 0.8, 0.0, 1.0),
                                             (0, 1.0, 0.15, 1.1), (6, 0.9, 0.05, 0.9)):
        filters = (top_k, top_p, min_p)
        draw = jax.jit(jax.vmap(lambda k: tr.sample_target_tokens(jnp.asarray(logits), temperature, k, *filters)))
        traced = jax.jit(jax.vmap(lambda k, t: tr.sample_target_tokens(jnp.asarray(logits), t, k, *filters),
                                  in_axes=(0, None)))
        for samples in (np.asarray(draw(keys)), np.asarray(traced(keys, jnp.full((2,), temperature)))):
            for b in range(2):
                for t in range(3):
                    want = truncated_probs(logits[b, t], temperature, *filters)
                    freq = np.bincount(samples[:, b, t], minlength=10) / n
                    assert (freq[want == 0] == 0).all(), (filters, b, t)
                    sigma = np.sqrt(want * (1 - want) / n)
                    assert (np.abs(freq - want) <= 5 * sigma + 1e-12).all(), (filters, b, t, freq, want)


def test_greedy_ignores_the_filters():
    logits = jnp.asarray(np.random.default_rng(2).normal(size=(3, 4, 30)), jnp.float32)
    key = jax.random.key(0)
    argmax = np.asarray(jnp.argmax(logits, -1))
    np.testing.assert_array_equal(tr.sample_target_tokens(logits, 0.0, key, 5, 0.5), argmax)
    mixed = tr.sample_target_tokens(logits, jnp.array([0.0, 1.0, 0.0]), key, 1, 1.0)  # top_k 1: the argmax too
    np.testing.assert_array_equal(mixed, argmax)
    np.testing.assert_array_equal(tr.sample_target_tokens(logits, 1.0, key, 0, 1e-9), argmax)
    np.testing.assert_array_equal(tr.sample_target_tokens(logits, 1.0, key, 0, 1.0, 1.0), argmax)  # min_p 1: ties


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
    with pytest.raises(ValueError, match="top_p_method must be one of"):
        sampling.truncate(jnp.zeros((2, 30)), 0, 0.5, "heap")


@pytest.mark.parametrize("min_p", [-0.1, 1.5, float("nan"), True, "0.1", None])
def test_bad_min_p_refused(min_p):
    with pytest.raises(ValueError, match="min_p must be"):
        sampling.truncate(jnp.zeros((2, 30)), 0, 1.0, min_p=min_p)


@pytest.mark.parametrize("temperature", [0.0, 0.8, "per stream"])
def test_sampled_logits_are_what_each_row_is_taken_from(temperature):
    """``sampled_logits``: a sampled stream's rows are the truncated reference's log-probabilities up to a constant
    (filtered tokens -inf); a greedy stream's (temperature 0) are its logits, untouched, for a Python or a [B]
    temperature."""
    rng = np.random.default_rng(8)
    logits = rng.standard_normal((3, 4, 50)).astype(np.float32) * 3
    temps = [0.0, 0.7, 1.3] if temperature == "per stream" else [temperature] * 3
    arg = jnp.asarray(temps, jnp.float32) if temperature == "per stream" else temperature
    got = np.asarray(jax.nn.log_softmax(sampling.sampled_logits(jnp.asarray(logits), arg, 10, 0.9, 0.05), axis=-1))
    for b, t in enumerate(temps):
        for r in range(4):
            if t:
                with np.errstate(divide="ignore"):
                    want = np.log(truncated_probs(logits[b, r], t, 10, 0.9, 0.05))
            else:
                want = np.asarray(jax.nn.log_softmax(logits[b, r]))
            np.testing.assert_allclose(got[b, r], want, rtol=1e-5, atol=1e-5)


STREAM_FILTERS = [(0, 1.0, 0.0), (3, 1.0, 0.0), (0, 0.6, 0.0), (0, 1.0, 0.2), (7, 0.8, 0.05), (1, 0.5, 0.0)]


@pytest.mark.parametrize("vocab", [96, 9000])
@pytest.mark.parametrize("method", ["auto", "sort", "search"])
@pytest.mark.parametrize("streams", [[0, 1, 2, 3, 4, 5], [1, 4, 5], [2, 3]])
def test_per_stream_filters_equal_each_streams_own(streams, method, vocab):
    """[B] top_k / top_p / min_p (traced under jit) give every stream's rows exactly what that stream's Python
    numbers give them, off values included; at 9000 tokens "auto" searches the nucleus unless every stream has a
    top_k (then it ranks the K best)."""
    settings = [STREAM_FILTERS[s] for s in streams]
    rng = np.random.default_rng([vocab, len(streams)])
    logits = jnp.asarray(rng.normal(size=(len(streams), 3, vocab)) * rng.uniform(0.5, 3, size=(len(streams), 1, 1)),
                         jnp.float32)
    top_k, top_p, min_p = (np.asarray(column) for column in zip(*settings))
    every_row = bool((top_k > 0).all())

    @jax.jit
    def per_stream(logits, top_k, top_p, min_p):
        return sampling.truncate(logits, top_k, top_p, method, min_p, top_k_ceiling=8, top_k_in_every_row=every_row)

    got = np.asarray(per_stream(logits, jnp.asarray(top_k, jnp.int32), jnp.asarray(top_p, jnp.float32),
                                jnp.asarray(min_p, jnp.float32)))
    for b, (k, p, m) in enumerate(settings):
        want = np.asarray(sampling.truncate(logits[b], k, p, method, m))
        np.testing.assert_array_equal(got[b], want, err_msg=f"stream {b}: top_k={k}, top_p={p}, min_p={m}")


def test_per_stream_sampling_follows_each_streams_filters():
    """sample_target_tokens and sampled_logits with [B] filters and temperatures: each stream's draws and rows are
    its own settings'."""
    rng = np.random.default_rng(11)
    logits = jnp.asarray(rng.normal(size=(3, 2, 10)) * 2, jnp.float32)
    temps, top_k, top_p, min_p = [0.9, 0.0, 1.2], [3, 0, 0], [1.0, 0.5, 0.7], [0.0, 0.0, 0.1]
    filters = dict(top_k=jnp.asarray(top_k), top_p=jnp.asarray(top_p), min_p=jnp.asarray(min_p), top_k_ceiling=4)
    n = 20_000
    keys = jax.random.split(jax.random.key(3), n)
    draw = jax.jit(jax.vmap(lambda key: tr.sample_target_tokens(logits, jnp.asarray(temps), key, **filters)))
    samples = np.asarray(draw(keys))  # [n, B, T]
    rows = np.asarray(jax.nn.log_softmax(sampling.sampled_logits(logits, jnp.asarray(temps), **filters), axis=-1))
    for b in range(3):
        for t in range(2):
            if temps[b] == 0:
                assert (samples[:, b, t] == int(np.argmax(logits[b, t]))).all()
                continue
            want = truncated_probs(np.asarray(logits[b, t]), temps[b], top_k[b], top_p[b], min_p[b])
            freq = np.bincount(samples[:, b, t], minlength=10) / n
            assert (freq[want == 0] == 0).all(), (b, t)
            assert (np.abs(freq - want) <= 5 * np.sqrt(want * (1 - want) / n) + 1e-12).all(), (b, t, freq, want)
            np.testing.assert_allclose(np.exp(rows[b, t]), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kwargs,message", [
    (dict(top_k=np.array([2, 0])), "a per-stream top_k needs top_k_ceiling >= 1"),
    (dict(top_k=np.array([2, 5]), top_k_ceiling=4), r"per-stream top_k: top_k=5 passes top_k_ceiling=4"),
    (dict(top_k=np.array([2, -1]), top_k_ceiling=4), r"per-stream top_k: top_k must be >= 0"),
    (dict(top_k=3, top_k_ceiling=4), "top_k_ceiling=4 is for a per-stream top_k"),
    (dict(top_p=np.array([0.5, 0.0])), "per-stream top_p: top_p must be in"),
    (dict(min_p=np.array([0.5, np.nan])), "per-stream min_p: min_p must be in"),
    (dict(top_p=np.array([0.5, 0.9, 1.0])), r"one value per stream \(2\), got shape \(3,\)"),
])
def test_bad_per_stream_filters_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        sampling.truncate(jnp.zeros((2, 3, 30)), **kwargs)
    with pytest.raises(ValueError, match="per-stream filters need logits"):
        sampling.truncate(jnp.zeros((30,)), top_p=np.array([0.5]))


def test_temperatures_at_the_edges_of_float32_sample_as_their_limits_or_are_refused():
    """A temperature of 1e-37 (a normal float32) takes the argmax, as its limit T -> 0+ does, through every filter:
    before, 45 / 1e-37 overflowed to +inf and the draw took the first +inf token, or min-p's inf - inf dropped the
    row and gave token 0. Temperatures whose float32 or reciprocal is not normal are refused on the host; before,
    1e38 turned a banned token's -inf into NaN, which the draw picked."""
    from ddtree_jax.stream_settings import check_temperature

    logits = jnp.asarray([[[1.0, 40.0, 45.0, -3.0, 5.0], [1.0, 2.0, -jnp.inf, -jnp.inf, 0.5]]])
    keys = jax.random.split(jax.random.key(0), 8)
    for filters in ((0, 1.0, 0.0), (0, 1.0, 0.1), (0, 0.9, 0.0), (2, 1.0, 0.0)):
        for temperature in (1e-37, jnp.full((1,), 1e-37, jnp.float32)):
            draw = jax.vmap(lambda k, t=temperature, f=filters: tr.sample_target_tokens(logits, t, k, *f))
            draws = np.asarray(draw(keys))
            np.testing.assert_array_equal(draws, np.broadcast_to([[2, 1]], draws.shape), err_msg=str(filters))
            kept = np.isfinite(np.asarray(sampling.sampled_logits(logits, temperature, *filters)))
            assert kept[0, [0, 1], [2, 1]].all() and not kept[0, 1, 2:4].any()
    big = jnp.full((1,), sampling.TEMPERATURE_RANGE[1], jnp.float32)  # the largest: banned tokens stay banned
    draws = np.asarray(jax.vmap(lambda k: tr.sample_target_tokens(logits, big, k))(jax.random.split(keys[0], 64)))
    assert set(draws[:, 0, 1].tolist()) <= {0, 1, 4} and len(set(draws[:, 0, 0].tolist())) > 1
    for bad in (1e-39, 1e-45, 1e38, 1e39):
        for check in (check_temperature, lambda t: tr.sample_target_tokens(logits, t, keys[0]),
                      lambda t: sampling.sampled_logits(logits, t)):
            with pytest.raises(ValueError, match=r"temperature must be 0 \(greedy\) or in \[1.18e-38, 8.51e\+37\]"):
                check(bad)
    assert check_temperature(sampling.TEMPERATURE_RANGE[0]) == 2.0**-126 and check_temperature(0) == 0.0


def test_a_mixed_batch_keeps_what_each_stream_keeps_alone_past_the_sort_size():
    """Past SORT_MAX_VALUES, a stream with top_k and top_p ranks its K best for the nucleus alone, and one without
    top_k searches; in a batch of both (``top_k_in_every_row`` False), each row still takes its own way. Before, every
    row searched, and the edge moved by a token against the stream alone wherever top_p lay on the masses' sums
    (here top_p is the sum of the 3 likeliest of 4, where the two sums round apart in some rows)."""
    vocab = sampling.SORT_MAX_VALUES + 808
    rng = np.random.default_rng(0)
    for _ in range(16):
        logits = np.full((2, 1, vocab), -30.0, np.float32)
        logits[0, 0, rng.choice(vocab, 4, replace=False)] = rng.normal(size=4)
        logits[1, 0] = rng.normal(size=vocab)
        kept = np.where(logits[0, 0] >= np.sort(logits[0, 0])[-4], logits[0, 0], -np.inf)
        probs = np.sort(np.asarray(jax.nn.softmax(jnp.asarray(kept))))[::-1]
        top_p = float(np.cumsum(probs[:4].astype(np.float32))[2])
        mixed = np.asarray(sampling.truncate(jnp.asarray(logits), jnp.asarray([4, 0]), jnp.asarray([top_p, 0.9]),
                                             top_k_ceiling=4))
        for b, (top_k, p) in enumerate([(4, top_p), (0, 0.9)]):
            alone = np.asarray(sampling.truncate(jnp.asarray(logits[b:b + 1]), top_k, p))
            np.testing.assert_array_equal(np.isfinite(mixed[b]), np.isfinite(alone[0]), err_msg=f"stream {b}")
