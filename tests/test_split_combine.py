"""One-launch split merge (``pallas_kernels.split_combine``): the Pallas-Triton kernel in interpret mode
against its XLA twin and against a float64 reference (both split layouts, one to several hundred
splits, empty splits and rows that saw nothing); its lowering for CUDA on CPU; argument errors; and
on the GPU (``gpu`` marker) the compiled kernel against the twin at K2.6 decode shapes."""

import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels.split_combine import combine_blocks, combine_splits, combine_splits_ref, combine_warps, merge_lse


def reference(o, lse):
    """float64 loops over rows: sum_s exp(lse_s) o_s / sum_s exp(lse_s); empty rows 0 / -inf."""
    o, lse = np.asarray(o, np.float64), np.asarray(lse, np.float64)
    out, tot = np.zeros(o.shape[1:]), np.full(lse.shape[1:], -np.inf)
    for idx in np.ndindex(*lse.shape[1:]):
        col = lse[(slice(None),) + idx]
        if np.isneginf(col).all():
            continue
        w = np.exp(col - col.max())
        out[idx] = w @ o[(slice(None),) + idx] / w.sum()
        tot[idx] = col.max() + np.log(w.sum())
    return out, tot


def make_parts(seed, NS, B, V, L, dtype=jnp.bfloat16):
    rng = np.random.default_rng(seed)
    o = rng.standard_normal((NS, B, V, L)).astype(np.float32)
    lse = (rng.standard_normal((NS, B, V)) * 4).astype(np.float32)
    lse[rng.random((NS, B, V)) < 0.2] = -np.inf          # empty splits here and there
    lse[:, 0, 3] = -np.inf                               # a row that saw no key at all
    o[np.isneginf(lse)] = 0.0                            # as the kernels write them
    return jnp.asarray(o, dtype), jnp.asarray(lse)


@pytest.mark.parametrize("NS,B,V,L,split_axis", [
    (1, 1, 8, 64, 0), (5, 2, 6, 128, 0), (13, 3, 8, 512, 0), (128, 1, 8, 512, 0), (4, 1, 5, 40, 0),
    (200, 2, 8, 64, 0), (200, 2, 8, 64, 1),     # 200: two chunks of 128 splits
    (13, 3, 8, 512, 1), (5, 2, 6, 128, 1)])     # split_axis 1: the Triton attention's [B, NS, V, L]
def test_kernel_interpret_matches_twin_and_reference(NS, B, V, L, split_axis):
    o, lse = make_parts(NS * 7 + V, NS, B, V, L)
    if split_axis == 1:
        o, lse = jnp.moveaxis(o, 0, 1), jnp.moveaxis(lse, 0, 1)
    out, tot = combine_splits(o, lse, split_axis=split_axis, interpret=True)
    r_out, r_tot = combine_splits_ref(o, lse, split_axis=split_axis)
    assert out.shape == (B, V, L) and out.dtype == jnp.bfloat16 and tot.dtype == jnp.float32
    assert r_out.shape == out.shape and r_out.dtype == out.dtype and r_tot.dtype == tot.dtype
    o64, lse64 = (np.asarray(jnp.moveaxis(a, 1, 0) if split_axis == 1 else a, np.float64) for a in (o, lse))
    d_out, d_tot = reference(o64, lse64)
    np.testing.assert_allclose(np.asarray(out, np.float32), d_out, atol=1e-2, rtol=1e-2)  # one bf16 rounding
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(r_out, np.float32), atol=1e-2, rtol=1e-2)
    np.testing.assert_allclose(np.asarray(tot), d_tot, rtol=1e-5, atol=1e-5)
    assert np.isneginf(np.asarray(tot)[0, 3]) and not np.asarray(out, np.float32)[0, 3].any()


def test_kernel_keeps_f32_and_casts_on_request():
    o, lse = make_parts(3, 6, 2, 8, 32, jnp.float32)
    out, _ = combine_splits(o, lse, interpret=True)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), reference(o, lse)[0], rtol=1e-5, atol=1e-5)
    out16, _ = combine_splits(o, lse, out_dtype=jnp.bfloat16, interpret=True)
    assert out16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out16), np.asarray(out.astype(jnp.bfloat16)))


def test_merge_lse_weights_parts_and_keeps_empty_rows_empty():
    o = jnp.asarray([[[1.0, 0.0]], [[0.0, 1.0]], [[5.0, 5.0]]])          # [NS=3, rows=1, L=2]
    lse = jnp.asarray([[0.0], [jnp.log(3.0)], [-jnp.inf]])
    out, l = merge_lse(o, lse)
    np.testing.assert_allclose(np.asarray(out), [[0.25, 0.75]], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(l), [np.log(4.0)], rtol=1e-6)
    empty, l = merge_lse(o[:1], jnp.full((1, 1), -jnp.inf))
    assert not np.asarray(empty).any() and np.isneginf(np.asarray(l)).all()


def test_blocks_divide_the_width_and_chunk_the_splits():
    assert combine_blocks(128, 512) == (64, 128)
    assert combine_blocks(13, 512) == (512, 16)
    assert combine_blocks(8, 512) == (512, 8)
    assert combine_blocks(64, 512) == (128, 64)
    assert combine_blocks(300, 512) == (64, 128)
    assert combine_blocks(3, 40) == (8, 4)


def test_warps_follow_the_slab():
    """Two warps where a program holds at most half the full slab (few splits, whole rows), else four."""
    assert [combine_warps(*reversed(combine_blocks(ns, 512))) for ns in (2, 4, 8, 13, 64, 128, 300)] == \
        [2, 2, 2, 4, 4, 4, 4]


def test_errors():
    o, lse = make_parts(0, 4, 1, 8, 64)
    with pytest.raises(ValueError, match="split_axis"):
        combine_splits(o, lse, split_axis=2, interpret=True)
    with pytest.raises(ValueError, match="first three dims"):
        combine_splits(o, lse[:, :, :4], interpret=True)
    with pytest.raises(ValueError, match="float32"):
        combine_splits(o, lse.astype(jnp.bfloat16), interpret=True)
    with pytest.raises(ValueError, match="multiple of 8"):
        combine_splits(o[..., :12], lse, interpret=True)
    with pytest.raises(ValueError, match="no split"):
        combine_splits(o[:0], lse[:0], interpret=True)
    for fn in (functools.partial(combine_splits, interpret=True), combine_splits_ref):  # the twin checks them too
        for cols in (48, 4, 128):  # not a power of two; below 8; not dividing L = 64
            with pytest.raises(ValueError, match=f"block_cols={cols}"):
                fn(o, lse, block_cols=cols)
        with pytest.raises(ValueError, match="num_warps=3"):
            fn(o, lse, num_warps=3)


@pytest.mark.parametrize("split_axis", [0, 1])
def test_kernel_lowers_for_cuda_on_cpu(split_axis):
    shape = (128, 1, 8, 512) if split_axis == 0 else (1, 128, 8, 512)
    f = jax.jit(functools.partial(combine_splits, split_axis=split_axis))
    text = f.trace(jax.ShapeDtypeStruct(shape, jnp.bfloat16),
                   jax.ShapeDtypeStruct(shape[:3], jnp.float32)).lower(lowering_platforms=("cuda",)).as_text()
    assert "combine_splits" in text and "triton" in text.lower()
    assert "num_warps = 4 : i32" in text  # 128 splits: the full slab


def test_overrides_reach_the_kernel_and_keep_the_result():
    o, lse = make_parts(5, 8, 2, 8, 512)
    text = jax.jit(functools.partial(combine_splits, block_cols=128, num_warps=8)).trace(o, lse).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "num_warps = 8 : i32" in text
    assert "num_warps = 2 : i32" in jax.jit(combine_splits).trace(o, lse).lower(lowering_platforms=("cuda",)).as_text()
    out, tot = combine_splits(o, lse, block_cols=128, interpret=True)
    r_out, r_tot = combine_splits(o, lse, interpret=True)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(r_out, np.float32))
    np.testing.assert_array_equal(np.asarray(tot), np.asarray(r_tot))


@pytest.mark.gpu
@pytest.mark.parametrize("NS,B,V,warps", [(128, 1, 8, None), (64, 1, 64, None), (8, 16, 8, None), (8, 16, 72, 4),
                                          (4, 1, 2048, None), (13, 10, 72, None), (200, 1, 8, None)])
def test_gpu_kernel_matches_twin(NS, B, V, warps):
    o, lse = make_parts(NS + B, NS, B, V, 512)
    out, tot = jax.jit(functools.partial(combine_splits, num_warps=warps))(o, lse)
    r_out, r_tot = jax.jit(combine_splits_ref)(o, lse)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(r_out, np.float32), atol=1e-2, rtol=1e-2)
    np.testing.assert_allclose(np.asarray(tot), np.asarray(r_tot), rtol=1e-5, atol=1e-5)
