"""The Mosaic GPU INT4 MoE kernel's layout ("tiles"), its pure-JAX twin, and the kernel in the model.

On CPU: the one-time repack (bit-exact both ways, the documented element placement), the twin against
a NumPy reference, the routed layer against the compressed-tensors XLA path, the prepared model
(forward, expert parallelism, greedy DDTree), lowering for CUDA (the kernel is in the program exactly
when it should be), errors. On a Hopper GPU: kernel == twin, and the prepared model on the kernel.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ddtree_jax.config import QuantConfig, tiny_config
from ddtree_jax.drafter import DFlashDrafter, tiny_drafter_config
from ddtree_jax.engine import Engine, EngineConfig
from ddtree_jax.memory_plan import array_bytes
from ddtree_jax.model import KimiModel, Runtime
from ddtree_jax.moe import (KERNEL_AXES, TiledInt4, prepare_for_kernels, routed_experts_tiled, routed_experts_xla,
                            unprepare_for_kernels)
from ddtree_jax.quant import dequantize_int4, quantize_array
from ddtree_jax.sharding import DEFAULT_RULES, make_mesh, param_shardings
from pallas_kernels import int4_moe_mgpu as K
from pallas_kernels import int4_tiles as TL
from tests.test_moe_kernel_model import _forward, forward, rel, rel_norm

TCFG = dict(hidden_size=256, moe_intermediate_size=256, quant=QuantConfig(group_size=32))


def random_stack(rng, e, o, i):
    w = rng.standard_normal((e, o, i)).astype(np.float32) * 0.05
    return quantize_array(jnp.asarray(w), 32)


@pytest.mark.parametrize("o,i", [(128, 256), (192, 512)])
def test_repack_is_bit_exact_and_places_elements_as_documented(o, i):
    rng = np.random.default_rng(0)
    qa = random_stack(rng, 3, o, i)
    leaf = TiledInt4.from_compressed_tensors(qa.packed, qa.scale, order="groups")
    rows = 128 if o % 128 == 0 else 64
    assert leaf.rows == rows and leaf.shape == (3, o, i) and leaf.packed.dtype == jnp.int4
    packed, scale = leaf.to_compressed_tensors()
    np.testing.assert_array_equal(np.asarray(packed), np.asarray(qa.packed))
    np.testing.assert_array_equal(np.asarray(scale).view(np.uint16), np.asarray(qa.scale).view(np.uint16))
    assert leaf.nbytes == array_bytes(leaf.packed.shape, leaf.packed.dtype) + leaf.scale.size * 2
    assert leaf.nbytes == qa.packed.size * 4 + qa.scale.size * 2
    # slab (e, b, k): element (j, c) <-> flat f = j*S + c = g*R*G + r*G + c'  ->  q[e, b*R + r, k*S + g*G + c']
    q = np.asarray(TL.unpack_compressed_tensors(qa.packed))
    w = np.asarray(leaf.packed.astype(jnp.int8))
    e, b, k = 2, o // rows - 1, i // K.STEP - 1
    slab = w[e, b, k * rows:(k + 1) * rows]
    j, c = np.meshgrid(np.arange(rows), np.arange(K.STEP), indexing="ij")
    f = j * K.STEP + c
    g, r, cc = f // (rows * K.GROUP), (f // K.GROUP) % rows, f % K.GROUP
    np.testing.assert_array_equal(slab, q[e, b * rows + r, k * K.STEP + g * K.GROUP + cc])
    s = np.asarray(leaf.scale, np.float32)
    np.testing.assert_array_equal(s[e, b, :, 5], np.asarray(qa.scale, np.float32)[e, b * rows + 5])
    for dtype in (jnp.float32, jnp.bfloat16):
        want = dequantize_int4(qa.packed[1], qa.scale[1], dtype)
        np.testing.assert_array_equal(np.asarray(leaf.dequantize_expert(1, dtype)), np.asarray(want))


def test_compressed_tensors_nibbles_roundtrip():
    q = jnp.asarray(np.random.default_rng(1).integers(-8, 8, (4, 64)), jnp.int8)
    packed = TL.pack_compressed_tensors(q)
    assert packed.dtype == jnp.int32 and packed.shape == (4, 8)
    u = (np.asarray(packed).view(np.uint32)[:, :, None] >> (4 * np.arange(8))) & 0xF
    np.testing.assert_array_equal(u.reshape(4, 64).astype(np.int32) - 8, np.asarray(q))
    np.testing.assert_array_equal(np.asarray(TL.unpack_compressed_tensors(packed)), np.asarray(q))


@pytest.mark.parametrize("n,rows,chunk", [(8, 64, 32), (16, 128, 64), (32, 64, 128)])
def test_twin_matches_numpy(n, rows, chunk):
    rng = np.random.default_rng(n)
    e, o, i = 4, 256, 512
    q = jnp.asarray(rng.integers(-8, 8, (e, o, i)), jnp.int8)
    sc = jnp.asarray(rng.uniform(0.01, 0.1, (e, o, i // 32)), jnp.bfloat16)
    w, s = TL.tile_weights(q, sc, rows)
    te = np.array([3, 0, -1, 3, 1], np.int32)
    x = jnp.asarray(rng.standard_normal((te.size * n, i)), jnp.bfloat16)
    out = np.asarray(K.grouped_int4_matmul_ref(K.to_chunks(x, chunk), w, s, jnp.asarray(te), tokens_per_tile=n))
    for t, ex in enumerate(te):
        cols = slice(t * n, (t + 1) * n)
        if ex < 0:
            assert not out[:, cols].any()
            continue
        deq = np.asarray(q[ex], np.float32).reshape(o, i // 32, 32) * np.asarray(sc[ex], np.float32)[:, :, None]
        deq = np.asarray(jnp.asarray(deq.reshape(o, i), jnp.bfloat16), np.float64)
        want = deq @ np.asarray(x[cols], np.float64).T
        np.testing.assert_allclose(out[:, cols], want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("m,k,offset", [(1, 2, 0), (5, 4, 0), (33, 2, 0), (9, 3, 4)])
def test_routed_layer_twin_equals_xla_path(m, k, offset):
    """Expert sums over sorted tiles == the per-expert XLA path on the compressed-tensors stacks; with an
    expert offset the stacks hold experts offset.. only (pairs routed elsewhere contribute nothing)."""
    rng = np.random.default_rng(m)
    e, d, f = 8, 256, 256
    w13, w2 = random_stack(rng, e, 2 * f, d), random_stack(rng, e, d, f)
    x = jnp.asarray(rng.standard_normal((m, d)), jnp.float32)
    ids = jnp.asarray(np.stack([rng.choice(e + offset, k, replace=False) for _ in range(m)]), jnp.int32)
    wts = jnp.asarray(rng.random((m, k)), jnp.float32)
    t13 = TiledInt4.from_compressed_tensors(w13.packed, w13.scale)
    t2 = TiledInt4.from_compressed_tensors(w2.packed, w2.scale)
    got = K.routed_experts_tiled(x, ids, wts, t13, t2, expert_offset=offset, out_dtype=jnp.float32)
    want = routed_experts_xla(x, ids, wts, w13, w2, expert_offset=offset)
    assert rel(got, want) < 1e-5
    assert rel(routed_experts_tiled(x, ids, wts, t13, t2, expert_offset=offset), want) < 1e-5


@pytest.mark.parametrize("m,offset", [(1, 0), (1, 3), (4, 0)])
def test_per_pair_tiles_and_word_gather_equal_the_grouped_layout(m, offset):
    """The layer on a tile per pair (the default at M = 1) and with the token rows gathered as uint32 words
    gives what the grouped layout and the element gather give, bit for bit (same rows, same products)."""
    rng = np.random.default_rng(7 + m)
    e, d, f, k = 8, 256, 256, 4
    w13, w2 = random_stack(rng, e, 2 * f, d), random_stack(rng, e, d, f)
    t13 = TiledInt4.from_compressed_tensors(w13.packed, w13.scale)
    t2 = TiledInt4.from_compressed_tensors(w2.packed, w2.scale)
    x = jnp.asarray(rng.standard_normal((m, d)), jnp.bfloat16)
    ids = jnp.asarray(rng.integers(0, e + offset, (m, k)), jnp.int32)
    wts = jnp.asarray(rng.random((m, k)), jnp.float32)
    layer = jax.jit(functools.partial(K.routed_experts_tiled, out_dtype=jnp.float32, expert_offset=offset),
                    static_argnames=("routing", "gather"))
    grouped = np.asarray(layer(x, ids, wts, t13, t2, routing="compare"))
    for routing, gather in (("per_pair", "elements"), ("per_pair", "words"), ("compare", "words")):
        np.testing.assert_array_equal(np.asarray(layer(x, ids, wts, t13, t2, routing=routing, gather=gather)),
                                      grouped, err_msg=f"{routing}, {gather}")
    want = routed_experts_xla(x.astype(jnp.float32), ids, wts, w13, w2, expert_offset=offset)
    assert rel(grouped, want) < 2e-2  # bf16 activations and h against the f32 path
    with pytest.raises(ValueError, match="one width"):
        K.routed_experts_tiled(x, ids, wts, t13, t2, routing="per_pair", widths="ragged")
    with pytest.raises(ValueError, match="routing must be"):
        K.routed_experts_tiled(x, ids, wts, t13, t2, routing="bitonic")
    with pytest.raises(ValueError, match="gather must be"):
        K.routed_experts_tiled(x, ids, wts, t13, t2, gather="bytes")
    with pytest.raises(ValueError, match=r"expert_weights must be \[M, K\]"):  # routing would clamp the lookups
        K.routed_experts_tiled(x, ids, wts[:, :1], t13, t2)
    with pytest.raises(ValueError, match=r"expert_ids must be integers \[M, K\] with M = "):
        K.routed_experts_tiled(x, jnp.concatenate([ids, ids]), jnp.concatenate([wts, wts]), t13, t2)


def tiny_model(seed=0, dtype="float32", **overrides):
    return KimiModel(tiny_config(dtype=dtype, **{**TCFG, **overrides}), nnx.Rngs(seed))


@pytest.fixture(scope="module")
def pair():
    model = tiny_model()
    return model, prepare_for_kernels(nnx.clone(model))


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(0).integers(0, 256, (3, 11))


def test_prepare_tiles_forward_and_undo(pair, tokens):
    model, prepared = pair
    moe = prepared.layers[1].mlp
    assert isinstance(moe.w13.get_value(), TiledInt4) and moe.w13.get_metadata()["logical_axes"] == KERNEL_AXES
    assert prepare_for_kernels(prepared) is prepared
    ref = forward(model, tokens)
    assert rel(forward(prepared, tokens), ref) < 1e-5
    np.testing.assert_array_equal(np.asarray(forward(prepared, tokens, Runtime(routed_fn=routed_experts_xla))),
                                  np.asarray(ref))
    back = unprepare_for_kernels(nnx.clone(prepared))
    for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(back))):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def test_expert_parallel_tiles_equal_unsharded(pair, tokens, host_devices):
    model, prepared = pair
    mesh = make_mesh(data=2, model=4, devices=host_devices)
    graphdef, state = nnx.split(prepared)
    sharded = jax.device_put(state, param_shardings(state, mesh, DEFAULT_RULES))
    w13 = sharded["layers"][1]["mlp"]["w13"].get_value()
    assert w13.packed.addressable_shards[0].data.shape[0] == model.cfg.n_routed_experts // 4
    got = forward(prepared, tokens, Runtime(mesh=mesh, rules=DEFAULT_RULES), state=sharded)
    assert rel(got, forward(model, tokens)) < 1e-5


def test_expert_parallel_tiles_tell_the_kernel_its_share(pair, tokens, monkeypatch, host_devices):
    """Under expert parallelism each device's call learns how many devices share the experts (its split-K
    default counts the busy experts one device can expect) and still computes the unsharded result."""
    model, prepared = pair
    mesh = make_mesh(data=2, model=4, devices=host_devices)
    seen, inner = [], K.routed_experts

    def spy(*args, **kwargs):
        seen.append(kwargs.get("expert_shards"))
        return inner(*args, **kwargs)

    monkeypatch.setattr(K, "routed_experts", spy)
    _, state = nnx.split(prepared)
    sharded = jax.device_put(state, param_shardings(state, mesh, DEFAULT_RULES))
    tokens = tokens[:, :6]  # shapes no other test compiles: the spy sees a fresh trace
    got = forward(prepared, tokens, Runtime(mesh=mesh, rules=DEFAULT_RULES), state=sharded)
    assert seen and set(seen) == {4}
    assert rel(got, forward(model, tokens)) < 1e-5
    seen.clear()
    forward(prepared, tokens[:1])  # unsharded: the default share
    assert seen and set(seen) == {None}


def test_default_tiles_pair_gate_up_rows_where_the_stack_allows():
    """fuse_silu None (default) stores w13 with gate and up rows paired in 64-row blocks (the kernel's fused
    SiLU epilogue) where 2F % 256 == 0, as here (2F = 512); False keeps them apart. Shapes only."""
    def gate_up_block(**kw):
        model = nnx.eval_shape(lambda: prepare_for_kernels(tiny_model(), **kw))
        return model.layers[1].mlp.w13.get_value().gate_up_block, model.layers[1].mlp.w2.get_value().gate_up_block

    assert gate_up_block() == (64, 0)
    assert gate_up_block(fuse_silu=False) == (0, 0)


def test_prepare_a_sharded_model_repacks_tiles_in_place(pair, host_devices):
    """A model already split over experts is repacked per device and stays split (never gathered)."""
    model, prepared = pair
    mesh = make_mesh(data=2, model=4, devices=host_devices)
    graphdef, state = nnx.split(nnx.clone(model))
    sharded = nnx.merge(graphdef, jax.device_put(state, param_shardings(state, mesh, DEFAULT_RULES)))
    prepare_for_kernels(sharded)
    leaf = sharded.layers[1].mlp.w2.get_value()
    assert leaf.packed.sharding.spec[0] == "model" and leaf.scale.sharding.spec[0] == "model"
    assert leaf.packed.addressable_shards[0].data.shape[0] == model.cfg.n_routed_experts // 4
    want = prepared.layers[1].mlp.w2.get_value()
    np.testing.assert_array_equal(np.asarray(leaf.packed.astype(jnp.int8)), np.asarray(want.packed.astype(jnp.int8)))
    back = unprepare_for_kernels(sharded).layers[1].mlp.w2.get_value()
    assert back.packed.sharding.spec[0] == "model"
    np.testing.assert_array_equal(np.asarray(back.packed), np.asarray(model.layers[1].mlp.w2.get_value().packed))
    with pytest.raises(ValueError, match="another kernel layout"):
        prepare_for_kernels(nnx.clone(prepared), layout="planar")


def test_skipped_tile_columns_never_reach_the_output(monkeypatch):
    """The kernel leaves skipped tiles' columns unwritten: a twin that fills them with NaN gives the same
    finite result, with an expert offset and when every pair is routed to another device, with and without
    the SiLU·up epilogue (gate/up rows paired), with one tile width and with ragged tiles."""
    rng = np.random.default_rng(7)
    e, d, f = 8, 256, 256
    w13, w2 = random_stack(rng, e, 2 * f, d), random_stack(rng, e, d, f)
    t2 = TiledInt4.from_compressed_tensors(w2.packed, w2.scale)
    plain = K.grouped_int4_matmul_ref

    def poisoned(x_chunks, w, s, tile_expert, tile_rows=None, *, tokens_per_tile, out_layout="rows",
                 epilogue="none", out_dtype=jnp.float32, **schedule):
        out = plain(x_chunks, w, s, tile_expert, tile_rows, tokens_per_tile=tokens_per_tile, out_layout=out_layout,
                    epilogue=epilogue, out_dtype=out_dtype, **schedule)
        n, p, nt = tokens_per_tile, x_chunks.shape[1], tile_expert.shape[0]
        if tile_rows is None:  # one width: tile t holds rows [t N, (t + 1) N)
            tile_rows = jnp.stack([jnp.arange(nt) * n, jnp.full((nt,), n)])
        row = jnp.arange(p)[:, None]  # rows no used tile holds (skipped tiles, padding past the used ones)
        held = (tile_expert >= 0) & (row >= tile_rows[0]) & (row < tile_rows[0] + tile_rows[1])
        skipped = ~held.any(axis=1)
        if epilogue == "silu_mul":  # h chunks [F/C, P, C]
            return jnp.where(skipped[None, :, None], jnp.nan, out)
        return jnp.where(skipped[:, None] if out_layout == "tokens" else skipped[None, :], jnp.nan, out)

    x = jnp.asarray(rng.standard_normal((5, d)), jnp.float32)
    wts = jnp.asarray(rng.random((5, 2)), jnp.float32)
    cases = [(rng.integers(0, 16, (5, 2)), 4), (rng.integers(20, 30, (5, 2)), 0)]
    layouts = [(True, "one"), (False, "one"), (True, "ragged"), (False, "ragged")]  # each epilogue path, each layout
    for (ids, offset), paired, widths in [(c, p, wd) for c in cases for p, wd in layouts]:
        t13 = TiledInt4.from_compressed_tensors(w13.packed, w13.scale, pair_gate_up=paired)
        ids = jnp.asarray(ids, jnp.int32)
        want = K.routed_experts_tiled(x, ids, wts, t13, t2, expert_offset=offset, out_dtype=jnp.float32, tile=16,
                                      widths=widths)
        monkeypatch.setattr(K, "grouped_int4_matmul_ref", poisoned)
        got = K.routed_experts_tiled(x, ids, wts, t13, t2, expert_offset=offset, out_dtype=jnp.float32, tile=16,
                                      widths=widths)
        monkeypatch.setattr(K, "grouped_int4_matmul_ref", plain)
        assert np.isfinite(np.asarray(got)).all()
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_engine_greedy_tiles_equals_compressed_tensors():
    cfg = tiny_config(vocab_size=64, eos_token_ids=(), num_layers=2, **TCFG)
    target = KimiModel(cfg, nnx.Rngs(0))
    target.lm_head.set_value(target.lm_head.get_value() * 8)
    drafter = DFlashDrafter(tiny_drafter_config(cfg), nnx.Rngs(1))
    prepared = prepare_for_kernels(nnx.clone(target))
    prompts = [np.random.default_rng(i).integers(0, 64, 3 + 2 * i).tolist() for i in range(3)]
    ecfg = EngineConfig(mode="ddtree", budget=16, max_new_tokens=8, capacity=64)
    a = Engine(target, drafter, ecfg).generate(prompts)
    b = Engine(prepared, drafter, ecfg).generate(prompts)
    assert a["tokens"] == b["tokens"] and a["rounds"] == b["rounds"]


MGPU_CALL = "mosaic_gpu"


@pytest.mark.parametrize("dtype,kernel", [("bfloat16", True), ("float32", False)])
def test_kernel_chosen_when_lowered_for_cuda(dtype, kernel):
    cfg = tiny_config(dtype=dtype, **TCFG)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: prepare_for_kernels(KimiModel(cfg, nnx.Rngs(0)))))
    toks = jax.ShapeDtypeStruct((1, 4), jnp.int32)
    staged = jax.jit(lambda s, t: _forward(graphdef, s, t, Runtime())).trace(state, toks)
    text = staged.lower(lowering_platforms=("cuda",)).as_text()
    assert (MGPU_CALL in text) == kernel
    # its own name, so that a profiler trace tells it from the attention's kernels (session 71 could not)
    assert ("int4_gemm_body" in text) == kernel
    assert MGPU_CALL not in staged.lower(lowering_platforms=("cpu",)).as_text()


def test_sharded_bf16_model_lowers_for_cuda_with_the_shared_expert_beside_the_kernel(host_devices, monkeypatch):
    """Lowered for CUDA on a 1x4 host mesh (nothing runs): the experts' shard_map holds the Mosaic GPU MoE kernel
    and, since session 69, each device's slice of the shared expert (its one-token dots' CUDA branch included)
    before the one psum; the CPU tests run only the twins there."""
    from ddtree_jax import moe
    cfg = tiny_config(dtype="bfloat16", **TCFG)
    mesh = make_mesh(data=1, model=4, devices=host_devices[:4])
    graphdef, state = nnx.split(nnx.eval_shape(lambda: prepare_for_kernels(KimiModel(cfg, nnx.Rngs(0)))))
    local_shared, swiglu = [], moe.swiglu

    def spy(x, gate, up, down, out_dtype=None):
        local_shared.append((gate.shape, down.shape))
        return swiglu(x, gate, up, down, out_dtype)

    monkeypatch.setattr(moe, "swiglu", spy)
    rt = Runtime(mesh=mesh, rules=DEFAULT_RULES)
    toks = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    text = jax.jit(lambda s, t: _forward(graphdef, s, t, rt)).trace(state, toks).lower(
        lowering_platforms=("cuda",)).as_text()
    assert MGPU_CALL in text and "stablehlo.all_reduce" in text
    f, d = cfg.shared_intermediate_size // 4, cfg.hidden_size
    assert local_shared and set(local_shared) == {((d, f), (f, d))}  # traced inside the shard_map: local slices


@pytest.mark.parametrize("rows,n,stages,split,out_layout,inflight", [
    (64, 8, 2, 1, "rows", None), (128, 16, 3, 2, "rows", 1), (128, 64, 2, 1, "rows", None),
    (64, 8, 2, 1, "tokens", 0), (128, 32, 2, 2, "tokens", 2)])
def test_kernel_lowers_for_cuda(rows, n, stages, split, out_layout, inflight):
    w = jax.ShapeDtypeStruct((3, 2, 2 * rows, K.STEP), jnp.int4)
    s = jax.ShapeDtypeStruct((3, 2, 2 * K.STEP // K.GROUP, rows), jnp.bfloat16)
    xg = jax.ShapeDtypeStruct((2 * K.STEP // K.GROUP, 2 * n, K.GROUP), jnp.bfloat16)
    te = jax.ShapeDtypeStruct((2,), jnp.int32)
    fn = functools.partial(K.grouped_int4_matmul, tokens_per_tile=n, stages=stages, split=split, out_layout=out_layout,
                           mma_in_flight=inflight)
    text = jax.jit(fn).trace(xg, w, s, te).lower(lowering_platforms=("cuda",)).as_text()
    assert MGPU_CALL in text


@pytest.mark.parametrize("dependent_launch", [False, True])
def test_dependent_launch_probe_lowers_with_the_grid_controls(dependent_launch):
    """The probe's two instructions are in the lowered kernel only when asked for, wait before signal."""
    n, rows = 8, 128
    w = jax.ShapeDtypeStruct((3, 2, 2 * rows, K.STEP), jnp.int4)
    s = jax.ShapeDtypeStruct((3, 2, 2 * K.STEP // K.GROUP, rows), jnp.bfloat16)
    xg = jax.ShapeDtypeStruct((2 * K.STEP // K.GROUP, 2 * n, K.GROUP), jnp.bfloat16)
    te = jax.ShapeDtypeStruct((2,), jnp.int32)
    fn = functools.partial(K.grouped_int4_matmul, tokens_per_tile=n, dependent_launch=dependent_launch)
    text = jax.jit(fn).trace(xg, w, s, te).lower(lowering_platforms=("cuda",)).as_text()
    waits, signals = text.count("griddepcontrol.wait"), text.count("griddepcontrol.launch_dependents")
    if dependent_launch:
        assert waits >= 1 and signals >= 1
        assert text.index("griddepcontrol.wait") < text.index("griddepcontrol.launch_dependents")
    else:
        assert waits == signals == 0


def test_bad_input_errors():
    rng = np.random.default_rng(0)
    qa = random_stack(rng, 2, 128, 256)
    with pytest.raises(ValueError, match="group size 64"):
        TiledInt4.from_compressed_tensors(qa.packed, qa.scale[..., ::2])
    with pytest.raises(ValueError, match="I % 256"):
        TiledInt4.from_compressed_tensors(qa.packed[..., :16], qa.scale[..., :4])
    with pytest.raises(ValueError, match="float32 scales"):
        TiledInt4.from_compressed_tensors(qa.packed, qa.scale.astype(jnp.float32))
    with pytest.raises(ValueError, match="expected packed int32"):
        TiledInt4.from_compressed_tensors(qa.packed.astype(jnp.float32), qa.scale)
    with pytest.raises(ValueError, match="unknown kernel layout"):
        prepare_for_kernels(tiny_model(), layout="swizzled")
    with pytest.raises(ValueError, match=r"layers\.1\.mlp: .*'tiles'.*I % 256"):
        nnx.eval_shape(lambda: prepare_for_kernels(tiny_model(hidden_size=128)))
    leaf = TiledInt4.from_compressed_tensors(qa.packed, qa.scale)
    xg = jnp.zeros((8, 24, 32), jnp.bfloat16)
    te = jnp.zeros((2,), jnp.int32)
    with pytest.raises(ValueError, match="multiple of 8"):
        K.grouped_int4_matmul(xg, leaf.packed, leaf.scale, te, tokens_per_tile=12)
    te3 = jnp.zeros((3,), jnp.int32)
    for fn in (K.grouped_int4_matmul, K.grouped_int4_matmul_ref):  # the twin refuses what the kernel refuses
        with pytest.raises(ValueError, match="split=3"):
            fn(xg, leaf.packed, leaf.scale, te3, tokens_per_tile=8, split=3)
        with pytest.raises(ValueError, match="mma_in_flight must be None or an int in"):
            fn(xg, leaf.packed, leaf.scale, te3, tokens_per_tile=8, mma_in_flight=8)
        with pytest.raises(ValueError, match="overlap=True needs auto_barriers"):
            fn(xg, leaf.packed, leaf.scale, te3, tokens_per_tile=8, overlap=True, auto_barriers=False)
        with pytest.raises(ValueError, match="unknown probe"):
            fn(xg, leaf.packed, leaf.scale, te3, tokens_per_tile=8, probe="fast")
        with pytest.raises(ValueError, match=r"tile_expert must be \[P/N\] = \[3\]"):
            fn(xg, leaf.packed, leaf.scale, te, tokens_per_tile=8)
        with pytest.raises(ValueError, match="do not match activations"):
            fn(xg, leaf.packed, leaf.scale[:, :, :4], te3, tokens_per_tile=8)
        with pytest.raises(ValueError, match="dividing P=24"):
            fn(xg, leaf.packed, leaf.scale, te3, tokens_per_tile=16)
    with pytest.raises(ValueError, match="bf16 activations"):
        K.grouped_int4_matmul(xg.astype(jnp.float32), leaf.packed, leaf.scale, te3, tokens_per_tile=8)
    with pytest.raises(ValueError, match="the twin has none"):  # a probe's results are wrong on purpose
        K.grouped_int4_matmul_ref(xg, leaf.packed, leaf.scale, te3, tokens_per_tile=8, probe="no_scale")
    with pytest.raises(ValueError, match="shared memory"):
        K.grouped_int4_matmul(jnp.zeros((8, 512, 32), jnp.bfloat16), leaf.packed, leaf.scale, te,
                              tokens_per_tile=256)
    l13, l2 = (TiledInt4.from_compressed_tensors(a.packed, a.scale)
               for a in (random_stack(rng, 2, 512, 256), random_stack(rng, 2, 256, 256)))
    with pytest.raises(ValueError, match="bf16 activations"):
        K.routed_experts_tiled(jnp.zeros((2, 256)), jnp.zeros((2, 2), jnp.int32), jnp.ones((2, 2)), l13, l2,
                               use_kernel=True)
    with pytest.raises(ValueError, match="do not match"):
        K.routed_experts_tiled(jnp.zeros((2, 256)), jnp.zeros((2, 2), jnp.int32), jnp.ones((2, 2)), leaf, leaf)
    with pytest.raises(ValueError, match="tile=12"):  # refused on CPU as the GPU kernel would refuse it
        K.routed_experts_tiled(jnp.zeros((2, 256)), jnp.zeros((2, 2), jnp.int32), jnp.ones((2, 2)), l13, l2, tile=12)
    with pytest.raises(ValueError, match="split=2"):
        K.routed_experts_tiled(jnp.zeros((2, 256)), jnp.zeros((2, 2), jnp.int32), jnp.ones((2, 2)), l13, l2, split=2)
    with pytest.raises(TypeError, match="prepare_for_kernels"):
        routed_experts_tiled(jnp.zeros((2, 256)), jnp.zeros((2, 2), jnp.int32), jnp.ones((2, 2)), qa, qa)


def test_repack_refuses_an_unknown_order_and_scales_of_another_stack():
    """The repack's own checks, before anything is converted: a misspelt order is not taken as "groups"."""
    qa = random_stack(np.random.default_rng(1), 2, 128, 256)
    with pytest.raises(ValueError, match="unknown order 'fragment'"):
        TiledInt4.from_compressed_tensors(qa.packed, qa.scale, order="fragment")
    with pytest.raises(ValueError, match=r"scale \(2, 64, 8\) does not match packed \(2, 128, 32\)"):
        TiledInt4.from_compressed_tensors(qa.packed, qa.scale[:, :64])
    q = TL.unpack_compressed_tensors(qa.packed)
    with pytest.raises(ValueError, match="rows per program must be 64 or 128, got 32"):
        TL.tile_weights(q, qa.scale, rows=32)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.float16])
def test_dequantize_expert_rounds_q_times_scale_once(dtype):
    """W_e = q * scale computed in f32 and rounded once to ``dtype`` (both orders), checked against the
    compressed-tensors values; scales ~1e-6 make a float16 rounding of the scale itself show."""
    qa = random_stack(np.random.default_rng(2), 2, 128, 256)
    scale = (qa.scale.astype(jnp.float32) * 1e-4).astype(jnp.bfloat16)
    q = np.asarray(TL.unpack_compressed_tensors(qa.packed), np.float32)
    want = (q.reshape(2, 128, 8, 32) * np.asarray(scale, np.float32)[..., None]).reshape(2, 128, 256)
    for order in ("groups", "fragments"):
        leaf = TiledInt4.from_compressed_tensors(qa.packed, scale, order=order)
        for e in range(2):
            got = leaf.dequantize_expert(jnp.int32(e), dtype)
            assert got.dtype == dtype
            np.testing.assert_array_equal(np.asarray(got, np.float32),
                                          np.asarray(jnp.asarray(want[e]).astype(dtype), np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("rows,n,split,out_layout,chunk", [
    (64, 8, 1, "rows", 32), (128, 8, 2, "rows", 64), (128, 16, 1, "rows", 128), (128, 32, 1, "rows", 32),
    (64, 64, 1, "rows", 64), (64, 8, 1, "tokens", 128), (128, 8, 2, "tokens", 32), (128, 64, 1, "tokens", 64)])
def test_gpu_kernel_matches_twin(rows, n, split, out_layout, chunk):
    rng = np.random.default_rng(rows + n)
    e, o, i = 5, 256, 1024
    q = jnp.asarray(rng.integers(-8, 8, (e, o, i)), jnp.int8)
    sc = jnp.asarray(rng.uniform(0.01, 0.1, (e, o, i // 32)), jnp.bfloat16)
    w, s = TL.tile_weights(q, sc, rows)
    te = jnp.asarray([4, 0, -1, 4, 2, -1], jnp.int32)
    xg = K.to_chunks(jnp.asarray(rng.standard_normal((te.shape[0] * n, i)), jnp.bfloat16), chunk)
    got = np.asarray(jax.jit(functools.partial(K.grouped_int4_matmul, tokens_per_tile=n, split=split,
                                               out_layout=out_layout, mma_in_flight=1 if n == 16 else None))(
        xg, w, s, te))
    want = np.asarray(K.grouped_int4_matmul_ref(xg, w, s, te, tokens_per_tile=n))
    if out_layout == "tokens":
        assert got.shape == want.T.shape
        got = got.T
    valid = np.repeat(np.asarray(te) >= 0, n)
    assert np.isfinite(got[:, valid]).all()
    assert rel_norm(got[:, valid], want[:, valid]) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 3])
def test_gpu_per_pair_tiles_and_word_gather_match_the_grouped_kernel(m):
    """On the GPU: the layer on a tile per pair and with the word gather gives the grouped layout's output
    bit for bit (the same tiles' products), and the twin's within bf16 rounding."""
    rng = np.random.default_rng(m)
    e, d, f, k = 16, 1024, 512, 8
    w13, w2 = random_stack(rng, e, 2 * f, d), random_stack(rng, e, d, f)
    t13 = TiledInt4.from_compressed_tensors(w13.packed, w13.scale)
    t2 = TiledInt4.from_compressed_tensors(w2.packed, w2.scale)
    x = jnp.asarray(rng.standard_normal((m, d)), jnp.bfloat16)
    ids = jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(m)]), jnp.int32)
    wts = jnp.asarray(rng.random((m, k)), jnp.float32)
    layer = jax.jit(functools.partial(K.routed_experts_tiled, out_dtype=jnp.float32),
                    static_argnames=("routing", "gather", "use_kernel"))
    grouped = np.asarray(layer(x, ids, wts, t13, t2, routing="compare", use_kernel=True))
    for routing, gather in (("per_pair", "elements"), ("per_pair", "words"), ("compare", "words")):
        got = np.asarray(layer(x, ids, wts, t13, t2, routing=routing, gather=gather, use_kernel=True))
        np.testing.assert_array_equal(got, grouped, err_msg=f"{routing}, {gather}")
    assert rel_norm(grouped, layer(x, ids, wts, t13, t2, routing="compare", use_kernel=False)) < 1e-2


@pytest.mark.gpu
def test_gpu_tiled_model_matches_twin_and_xla():
    model = tiny_model(dtype="bfloat16", n_routed_experts=16, num_experts_per_tok=4, num_layers=3)
    prepared = prepare_for_kernels(nnx.clone(model))
    toks = np.random.default_rng(5).integers(0, 256, (2, 33))
    graphdef, state = nnx.split(prepared)
    assert MGPU_CALL in jax.jit(lambda s, t: _forward(graphdef, s, t, Runtime())).lower(
        state, jnp.asarray(toks)).as_text()
    kernel = forward(prepared, toks).astype(jnp.float32)
    twin = forward(prepared, toks, Runtime(routed_fn=functools.partial(
        K.routed_experts_tiled, out_dtype=jnp.float32, use_kernel=False))).astype(jnp.float32)
    xla = forward(model, toks).astype(jnp.float32)
    assert bool(jnp.all(jnp.isfinite(kernel)))
    assert rel_norm(kernel, twin) < 2e-2 and rel_norm(kernel, xla) < 2e-2


# ----------------------------------------------------------------------------------------------
# The experimental "fragments" order (weights pre-laid-out in wgmma fragment order, no register shuffles)
# ----------------------------------------------------------------------------------------------
def test_fragment_order_roundtrip_and_register_contents():
    """Every slab element is stored once; each thread's words hold exactly the (row, col) pairs of its
    wgmma A fragment (row 64h + 16w + 8i + l//4, columns 8j + 2(l%4) + {0, 1}) at nibbles (j, j + 4)."""
    r, c = TL.fragment_maps()
    assert np.unique(r * K.STEP + c).size == TL.FRAG_ROWS * K.STEP
    rng = np.random.default_rng(0)
    qa = random_stack(rng, 2, 256, 512)
    leaf = TiledInt4.from_compressed_tensors(qa.packed, qa.scale, order="fragments")
    assert leaf.order == "fragments" and leaf.shape == (2, 256, 512) and leaf.packed.dtype == jnp.int32
    assert leaf.nbytes == qa.packed.size * 4 + qa.scale.size * 2
    packed, scale = leaf.to_compressed_tensors()
    np.testing.assert_array_equal(np.asarray(packed), np.asarray(qa.packed))
    np.testing.assert_array_equal(np.asarray(scale).view(np.uint16), np.asarray(qa.scale).view(np.uint16))
    np.testing.assert_array_equal(np.asarray(leaf.dequantize_expert(1, jnp.bfloat16)),
                                  np.asarray(dequantize_int4(qa.packed[1], qa.scale[1], jnp.bfloat16)))
    q = np.asarray(TL.unpack_compressed_tensors(qa.packed))[1, 128:256, 256:512]  # expert 1, row block 1, step 1
    words = np.asarray(leaf.packed).view(np.uint32)[1, 1, 32:64].reshape(-1)
    for g, h, t in [(0, 0, 0), (3, 1, 37), (7, 1, 127), (5, 0, 90)]:
        w, lane = divmod(t, 32)
        for i in range(2):
            word = int(words[((g * 2 + h) * 128 + t) * 2 + i])
            row = 64 * h + 16 * w + 8 * i + lane // 4
            for j in range(4):
                pair = (word >> (4 * j)) & 0x000F000F
                col = 32 * g + 8 * j + 2 * (lane % 4)
                assert ((pair & 0xF) - 8, (pair >> 16) - 8) == (q[row, col], q[row, col + 1])


def test_fragment_kernel_lowers_and_twin_agrees():
    rng = np.random.default_rng(1)
    qa = random_stack(rng, 3, 256, 512)
    frag = TiledInt4.from_compressed_tensors(qa.packed, qa.scale, order="fragments")
    grp = TiledInt4.from_compressed_tensors(qa.packed, qa.scale, order="groups")
    assert TiledInt4.from_compressed_tensors(qa.packed, qa.scale).order == "fragments"  # the default here
    te = jnp.asarray([2, -1, 0], jnp.int32)
    xg = K.to_chunks(jnp.asarray(rng.standard_normal((24, 512)), jnp.bfloat16), 64)
    a = K.grouped_int4_matmul_ref(xg, frag.packed, frag.scale, te, tokens_per_tile=8)
    b = K.grouped_int4_matmul_ref(xg, grp.packed, grp.scale, te, tokens_per_tile=8)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    fn = functools.partial(K.grouped_int4_matmul, tokens_per_tile=8)
    text = jax.jit(fn).trace(xg, frag.packed, frag.scale, te).lower(lowering_platforms=("cuda",)).as_text()
    assert MGPU_CALL in text
    assert "lop3.b32 $0, $1, $2, $3, 0xEA;" in text  # the mask-and-or as one LOP3 (K._mask_or)
    with pytest.raises(ValueError, match="O % 128"):
        small = random_stack(rng, 2, 192, 256)
        TiledInt4.from_compressed_tensors(small.packed, small.scale, order="fragments")


@pytest.mark.gpu
@pytest.mark.parametrize("n,split,out_layout,chunk,inflight", [
    (8, 1, "rows", 32, None), (16, 2, "rows", 64, 1), (32, 1, "rows", 128, 0), (8, 2, "tokens", 64, None),
    (32, 1, "tokens", 32, 2), (8, 1, "tokens", 128, None)])
def test_gpu_fragment_kernel_matches_twin(n, split, out_layout, chunk, inflight):
    rng = np.random.default_rng(n)
    qa = random_stack(rng, 5, 256, 1024)
    frag = TiledInt4.from_compressed_tensors(qa.packed, qa.scale, order="fragments")
    te = jnp.asarray([4, 0, -1, 4, 2], jnp.int32)
    xg = K.to_chunks(jnp.asarray(rng.standard_normal((te.shape[0] * n, 1024)), jnp.bfloat16), chunk)
    fn = jax.jit(functools.partial(K.grouped_int4_matmul, tokens_per_tile=n, split=split, out_layout=out_layout,
                                   mma_in_flight=inflight))
    got = np.asarray(fn(xg, frag.packed, frag.scale, te))
    want = np.asarray(K.grouped_int4_matmul_ref(xg, frag.packed, frag.scale, te, tokens_per_tile=n,
                                                out_layout=out_layout))
    if out_layout == "tokens":
        got, want = got.T, want.T
    valid = np.repeat(np.asarray(te) >= 0, n)
    assert np.isfinite(got[:, valid]).all()
    assert rel_norm(got[:, valid], want[:, valid]) < 1e-5


def test_default_split_only_where_few_programs_are_busy():
    """K2.6 stacks (abstract): no split-K at one token on 132 SMs (8 x 32 gate+up, 8 x 56 down busy
    programs), split 2 where the busy programs cannot give every SM one, none where the pipeline steps are
    odd."""
    def leaf(e, o, i):
        return TiledInt4(packed=jax.ShapeDtypeStruct((e, o // 128, (i // 256) * 32, 128), jnp.int32),
                         scale=jax.ShapeDtypeStruct((e, o // 128, i // 32, 128), jnp.bfloat16))
    w13, w2 = leaf(384, 4096, 7168), leaf(384, 7168, 2048)
    assert K.default_split(1, 8, 384, w13) == 1 and K.default_split(1, 8, 384, w2) == 1
    assert K.default_split(1, 8, 384, w13, num_sms=300) == 2 and K.default_split(1, 8, 384, w2, num_sms=300) == 1
    assert K.default_split(1, 2, 384, w13) == 2                       # 2 experts (e.g. one device's share)
    assert K.default_split(9, 8, 384, w13, num_sms=300) == 1
    assert K.default_split(1, 2, 384, leaf(384, 4096, 768)) == 1      # 3 steps: no even split
    assert K.default_split(1, 8, 384, w13, num_sms=16) == 1
    local13 = leaf(192, 4096, 7168)  # one of two devices' experts: about 4 of a token's 8 pairs each
    assert K.default_split(1, 8, 192, local13) == 1 and K.default_split(1, 8, 192, local13, shards=2) == 2
    assert K.default_split(9, 8, 192, local13, shards=2) == 1
    with pytest.raises(ValueError, match="expert_shards"):
        K.routed_experts_tiled(jnp.zeros((1, 256)), jnp.zeros((1, 2), jnp.int32), jnp.ones((1, 2)),
                               leaf(2, 512, 256), leaf(2, 256, 256), expert_shards=0)


def test_default_mma_in_flight_is_per_gemm_at_one_token():
    """K2.6 stacks (abstract) at one token: gate+up's 8 x 32 busy programs fit one wave at 3 per SM with every
    chunk in flight (None); down's 8 x 56 do not, so it waits per chunk (0 with 128-column chunks) and
    four fit per SM. From 64 pairs on both take 64 // chunk; under 8-way expert parallelism down's ~56
    local programs keep None."""
    def leaf(e, o, i):
        return TiledInt4(packed=jax.ShapeDtypeStruct((e, o // 128, (i // 256) * 32, 128), jnp.int32),
                         scale=jax.ShapeDtypeStruct((e, o // 128, i // 32, 128), jnp.bfloat16))
    w13, w2 = leaf(384, 4096, 7168), leaf(384, 7168, 2048)
    assert K.default_mma_in_flight(1, 8, 128, w13, 384) is None
    assert K.default_mma_in_flight(1, 8, 128, w2, 384) == 0
    assert K.default_mma_in_flight(1, 8, 64, w2, 384) == 1
    assert K.default_mma_in_flight(1, 8, 128, w13, 384, split=2) == 0  # 512 programs split in two
    assert K.default_mma_in_flight(1, 8, 128, w2, 384, shards=8) is None
    assert K.default_mma_in_flight(9, 8, 128, w13, 384) == 0 and K.default_mma_in_flight(9, 8, 128, w2, 384) == 0


def test_default_split_is_checked_per_gemm():
    """At one token gate+up (2 pipeline steps, 24 busy programs) splits K in two while down (3 steps)
    cannot; each GEMM's split is checked against its own stack only, and the result is the twin's."""
    rng = np.random.default_rng(4)
    e, d, f, k = 2, 512, 768, 2
    w13, w2 = random_stack(rng, e, 2 * f, d), random_stack(rng, e, d, f)
    t13, t2 = (TiledInt4.from_compressed_tensors(a.packed, a.scale) for a in (w13, w2))
    assert K.default_split(1, k, e, t13) == 2 and K.default_split(1, k, e, t2) == 1
    x = jnp.asarray(rng.standard_normal((1, d)), jnp.float32)
    ids, wts = jnp.asarray([[0, 1]], jnp.int32), jnp.asarray([[0.6, 0.4]], jnp.float32)
    got = K.routed_experts_tiled(x, ids, wts, t13, t2, out_dtype=jnp.float32)
    assert rel(got, routed_experts_xla(x, ids, wts, w13, w2)) < 1e-5
