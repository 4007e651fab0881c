"""Tile widths in the Mosaic GPU MoE path. Two widths (``route_wide``, ``grouped_int4_matmul(wide_tiles=)``): an
expert with more than N pairs gets tiles of 2N, so its weights are fed to the tensor cores per 2N tokens.
Ragged tiles (``route_ragged``, ``grouped_int4_matmul(tile_rows=)``): an expert's last tile only as wide as
its pairs rounded up to 8. Also the down GEMM's bf16 pair rows (``out_dtype``).

CPU: the routing against a plain per-pair reference, the twin against numpy tile by tile, the layer against
the XLA path, CUDA lowering. GPU (skipped without one): the kernel against the twin."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.moe import TiledInt4, routed_experts_xla
from pallas_kernels import int4_moe_mgpu as K
from pallas_kernels import int4_tiles as TL
from tests.test_moe_kernel_model import rel, rel_norm
from tests.test_moe_tiled import MGPU_CALL, random_stack


def tile_spans(nt, wide, n, p):
    """(first row, width) of each tile: narrow tile t at t N, wide tile j (the (NT - W + j)-th) at
    P - (j + 1) 2N, as the module docstring lays them out."""
    narrow = nt - wide
    return [(t * n, n) for t in range(narrow)] + [(p - (j + 1) * 2 * n, 2 * n) for j in range(wide)]


@pytest.mark.parametrize("n,rows", [(8, 128), (16, 64)])
def test_twin_wide_tiles_match_numpy(n, rows):
    rng = np.random.default_rng(n)
    e, o, i = 4, 256, 512
    q = jnp.asarray(rng.integers(-8, 8, (e, o, i)), jnp.int8)
    sc = jnp.asarray(rng.uniform(0.01, 0.1, (e, o, i // 32)), jnp.bfloat16)
    w, s = TL.tile_weights(q, sc, rows)
    te = np.array([3, 0, -1, -1, 2, 2, 1, -1], np.int32)  # 4 narrow tiles, then 4 wide ones
    p = 4 * n + 4 * 2 * n
    x = jnp.asarray(rng.standard_normal((p, i)), jnp.bfloat16)
    out = np.asarray(K.grouped_int4_matmul_ref(K.to_chunks(x, 64), w, s, jnp.asarray(te), tokens_per_tile=n,
                                               wide_tiles=4))
    for ex, (start, width) in zip(te, tile_spans(8, 4, n, p)):
        cols = slice(start, start + width)
        if ex < 0:
            assert not out[:, cols].any()
            continue
        deq = np.asarray(q[ex], np.float32).reshape(o, i // 32, 32) * np.asarray(sc[ex], np.float32)[:, :, None]
        deq = np.asarray(jnp.asarray(deq.reshape(o, i), jnp.bfloat16), np.float64)
        np.testing.assert_allclose(out[:, cols], deq @ np.asarray(x[cols], np.float64).T, rtol=1e-5, atol=1e-4)


def test_wide_tile_arguments_are_checked():
    w = jnp.zeros((2, 2, 2 * 32, 128), jnp.int32)
    s = jnp.zeros((2, 2, 512 // 32, 128), jnp.bfloat16)
    x = jnp.zeros((512 // 64, 6 * 8, 64), jnp.bfloat16)  # 48 rows
    for fn in (K.grouped_int4_matmul_ref, K.grouped_int4_matmul):
        with pytest.raises(ValueError, match="rows must be a multiple of 2N=32"):  # 48 % 32
            fn(x, w, s, jnp.zeros((4,), jnp.int32), tokens_per_tile=16, wide_tiles=1)
        with pytest.raises(ValueError, match="holding the NT - W = 7 narrow tiles"):  # 7 x 8 > 48
            fn(x, w, s, jnp.zeros((8,), jnp.int32), tokens_per_tile=8, wide_tiles=1)


@pytest.mark.parametrize("m,k,offset,paired", [(40, 4, 0, True), (33, 2, 0, False), (60, 3, 4, True),
                                               (3, 2, 0, True)])
def test_layer_with_wide_tiles_equals_xla_path(m, k, offset, paired):
    rng = np.random.default_rng(m + k)
    e, d, f = 8, 256, 256
    w13, w2 = random_stack(rng, e, 2 * f, d), random_stack(rng, e, d, f)
    t13 = TiledInt4.from_compressed_tensors(w13.packed, w13.scale, pair_gate_up=paired)
    t2 = TiledInt4.from_compressed_tensors(w2.packed, w2.scale)
    x = jnp.asarray(rng.standard_normal((m, d)), jnp.float32)
    popular = rng.random(e + offset) ** 3  # skewed: some experts get more than a tile
    ids = jnp.asarray(np.stack([rng.choice(e + offset, k, replace=False, p=popular / popular.sum())
                                for _ in range(m)]), jnp.int32)
    wts = jnp.asarray(rng.random((m, k)), jnp.float32)
    want = routed_experts_xla(x, ids, wts, w13, w2, expert_offset=offset)
    for chunk in (64, 128):
        got = K.routed_experts_tiled(x, ids, wts, t13, t2, expert_offset=offset, out_dtype=jnp.float32, tile=8,
                                     widths="two", chunk=chunk)
        assert rel(got, want) < 1e-5


@pytest.mark.parametrize("n,out_layout,epilogue,out_dtype", [
    (8, "rows", "none", jnp.float32), (16, "tokens", "none", jnp.bfloat16), (8, "tokens", "silu_mul", jnp.float32)])
def test_wide_tile_kernel_lowers_for_cuda(n, out_layout, epilogue, out_dtype):
    qa = random_stack(np.random.default_rng(n), 3, 512, 512)
    leaf = TiledInt4.from_compressed_tensors(qa.packed, qa.scale, pair_gate_up=epilogue == "silu_mul")
    xg = jax.ShapeDtypeStruct((512 // 128, 2 * n + 3 * 2 * n, 128), jnp.bfloat16)
    te = jax.ShapeDtypeStruct((5,), jnp.int32)
    fn = functools.partial(K.grouped_int4_matmul, tokens_per_tile=n, wide_tiles=3, out_layout=out_layout,
                           epilogue=epilogue, out_dtype=out_dtype)
    assert MGPU_CALL in jax.jit(fn).trace(xg, leaf.packed, leaf.scale, te).lower(
        lowering_platforms=("cuda",)).as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("n,out_layout,epilogue,out_dtype", [
    (8, "tokens", "none", jnp.float32), (16, "rows", "none", jnp.float32), (8, "tokens", "silu_mul", jnp.float32),
    (8, "tokens", "none", jnp.bfloat16)])
def test_gpu_wide_tile_kernel_matches_twin(n, out_layout, epilogue, out_dtype):
    rng = np.random.default_rng(n)
    qa = random_stack(rng, 5, 512, 1024)
    leaf = TiledInt4.from_compressed_tensors(qa.packed, qa.scale, pair_gate_up=epilogue == "silu_mul")
    te = jnp.asarray([4, 0, -1, -1, 2, 4, -1], jnp.int32)  # 4 narrow, 3 wide
    rows = 4 * n + 3 * 2 * n
    xg = K.to_chunks(jnp.asarray(rng.standard_normal((rows, 1024)), jnp.bfloat16), 128)
    kw = dict(tokens_per_tile=n, wide_tiles=3, out_layout=out_layout, epilogue=epilogue, out_dtype=out_dtype)
    got = np.asarray(jax.jit(functools.partial(K.grouped_int4_matmul, **kw))(xg, leaf.packed, leaf.scale, te),
                     np.float32)
    want = np.asarray(K.grouped_int4_matmul_ref(xg, leaf.packed, leaf.scale, te, **kw), np.float32)
    if epilogue == "silu_mul":
        got, want = (np.swapaxes(a, 0, 1).reshape(rows, -1) for a in (got, want))
    elif out_layout == "rows":
        got, want = got.T, want.T
    valid = np.zeros(rows, bool)
    for ex, (start, width) in zip(np.asarray(te), tile_spans(7, 3, n, rows)):
        valid[start:start + width] = ex >= 0
    assert np.isfinite(got[valid]).all()
    assert rel_norm(got[valid], want[valid]) < (1e-5 if epilogue == "none" and out_dtype == jnp.float32 else 1e-2)


def test_bf16_pair_rows_are_the_f32_products_rounded():
    """out_dtype bfloat16 (token rows, no epilogue, no split) is the f32 result rounded once; anything else
    asking for it is refused, by the kernel and the twin alike."""
    rng = np.random.default_rng(3)
    qa = random_stack(rng, 3, 256, 256)
    leaf = TiledInt4.from_compressed_tensors(qa.packed, qa.scale)
    te = jnp.asarray([2, 0, -1], jnp.int32)
    xg = K.to_chunks(jnp.asarray(rng.standard_normal((24, 256)), jnp.bfloat16), 128)
    kw = dict(tokens_per_tile=8, out_layout="tokens")
    f32 = K.grouped_int4_matmul_ref(xg, leaf.packed, leaf.scale, te, **kw)
    bf16 = K.grouped_int4_matmul_ref(xg, leaf.packed, leaf.scale, te, out_dtype=jnp.bfloat16, **kw)
    assert bf16.dtype == jnp.bfloat16 and bool(jnp.all(bf16 == f32.astype(jnp.bfloat16)))
    for fn in (K.grouped_int4_matmul, K.grouped_int4_matmul_ref):
        for bad in (dict(out_layout="rows"), dict(out_layout="tokens", out_dtype=jnp.float16)):
            with pytest.raises(ValueError, match="out_dtype must be float32, or bfloat16 with token rows"):
                fn(xg, leaf.packed, leaf.scale, te, tokens_per_tile=8, **dict(dict(out_dtype=jnp.bfloat16), **bad))
    with pytest.raises(ValueError, match="split=2"):
        K.grouped_int4_matmul(xg, leaf.packed, leaf.scale, te, split=2, out_dtype=jnp.bfloat16, **kw)


def test_default_wide_where_tiles_are_narrow_and_pairs_many():
    assert [K.default_wide(m, 8, 384, K.tiled_default_tile(m, 8, 384)) for m in (1, 9, 32, 48, 90, 256, 512, 1024)] \
        == [False, False, False, True, True, True, True, False]
    assert not K.default_wide(256, 8, 384, 32) and K.default_wide(4, 2, 8, 8)


RAGGED_TILES = np.array([[0, 8, 16, 48, 0], [8, 8, 32, 24, 8]], np.int32)  # (first row, width); the last unused
RAGGED_EXPERTS = np.array([3, -1, 0, 3, -1], np.int32)


def test_twin_ragged_tiles_match_numpy():
    """Each used tile's rows are its expert's product, and rows no used tile holds stay zero (a skipped
    tile's, and the gap [72, 80) no tile holds)."""
    rng = np.random.default_rng(5)
    e, o, i, n, p = 4, 256, 512, 32, 80
    q = jnp.asarray(rng.integers(-8, 8, (e, o, i)), jnp.int8)
    sc = jnp.asarray(rng.uniform(0.01, 0.1, (e, o, i // 32)), jnp.bfloat16)
    w, s = TL.tile_weights(q, sc, 128)
    x = jnp.asarray(rng.standard_normal((p, i)), jnp.bfloat16)
    out = np.asarray(K.grouped_int4_matmul_ref(K.to_chunks(x, 64), w, s, jnp.asarray(RAGGED_EXPERTS),
                                               jnp.asarray(RAGGED_TILES), tokens_per_tile=n, out_layout="tokens"))
    held = np.zeros(p, bool)
    for ex, (start, width) in zip(RAGGED_EXPERTS, RAGGED_TILES.T):
        if ex < 0:
            continue
        rows = slice(start, start + width)
        held[rows] = True
        deq = np.asarray(q[ex], np.float32).reshape(o, i // 32, 32) * np.asarray(sc[ex], np.float32)[:, :, None]
        deq = np.asarray(jnp.asarray(deq.reshape(o, i), jnp.bfloat16), np.float64)
        np.testing.assert_allclose(out[rows], np.asarray(x[rows], np.float64) @ deq.T, rtol=1e-5, atol=1e-4)
    assert not out[~held].any()


def test_ragged_tile_arguments_are_checked():
    w = jnp.zeros((2, 2, 2 * 32, 128), jnp.int32)
    s = jnp.zeros((2, 2, 512 // 32, 128), jnp.bfloat16)
    x = jnp.zeros((512 // 64, 40, 64), jnp.bfloat16)
    te = jnp.zeros((3,), jnp.int32)
    for fn in (K.grouped_int4_matmul_ref, K.grouped_int4_matmul):
        with pytest.raises(ValueError, match="two layouts"):
            fn(x, w, s, te, jnp.zeros((2, 3), jnp.int32), tokens_per_tile=8, wide_tiles=1)
        with pytest.raises(ValueError, match=r"tile_rows must be int32 \[2, NT\]"):
            fn(x, w, s, te, jnp.zeros((2, 4), jnp.int32), tokens_per_tile=8)
        with pytest.raises(ValueError, match="tile_rows must be int32"):
            fn(x, w, s, te, jnp.zeros((2, 3), jnp.float32), tokens_per_tile=8)
    with pytest.raises(ValueError, match="widths must be"):
        K.routed_experts_tiled(jnp.zeros((2, 256)), jnp.zeros((2, 2), jnp.int32), jnp.ones((2, 2)),
                               *[TiledInt4.from_compressed_tensors(a.packed, a.scale) for a in
                                 (random_stack(np.random.default_rng(0), 4, 512, 256),
                                  random_stack(np.random.default_rng(1), 4, 256, 256))], widths="three")


@pytest.mark.parametrize("m,k,offset,tile", [(40, 4, 0, 16), (33, 2, 0, 32), (60, 3, 4, 24), (3, 2, 0, 8)])
def test_layer_with_ragged_tiles_equals_xla_path(m, k, offset, tile):
    rng = np.random.default_rng(m + k)
    e, d, f = 8, 256, 256
    w13, w2 = random_stack(rng, e, 2 * f, d), random_stack(rng, e, d, f)
    t13 = TiledInt4.from_compressed_tensors(w13.packed, w13.scale, pair_gate_up=m % 2 == 0)
    t2 = TiledInt4.from_compressed_tensors(w2.packed, w2.scale)
    x = jnp.asarray(rng.standard_normal((m, d)), jnp.float32)
    popular = rng.random(e + offset) ** 3  # skewed: some experts need several tiles
    ids = jnp.asarray(np.stack([rng.choice(e + offset, k, replace=False, p=popular / popular.sum())
                                for _ in range(m)]), jnp.int32)
    wts = jnp.asarray(rng.random((m, k)), jnp.float32)
    want = routed_experts_xla(x, ids, wts, w13, w2, expert_offset=offset)
    got = K.routed_experts_tiled(x, ids, wts, t13, t2, expert_offset=offset, out_dtype=jnp.float32, tile=tile,
                                 widths="ragged")
    assert rel(got, want) < 1e-5


@pytest.mark.parametrize("out_layout,epilogue,out_dtype", [
    ("rows", "none", jnp.float32), ("tokens", "none", jnp.bfloat16), ("tokens", "silu_mul", jnp.float32)])
def test_ragged_tile_kernel_lowers_for_cuda(out_layout, epilogue, out_dtype):
    qa = random_stack(np.random.default_rng(2), 4, 512, 512)
    leaf = TiledInt4.from_compressed_tensors(qa.packed, qa.scale, pair_gate_up=epilogue == "silu_mul")
    xg = jax.ShapeDtypeStruct((512 // 128, 80, 128), jnp.bfloat16)
    fn = functools.partial(K.grouped_int4_matmul, tokens_per_tile=32, out_layout=out_layout, epilogue=epilogue,
                           out_dtype=out_dtype)
    assert MGPU_CALL in jax.jit(fn).trace(xg, leaf.packed, leaf.scale, jnp.asarray(RAGGED_EXPERTS),
                                          jnp.asarray(RAGGED_TILES)).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("out_layout,epilogue,out_dtype", [
    ("tokens", "none", jnp.float32), ("rows", "none", jnp.float32), ("tokens", "silu_mul", jnp.float32),
    ("tokens", "none", jnp.bfloat16)])
def test_gpu_ragged_tile_kernel_matches_twin(out_layout, epilogue, out_dtype):
    rng = np.random.default_rng(9)
    qa = random_stack(rng, 4, 512, 1024)
    leaf = TiledInt4.from_compressed_tensors(qa.packed, qa.scale, pair_gate_up=epilogue == "silu_mul")
    p = 80
    xg = K.to_chunks(jnp.asarray(rng.standard_normal((p, 1024)), jnp.bfloat16), 128)
    kw = dict(tokens_per_tile=32, out_layout=out_layout, epilogue=epilogue, out_dtype=out_dtype)
    args = (xg, leaf.packed, leaf.scale, jnp.asarray(RAGGED_EXPERTS), jnp.asarray(RAGGED_TILES))
    got = np.asarray(jax.jit(functools.partial(K.grouped_int4_matmul, **kw))(*args), np.float32)
    want = np.asarray(K.grouped_int4_matmul_ref(*args, **kw), np.float32)
    if epilogue == "silu_mul":
        got, want = (np.swapaxes(a, 0, 1).reshape(p, -1) for a in (got, want))
    elif out_layout == "rows":
        got, want = got.T, want.T
    held = np.zeros(p, bool)
    for ex, (start, width) in zip(RAGGED_EXPERTS, RAGGED_TILES.T):
        held[start:start + width] |= ex >= 0
    assert np.isfinite(got[held]).all()
    assert rel_norm(got[held], want[held]) < (1e-5 if epilogue == "none" and out_dtype == jnp.float32 else 1e-2)
