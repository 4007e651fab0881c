"""Gate and up rows paired for the gate+up kernel's SiLU·up epilogue ("fuse_silu"): the pairing, its repack
(bit-exact both ways), the epilogue in the twin and the routed layer against the XLA path, the prepared model,
errors and lowering for CUDA on CPU; on a Hopper GPU the epilogue kernel == twin and the fused model.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ddtree_jax.model import Runtime
from ddtree_jax.moe import (TiledInt4, prepare_for_kernels, routed_experts_tiled, routed_experts_xla,
                            unprepare_for_kernels)
from ddtree_jax.quant import dequantize_int4
from pallas_kernels import int4_moe_mgpu as K
from pallas_kernels import int4_tiles as TL
from tests.test_moe_kernel_model import forward, rel, rel_norm
from tests.test_moe_tiled import MGPU_CALL, random_stack, tiny_model


# ----------------------------------------------------------------------------------------------
# Gate/up rows paired for the SiLU·up epilogue of the gate+up kernel
# ----------------------------------------------------------------------------------------------
def test_gate_up_pairing_is_a_permutation_that_pairs_rows_of_one_f():
    o, block = 512, 64
    rows = TL.gate_up_pair_rows(o, block)
    assert sorted(rows.tolist()) == list(range(o))
    f = o // 2
    for j in range(f // block):  # stored block 2j: gate f in [64j, 64j + 64); block 2j + 1: up of the same f
        np.testing.assert_array_equal(rows[2 * j * block:(2 * j + 1) * block], np.arange(j * block, (j + 1) * block))
        np.testing.assert_array_equal(rows[(2 * j + 1) * block:(2 * j + 2) * block],
                                      f + np.arange(j * block, (j + 1) * block))


@pytest.mark.parametrize("order", ["fragments", "groups"])
def test_paired_repack_is_bit_exact_and_dequantizes_in_natural_order(order):
    qa = random_stack(np.random.default_rng(3), 2, 512, 256)
    leaf = TiledInt4.from_compressed_tensors(qa.packed, qa.scale, order=order, pair_gate_up=True)
    assert leaf.gate_up_block == 64 and leaf.order == order
    packed, scale = leaf.to_compressed_tensors()
    np.testing.assert_array_equal(np.asarray(packed), np.asarray(qa.packed))
    np.testing.assert_array_equal(np.asarray(scale).view(np.uint16), np.asarray(qa.scale).view(np.uint16))
    np.testing.assert_array_equal(np.asarray(leaf.dequantize_expert(1, jnp.float32)),
                                  np.asarray(dequantize_int4(qa.packed[1], qa.scale[1], jnp.float32)))
    # the pairing is static metadata: it survives a trip through a pytree
    leaves, tdef = jax.tree_util.tree_flatten(leaf)
    assert len(leaves) == 2 and jax.tree_util.tree_unflatten(tdef, leaves).gate_up_block == 64
    with pytest.raises(ValueError, match="multiple of 256"):
        small = random_stack(np.random.default_rng(4), 1, 384, 256)
        TiledInt4.from_compressed_tensors(small.packed, small.scale, pair_gate_up=True)


def test_twin_epilogue_is_silu_of_gate_times_up():
    rng = np.random.default_rng(5)
    qa = random_stack(rng, 3, 512, 512)
    plain = TiledInt4.from_compressed_tensors(qa.packed, qa.scale)
    paired = TiledInt4.from_compressed_tensors(qa.packed, qa.scale, pair_gate_up=True)
    te = jnp.asarray([2, -1, 0], jnp.int32)
    xg = K.to_chunks(jnp.asarray(rng.standard_normal((24, 512)), jnp.float32), 64)
    gu = np.asarray(K.grouped_int4_matmul_ref(xg, plain.packed, plain.scale, te, tokens_per_tile=8,
                                              out_layout="tokens"))
    hc = K.grouped_int4_matmul_ref(xg, paired.packed, paired.scale, te, tokens_per_tile=8, out_layout="tokens",
                                   epilogue="silu_mul")
    assert hc.shape == (4, 24, 64) and hc.dtype == np.float32  # h in the down GEMM's chunks
    h = np.asarray(jnp.swapaxes(hc, 0, 1).reshape(24, 256))
    h128 = K.grouped_int4_matmul_ref(K.to_chunks(jnp.swapaxes(xg, 0, 1).reshape(24, 512), 128), paired.packed,
                                     paired.scale, te, tokens_per_tile=8, out_layout="tokens", epilogue="silu_mul")
    np.testing.assert_array_equal(np.asarray(h128), np.asarray(K.to_chunks(jnp.asarray(h), 128)))
    g, u = gu[:, :256].astype(np.float64), gu[:, 256:].astype(np.float64)
    np.testing.assert_allclose(h, g / (1 + np.exp(-g)) * u, rtol=2e-5, atol=1e-6)
    # the unfused output of the paired stack is the plain output with columns paired the same way
    gu_paired = K.grouped_int4_matmul_ref(xg, paired.packed, paired.scale, te, tokens_per_tile=8, out_layout="tokens")
    g2, u2 = K.gate_and_up(gu_paired, 64)
    np.testing.assert_allclose(np.asarray(g2), gu[:, :256], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(u2), gu[:, 256:], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("split", [1, 2])
def test_routed_layer_with_paired_gate_up_equals_xla_path(split, monkeypatch):
    """Fused (split 1: SiLU·up in the epilogue) and unfused (split-K: paired columns taken apart in XLA)."""
    rng = np.random.default_rng(11)
    e, d, f, m, k = 8, 512, 512, 9, 3  # two pipeline steps per stack, so split-K 2 divides them
    w13, w2 = random_stack(rng, e, 2 * f, d), random_stack(rng, e, d, f)
    x = jnp.asarray(rng.standard_normal((m, d)), jnp.float32)
    ids = jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(m)]), jnp.int32)
    wts = jnp.asarray(rng.random((m, k)), jnp.float32)
    t13 = TiledInt4.from_compressed_tensors(w13.packed, w13.scale, pair_gate_up=True)
    t2 = TiledInt4.from_compressed_tensors(w2.packed, w2.scale)
    epilogues = []
    plain = K.grouped_int4_matmul_ref

    def spy(*a, epilogue="none", **kw):
        epilogues.append(epilogue)
        return plain(*a, epilogue=epilogue, **kw)

    monkeypatch.setattr(K, "grouped_int4_matmul_ref", spy)
    got = K.routed_experts_tiled(x, ids, wts, t13, t2, out_dtype=jnp.float32, split=split)
    assert epilogues == (["silu_mul", "none"] if split == 1 else ["none", "none"])
    assert rel(got, routed_experts_xla(x, ids, wts, w13, w2)) < 1e-5


def test_epilogue_errors():
    qa = random_stack(np.random.default_rng(6), 2, 512, 256)
    paired = TiledInt4.from_compressed_tensors(qa.packed, qa.scale, pair_gate_up=True)
    xg = K.to_chunks(jnp.zeros((8, 256), jnp.bfloat16), 64)
    te = jnp.asarray([0], jnp.int32)
    args = (xg, paired.packed, paired.scale, te)
    for fn in (K.grouped_int4_matmul_ref, K.grouped_int4_matmul):
        with pytest.raises(ValueError, match="token rows"):
            fn(*args, tokens_per_tile=8, epilogue="silu_mul")
        with pytest.raises(ValueError, match="epilogue must be"):
            fn(*args, tokens_per_tile=8, out_layout="tokens", epilogue="gelu")
    with pytest.raises(ValueError, match="split=2"):
        K.grouped_int4_matmul(*args, tokens_per_tile=8, out_layout="tokens", epilogue="silu_mul", split=2)
    narrow = (K.to_chunks(jnp.zeros((8, 256), jnp.bfloat16), 32),) + args[1:]
    for fn in (K.grouped_int4_matmul_ref, K.grouped_int4_matmul):
        with pytest.raises(ValueError, match="chunk 32"):
            fn(*narrow, tokens_per_tile=8, out_layout="tokens", epilogue="silu_mul")
    with pytest.raises(ValueError, match="fuse_silu"):
        prepare_for_kernels(tiny_model(), layout="planar", fuse_silu=True)


@pytest.mark.parametrize("n,chunk", [(8, 64), (32, 128)])
def test_epilogue_kernel_lowers_for_cuda(n, chunk):
    qa = random_stack(np.random.default_rng(n), 3, 512, 512)
    paired = TiledInt4.from_compressed_tensors(qa.packed, qa.scale, pair_gate_up=True)
    xg = jax.ShapeDtypeStruct((512 // chunk, 2 * n, chunk), jnp.bfloat16)
    te = jax.ShapeDtypeStruct((2,), jnp.int32)
    fn = functools.partial(K.grouped_int4_matmul, tokens_per_tile=n, out_layout="tokens", epilogue="silu_mul")
    lowered = jax.jit(fn).trace(xg, paired.packed, paired.scale, te)
    assert lowered.out_info.shape == (256 // chunk, 2 * n, chunk) and lowered.out_info.dtype == jnp.bfloat16
    assert MGPU_CALL in lowered.lower(lowering_platforms=("cuda",)).as_text()


def test_fused_silu_by_default():  # (a w2 the layout holds has F % 256 == 0, so 2F always pairs)
    assert prepare_for_kernels(tiny_model()).layers[1].mlp.w13.get_value().gate_up_block == 64
    assert prepare_for_kernels(tiny_model(), fuse_silu=False).layers[1].mlp.w13.get_value().gate_up_block == 0


def test_mma_in_flight_default_and_checks():
    assert K.default_mma_in_flight(1, 8, 64) is None and K.default_mma_in_flight(9, 8, 32) == 2
    assert K.default_mma_in_flight(9, 8, 64) == 1 and K.default_mma_in_flight(9, 8, 128) == 0
    rng = np.random.default_rng(0)
    w13_ct, w2_ct = random_stack(rng, 4, 512, 256), random_stack(rng, 4, 256, 256)
    w13, w2 = (TiledInt4.from_compressed_tensors(qa.packed, qa.scale) for qa in (w13_ct, w2_ct))
    x = jnp.asarray(rng.standard_normal((3, 256)), jnp.float32)  # not constant: a permuted feature would show
    ids = jnp.asarray([[0, 1], [2, 3], [1, 2]], jnp.int32)
    wts = jnp.asarray(rng.uniform(0.1, 1.0, (3, 2)), jnp.float32)
    for bad in (4, -1, "2"):
        with pytest.raises(ValueError, match="mma_in_flight"):
            routed_experts_tiled(x, ids, wts, w13, w2, mma_in_flight=bad)
    with pytest.raises(ValueError, match="chunk=48"):
        routed_experts_tiled(x, ids, wts, w13, w2, chunk=48)
    want = routed_experts_xla(x, ids, wts, w13_ct, w2_ct)
    for chunk in (32, 64, 128):
        assert rel(routed_experts_tiled(x, ids, wts, w13, w2, chunk=chunk), want) < 1e-5, chunk


def test_prepared_model_with_fused_silu_matches_unprepared():
    tokens = np.random.default_rng(0).integers(0, 256, (3, 11))
    model = tiny_model()
    fused = prepare_for_kernels(nnx.clone(model), fuse_silu=True)
    assert fused.layers[1].mlp.w13.get_value().gate_up_block == 64
    assert fused.layers[1].mlp.w2.get_value().gate_up_block == 0
    assert rel_norm(forward(fused, tokens), forward(model, tokens)) < 1e-5
    undone = unprepare_for_kernels(fused)
    w13 = undone.layers[1].mlp.w13.get_value()
    np.testing.assert_array_equal(np.asarray(w13.packed), np.asarray(model.layers[1].mlp.w13.get_value().packed))


@pytest.mark.gpu
@pytest.mark.parametrize("n,chunk", [(8, 64), (16, 128), (64, 64)])
def test_gpu_epilogue_kernel_matches_twin(n, chunk):
    rng = np.random.default_rng(n)
    qa = random_stack(rng, 5, 512, 1024)
    paired = TiledInt4.from_compressed_tensors(qa.packed, qa.scale, pair_gate_up=True)
    te = jnp.asarray([4, 0, -1, 4, 2], jnp.int32)
    xg = K.to_chunks(jnp.asarray(rng.standard_normal((te.shape[0] * n, 1024)), jnp.bfloat16), chunk)
    kw = dict(tokens_per_tile=n, out_layout="tokens", epilogue="silu_mul")
    got = np.asarray(jax.jit(functools.partial(K.grouped_int4_matmul, **kw))(xg, paired.packed, paired.scale, te),
                     np.float32)
    want = np.asarray(K.grouped_int4_matmul_ref(xg, paired.packed, paired.scale, te, **kw), np.float32)
    assert got.shape == (256 // chunk, te.shape[0] * n, chunk)
    got, want = (np.swapaxes(a, 0, 1).reshape(te.shape[0] * n, 256) for a in (got, want))
    valid = np.repeat(np.asarray(te) >= 0, n)
    assert np.isfinite(got[valid]).all()
    assert rel_norm(got[valid], want[valid]) < 1e-2  # both round h to bf16; the f32 sums differ in order


@pytest.mark.gpu
def test_gpu_model_with_fused_silu_matches_twin():
    model = tiny_model(dtype="bfloat16", n_routed_experts=16, num_experts_per_tok=4, num_layers=3)
    prepared = prepare_for_kernels(nnx.clone(model), fuse_silu=True)
    toks = np.random.default_rng(5).integers(0, 256, (2, 33))
    kernel = forward(prepared, toks).astype(jnp.float32)
    twin = forward(prepared, toks, Runtime(routed_fn=functools.partial(
        K.routed_experts_tiled, out_dtype=jnp.float32, use_kernel=False))).astype(jnp.float32)
    assert bool(jnp.all(jnp.isfinite(kernel)))
    assert rel_norm(kernel, twin) < 2e-2 and rel_norm(kernel, forward(model, toks).astype(jnp.float32)) < 2e-2
