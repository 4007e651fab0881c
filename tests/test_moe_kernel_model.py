"""The Pallas-Triton INT4 kernel (layout "planar") inside the model: prepare_for_kernels (load-time repack of every
MoE layer) and back, forward parity with the compressed-tensors model (twin, XLA path, interpret-mode kernel), expert
parallelism, the Engine, platform choice (lowered for CUDA on this CPU), errors, and a GPU check.

Tiny configs with D = F = 128 (planar blocks of 16 words, the smallest the GPU kernel tiles).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ddtree_jax.cache import init_cache
from ddtree_jax.checkpoint import save_model
from ddtree_jax.config import QuantConfig, tiny_config
from ddtree_jax.drafter import DFlashDrafter, tiny_drafter_config
from ddtree_jax.engine import Engine, EngineConfig
from ddtree_jax.model import KimiModel, Runtime, causal_mask
from ddtree_jax.moe import (KERNEL_AXES, W13_AXES, PlanarInt4, prepare_for_kernels, routed_experts_int4,
                            routed_experts_xla, unprepare_for_kernels)
from ddtree_jax.quant import QuantArray
from ddtree_jax.safetensors_io import CheckpointError
from ddtree_jax.sharding import DEFAULT_RULES, make_mesh, param_shardings
from pallas_kernels.int4_moe import Int4ExpertWeights, int4_moe_ref

KCFG = dict(hidden_size=128, moe_intermediate_size=128, quant=QuantConfig(group_size=32))


def tiny_model(seed=0, dtype="float32", **overrides):
    return KimiModel(tiny_config(dtype=dtype, **{**KCFG, **overrides}), nnx.Rngs(seed))


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def rel_norm(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@functools.partial(jax.jit, static_argnames=("graphdef", "runtime"))
def _forward(graphdef, state, tokens, runtime):
    model = nnx.merge(graphdef, state)
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    return model(tokens, positions, init_cache(model.cfg, b, t), causal_mask(b, t), runtime=runtime).logits


def forward(model, tokens, runtime=Runtime(), state=None):
    graphdef, own = nnx.split(model)
    return _forward(graphdef, own if state is None else state, jnp.asarray(tokens), runtime)


def twin_routed(x, ids, weights, w13, w2, *, expert_offset=0):
    """The twin forced on every platform (the kernel path's reference on a GPU)."""
    return int4_moe_ref(x, ids, weights, Int4ExpertWeights.from_leaves(w13, w2), expert_offset=expert_offset,
                        out_dtype=jnp.float32)


@pytest.fixture(scope="module")
def pair():
    model = tiny_model()
    return model, prepare_for_kernels(nnx.clone(model), layout="planar")


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(0).integers(0, 256, (3, 11))


def test_prepare_repacks_every_moe_layer_and_undoes_bit_exact(pair):
    model, prepared = pair
    for i, layer in enumerate(prepared.layers):
        if i < model.cfg.first_k_dense_replace:
            continue
        for name in ("w13", "w2"):
            param = getattr(layer.mlp, name)
            assert isinstance(param.get_value(), PlanarInt4)
            assert param.get_metadata()["logical_axes"] == KERNEL_AXES
        assert isinstance(model.layers[i].mlp.w13.get_value(), QuantArray)  # the clone's source is untouched
    assert prepare_for_kernels(prepared, layout="planar") is prepared  # prepared layers are left as they are
    back = unprepare_for_kernels(nnx.clone(prepared))
    assert back.layers[1].mlp.w13.get_metadata()["logical_axes"] == W13_AXES
    orig, again = nnx.state(model), nnx.state(back)
    assert jax.tree.structure(orig) == jax.tree.structure(again)
    for a, b in zip(jax.tree.leaves(orig), jax.tree.leaves(again)):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def test_prepared_forward_equals_compressed_tensors_forward(pair, tokens):
    """CPU: the twin (default elsewhere than CUDA) within f32 rounding; the XLA path on the repacked
    weights bit-exact (same dequantised values)."""
    model, prepared = pair
    ref = forward(model, tokens)
    twin = forward(prepared, tokens)
    assert rel(twin, ref) < 1e-5
    forced = forward(prepared, tokens, Runtime(routed_fn=twin_routed))
    np.testing.assert_array_equal(np.asarray(twin), np.asarray(forced))
    xla = forward(prepared, tokens, Runtime(routed_fn=routed_experts_xla))
    np.testing.assert_array_equal(np.asarray(xla), np.asarray(ref))


@pytest.mark.parametrize("routed", ["twin", "interpret"])
def test_expert_parallel_prepared_equals_unsharded(pair, tokens, routed, host_devices):
    """data=2 x model=4: two experts per device, each device's twin / interpret-mode kernel sees global
    ids and its expert offset; equal to the unsharded compressed-tensors model."""
    model, prepared = pair
    mesh = make_mesh(data=2, model=4, devices=host_devices)
    graphdef, state = nnx.split(prepared)
    sharded = jax.device_put(state, param_shardings(state, mesh, DEFAULT_RULES))
    w13 = sharded["layers"][1]["mlp"]["w13"].get_value()
    assert w13.packed.addressable_shards[0].data.shape[0] == 2 and w13.scale.addressable_shards[0].data.shape[0] == 2
    fn = None if routed == "twin" else functools.partial(routed_experts_int4, interpret=True, tile=4)
    toks = tokens if routed == "twin" else tokens[:2, :4]
    got = forward(prepared, toks, Runtime(mesh=mesh, rules=DEFAULT_RULES, routed_fn=fn), state=sharded)
    assert rel(got, forward(model, toks)) < 1e-5


def test_prepare_a_sharded_model_repacks_in_place(pair, tokens, host_devices):
    """A model already split over experts is repacked per device and stays split; values as unsharded."""
    model, prepared = pair
    mesh = make_mesh(data=2, model=4, devices=host_devices)
    graphdef, state = nnx.split(nnx.clone(model))
    sharded = nnx.merge(graphdef, jax.device_put(state, param_shardings(state, mesh, DEFAULT_RULES)))
    prepare_for_kernels(sharded, layout="planar")
    leaf = sharded.layers[2].mlp.w2.get_value()
    assert leaf.packed.sharding.spec[0] == "model" and leaf.scale.sharding.spec[0] == "model"
    want = prepared.layers[2].mlp.w2.get_value()
    np.testing.assert_array_equal(np.asarray(leaf.packed), np.asarray(want.packed))
    np.testing.assert_array_equal(np.asarray(leaf.scale), np.asarray(want.scale))
    back = unprepare_for_kernels(sharded).layers[2].mlp.w2.get_value()
    np.testing.assert_array_equal(np.asarray(back.packed), np.asarray(model.layers[2].mlp.w2.get_value().packed))


def test_engine_greedy_prepared_equals_compressed_tensors():
    """DDTree greedy decode (tree verify through the prepared MoE) == the compressed-tensors target."""
    cfg = tiny_config(vocab_size=64, eos_token_ids=(), num_layers=2, **KCFG)
    target = KimiModel(cfg, nnx.Rngs(0))
    target.lm_head.set_value(target.lm_head.get_value() * 8)  # peaked, like a trained model
    drafter = DFlashDrafter(tiny_drafter_config(cfg), nnx.Rngs(1))
    prepared = prepare_for_kernels(nnx.clone(target), layout="planar")
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 64, int(rng.integers(2, 12))).tolist() for _ in range(4)]
    ecfg = EngineConfig(mode="ddtree", budget=16, max_new_tokens=10, capacity=64)
    a = Engine(target, drafter, ecfg).generate(prompts)
    b = Engine(prepared, drafter, ecfg).generate(prompts)
    assert a["tokens"] == b["tokens"] and a["rounds"] == b["rounds"]


def abstract_prepared(allow_twin_only=False, **overrides):
    """A prepared model of shapes only (nnx.eval_shape): for lowering and error checks, no compute."""
    cfg = tiny_config(**{**KCFG, **overrides})
    return nnx.eval_shape(lambda: prepare_for_kernels(KimiModel(cfg, nnx.Rngs(0)), layout="planar",
                                                      allow_twin_only=allow_twin_only))


def test_experts_that_do_not_split_over_the_mesh_are_refused(host_devices):
    """6 experts over a model axis of 4: refused by name, not handed to shard_map unevenly."""
    from ddtree_jax.moe import routed_experts
    mesh = make_mesh(data=2, model=4, devices=host_devices)
    e, f, d = 6, 8, 16
    x, ids, weights = jnp.ones((2, d)), jnp.array([[0, 5], [1, 4]], jnp.int32), jnp.ones((2, 2))
    with pytest.raises(ValueError, match="6 experts do not split over mesh axis 'model' of size 4"):
        routed_experts(x, ids, weights, jnp.ones((e, 2 * f, d)), jnp.ones((e, d, f)), mesh=mesh, rules=DEFAULT_RULES)


def test_the_shared_experts_share_rides_the_experts_psum(host_devices):
    """With the shared expert's (gate, up, down), routed_experts adds it: alone, routed + SwiGLU; on a 2x4 mesh,
    each device's FFN slice inside the experts' shard_map, one psum for both, the same sum; refused where the
    rules put the FFN width on another axis than the experts."""
    from ddtree_jax.layers import swiglu
    from ddtree_jax.moe import routed_experts, routed_experts_xla
    from ddtree_jax.sharding import ShardingRules
    rng = np.random.default_rng(7)
    e, f, d, fs, m = 8, 8, 16, 12, 3
    x = jnp.asarray(rng.standard_normal((m, d)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, e, (m, 2)), jnp.int32)
    weights = jnp.asarray(rng.random((m, 2)), jnp.float32)
    w13, w2 = (jnp.asarray(0.3 * rng.standard_normal(s), jnp.float32) for s in ((e, 2 * f, d), (e, d, f)))
    shared = tuple(jnp.asarray(0.3 * rng.standard_normal(s), jnp.float32) for s in ((d, fs), (d, fs), (fs, d)))
    want = routed_experts_xla(x, ids, weights, w13, w2) + swiglu(x, *shared)
    alone = routed_experts(x, ids, weights, w13, w2, shared=shared)
    np.testing.assert_allclose(np.asarray(alone), np.asarray(want), rtol=1e-6, atol=1e-6)
    mesh = make_mesh(data=2, model=4, devices=host_devices)
    sharded = jax.jit(lambda *a: routed_experts(*a, mesh=mesh, rules=DEFAULT_RULES, shared=shared))(
        x, ids, weights, w13, w2)
    np.testing.assert_allclose(np.asarray(sharded), np.asarray(want), rtol=1e-5, atol=1e-5)
    other = ShardingRules(rules=(("experts", "model"), ("ffn", "data")))
    with pytest.raises(ValueError, match="FFN width \\(12\\) must split over the experts' mesh axis 'model'"):
        routed_experts(x, ids, weights, w13, w2, mesh=mesh, rules=other, shared=shared)


def test_fuse_silu_is_refused_for_the_planar_layout():
    """fuse_silu=True asks for a 'tiles' storage; with layout 'planar' it is refused, not silently dropped."""
    with pytest.raises(ValueError, match="fuse_silu is a property of the 'tiles' layout, not 'planar'"):
        nnx.eval_shape(lambda: prepare_for_kernels(tiny_model(), layout="planar", fuse_silu=True))


def test_a_layer_whose_w2_alone_is_float_is_refused_by_name():
    """Both stacks must be INT4: a float w2 beside an INT4 w13 is refused naming the layer and the float stack
    (w2, not w13's QuantArray), not repacked."""
    def build():
        model = tiny_model()
        moe = model.layers[1].mlp
        moe.w2 = nnx.Param(jnp.zeros(moe.w2.get_value().shape), logical_axes=moe.w2.get_metadata()["logical_axes"])
        return prepare_for_kernels(model, layout="planar")

    with pytest.raises(ValueError, match=r"layers\.1\.mlp: routed experts' w2 is (?!QuantArray).*not INT4"):
        nnx.eval_shape(build)


@pytest.mark.parametrize("overrides,kernel", [(dict(dtype="bfloat16"), True), (dict(dtype="float32"), False),
                                              (dict(dtype="bfloat16", hidden_size=64, moe_intermediate_size=32,
                                                    allow_twin_only=True), False)])
def test_kernel_chosen_when_lowered_for_cuda(overrides, kernel):
    """Lowered for CUDA (on this CPU) a bf16 prepared model contains the Triton MoE kernels; f32
    activations and twin-only shapes take the twin; lowered for CPU there is never a kernel."""
    graphdef, state = nnx.split(abstract_prepared(**overrides))
    toks = jax.ShapeDtypeStruct((1, 4), jnp.int32)
    staged = jax.jit(lambda s, t: _forward(graphdef, s, t, Runtime())).trace(state, toks)
    assert ("int4_moe_gate_up" in staged.lower(lowering_platforms=("cuda",)).as_text()) == kernel
    assert "int4_moe_gate_up" not in staged.lower(lowering_platforms=("cpu",)).as_text()


def test_bad_input_errors(pair, tmp_path):
    model, prepared = pair
    with pytest.raises(ValueError, match="not INT4"):
        abstract_prepared(quant=None)
    with pytest.raises(ValueError, match="group-32"):
        abstract_prepared(quant=QuantConfig(group_size=64))
    with pytest.raises(ValueError, match=r"layers\.1\.mlp: .*multiples of 128.*allow_twin_only"):
        abstract_prepared(hidden_size=64, moe_intermediate_size=32)  # planar blocks of 8 / 4 words
    with pytest.raises(TypeError, match="prepare_for_kernels"):
        forward(model, np.zeros((1, 2), np.int32), Runtime(routed_fn=routed_experts_int4))
    with pytest.raises(CheckpointError, match="unprepare_for_kernels"):
        save_model(prepared, str(tmp_path / "ckpt"))


@pytest.mark.gpu
def test_gpu_kernel_in_model_matches_twin_and_xla():
    """bf16 on the GPU: the prepared model runs the Pallas kernel (in the compiled program) and its
    logits match the twin's and the compressed-tensors XLA path's."""
    model = tiny_model(dtype="bfloat16", hidden_size=256, moe_intermediate_size=256, n_routed_experts=16,
                       num_experts_per_tok=4, num_layers=3)
    prepared = prepare_for_kernels(nnx.clone(model), layout="planar")
    toks = np.random.default_rng(5).integers(0, 256, (2, 33))
    graphdef, state = nnx.split(prepared)
    hlo = jax.jit(lambda s, t: _forward(graphdef, s, t, Runtime())).lower(state, jnp.asarray(toks)).as_text()
    assert "int4_moe_gate_up" in hlo and "int4_moe_down" in hlo
    kernel = forward(prepared, toks).astype(jnp.float32)
    twin = forward(prepared, toks, Runtime(routed_fn=twin_routed)).astype(jnp.float32)
    xla = forward(model, toks).astype(jnp.float32)
    assert bool(jnp.all(jnp.isfinite(kernel)))
    assert rel_norm(kernel, twin) < 2e-2 and rel_norm(kernel, xla) < 2e-2
