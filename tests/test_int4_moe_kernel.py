"""INT4 routed-experts kernel (pallas_kernels/int4_moe.py): repack, XLA twin, interpret-mode kernel, GPU parity.

Letters: M tokens, K top-k, E experts, D model, F expert FFN. The reference is a plain float64 numpy MoE on
weights dequantised with ddtree_jax.quant.dequantize_int4 from the compressed-tensors layout.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.quant import dequantize_int4, pack_int4
from pallas_kernels.int4_moe import (Int4ExpertWeights, PlanarInt4, _default_split, _dequant_planar, _kernel_tiling,
                                     default_tile, int4_moe, int4_moe_ref, routed_experts)


K26_DIMS = (384, 7168, 2048, 8)  # experts, d_model, d_ff, top-k


def k26_abstract_weights() -> Int4ExpertWeights:
    """K2.6's routed-expert stacks as shapes only, for tests that trace or lower the kernels without running them."""
    e, d, f, _ = K26_DIMS
    sd = jax.ShapeDtypeStruct
    return Int4ExpertWeights(w13=sd((e, 2 * f, d // 8), jnp.int32), w13_scale=sd((e, d // 32, 2 * f), jnp.bfloat16),
                             w2=sd((e, d, f // 8), jnp.int32), w2_scale=sd((e, f // 32, d), jnp.bfloat16))


def make_ct(e, d, f, seed=0, group=32):
    """Random compressed-tensors expert weights: (w13_packed, w13_scale, w2_packed, w2_scale)."""
    r = np.random.default_rng(seed)
    q13 = r.integers(-8, 8, (e, 2 * f, d))
    q2 = r.integers(-8, 8, (e, d, f))
    s13 = jnp.asarray(r.uniform(0.01, 0.03, (e, 2 * f, d // group)), jnp.bfloat16)
    s2 = jnp.asarray(r.uniform(0.01, 0.03, (e, d, f // group)), jnp.bfloat16)
    return pack_int4(q13), np.asarray(s13), pack_int4(q2), np.asarray(s2)


def dense_moe(x, ids, w, ct):
    """float64 numpy y [M, D] = sum_k w[m,k] * W2_e (silu(Wg_e x) * (Wu_e x))."""
    w13 = np.asarray(dequantize_int4(ct[0], jnp.asarray(ct[1], jnp.float32)), np.float64)
    w2 = np.asarray(dequantize_int4(ct[2], jnp.asarray(ct[3], jnp.float32)), np.float64)
    f = w13.shape[1] // 2
    x = np.asarray(x, np.float64)
    y = np.zeros((x.shape[0], w2.shape[1]))
    for m in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = ids[m, k]
            gu = w13[e] @ x[m]
            g, u = gu[:f], gu[f:]
            y[m] += w[m, k] * (w2[e] @ (g / (1 + np.exp(-g)) * u))
    return y


def make_routing(m, k, e, seed, skew=False):
    """Distinct top-k expert ids per token. skew=True: tokens crowd onto experts 0..k (some get none)."""
    r = np.random.default_rng(seed)
    if skew:
        p = np.array([1.0 / (i + 1) ** 3 for i in range(e)])
        p[e // 2:] = 0.0  # the upper half of the experts never gets a token
        ids = np.stack([r.choice(e, k, replace=False, p=p / p.sum()) for _ in range(m)])
    else:
        ids = np.stack([r.choice(e, k, replace=False) for _ in range(m)])
    w = r.uniform(0.1, 1.0, (m, k)).astype(np.float32)
    return ids.astype(np.int32), w


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


TINY = (8, 64, 32)  # E, D, F: the tiny test config (planar blocks of 8 / 4 words)
KSHAPE = (4, 256, 256)  # kernel test shape with the production block of 32 words (one group per plane)


@pytest.fixture(scope="module")
def tiny():
    ct = make_ct(*TINY, seed=0)
    return ct, Int4ExpertWeights.from_compressed_tensors(*ct)


@pytest.fixture(scope="module")
def kshape():
    ct = make_ct(*KSHAPE, seed=1)
    return ct, Int4ExpertWeights.from_compressed_tensors(*ct)


@pytest.mark.parametrize("shape", [TINY, KSHAPE, (2, 512, 512)])
def test_repack_roundtrip_bit_exact(shape):
    ct = make_ct(*shape, seed=3)
    wts = Int4ExpertWeights.from_compressed_tensors(*ct)
    back = wts.to_compressed_tensors()
    for a, b in zip(ct, back):
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))
    # the planar layout dequantises to exactly the compressed-tensors weights
    e = shape[0] - 1
    got = _dequant_planar(wts.w13[e], wts.w13_scale[e], wts.w13_block_words, jnp.float32)[wts._w13_row_inverse()]
    want = dequantize_int4(ct[0][e], jnp.asarray(ct[1][e], jnp.float32))
    assert np.array_equal(np.asarray(got), np.asarray(want))
    got2 = _dequant_planar(wts.w2[e], wts.w2_scale[e], wts.w2_block_words, jnp.float32)
    want2 = dequantize_int4(ct[2][e], jnp.asarray(ct[3][e], jnp.float32))
    assert np.array_equal(np.asarray(got2), np.asarray(want2))


def test_weights_are_a_pytree(tiny):
    _, wts = tiny
    leaves, tdef = jax.tree_util.tree_flatten(wts)
    assert len(leaves) == 4
    again = jax.tree_util.tree_unflatten(tdef, leaves)
    assert again.w13_block_words == wts.w13_block_words and again.group_size == 32


@pytest.mark.parametrize("m", [1, 3, 17, 64])
@pytest.mark.parametrize("skew", [False, True])
def test_twin_matches_dense(tiny, m, skew):
    ct, wts = tiny
    ids, w = make_routing(m, 2, TINY[0], seed=m, skew=skew)
    x = np.random.default_rng(m).standard_normal((m, TINY[1])).astype(np.float32)
    y = jax.jit(int4_moe_ref)(jnp.asarray(x), jnp.asarray(ids), jnp.asarray(w), wts)
    assert y.dtype == jnp.float32 and y.shape == (m, TINY[1])
    assert rel(y, dense_moe(x, ids, w, ct)) < 1e-5


def test_twin_bf16_and_tile_sizes(tiny):
    ct, wts = tiny
    m = 33
    ids, w = make_routing(m, 4, TINY[0], seed=11, skew=True)
    x = np.random.default_rng(0).standard_normal((m, TINY[1])).astype(np.float32)
    ref = dense_moe(x, ids, w, ct)
    for t in (1, 8, 64):
        y = jax.jit(functools.partial(int4_moe_ref, tile=t))(jnp.asarray(x), jnp.asarray(ids), jnp.asarray(w), wts)
        assert rel(y, ref) < 1e-5
    yb = jax.jit(int4_moe_ref)(jnp.asarray(x, jnp.bfloat16), jnp.asarray(ids), jnp.asarray(w), wts)
    assert yb.dtype == jnp.bfloat16
    assert rel(yb.astype(jnp.float32), ref) < 2e-2


def test_dispatcher_takes_the_twin_on_cpu_and_the_kernel_for_cuda(kshape):
    """bf16 tokens and weights the kernel tiles: the one case that dispatches per platform (f32 or untileable weights
    take the twin everywhere). On the CPU the result is the twin's, bit for bit; lowered for CUDA, the kernel."""
    _, wts = kshape
    ids, w = make_routing(5, 2, KSHAPE[0], seed=2)
    args = (jnp.asarray(np.random.default_rng(2).standard_normal((5, KSHAPE[1])), jnp.bfloat16), jnp.asarray(ids),
            jnp.asarray(w), wts)
    dispatch = jax.jit(routed_experts)
    assert "triton" in dispatch.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    if jax.default_backend() == "gpu":
        pytest.skip("the CPU half of the dispatch test")
    cpu_text = dispatch.lower(*args).as_text()
    assert "triton" not in cpu_text
    np.testing.assert_array_equal(np.asarray(dispatch(*args)), np.asarray(jax.jit(int4_moe_ref)(*args)))


def test_entry_points_refuse_token_inputs_that_do_not_match():
    """x's width against the weights', expert_ids' rows against x's, expert_weights' shape against expert_ids': a
    ValueError naming the mismatch at the twin, the kernel and the dispatcher (the kernel would read past D, or
    the routing clamp a missing weight)."""
    ct = make_ct(*KSHAPE, seed=1)
    wts = Int4ExpertWeights.from_compressed_tensors(*ct)
    ids, w = make_routing(3, 2, KSHAPE[0], seed=5)
    x = jnp.zeros((3, KSHAPE[1]), jnp.float32)
    cases = [((jnp.zeros((3, 128), jnp.float32), ids, w), "x must be \\[M, D\\] with D = d_model = 256"),
             ((x, np.concatenate([ids, ids]), np.concatenate([w, w])), "expert_ids must be integers \\[M, K\\]"),
             ((x, ids.astype(np.float32), w), "expert_ids must be integers"),
             ((x, ids, w[:, :1]), "expert_weights must be \\[M, K\\] = \\(3, 2\\)")]
    for (xx, ii, ww), match in cases:
        for fn in (int4_moe_ref, functools.partial(int4_moe, interpret=True), routed_experts):
            with pytest.raises(ValueError, match=match):
                fn(xx, jnp.asarray(ii), jnp.asarray(ww), wts)


def test_entry_points_refuse_tiling_the_weights_do_not_divide(kshape):
    """Row blocks that do not divide F or D, split-K factors that do not divide the 256-column block counts, an
    unknown design: a ValueError at the kernel and at the twin, which checks the kernel's tuning as the kernel does."""
    _, wts = kshape
    ids, w = make_routing(3, 2, KSHAPE[0], seed=5)
    args = (jnp.zeros((3, KSHAPE[1]), jnp.float32), jnp.asarray(ids), jnp.asarray(w), wts)
    cases = [(dict(block_n1=96), "block_n1=96 must divide F=256"), (dict(block_n2=96), "block_n2=96 must divide D"),
             (dict(split1=3), "split1=3"), (dict(split2=2), "split2=2"), (dict(design="fused"), "unknown design")]
    for fn in (int4_moe_ref, functools.partial(int4_moe, interpret=True)):
        for tuning, match in cases:
            with pytest.raises(ValueError, match=match):
                fn(*args, **tuning)
    with pytest.raises(ValueError, match="dequant='asm' needs a GPU"):  # inline PTX cannot be interpreted
        int4_moe(*args, interpret=True, dequant="asm")


@pytest.mark.parametrize("m,k,e", [(1, 8, 384), (3, 2, 8), (17, 2, 8), (64, 8, 384), (300, 8, 384), (1000, 8, 16),
                                   (5, 4, 4), (40, 1, 2)])
def test_default_tile_is_mean_pairs_per_busy_expert_rounded_up_to_a_power_of_two(m, k, e):
    """T = the smallest power of two >= the mean pairs per busy expert (M*K / min(E, M*K)), clipped to
    [smallest, largest]; checked against the definition for several bounds (no golden tile)."""
    mean = m * k / min(e, m * k)
    for lo, hi in ((16, 64), (1, 64), (1, 1024), (4, 8)):
        t = default_tile(m, k, e, smallest=lo, largest=hi)
        assert isinstance(t, int) and t & (t - 1) == 0 and lo <= t <= hi, (t, lo, hi)
        if t < hi:
            assert t >= mean, (t, mean)
        if t > lo:
            assert t < 2 * mean, (t, mean)


def test_default_split_k_is_the_smallest_divisor_reaching_528_programs():
    """``_default_split(programs, nblk)``: the smallest divisor s of the K-block count with programs * s >= 528 (4
    programs per SM), or the whole block count when no divisor gets there; brute force over a grid that includes
    exact hits (264 programs x 2 = 528)."""
    for nblk in (1, 2, 4, 7, 12, 28):
        divisors = [s for s in range(1, nblk + 1) if nblk % s == 0]
        for programs in range(1, 600):
            enough = [s for s in divisors if programs * s >= 528]
            assert _default_split(programs, nblk) == (enough[0] if enough else nblk), (programs, nblk)


@pytest.mark.parametrize("m", [1, 3, 64, 300])
def test_default_split_counts_only_tiles_that_can_have_work(m):
    """At K2.6 dims (E=384, D=7168, F=2048, top-8) the default split-K factors come from the programs of the
    min(E, M*K) tiles that can have work (not all E experts): e.g. one decode token has 8 busy tiles x 32 row blocks,
    too few for 528 programs, so kernel 1 splits its 28 K-blocks. The tile is ``default_tile`` unless one is given."""
    e, d, f, k = K26_DIMS
    wts = k26_abstract_weights()
    t, bn1, bn2, s1, s2 = _kernel_tiling(m, k, wts, None, 64, 64, None, None, "planes", None, "")
    assert t == default_tile(m, k, e) and _kernel_tiling(m, k, wts, 8, 64, 64, None, None, "planes", None, "")[0] == 8
    busy = min(e, m * k)
    for programs, nblk, s in ((busy * (f // bn1), d // 256, s1), (busy * (d // bn2), f // 256, s2)):
        assert _default_split(programs, nblk) == s, (programs, nblk, s)
    if m == 1:
        assert s1 > 1  # a decode token's gate/up GEMM is split-K


def test_planar_leaves_roundtrip_and_dequantize_bit_exact():
    """Each stack alone (the model's leaves): f32 scales keep their dtype, rows dequantise in natural order."""
    ct = make_ct(3, 256, 128, seed=4)
    s13 = jnp.asarray(ct[1], jnp.float32) * 1.0001  # not bf16-representable: a cast would show
    for packed, scale, gate_up in ((ct[0], s13, True), (ct[2], ct[3], False)):
        leaf = PlanarInt4.from_compressed_tensors(packed, scale, gate_up=gate_up)
        assert leaf.shape == (3, packed.shape[1], packed.shape[2] * 8) and leaf.scale.dtype == jnp.asarray(scale).dtype
        back_p, back_s = leaf.to_compressed_tensors()
        assert np.array_equal(np.asarray(back_p), np.asarray(packed))
        assert back_s.dtype == jnp.asarray(scale).dtype and np.array_equal(np.asarray(back_s), np.asarray(scale))
        want = dequantize_int4(packed[2], jnp.asarray(scale)[2], jnp.float32)
        assert np.array_equal(np.asarray(leaf.dequantize_expert(2, jnp.float32)), np.asarray(want))
    w = Int4ExpertWeights.from_compressed_tensors(*ct)
    again = Int4ExpertWeights.from_leaves(*w.leaves())
    assert all(a is b for a, b in zip(jax.tree.leaves(w), jax.tree.leaves(again)))


def test_repack_refuses_bad_shapes():
    ct = make_ct(2, 64, 32, seed=5)
    with pytest.raises(ValueError, match="int32"):
        PlanarInt4.from_compressed_tensors(np.asarray(ct[0], np.float32), ct[1], gate_up=True)
    with pytest.raises(ValueError, match="scale groups"):
        PlanarInt4.from_compressed_tensors(ct[0], np.concatenate([ct[1], ct[1][..., :1]], -1), gate_up=True)
    a = PlanarInt4.from_compressed_tensors(ct[0], ct[1], gate_up=True)
    with pytest.raises(ValueError, match="not one layer's"):
        Int4ExpertWeights.from_leaves(a, a)


def test_repack_and_layer_refuse_each_stack_they_cannot_hold():
    """Each check of ``PlanarInt4.from_compressed_tensors`` and ``Int4ExpertWeights.from_leaves`` alone (the rest
    of the input valid), the group size a stack reports, and the twin refusing a probe."""
    ct = make_ct(2, 64, 32, seed=5)  # w13 [2, 64, 64/8], 2 groups a row; w2 [2, 64, 32/8], 1 group
    with pytest.raises(ValueError, match="does not match packed"):
        PlanarInt4.from_compressed_tensors(ct[0], ct[1][:, :32], gate_up=True)
    with pytest.raises(ValueError, match="group_size 4 is not a multiple of 8"):
        PlanarInt4.from_compressed_tensors(ct[0], np.repeat(ct[1], 8, -1), gate_up=True)
    with pytest.raises(ValueError, match="even row count, got 63"):
        PlanarInt4.from_compressed_tensors(ct[0][:, :63], ct[1][:, :63], gate_up=True)
    w13 = PlanarInt4.from_compressed_tensors(ct[0], ct[1], gate_up=True)
    w2 = PlanarInt4.from_compressed_tensors(ct[2], ct[3], gate_up=False)
    w2_16 = PlanarInt4.from_compressed_tensors(ct[2], np.repeat(ct[3], 2, -1), gate_up=False)
    assert (w13.group_size, w2.group_size, w2_16.group_size) == (32, 32, 16)
    layer = Int4ExpertWeights.from_leaves(w13, w2)
    assert (layer.group_size, layer.w13_block_words, layer.w2_block_words) == (32, w13.block_words, w2.block_words)
    with pytest.raises(TypeError, match="expected two PlanarInt4 stacks"):
        Int4ExpertWeights.from_leaves(w13, (w2.packed, w2.scale))
    unpaired = PlanarInt4(w13.packed, w13.scale, w13.block_words, 0)
    other_blocks = PlanarInt4(w13.packed, w13.scale, w13.block_words, 2 * w13.row_block_words)
    paired_w2 = PlanarInt4(w2.packed, w2.scale, w2.block_words, w2.block_words)
    assert w2_16.block_words == w13.row_block_words  # only the group size differs
    for a, b in ((unpaired, w2), (other_blocks, w2), (w13, paired_w2), (w13, w2_16), (w13, w13)):
        with pytest.raises(ValueError, match="not one layer's"):
            Int4ExpertWeights.from_leaves(a, b)
    x, ids, wts = jnp.ones((3, 64), jnp.float32), jnp.zeros((3, 1), jnp.int32), jnp.ones((3, 1), jnp.float32)
    with pytest.raises(ValueError, match="the twin has none"):
        int4_moe_ref(x, ids, wts, layer, probe="dq_once")


@pytest.mark.parametrize("offset", [0, 3, 6])
def test_expert_offset_keeps_only_local_experts(offset):
    """Weights of experts offset..offset+3 only: pairs routed elsewhere add nothing (twin and kernel)."""
    ct = make_ct(*TINY, seed=6)
    ids, w = make_routing(9, 3, TINY[0], seed=offset)
    x = np.random.default_rng(offset).standard_normal((9, TINY[1])).astype(np.float32)
    lo, hi = offset, min(offset + 3, TINY[0])
    local = Int4ExpertWeights.from_compressed_tensors(*(a[lo:hi] for a in ct))
    w_local = np.where((ids >= lo) & (ids < hi), w, 0.0).astype(np.float32)
    ref = dense_moe(x, ids, w_local, ct)
    args = (jnp.asarray(x), jnp.asarray(ids), jnp.asarray(w), local)
    y = jax.jit(functools.partial(int4_moe_ref, out_dtype=jnp.float32))(*args, expert_offset=jnp.int32(offset))
    assert rel(y, ref) < 1e-5
    yk = int4_moe(*args, interpret=True, expert_offset=offset, tile=4)
    assert rel(yk, ref) < 1e-5


# --- interpret-mode kernel vs twin (CPU) -------------------------------------------------------------
@pytest.mark.parametrize("mode,m,skew,design", [("magic", 1, False, "planes"), ("int", 5, True, "join")])
def test_kernel_interpret_matches_twin(kshape, mode, m, skew, design):
    ct, wts = kshape
    ids, w = make_routing(m, 2, KSHAPE[0], seed=20 + m, skew=skew)
    x = jnp.asarray(np.random.default_rng(m).standard_normal((m, KSHAPE[1])), jnp.float32)
    y = int4_moe(x, jnp.asarray(ids), jnp.asarray(w), wts, interpret=True, dequant=mode, block_n1=128,
                 block_n2=128, design=design)
    twin = jax.jit(int4_moe_ref)(x, jnp.asarray(ids), jnp.asarray(w), wts)
    assert rel(y, twin) < 1e-5
    assert rel(y, dense_moe(np.asarray(x), ids, w, ct)) < 1e-5


def test_kernel_interpret_split_k_and_tiny_blocks(tiny):
    ct, wts = tiny  # planar blocks of 8 (w13) and 4 (w2) words: several nibble planes share one scale group
    m = 6
    ids, w = make_routing(m, 2, TINY[0], seed=7, skew=True)
    x = jnp.asarray(np.random.default_rng(7).standard_normal((m, TINY[1])), jnp.float32)
    for design in ("planes", "join"):
        y = int4_moe(x, jnp.asarray(ids), jnp.asarray(w), wts, interpret=True, tile=4, split1=1, split2=1,
                     design=design)
        assert rel(y, dense_moe(np.asarray(x), ids, w, ct)) < 1e-5, design
    ct2 = make_ct(2, 512, 512, seed=9)
    w2 = Int4ExpertWeights.from_compressed_tensors(*ct2)
    ids2, rw2 = make_routing(3, 1, 2, seed=9)
    x2 = jnp.asarray(np.random.default_rng(9).standard_normal((3, 512)), jnp.float32)
    y2 = int4_moe(x2, jnp.asarray(ids2), jnp.asarray(rw2), w2, interpret=True, split1=2, split2=2,
                  block_n1=256, block_n2=512, design="join")
    assert rel(y2, dense_moe(np.asarray(x2), ids2, rw2, ct2)) < 1e-5


def dense_moe_bf16(x, ids, w, ct, round_w):
    """float64 numpy y [M, D] of the bf16 kernel's arithmetic: h = silu(g) * u rounded to bf16 (the module's stated
    rounding of the intermediate), weights exact (``round_w=False``, design "planes": f32 post-scaling) or each
    dequantised weight q * scale rounded to bf16 (``round_w=True``, design "join": planes scaled in bf16)."""
    def deq(packed, scale):
        wd = np.asarray(dequantize_int4(packed, jnp.asarray(scale, jnp.float32)), np.float64)
        return np.asarray(jnp.asarray(wd, jnp.bfloat16), np.float64) if round_w else wd

    w13, w2 = deq(ct[0], ct[1]), deq(ct[2], ct[3])
    f = w13.shape[1] // 2
    x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    y = np.zeros((x.shape[0], w2.shape[1]))
    for m in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = ids[m, k]
            gu = w13[e] @ x[m]
            h = np.asarray(jnp.asarray(gu[:f] / (1 + np.exp(-gu[:f])) * gu[f:], jnp.bfloat16), np.float64)
            y[m] += w[m, k] * (w2[e] @ h)
    return y


@pytest.mark.parametrize("design", ["planes", "join"])
def test_kernel_interpret_bf16_split_k_matches_bf16_reference(design):
    """bf16 tokens through the kernel with split-K in both GEMMs: the split partial sums stay f32 (only h is rounded
    to bf16, as the one-pass epilogue does), "join" scales its planes in bf16 while "planes" post-scales in f32, so
    y (out_dtype f32) equals a float64 evaluation with exactly those roundings to ~1e-7 (a wrong rounding shows at
    ~3e-3); the default out_dtype is x's, the same values cast once at the end."""
    ct = make_ct(2, 512, 512, seed=12)
    wts = Int4ExpertWeights.from_compressed_tensors(*ct)
    ids, rw = make_routing(3, 2, 2, seed=12)
    x = jnp.asarray(np.random.default_rng(12).standard_normal((3, 512)), jnp.bfloat16)
    run = functools.partial(int4_moe, x, jnp.asarray(ids), jnp.asarray(rw), wts, interpret=True, split1=2, split2=2,
                            block_n1=256, block_n2=512, design=design)
    y32 = run(out_dtype=jnp.float32)
    assert y32.dtype == jnp.float32
    assert rel(y32, dense_moe_bf16(x, ids, rw, ct, round_w=design == "join")) < 1e-5
    y16 = run()
    assert y16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(y16, np.float32), np.asarray(y32.astype(jnp.bfloat16), np.float32))


def test_kernel_traffic_dtypes_at_k26_dims():
    """Traced (not run) at K2.6 dims for one bf16 decode token (default split-K 4 on the gate/up GEMM, none on down):
    kernel 1 writes f32 split-K partials of gate and up, the XLA epilogue hands h to kernel 2 in x's dtype (bf16,
    half the bytes of f32), and kernel 2 writes f32 rows."""
    e, d, f, k = K26_DIMS
    sd = jax.ShapeDtypeStruct
    wts = k26_abstract_weights()
    args = (sd((1, d), jnp.bfloat16), sd((1, k), jnp.int32), sd((1, k), jnp.float32), wts)
    jaxpr = jax.make_jaxpr(functools.partial(int4_moe, interpret=True))(*args).jaxpr
    calls = {q.params["name"]: q for q in jaxpr.eqns if q.primitive.name == "pallas_call"}
    gate_up, down = calls["int4_moe_gate_up"], calls["int4_moe_down"]
    split1 = gate_up.params["grid_mapping"].grid[2]
    assert split1 > 1
    [h_parts] = gate_up.params["out_avals"]
    assert h_parts.dtype == jnp.float32 and h_parts.shape[:3] == (split1, 2, f)
    x_t, h_t = gate_up.invars[1].aval, down.invars[2].aval
    assert x_t.dtype == jnp.bfloat16 and h_t.dtype == jnp.bfloat16 and h_t.shape == (f, x_t.shape[1])
    assert down.params["out_avals"][0].dtype == jnp.float32


# --- GPU parity at K2.6 shapes (skipped without a GPU) ---------------------------------------------------
def _k26_weights(seed=0, e=384, d=7168, f=2048):
    k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
    bits = lambda k, s: jax.lax.bitcast_convert_type(jax.random.bits(k, s, jnp.uint32), jnp.int32)
    return Int4ExpertWeights(
        w13=bits(k1, (e, 2 * f, d // 8)), w2=bits(k2, (e, d, f // 8)),
        w13_scale=jax.random.uniform(k3, (e, d // 32, 2 * f), jnp.float32, 0.01, 0.03).astype(jnp.bfloat16),
        w2_scale=jax.random.uniform(k4, (e, f // 32, d), jnp.float32, 0.01, 0.03).astype(jnp.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("m,skew", [(1, False), (9, True), (90, False), (300, True)])
def test_gpu_kernel_matches_twin_k26(m, skew):
    wts = _k26_weights()
    ids, w = make_routing(m, 8, 384, seed=m, skew=skew)
    x = jax.random.normal(jax.random.key(m), (m, 7168), jnp.bfloat16)
    twin = jax.jit(int4_moe_ref)(x, jnp.asarray(ids), jnp.asarray(w), wts)
    for design, mode in (("planes", "asm"), ("join", "asm"), ("planes", "magic")):
        fn = jax.jit(functools.partial(int4_moe, dequant=mode, design=design))
        y = fn(x, jnp.asarray(ids), jnp.asarray(w), wts)
        assert y.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(y.astype(jnp.float32))))
        assert rel(y.astype(jnp.float32), twin.astype(jnp.float32)) < 1e-2, (design, mode)
    yd = jax.jit(routed_experts)(x, jnp.asarray(ids), jnp.asarray(w), wts)
    assert rel(yd.astype(jnp.float32), twin.astype(jnp.float32)) < 1e-2


@pytest.mark.gpu
def test_gpu_kernel_matches_dense_f32_one_token():
    """M=1 at K2.6 dims against an f32 dense evaluation of the 8 routed experts (dequantised in XLA)."""
    wts = _k26_weights(seed=1)
    ids, w = make_routing(1, 8, 384, seed=1)
    x = jax.random.normal(jax.random.key(1), (1, 7168), jnp.bfloat16)
    y = jax.jit(int4_moe)(x, jnp.asarray(ids), jnp.asarray(w), wts)
    xf = x.astype(jnp.float32)[0]
    ref = jnp.zeros((7168,), jnp.float32)
    for k in range(8):
        e = int(ids[0, k])
        w13 = _dequant_planar(wts.w13[e], wts.w13_scale[e], 32, jnp.float32)[wts._w13_row_inverse()]
        w2 = _dequant_planar(wts.w2[e], wts.w2_scale[e], 32, jnp.float32)
        gu = jnp.dot(w13, xf, precision="highest")
        h = (jax.nn.silu(gu[:2048]) * gu[2048:]).astype(jnp.bfloat16).astype(jnp.float32)
        ref = ref + w[0, k] * jnp.dot(w2, h, precision="highest")
    assert rel(y[0].astype(jnp.float32), ref) < 1e-2


@pytest.mark.parametrize("design,m", [("planes", 1), ("planes", 300), ("join", 9)])
def test_kernel_lowers_for_cuda_on_cpu(design, m, monkeypatch):
    """Triton lowering at K2.6 dims without a GPU, with MLIR verification of each Triton module."""
    from jax._src.pallas.triton import pallas_call_registration as reg

    lower = reg.lowering.lower_jaxpr_to_triton_module
    names = []

    def verified(*a, **k):
        res = lower(*a, **k)
        with res.module.context:
            res.module.operation.verify()
        names.append(res.module.operation.attributes["sym_name"])
        return res

    monkeypatch.setattr(reg.lowering, "lower_jaxpr_to_triton_module", verified)
    e, d, f, k = K26_DIMS
    sd = jax.ShapeDtypeStruct
    wts = k26_abstract_weights()
    args = (sd((m, d), jnp.bfloat16), sd((m, k), jnp.int32), sd((m, k), jnp.float32), wts)
    text = jax.jit(functools.partial(int4_moe, design=design)).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "stablehlo.while" not in text  # routing metadata has no host-synchronising loop
    assert len(names) == 2
