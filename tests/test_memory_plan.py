"""memory_plan against what is really placed: a target with a drafter on a 2x2 mesh under two rule sets (weights
and both caches, per device and in all), the weight categories against sums from the config, and the byte
arithmetic of uneven splits and sub-byte dtypes."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from ddtree_jax.cache import CACHE_AXES, init_cache
from ddtree_jax.config import QuantConfig, tiny_config
from ddtree_jax.drafter import DFlashDrafter, draft_cache_axes, init_draft_cache, tiny_drafter_config
from ddtree_jax.hf_loader import abstract_model
from ddtree_jax.memory_plan import (array_bytes, bytes_per_device, held_bytes_per_device, param_bytes, parse_mesh,
                                    plan_memory, state_bytes)
from ddtree_jax.sharding import DEFAULT_RULES, ShardingRules, make_mesh, named_sharding, shard_state

REPLICATED_VOCAB_AND_STREAMS = ShardingRules(
    rules=tuple(rule for rule in DEFAULT_RULES.rules if rule[0] not in ("vocab", "batch")))


def _largest(held: dict) -> int:
    return max(held.values())


@pytest.mark.parametrize("rules", [DEFAULT_RULES, REPLICATED_VOCAB_AND_STREAMS], ids=["default", "no-vocab-no-batch"])
def test_plan_with_a_drafter_equals_the_placed_arrays(host_devices, rules):
    """A 2x2 mesh: the tiny drafter has 2 kv heads."""
    cfg = tiny_config(quant=QuantConfig())
    dcfg = tiny_drafter_config(cfg)
    mesh = make_mesh(data=2, model=2, devices=host_devices)
    plan = plan_memory(cfg, parse_mesh("2x2"), rules, drafter_cfg=dcfg)
    target = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract_model(cfg)[1])
    drafter = nnx.state(nnx.eval_shape(lambda: DFlashDrafter(dcfg, nnx.Rngs(0))))
    drafter = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), drafter)
    placed_target, placed_drafter = shard_state(target, mesh, rules), shard_state(drafter, mesh, rules)
    assert sum(v["total"] for v in plan.drafter_weights.values()) == state_bytes(drafter)
    assert plan.weight_bytes("total") == state_bytes(target) + state_bytes(drafter)
    drafter_per_device = sum(v["per_device"] for v in plan.drafter_weights.values())
    assert drafter_per_device == _largest(held_bytes_per_device(placed_drafter))
    assert plan.weight_bytes() == _largest(held_bytes_per_device((placed_target, placed_drafter)))
    streams, capacity = 2, 5  # an odd capacity: streams and capacity cannot trade places unnoticed
    cache = init_cache(cfg, streams, capacity)
    dcache = init_draft_cache(dcfg, streams, capacity)
    placed_caches = (jax.device_put(cache.kv, named_sharding(mesh, rules, CACHE_AXES)),
                     jax.device_put(dcache.k, named_sharding(mesh, rules, draft_cache_axes().k)),
                     jax.device_put(dcache.v, named_sharding(mesh, rules, draft_cache_axes().v)))
    assert plan.cache_bytes(capacity, streams, "total") == cache.kv.nbytes + dcache.k.nbytes + dcache.v.nbytes
    assert plan.cache_bytes(capacity, streams) == _largest(held_bytes_per_device(placed_caches))
    per_token = (dcache.k.nbytes + dcache.v.nbytes) // (streams * capacity)
    assert plan.drafter_cache_per_token["total"] == per_token
    assert plan.cache_per_token["total"] == cache.kv.nbytes // (streams * capacity)


def test_weight_categories_add_up_from_the_config():
    cfg = tiny_config(quant=QuantConfig(), router_dtype="float32")
    weights = param_bytes(abstract_model(cfg)[1], parse_mesh("1x1"), DEFAULT_RULES)
    item = jnp.dtype(cfg.dtype).itemsize
    moe_layers = cfg.num_layers - cfg.first_k_dense_replace
    norms = cfg.num_layers * (2 * cfg.hidden_size + cfg.q_lora_rank + cfg.kv_lora_rank) + cfg.hidden_size
    assert weights["norms"]["total"] == norms * item
    assert weights["router"]["total"] == moe_layers * cfg.n_routed_experts * (cfg.hidden_size + 1) * 4
    assert weights["embed_head"]["total"] == 2 * cfg.vocab_size * cfg.hidden_size * item
    experts = moe_layers * cfg.n_routed_experts * 3 * cfg.moe_intermediate_size * cfg.hidden_size
    assert weights["experts_int4"]["total"] == experts // 2
    assert weights["expert_scales"]["total"] == experts // cfg.quant.group_size * 2  # bf16 scales


def test_uneven_splits_count_the_largest_shard_and_int4_packs_two_per_byte():
    mesh_shape = {"data": 1, "model": 4}
    assert bytes_per_device((10, 6), jnp.float32, ("vocab", "embed"), mesh_shape, DEFAULT_RULES) == 3 * 6 * 4
    assert bytes_per_device((10, 6), jnp.float32, ("embed", "vocab"), mesh_shape, DEFAULT_RULES) == 10 * 2 * 4
    assert array_bytes((3, 8), jnp.int4) == 12 and array_bytes((3, 8), jnp.bfloat16) == 48


@pytest.mark.parametrize("layout", ["planar", "tiles"])
def test_a_prepared_model_plans_its_kernel_layout_as_int4(layout):
    """prepare_for_kernels repacks the INT4 experts bit for bit: the plan of the prepared model holds the same
    packed words and scales as the compressed-tensors one, and nothing of them moves to another category."""
    from ddtree_jax.model import KimiModel
    from ddtree_jax.moe import prepare_for_kernels

    cfg = tiny_config(vocab_size=64, num_layers=2, hidden_size=256, moe_intermediate_size=256,
                      quant=QuantConfig(group_size=32))  # widths the tiled layout takes
    model = KimiModel(cfg, nnx.Rngs(0))
    before = param_bytes(nnx.state(model), parse_mesh("1x1"), DEFAULT_RULES)
    after = param_bytes(nnx.state(prepare_for_kernels(model, layout=layout, allow_twin_only=True)), parse_mesh("1x1"),
                        DEFAULT_RULES)
    assert before["experts_int4"]["total"] > 0
    assert {c: v["total"] for c, v in after.items()} == {c: v["total"] for c, v in before.items()}


def test_a_plan_refuses_a_placement_jax_would_refuse(tmp_path, capsys):
    """A mesh axis that does not divide a weight (3 model devices, 4 heads) or the streams (3 over data 2): the plan
    refuses it, as JAX's placement does (it printed a plan of uneven shards before), and so does plan_memory.py,
    as a usage error; --config without --drafter plans the target alone (not the K2.6 preset drafter)."""
    from cli_helpers import refused
    from experiments import plan_memory as cli
    from hf_reference import tiny_hf_model

    cfg = tiny_config()
    with pytest.raises(ValueError, match="does not divide"):
        plan_memory(cfg, parse_mesh("1x3"))
    with pytest.raises(ValueError, match="mesh axis 'data' of size 2 does not divide dimension 3"):
        plan_memory(cfg, parse_mesh("2x1")).cache_bytes(capacity=4, streams=3)
    assert "--streams 3: mesh axis 'data' of size 2 does not divide" in refused(cli.main, ["--mesh", "2x8", "--streams",
                                                                                     "3"], capsys)
    for argv in (["--streams", "0"], ["--capacity", "-5"], ["--hbm-gib", "0"], ["--drafter", str(tmp_path)]):
        refused(cli.main, argv, capsys)
    tiny_hf_model(seed=0).config.save_pretrained(str(tmp_path))  # a config.json alone
    result = cli.main(["--config", str(tmp_path), "--mesh", "1x1", "--capacity", "16", "--hbm-gib", "1e-6"])
    assert result["drafter_weights"] is None
    assert "they do not fit this mesh" in capsys.readouterr().out
