"""Routing metadata of the grouped expert GEMMs (``pallas_kernels.moe_routing``): each layout checked pair
by pair against what its docstring promises, for both methods, and the two methods against each other bit
for bit (random, skewed and expert-parallel routings). Also the router's two top-k methods
(``ddtree_jax.moe.top_k``) against ``lax.top_k``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.config import tiny_config
from ddtree_jax.moe import route
from ddtree_jax.topk import top_k
from pallas_kernels import moe_routing as R
from tests.test_int4_moe_kernel import make_routing

route_narrow = jax.jit(R.route_narrow, static_argnums=(2, 3, 4))  # one compile per case, not one per op
route_ragged = jax.jit(R.route_ragged, static_argnums=(1, 2, 3))


@pytest.mark.parametrize("method", ["sort", "compare"])
def test_route_narrow_metadata(method):
    m, k, e, t = 17, 4, 8, 4
    ids, w = make_routing(m, k, e, seed=5, skew=True)
    routed = route_narrow(jnp.asarray(ids), jnp.asarray(w), e, t, method)
    row_token, row_weight, tile_expert, num_tiles, pair_row = map(np.asarray, routed)
    counts = np.bincount(ids.reshape(-1), minlength=e)
    assert int(num_tiles) == int(np.sum((counts + t - 1) // t))
    assert np.all(tile_expert[int(num_tiles):] == -1)
    seen = []
    for i in range(int(num_tiles)):
        ex = tile_expert[i]
        for r in range(i * t, (i + 1) * t):
            if row_token[r] < m:
                assert ex in ids[row_token[r]]
                kk = list(ids[row_token[r]]).index(ex)
                assert row_weight[r] == w[row_token[r], kk]
                seen.append((row_token[r], ex))
            else:
                assert row_weight[r] == 0
    assert sorted(seen) == sorted((mm, ids[mm, kk]) for mm in range(m) for kk in range(k))
    assert set(tile_expert[:int(num_tiles)]) == set(np.nonzero(counts)[0])  # no tile for idle experts
    # pair_row is the inverse map: pair (m, k) sits at that row
    assert pair_row.shape == (m, k)
    for mm in range(m):
        for kk in range(k):
            r = pair_row[mm, kk]
            assert row_token[r] == mm and row_weight[r] == w[mm, kk]
            assert tile_expert[r // t] == ids[mm, kk]


@pytest.mark.parametrize("method", ["sort", "compare"])
def test_route_pair_row_marks_pairs_without_a_row(method):
    ids = jnp.asarray([[0, 5], [2, 1]], jnp.int32)  # experts 5 (and 2 under offset) are held elsewhere
    w = jnp.ones((2, 2), jnp.float32)
    row_token, _, tile_expert, _, pair_row = map(np.asarray, route_narrow(ids, w, 2, 8, method))
    p = row_token.shape[0]
    assert pair_row[0, 1] == p and pair_row[1, 0] == p
    assert row_token[pair_row[0, 0]] == 0 and row_token[pair_row[1, 1]] == 1


def check_ragged(ids, e, tile, offset=0, method="auto"):
    """route_ragged's layout, checked pair by pair against what the docstring promises: every local pair in a
    row of a tile of its expert, the used tiles disjoint inside P, an expert's tiles N wide but its last,
    which is its remaining pairs rounded up to 8, and no tile for an idle expert."""
    m, k = ids.shape
    row_token, tile_expert, tile_rows, pair_row = map(np.asarray, route_ragged(jnp.asarray(ids - offset, jnp.int32),
                                                                              e, tile, method))
    p, nt = row_token.shape[0], tile_expert.size
    assert p == R.ragged_rows_bound(m * k, e) and nt == R.max_tiles(m, k, e, tile) and tile_rows.shape == (2, nt)
    local_ids = ids.ravel() - offset
    counts = np.bincount(local_ids[(local_ids >= 0) & (local_ids < e)], minlength=e)
    owner = np.full(p, -1)
    for t in np.flatnonzero(tile_expert >= 0):
        start, width = tile_rows[:, t]
        assert 0 <= start and start + width <= p and (owner[start:start + width] == -1).all()
        owner[start:start + width] = t
    for ex in np.flatnonzero(counts):
        mine = np.flatnonzero(tile_expert == ex)
        assert (np.diff(mine) == 1).all()  # one run of tiles per expert
        widths = tile_rows[1, mine]
        last = counts[ex] - tile * (len(mine) - 1)
        assert len(mine) == -(-counts[ex] // tile) and (widths[:-1] == tile).all()
        assert widths[-1] == -(-last // 8) * 8
    assert (tile_expert[tile_expert >= 0].size == np.sum(-(-counts // tile)))
    unused = tile_expert < 0  # documented as first row 0, width 8
    assert (tile_rows[0, unused] == 0).all() and (tile_rows[1, unused] == 8).all()
    seen = np.zeros(p, bool)
    for t in range(m):
        for j in range(k):
            r = pair_row[t, j]
            if not 0 <= ids[t, j] - offset < e:
                assert r == p
                continue
            assert row_token[r] == t and not seen[r] and owner[r] >= 0
            assert tile_expert[owner[r]] == ids[t, j] - offset
            seen[r] = True
    assert (row_token[~seen] == m).all()
    return tile_rows


@pytest.mark.parametrize("m,k,e,tile,offset", [(1, 8, 16, 8, 0), (40, 4, 16, 32, 0), (64, 8, 384, 16, 0),
                                               (50, 3, 12, 24, 4), (9, 2, 4, 16, 0)])
@pytest.mark.parametrize("method", ["sort", "compare"])
def test_route_ragged_places_every_pair(m, k, e, tile, offset, method):
    rng = np.random.default_rng(m * k)
    ids = np.stack([rng.choice(e + offset + 3, k, replace=False) for _ in range(m)]).astype(np.int32)
    check_ragged(ids, e, tile, offset, method)


def test_route_ragged_extremes_and_errors():
    m, k, e = 33, 4, 16
    rows = check_ragged(np.tile(np.arange(k, dtype=np.int32), (m, 1)), e, 16)  # 33 pairs each: 16 + 16 + 8
    assert sorted(rows[1][:3].tolist()) == [8, 16, 16]
    check_ragged(np.arange(m * k, dtype=np.int32).reshape(m, k) % e, e, 64)  # spread evenly: one tile each
    check_ragged(np.full((3, 2), 99, np.int32), e, 8)  # every pair held elsewhere: no tile used
    check_ragged(np.arange(16, dtype=np.int32).reshape(2, 8), e, 8)  # a pair per expert: 7 padding rows each, P's bound
    for tile in (12, 0, -8):
        with pytest.raises(ValueError, match="multiple of 8"):
            R.route_ragged(jnp.zeros((2, 2), jnp.int32), e, tile)


def routings():
    """(ids int32 [M, K], E, N) cases: uniform, skewed, one expert for all, other devices' experts."""
    cases = []
    for m, k, e, n, skew in [(1, 8, 384, 8, False), (9, 8, 384, 8, True), (32, 8, 384, 8, False), (5, 8, 48, 8, False),
                             (17, 4, 8, 4, True), (40, 4, 16, 8, True)]:
        name = f"{'skewed' if skew else 'uniform'}-{m}x{k}-e{e}"
        cases.append(pytest.param(make_routing(m, k, e, seed=m, skew=skew)[0], e, n, id=name))
    cases.append(pytest.param(np.zeros((12, 1), np.int32), 4, 8, id="one-expert"))
    rng = np.random.default_rng(3)
    cases.append(pytest.param(rng.integers(0, 64, (9, 8)).astype(np.int32) - 16, 16, 8, id="expert-parallel"))
    return cases


@pytest.mark.parametrize("ids,e,n", routings())
def test_compare_and_sort_give_the_same_layout(ids, e, n):
    w = jnp.asarray(np.random.default_rng(0).uniform(size=ids.shape), jnp.float32)
    ids = jnp.asarray(ids)
    narrow = [route_narrow(ids, w, e, n, method) for method in ("sort", "compare")]
    for a, b in zip(*narrow):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ragged = [route_ragged(ids, e, 2 * n, method) for method in ("sort", "compare")]
    for a, b in zip(*ragged):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_routing_method_resolves_and_refuses():
    assert R.routing_method(R.COMPARE_MAX_PAIRS) == "compare"
    assert R.routing_method(R.COMPARE_MAX_PAIRS + 1) == "sort"
    assert R.routing_method(8, "sort") == "sort"
    with pytest.raises(ValueError, match="routing method"):
        R.routing_method(8, "bitonic")


@pytest.mark.parametrize("m,e,k", [(1, 384, 8), (9, 384, 8), (5, 16, 4)])
def test_compare_top_k_is_lax_top_k_with_ties_and_masks(m, e, k):
    rng = np.random.default_rng(m * e)
    values = rng.integers(0, 6, (m, e)).astype(np.float32)  # many ties: lower index first, as lax.top_k
    values[:, rng.random(e) < 0.3] = -np.inf                 # masked groups' experts
    values[0] = -np.inf                                      # a row with nothing but masks
    want = jax.lax.top_k(jnp.asarray(values), k)
    got = jax.jit(lambda v: top_k(v, k, "compare"))(jnp.asarray(values))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    with pytest.raises(ValueError, match="top-k method"):
        top_k(jnp.asarray(values), k, "heap")
    with pytest.raises(ValueError, match="must be in"):
        top_k(jnp.asarray(values), e + 1, "compare")


@pytest.mark.parametrize("groups", [1, 4])
def test_router_picks_the_same_experts_with_either_top_k(groups):
    cfg = tiny_config(n_routed_experts=32, num_experts_per_tok=4, n_group=groups, topk_group=min(2, groups))
    rng = np.random.default_rng(groups)
    x = jnp.asarray(rng.standard_normal((7, cfg.hidden_size)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((32, cfg.hidden_size)) * 0.05, jnp.float32)
    bias = jnp.asarray(rng.standard_normal(32) * 0.1, jnp.float32)
    sort, compare = (route(x, w, bias, cfg, top_k_method=method) for method in ("sort", "compare"))
    np.testing.assert_array_equal(np.asarray(sort[0]), np.asarray(compare[0]))
    np.testing.assert_array_equal(np.asarray(sort[1]), np.asarray(compare[1]))


@pytest.mark.parametrize("m,k,e,n,offset", [(1, 8, 384, 8, 0), (3, 4, 16, 8, 0), (2, 4, 8, 16, 4)])
def test_route_per_pair_gives_each_pair_its_own_tile(m, k, e, n, offset):
    rng = np.random.default_rng(m + offset)
    ids = rng.integers(0, e + 2 * offset, (m, k)).astype(np.int32)  # repeats allowed: each pair still its tile
    row_token, tile_expert, pair_row = map(np.asarray, jax.jit(R.route_per_pair, static_argnums=(1, 2))(
        jnp.asarray(ids - offset), e, n))
    p = m * k * n
    assert row_token.shape == (p,) and tile_expert.shape == (m * k,) and pair_row.shape == (m, k)
    for mm in range(m):
        for kk in range(k):
            q, local = mm * k + kk, 0 <= ids[mm, kk] - offset < e
            assert tile_expert[q] == (ids[mm, kk] - offset if local else -1)
            assert pair_row[mm, kk] == (q * n if local else p)
            tile_rows = row_token[q * n:(q + 1) * n]
            assert tile_rows[0] == mm and np.all(tile_rows[1:] == m)  # the pair, then padding


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_router_with_16_bit_operands_sums_the_exact_products(dtype):
    """A 16-bit model's router runs a 16-bit dot with f32 accumulation (tensor cores on a GPU). Each product
    of two 16-bit floats is exact in f32, so it picks the experts of the reference's f32 dot over the upcast
    operands, with the same weights up to the order of the f32 sums."""
    cfg = tiny_config(n_routed_experts=384, num_experts_per_tok=8, n_group=1, topk_group=1)
    rng = np.random.default_rng(33)
    x = jnp.asarray(rng.standard_normal((33, 2048)), dtype)
    w = jnp.asarray(rng.standard_normal((384, 2048)) * 0.02, dtype)
    bias = jnp.asarray(rng.standard_normal(384) * 0.01, jnp.float32)
    ids, weights = jax.jit(lambda x, w: route(x, w, bias, cfg))(x, w)
    want_ids, want_weights = jax.jit(lambda x, w: route(x, w, bias, cfg))(x.astype(jnp.float32), w.astype(jnp.float32))
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
    np.testing.assert_allclose(np.asarray(weights), np.asarray(want_weights), rtol=1e-5)
    dots = [e for e in jax.make_jaxpr(lambda x, w: route(x, w, bias, cfg))(x, w).eqns
            if e.primitive.name == "dot_general"]
    assert [tuple(v.aval.dtype for v in e.invars) for e in dots] == [(jnp.dtype(dtype), jnp.dtype(dtype))]
    assert dots[0].outvars[0].aval.dtype == jnp.float32


@pytest.mark.parametrize("groups,topk_group,norm", [(4, 2, True), (2, 1, False), (1, 1, True)])
def test_router_equals_transformers_gate_where_masked_groups_matter(groups, topk_group, norm):
    """route against transformers' DeepseekV3TopkRouter, with correction biases that put every expert below zero
    (a masked expert must lose to any expert of a chosen group, even a negative one) and make the selection
    differ from the weights' order (the bias picks; the unbiased sigmoid weighs)."""
    import torch
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    e, d, k = 32, 64, 4
    cfg = tiny_config(n_routed_experts=e, num_experts_per_tok=k, n_group=groups, topk_group=topk_group,
                      norm_topk_prob=norm, routed_scaling_factor=2.5)
    rng = np.random.default_rng(groups + topk_group)
    x = rng.standard_normal((9, d)).astype(np.float32)
    w = (rng.standard_normal((e, d)) * 0.2).astype(np.float32)
    bias = (rng.standard_normal(e) * 0.3 - 1.5).astype(np.float32)
    ref = DeepseekV3TopkRouter(DeepseekV3Config(hidden_size=d, n_routed_experts=e, num_experts_per_tok=k,
                                                n_group=groups, topk_group=topk_group, norm_topk_prob=norm,
                                                routed_scaling_factor=2.5))
    with torch.no_grad():
        ref.weight.copy_(torch.from_numpy(w))
        ref.e_score_correction_bias.copy_(torch.from_numpy(bias))
        _, want_weights, want_ids = ref(torch.from_numpy(x))
    ids, weights = jax.jit(lambda x: route(x, jnp.asarray(w), jnp.asarray(bias), cfg))(jnp.asarray(x))
    ids, weights, want_ids, want_weights = map(np.asarray, (ids, weights, want_ids, want_weights))
    order, want_order = np.argsort(ids, axis=1), np.argsort(want_ids, axis=1)
    np.testing.assert_array_equal(np.take_along_axis(ids, order, 1), np.take_along_axis(want_ids, want_order, 1))
    np.testing.assert_allclose(np.take_along_axis(weights, order, 1), np.take_along_axis(want_weights, want_order, 1),
                               rtol=1e-6)
