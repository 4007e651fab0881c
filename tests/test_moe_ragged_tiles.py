"""Ragged tiles in the Mosaic GPU MoE path (``route_ragged``, ``grouped_int4_matmul(tile_rows=)``): an expert's
tiles are N wide but its last, which is only as wide as its remaining pairs rounded up to 8, so that the
tensor cores do no work on more than 7 padding tokens per expert. Also the down GEMM's bf16 pair rows
(``out_dtype``) and the default tile layout.

CPU: the twin against numpy tile by tile, argument errors, the default layout, the layer against the XLA
path, CUDA lowering (``route_ragged`` itself is checked pair by pair in test_moe_routing.py). GPU (skipped
without one): the kernel against the twin, with and without split-K."""

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


def test_default_widths():
    """One width while the pairs are fewer than the experts, then ragged tiles of at most 16 and 32."""
    assert [K.default_widths(m, 8, 384) for m in (9, 32, 48, 90, 256, 384, 512, 1024)] == [
        ("one", 8), ("one", 8), ("ragged", 16), ("ragged", 16), ("ragged", 16), ("ragged", 16), ("ragged", 32),
        ("ragged", 32)]
    assert K.uses_per_pair(1) and not K.uses_per_pair(2)
    assert K.uses_per_pair(5, "per_pair") and not K.uses_per_pair(1, "sort")
    assert K.tile_layout(1, 8, 384, per_pair=True) == ("one", 8)  # per-pair tiles: one width
    assert K.tile_layout(512, 8, 384, "one") == ("one", 16)  # another layout than the default's: its own N
    assert K.tile_layout(512, 8, 384, "ragged", 16) == ("ragged", 16)
    # expert parallelism: 8 devices hold 48 experts each and see about an eighth of the pairs locally
    assert [K.default_widths(m, 8, 48, shards=8) for m in (32, 90, 512, 1024)] == [
        ("one", 8), ("ragged", 16), ("ragged", 32), ("ragged", 32)]  # the same mean per expert as one device
    assert K.tile_layout(90, 8, 48, shards=8) == ("ragged", 16) and K.tile_layout(90, 8, 48) == ("ragged", 32)


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
        with pytest.raises(ValueError, match=r"\[8, 64\] with ragged tiles"):
            fn(x, w, s, te, jnp.zeros((2, 3), jnp.int32), tokens_per_tile=72)
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


@pytest.mark.parametrize("out_layout,epilogue,out_dtype,split", [
    ("rows", "none", jnp.float32, 1), ("tokens", "none", jnp.bfloat16, 1), ("tokens", "silu_mul", jnp.float32, 1),
    ("tokens", "none", jnp.float32, 2)])
def test_ragged_tile_kernel_lowers_for_cuda(out_layout, epilogue, out_dtype, split):
    qa = random_stack(np.random.default_rng(2), 4, 512, 512)
    leaf = TiledInt4.from_compressed_tensors(qa.packed, qa.scale, pair_gate_up=epilogue == "silu_mul")
    xg = jax.ShapeDtypeStruct((512 // 128, 80, 128), jnp.bfloat16)
    fn = functools.partial(K.grouped_int4_matmul, tokens_per_tile=32, out_layout=out_layout, epilogue=epilogue,
                           out_dtype=out_dtype, split=split)
    assert MGPU_CALL in jax.jit(fn).trace(xg, leaf.packed, leaf.scale, jnp.asarray(RAGGED_EXPERTS),
                                          jnp.asarray(RAGGED_TILES)).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("out_layout,epilogue,out_dtype,split", [
    ("tokens", "none", jnp.float32, 1), ("rows", "none", jnp.float32, 1), ("tokens", "silu_mul", jnp.float32, 1),
    ("tokens", "none", jnp.bfloat16, 1), ("tokens", "none", jnp.float32, 2)])
def test_gpu_ragged_tile_kernel_matches_twin(out_layout, epilogue, out_dtype, split):
    rng = np.random.default_rng(9)
    qa = random_stack(rng, 4, 512, 1024)
    leaf = TiledInt4.from_compressed_tensors(qa.packed, qa.scale, pair_gate_up=epilogue == "silu_mul")
    p = 80
    xg = K.to_chunks(jnp.asarray(rng.standard_normal((p, 1024)), jnp.bfloat16), 128)
    kw = dict(tokens_per_tile=32, out_layout=out_layout, epilogue=epilogue, out_dtype=out_dtype)
    args = (xg, leaf.packed, leaf.scale, jnp.asarray(RAGGED_EXPERTS), jnp.asarray(RAGGED_TILES))
    got = np.asarray(jax.jit(functools.partial(K.grouped_int4_matmul, split=split, **kw))(*args), np.float32)
    want = np.asarray(K.grouped_int4_matmul_ref(*args, **kw), np.float32)  # the twin has no split-K
    if epilogue == "silu_mul":
        got, want = (np.swapaxes(a, 0, 1).reshape(p, -1) for a in (got, want))
    elif out_layout == "rows":
        got, want = got.T, want.T
    held = np.zeros(p, bool)
    for ex, (start, width) in zip(RAGGED_EXPERTS, RAGGED_TILES.T):
        held[start:start + width] |= ex >= 0
    assert np.isfinite(got[held]).all()
    assert rel_norm(got[held], want[held]) < (1e-5 if epilogue == "none" and out_dtype == jnp.float32 else 1e-2)
