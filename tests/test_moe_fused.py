"""The one-launch routed experts for one token (``pallas_kernels.int4_moe_fused``).

On CPU: the twin's partials against a NumPy reference built from the compressed-tensors weights, the layer
with launch="one" against launch="two", lowering for CUDA, errors. On a Hopper GPU: kernel == twin, and the
layer's two launches agree.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.moe import TiledInt4
from ddtree_jax.quant import dequantize_int4
from pallas_kernels import int4_moe_fused as FU
from pallas_kernels import int4_moe_mgpu as K
from pallas_kernels.moe_routing import route_per_pair
from tests.test_moe_kernel_model import rel_norm
from tests.test_moe_tiled import MGPU_CALL, random_stack

E, D, F, TOPK = 8, 512, 256, 4


def stacks(rng, e=E, d=D, f=F):
    w13, w2 = random_stack(rng, e, 2 * f, d), random_stack(rng, e, d, f)
    t13 = TiledInt4.from_compressed_tensors(w13.packed, w13.scale, pair_gate_up=True)
    t2 = TiledInt4.from_compressed_tensors(w2.packed, w2.scale)
    return w13, w2, t13, t2


@pytest.fixture(scope="module")
def cpu_stacks():  # the CPU tests' experts, quantized and repacked once (seconds each time)
    return stacks(np.random.default_rng(0))


def fused_inputs(rng, m, e=E, d=D, f=F, k=TOPK, n=8, made=None):
    w13, w2, t13, t2 = made or stacks(rng, e, d, f)
    x = jnp.asarray(rng.standard_normal((m, d)), jnp.bfloat16)
    ids = jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(m)]), jnp.int32)
    row_token, tile_expert, _ = route_per_pair(ids, e, n)
    xs = K.gather_token_chunks(x, row_token, 128)
    return (w13, w2), x, ids, (xs, t13.packed, t13.scale, t2.packed, t2.scale, tile_expert)


def test_twin_partials_match_numpy(cpu_stacks):
    """partial[b, t] = W2[e_t][:, 64b:64b+64] h_t[64b:64b+64], h_t = silu(gate) * up (rounded to bf16) of
    the tile's first row, from the compressed-tensors weights; skipped tiles (expert -1) are zero."""
    rng = np.random.default_rng(0)
    (w13, w2), x, ids, args = fused_inputs(rng, m=2, made=cpu_stacks)
    tile_expert = args[-1].at[3].set(-1)
    got = np.asarray(FU.fused_int4_moe_ref(*args[:-1], tile_expert, tokens_per_tile=8))
    assert got.shape == (F // 64, 2 * TOPK, D)
    dense13 = np.asarray(dequantize_int4(w13.packed, w13.scale, jnp.bfloat16).astype(jnp.float32))
    dense2 = np.asarray(dequantize_int4(w2.packed, w2.scale, jnp.bfloat16).astype(jnp.float32))
    xf = np.asarray(x.astype(jnp.float32))
    for t in range(2 * TOPK):
        e = int(tile_expert[t])
        if e < 0:
            assert not got[:, t].any()
            continue
        gu = dense13[e] @ xf[t // TOPK]
        gate, up = gu[:F], gu[F:]
        h = np.asarray(jnp.asarray(gate / (1 + np.exp(-gate)) * up).astype(jnp.bfloat16).astype(jnp.float32))
        want = np.stack([dense2[e][:, 64 * b:64 * b + 64] @ h[64 * b:64 * b + 64] for b in range(F // 64)])
        np.testing.assert_allclose(got[:, t], want, rtol=2e-2, atol=2e-2 * np.abs(want).max())


@pytest.mark.parametrize("offset", [3])  # experts held elsewhere (ids past the offset's share) are skipped
def test_one_launch_layer_equals_two_launches(offset, cpu_stacks):
    """The layer with launch="one" (partials summed by XLA) gives the two-launch layer's output up to the
    order of f32 sums before each expert's bf16 rounding."""
    rng = np.random.default_rng(1 + offset)
    _, _, t13, t2 = cpu_stacks
    x = jnp.asarray(rng.standard_normal((1, D)), jnp.bfloat16)
    ids = jnp.asarray(rng.choice(E + offset, TOPK, replace=False)[None], jnp.int32)
    wts = jnp.asarray(rng.random((1, TOPK)), jnp.float32)
    layer = jax.jit(functools.partial(K.routed_experts_tiled, out_dtype=jnp.float32, expert_offset=offset),
                    static_argnames=("launch",))
    two, one = layer(x, ids, wts, t13, t2, launch="two"), layer(x, ids, wts, t13, t2, launch="one")
    assert np.abs(np.asarray(two)).max() > 0
    assert rel_norm(one, two) < 4e-3


def test_one_launch_errors(cpu_stacks):
    w13, w2, t13, t2 = cpu_stacks
    x = jnp.zeros((3, D), jnp.bfloat16)
    ids, wts = jnp.zeros((3, TOPK), jnp.int32), jnp.ones((3, TOPK), jnp.float32)
    with pytest.raises(ValueError, match="per-pair tiles"):  # M = 3 groups its pairs by default
        K.routed_experts_tiled(x, ids, wts, t13, t2, launch="one")
    unpaired = TiledInt4.from_compressed_tensors(w13.packed, w13.scale)
    with pytest.raises(ValueError, match="paired"):
        K.routed_experts_tiled(x[:1], ids[:1], wts[:1], unpaired, t2, launch="one")
    with pytest.raises(ValueError, match="launch must be"):
        K.routed_experts_tiled(x[:1], ids[:1], wts[:1], t13, t2, launch="three")
    groups = TiledInt4.from_compressed_tensors(w2.packed, w2.scale, order="groups")
    xs = jnp.zeros((D // 128, 8 * TOPK, 128), jnp.bfloat16)
    te = jnp.zeros((TOPK,), jnp.int32)
    with pytest.raises(ValueError, match="fragments"):
        FU.fused_int4_moe_ref(xs, t13.packed, t13.scale, groups.packed, groups.scale, te, tokens_per_tile=8)
    with pytest.raises(ValueError, match="down_blocks must be"):
        FU.fused_int4_moe_ref(xs, t13.packed, t13.scale, t2.packed, t2.scale, te, tokens_per_tile=8, down_blocks=3)
    with pytest.raises(ValueError, match="shared memory"):
        FU.fused_int4_moe(xs, t13.packed, t13.scale, t2.packed, t2.scale, te, tokens_per_tile=8, stages=12)


@pytest.mark.parametrize("n,stages,down_blocks", [(8, 2, 4), (16, 3, 2), (8, 2, 8)])
def test_fused_kernel_lowers_for_cuda(n, stages, down_blocks):
    f, d, e, nt = 512, 1024, 3, 2
    w13 = jax.ShapeDtypeStruct((e, 2 * f // 128, d // 256 * 32, 128), jnp.int32)
    s13 = jax.ShapeDtypeStruct((e, 2 * f // 128, d // 32, 128), jnp.bfloat16)
    w2 = jax.ShapeDtypeStruct((e, d // 128, f // 256 * 32, 128), jnp.int32)
    s2 = jax.ShapeDtypeStruct((e, d // 128, f // 32, 128), jnp.bfloat16)
    x = jax.ShapeDtypeStruct((d // 128, nt * n, 128), jnp.bfloat16)
    te = jax.ShapeDtypeStruct((nt,), jnp.int32)
    fn = functools.partial(FU.fused_int4_moe, tokens_per_tile=n, stages=stages, down_blocks=down_blocks)
    lowered = jax.jit(fn).trace(x, w13, s13, w2, s2, te)
    assert lowered.out_info.shape == (f // 64, nt, d) and lowered.out_info.dtype == jnp.float32
    assert MGPU_CALL in lowered.lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("m,down_blocks", [(1, 4), (2, 2), (1, 8)])
def test_gpu_fused_kernel_matches_twin(m, down_blocks):
    rng = np.random.default_rng(10 + m)
    _, x, ids, args = fused_inputs(rng, m, e=16, d=1024, f=512, k=8)
    tile_expert = args[-1].at[1].set(-1)
    kernel = functools.partial(FU.fused_int4_moe, tokens_per_tile=8, down_blocks=down_blocks)
    got = np.asarray(jax.jit(kernel)(*args[:-1], tile_expert))
    want = np.asarray(FU.fused_int4_moe_ref(*args[:-1], tile_expert, tokens_per_tile=8))
    real = np.asarray(tile_expert) >= 0
    assert rel_norm(got[:, real], want[:, real]) < 1e-3


@pytest.mark.gpu
def test_gpu_one_launch_layer_matches_two():
    rng = np.random.default_rng(3)
    _, _, t13, t2 = stacks(rng, e=16, d=1024, f=512)
    x = jnp.asarray(rng.standard_normal((1, 1024)), jnp.bfloat16)
    ids = jnp.asarray(rng.choice(16, 8, replace=False)[None], jnp.int32)
    wts = jnp.asarray(rng.random((1, 8)), jnp.float32)
    layer = jax.jit(functools.partial(K.routed_experts_tiled, out_dtype=jnp.float32, use_kernel=True),
                    static_argnames=("launch",))
    assert rel_norm(layer(x, ids, wts, t13, t2, launch="one"), layer(x, ids, wts, t13, t2, launch="two")) < 4e-3
