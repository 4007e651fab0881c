"""Bad input gets a clear error; nothing is silently clamped or truncated."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hf_reference import edited_copy, tiny_hf_model
from ddtree_jax.cache import commit, init_cache
from ddtree_jax.config import ConfigError, ModelConfig, tiny_config
from ddtree_jax.decode import pad_prompts
from ddtree_jax.hf_loader import abstract_model, flat_params, hf_model_config, iter_hf_params, load_hf_model
from ddtree_jax.safetensors_io import CheckpointError, SafetensorsFile


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_ok")
    tiny_hf_model(seed=0).save_pretrained(path)
    return str(path)


def test_unknown_architecture():
    with pytest.raises(ConfigError, match="unsupported architecture model_type='llama'"):
        ModelConfig.from_hf_dict({"model_type": "llama", "hidden_size": 8})


def test_missing_config_field(hf_dir):
    raw = json.load(open(os.path.join(hf_dir, "config.json")))
    del raw["kv_lora_rank"]
    with pytest.raises(ConfigError, match="kv_lora_rank"):
        ModelConfig.from_hf_dict(raw)


def test_non_interleaved_rope_refused(hf_dir):
    raw = json.load(open(os.path.join(hf_dir, "config.json")))
    raw["rope_interleave"] = False
    with pytest.raises(ConfigError, match="rope_interleave"):
        ModelConfig.from_hf_dict(raw)


def test_unsupported_quantization_refused(hf_dir):
    raw = json.load(open(os.path.join(hf_dir, "config.json")))
    raw["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    with pytest.raises(ConfigError, match="unsupported quant_method 'fp8'"):
        ModelConfig.from_hf_dict(raw)


def test_missing_tensor_named(hf_dir, tmp_path):
    name = "model.layers.2.self_attn.kv_b_proj.weight"
    path = edited_copy(hf_dir, tmp_path / "m", lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=r"missing .*model\.layers\.2\.self_attn\.kv_b_proj\.weight"):
        load_hf_model(str(path), dtype="float32")


def test_missing_expert_named(hf_dir, tmp_path):
    name = "model.layers.1.mlp.experts.5.up_proj.weight"
    path = edited_copy(hf_dir, tmp_path / "m", lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=r"experts\.5\.up_proj"):
        load_hf_model(str(path), dtype="float32")


def test_wrong_shape_named(hf_dir, tmp_path):
    name = "model.layers.0.self_attn.q_a_proj.weight"
    path = edited_copy(hf_dir, tmp_path / "m", lambda t: t.update({name: t[name][:, :-1]}))
    with pytest.raises(CheckpointError, match=r"q_a_proj\.weight: shape"):
        load_hf_model(str(path), dtype="float32")


def test_unexpected_tensor_named(hf_dir, tmp_path):
    path = edited_copy(hf_dir, tmp_path / "m", lambda t: t.update({"model.layers.0.mystery.weight": np.ones(3)}))
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.layers.0.mystery.weight'"):
        load_hf_model(str(path), dtype="float32")


def test_truncated_file(hf_dir, tmp_path):
    dst = tmp_path / "m"
    shutil.copytree(hf_dir, dst)
    file = dst / "model.safetensors"
    size = os.path.getsize(file)
    with open(file, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(CheckpointError, match="truncated"):
        load_hf_model(str(dst), dtype="float32")


def test_token_ids_outside_vocab():
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 256\)"):
        pad_prompts([[1, 2, 256]], vocab_size=256, capacity=64)
    with pytest.raises(ValueError, match="token ids"):
        pad_prompts([[-1, 2]], vocab_size=256, capacity=64)


def test_prompt_longer_than_cache():
    with pytest.raises(ValueError, match="does not fit the cache capacity 8"):
        pad_prompts([[1] * 5, [2] * 9], vocab_size=256, capacity=8)
    with pytest.raises(ValueError, match="empty prompt"):
        pad_prompts([[1], []], vocab_size=256, capacity=8)
    with pytest.raises(ValueError, match="no prompts given"):
        pad_prompts([], vocab_size=256, capacity=8)


def test_cache_write_past_capacity_is_flagged_not_clamped():
    cfg = tiny_config()
    cache = init_cache(cfg, batch=2, capacity=4)
    new = jnp.ones((cfg.num_layers, 2, 3, cfg.latent_dim))
    rows = jnp.broadcast_to(jnp.arange(3), (2, 3))
    cache, overflow = commit(cache, new, rows, jnp.array([3, 2]))
    assert not overflow.any()
    cache, overflow = commit(cache, 2 * new, rows, jnp.array([1, 3]))  # stream 1 would need 5 > 4
    assert overflow.tolist() == [False, True]
    assert cache.lengths.tolist() == [4, 2]
    assert float(cache.kv[0, 0, 3, 0]) == 2.0  # stream 0 wrote its last slot
    assert float(cache.kv[:, 1, 2:].sum()) == 0.0  # stream 1 untouched past its length
    for batch, capacity in ((0, 4), (2, 0)):
        with pytest.raises(ValueError, match=f"cache needs batch >= 1 and capacity >= 1, got batch={batch}"):
            init_cache(cfg, batch=batch, capacity=capacity)
    assert init_cache(cfg, 1, 4, dtype=jnp.bfloat16).kv.dtype == jnp.bfloat16  # an explicit dtype wins over cfg's


def test_bad_config_values():
    with pytest.raises(ConfigError, match="topk_group"):
        tiny_config(n_group=2, topk_group=3)
    with pytest.raises(ConfigError, match="not divisible by n_group"):
        tiny_config(n_group=3)


def test_prompts_must_be_integer_token_id_lists():
    for bad in ([[1.9, 2.5, 3]], [[True, False]], [1, 2, 3], ["hello"], "abc", [[1, 2], [3, [4]]]):
        with pytest.raises(ValueError, match="token-id lists|integer token ids"):
            pad_prompts(bad, vocab_size=256, capacity=64)
    tokens, lengths = pad_prompts([[1, 2, 3], np.array([4, 5], np.uint8)], vocab_size=256, capacity=64)
    assert lengths.tolist() == [3, 2] and tokens[1, :2].tolist() == [4, 5]


def test_a_bare_string_is_refused_as_the_prompt_list_not_read_as_prompts():
    """A str / bytes in place of the prompt list is named as such; not iterated as prompts (bytes would give
    ints, "abc" one-character strings) and blamed on its first element."""
    for bad, kind in (("abc", "str"), (b"abc", "bytes")):
        with pytest.raises(ValueError, match=f"prompts must be a list of token-id lists, got {kind}$"):
            pad_prompts(bad, vocab_size=256, capacity=64)


def test_commit_flags_counts_outside_the_block():
    cfg = tiny_config()
    cache = init_cache(cfg, batch=3, capacity=16)
    new = jnp.ones((cfg.num_layers, 3, 2, cfg.latent_dim))
    rows = jnp.broadcast_to(jnp.arange(2), (3, 2))
    cache, overflow = commit(cache, new, rows, jnp.array([2, 7, -2]))  # 7 > 2 rows; -2 < 0
    assert overflow.tolist() == [False, True, True]
    assert cache.lengths.tolist() == [2, 0, 0]


def test_commit_arguments_that_do_not_fit_the_cache_are_refused_by_name():
    """A block, rows or counts for other streams, or float rows / counts (a float count used to add to the lengths
    and be cast back to int32), raise a ValueError naming the argument: eagerly and at trace time."""
    cfg = tiny_config()
    cache = init_cache(cfg, batch=2, capacity=8)
    new = jnp.ones((cfg.num_layers, 2, 3, cfg.latent_dim))
    rows, counts = jnp.broadcast_to(jnp.arange(3), (2, 3)), jnp.array([3, 1])
    cases = [((new[:, :1], rows, counts), r"new_kv must be \[NL, B, T, C\] = \[3, 2, T, 40\] like the cache"),
             ((new[..., :8], rows, counts), "new_kv must be"),
             ((new, rows[:1], counts), r"rows must be \[B, R\] with B = 2, got \(1, 3\)"),
             ((new, rows * 1.0, counts), "rows must be integers, got dtype float32"),
             ((new, rows, counts + 0.5), "counts must be integers, got dtype float32"),
             ((new, rows, counts[:1]), r"counts must have shape \(2,\), got \(1,\)")]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            commit(cache, *args)
        with pytest.raises(ValueError, match=match):
            jax.jit(commit)(cache, *args)
    assert commit(cache, new, rows, counts)[0].lengths.tolist() == [3, 1]


def test_prefill_flags_lengths_outside_the_prompt_and_both_steps_name_bad_arguments():
    from flax import nnx
    from ddtree_jax.decode import decode_step, prefill
    from ddtree_jax.model import KimiModel
    cfg = tiny_config()
    graphdef, state = nnx.split(KimiModel(cfg, nnx.Rngs(0)))
    tokens = jnp.ones((3, 4), jnp.int32)
    last, cache, overflow, _ = prefill(graphdef, state, init_cache(cfg, 3, 16), tokens, jnp.array([4, 0, 9]))
    assert overflow.tolist() == [False, True, True]
    assert cache.lengths.tolist() == [4, 0, 0]
    assert np.isfinite(np.asarray(last[0])).all() and np.isnan(np.asarray(last[1:])).all()
    cache = init_cache(cfg, 3, 16)
    for args, match in (((tokens[:2], jnp.array([4, 4])), r"tokens must be \[B, P\] with B = 3 .*, got \(2, 4\)"),
                        ((tokens[0], jnp.array([4, 4, 4])), r"tokens must be \[B, P\]"),
                        ((tokens * 1.0, jnp.array([4, 4, 4])), "tokens must be integers"),
                        ((tokens, jnp.array([4.0, 4.0, 4.0])), "lengths must be integers"),
                        ((tokens, jnp.array([4, 4])), r"lengths must have shape \(3,\)")):
        with pytest.raises(ValueError, match=match):
            prefill(graphdef, state, cache, *args)
    for bad, match in ((np.ones((3, 1), np.int32), r"tokens must have shape \(3,\), got \(3, 1\)"),
                       (np.ones(3, np.float32), "tokens must be integers")):
        with pytest.raises(ValueError, match=match):
            decode_step(graphdef, state, cache, bad)


def test_checkpoint_layers_past_the_config_are_refused_unless_multi_token_prediction(hf_dir, tmp_path):
    def add_layer_3(t):
        t["model.layers.3.self_attn.kv_b_proj.weight"] = t["model.layers.2.self_attn.kv_b_proj.weight"]

    path = edited_copy(hf_dir, tmp_path / "m", add_layer_3)
    with pytest.raises(CheckpointError, match=r"layer 3 is past num_hidden_layers=3"):
        load_hf_model(path, dtype="float32")
    raw = json.load(open(os.path.join(path, "config.json")))
    raw["num_nextn_predict_layers"] = 1
    json.dump(raw, open(os.path.join(path, "config.json"), "w"))
    assert load_hf_model(path, dtype="float32").cfg.num_nextn_predict_layers == 1  # its layer 3 skipped


def test_engine_config_and_engine_refuse_bad_values():
    from flax import nnx
    from ddtree_jax.config import ConfigError
    from ddtree_jax.drafter import DFlashDrafter, tiny_drafter_config
    from ddtree_jax.engine import Engine, EngineConfig
    from ddtree_jax.model import KimiModel
    for kw, match in [(dict(max_new_tokens=4.5), "max_new_tokens must be an integer"),
                      (dict(capacity=0), r"capacity must be in \[1, 2\*\*31 - 1\], got 0"),
                      (dict(max_new_tokens=2**31), r"max_new_tokens must be in \[1, 2\*\*31 - 1\], got 2147483648"),
                      (dict(capacity=2**40), "capacity must be in"), (dict(rounds_per_dispatch=2**31), "rounds_per"),
                      (dict(budget=True), "budget must be an integer"),
                      (dict(eos_ids=(3, -1)), "eos_ids"), (dict(eos_ids=5), "eos_ids"),
                      (dict(logprobs=1), "logprobs must be True or False, got 1"),
                      (dict(logprobs="raw"), "logprobs must be True or False"),
                      (dict(repetition_penalty=0), "repetition_penalty must be a number in"),
                      (dict(repetition_penalty="1.1"), "repetition_penalty must be a number"),
                      (dict(logprobs=True, top_logprobs=-1), "top_logprobs must be an integer >= 0"),
                      (dict(logprobs=True, top_logprobs=2.0), "top_logprobs must be an integer >= 0"),
                      (dict(top_logprobs=3), "top_logprobs=3 is kept beside the log-probabilities: give logprobs"),
                      (dict(stop_sequences=(5, 6)), r"stop_sequences\[0\] must be a non-empty sequence of token ids"),
                      (dict(stop_sequences=((5,), ())), r"stop_sequences\[1\] must be a non-empty sequence"),
                      (dict(stop_sequences=((5, -1),)), r"stop_sequences\[0\] must hold token ids >= 0"),
                      (dict(stop_sequences=((5, 1.0),)), r"stop_sequences\[0\] must hold token ids >= 0"),
                      (dict(stop_sequences="\n\n"), "stop_sequences must be a sequence of token-id sequences"),
                      (dict(stop_sequences=(("ab",),)), "must hold token ids")]:
        with pytest.raises(ValueError, match=match):
            EngineConfig(**kw)
    assert EngineConfig(eos_ids=[1, np.int64(2)]).eos_ids == (1, 2)  # a list is normalised (hashable)
    assert EngineConfig(eos_ids=(0,)).eos_ids == (0,)  # token id 0 is a valid EOS
    assert EngineConfig(stop_sequences=[[1, np.int64(2)], (0,)]).stop_sequences == ((1, 2), (0,))  # hashable
    cfg = tiny_config(vocab_size=64)
    target = KimiModel(cfg, nnx.Rngs(0))
    other_vocab = DFlashDrafter(tiny_drafter_config(cfg.replace(vocab_size=128), mask_token_id=100), nnx.Rngs(1))
    with pytest.raises(ConfigError, match="vocab_size 128 != target vocab_size 64"):
        Engine(target, other_vocab, EngineConfig(mode="dflash", capacity=64))
    with pytest.raises(ValueError, match="mode 'ddtree' needs a drafter"):
        Engine(target, None, EngineConfig(mode="ddtree", capacity=64))
    one_deep = DFlashDrafter(tiny_drafter_config(cfg, block_size=2), nnx.Rngs(1))  # Dp = 1: 64 distinct prefixes
    with pytest.raises(ValueError, match=r"budget 65 exceeds the number of distinct draft prefixes for Dp=1, W=64"):
        Engine(target, one_deep, EngineConfig(mode="ddtree", budget=65, capacity=64))  # refused before any compile
    with pytest.raises(ValueError, match=r"eos_ids \[64\] outside"):
        Engine(target, None, EngineConfig(mode="ar", capacity=64, eos_ids=(64,)))
    with pytest.raises(ValueError, match="top_logprobs=65 passes the target's vocabulary of 64 tokens"):
        Engine(target, None, EngineConfig(mode="ar", capacity=64, logprobs=True, top_logprobs=65))
    with pytest.raises(ValueError, match=r"stop_sequences \[\(3, 64\)\] hold ids outside the target's vocabulary"):
        Engine(target, None, EngineConfig(mode="ar", capacity=64, stop_sequences=((1,), (3, 64))))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        Engine(target, None, EngineConfig(mode="ar", capacity=cfg.max_position_embeddings + 8))
    engine = Engine(target, None, EngineConfig(mode="ar", capacity=64, max_new_tokens=2))
    for temperature in (-1.0, float("nan"), float("inf"), "0.5", True):
        with pytest.raises(ValueError, match="temperature"):
            engine.generate([[1, 2]], temperature=temperature)


def test_drafter_taps_must_name_distinct_layers():
    from ddtree_jax.drafter import tiny_drafter_config
    with pytest.raises(ConfigError, match="names a layer twice"):
        tiny_drafter_config(tiny_config(), target_layer_ids=(0, 0, 1))


def test_stored_drafter_config_with_unknown_fields_is_named():
    from ddtree_jax.checkpoint import drafter_config_from_dict, drafter_config_to_dict
    from ddtree_jax.drafter import tiny_drafter_config
    raw = drafter_config_to_dict(tiny_drafter_config(tiny_config()))
    assert drafter_config_from_dict(raw) == tiny_drafter_config(tiny_config())
    with pytest.raises(CheckpointError, match=r"unknown fields \['mystery'\]"):
        drafter_config_from_dict({**raw, "mystery": 1})


def _gates_to_bf16(tensors):
    import ml_dtypes
    for name in [n for n in tensors if n.endswith("mlp.gate.weight")]:
        tensors[name] = tensors[name].astype(ml_dtypes.bfloat16)


def test_router_dtype_follows_the_checkpoint(hf_dir, tmp_path):
    """The router keeps the precision its checkpoint stores: f32 here (as transformers keeps it), bf16 where
    every gate weight is stored in bf16 (K2.6), and then loaded exactly."""
    assert hf_model_config(hf_dir, dtype="bfloat16").router_dtype == "float32"
    assert load_hf_model(hf_dir, dtype="bfloat16").layers[1].mlp.router.value.dtype == jnp.float32
    path = edited_copy(hf_dir, tmp_path / "m", _gates_to_bf16)
    assert hf_model_config(path, dtype="float32").router_dtype == "bfloat16"
    model = load_hf_model(path, dtype="bfloat16")
    stored = np.asarray(SafetensorsFile(os.path.join(path, "model.safetensors")).get("model.layers.1.mlp.gate.weight"))
    router = model.layers[1].mlp.router.value
    assert router.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(router), stored)


def test_router_never_narrowed_lossily(hf_dir):
    """A config asking for a bf16 router from f32 gate weights that bf16 cannot hold is refused, naming the
    tensor (the experts chosen would change)."""
    cfg = hf_model_config(hf_dir, dtype="bfloat16").replace(router_dtype="bfloat16")
    _, abstract = abstract_model(cfg)
    with pytest.raises(CheckpointError, match=r"mlp\.gate\.weight: stored as float32, not exactly representable"):
        for _ in iter_hf_params(hf_dir, cfg, flat_params(abstract)):
            pass


@pytest.mark.parametrize("field, transformers_default", [
    ("routed_scaling_factor", 2.5), ("n_group", 8), ("topk_group", 4)])
def test_config_fields_that_change_the_math_have_no_default(hf_dir, field, transformers_default):
    raw = json.load(open(os.path.join(hf_dir, "config.json")))
    del raw[field]
    with pytest.raises(ConfigError, match=rf"lacks required field '{field}' .*default is {transformers_default}"):
        ModelConfig.from_hf_dict(raw)


def test_yarn_without_factor_is_refused(hf_dir):
    raw = json.load(open(os.path.join(hf_dir, "config.json")))
    del raw["rope_parameters"]["factor"]
    with pytest.raises(ConfigError, match="yarn rope section lacks required field 'factor'"):
        ModelConfig.from_hf_dict(raw)
    raw["rope_parameters"]["rope_type"] = "default"  # plain RoPE has no factor
    assert ModelConfig.from_hf_dict(raw).rope.kind == "default"


@pytest.mark.parametrize("field", ["n_group", "topk_group"])
def test_group_counts_below_one_are_refused_not_replaced(hf_dir, field):
    raw = json.load(open(os.path.join(hf_dir, "config.json")))
    raw[field] = 0
    with pytest.raises(ConfigError, match=rf"{field}=0 must be >= 1"):
        ModelConfig.from_hf_dict(raw)


def test_commit_flags_rows_outside_the_block():
    cfg = tiny_config()
    cache = init_cache(cfg, batch=4, capacity=16)
    new = jnp.arange(1.0, 4.0)[None, None, :, None] * jnp.ones((cfg.num_layers, 4, 3, cfg.latent_dim))
    rows = jnp.array([[0, -1], [0, 3], [2, 1], [0, 7]])  # stream 3 reads row 7 only past its count
    cache, overflow = commit(cache, new, rows, jnp.array([2, 2, 2, 1]))
    assert overflow.tolist() == [True, True, False, False]
    assert cache.lengths.tolist() == [0, 0, 2, 1]
    assert float(jnp.abs(cache.kv[:, :2]).sum()) == 0.0  # streams 0 and 1 unwritten (no wrap, no NaN)
    assert cache.kv[0, 2, :2, 0].tolist() == [3.0, 2.0] and float(cache.kv[0, 3, 0, 0]) == 1.0


@pytest.mark.parametrize("overrides, message", [
    (dict(n_routed_experts=8, n_group=4, topk_group=1, num_experts_per_tok=4),
     "topk_group=1 groups of 2 experts hold fewer than num_experts_per_tok=4"),
    (dict(n_routed_experts=8, n_group=8, topk_group=4, num_experts_per_tok=2),
     "1 experts per group; group routing needs >= 2"),
])
def test_group_routing_must_reach_k_experts(overrides, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(**overrides)
    tiny_config(**dict(overrides, topk_group=2, n_group=4))  # 2 groups of 2 experts hold K <= 4


def _expert_stack():
    from ddtree_jax.hf_loader import _ExpertStack
    return _ExpertStack(tiny_config(), layer=1)


def test_fused_experts_cannot_overwrite_experts_already_read():
    cfg = tiny_config()
    e, d, f = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    stack = _expert_stack()
    stack.add("experts.0.gate_proj.weight", 0, "gate_proj", "weight", np.full((f, d), 7.0, np.float32))
    with pytest.raises(CheckpointError, match="fused: duplicate tensor"):
        stack.add_fused("fused", "gate_up_proj", np.ones((e, 2 * f, d), np.float32))
    stack = _expert_stack()
    stack.add_fused("fused", "gate_up_proj", np.ones((e, 2 * f, d), np.float32))
    with pytest.raises(CheckpointError, match="again: duplicate tensor"):
        stack.add_fused("again", "gate_up_proj", np.full((e, 2 * f, d), 2.0, np.float32))
    stack.add_fused("down", "down_proj", np.ones((e, d, f), np.float32))
    assert stack.complete() and float(stack.finish("")["w13"][0, 0, 0]) == 1.0


def test_expert_of_another_dtype_is_not_rounded_into_the_stack():
    import ml_dtypes
    cfg = tiny_config()
    d, f = cfg.hidden_size, cfg.moe_intermediate_size
    stack = _expert_stack()
    stack.add("experts.0.gate_proj.weight", 0, "gate_proj", "weight", np.ones((f, d), ml_dtypes.bfloat16))
    with pytest.raises(CheckpointError, match=r"experts\.1\.gate_proj\.weight: stored as float32, not exactly "
                                              r"representable in bfloat16"):
        stack.add("experts.1.gate_proj.weight", 1, "gate_proj", "weight", np.full((f, d), 1 + 2**-12, np.float32))
    stack.add("experts.2.gate_proj.weight", 2, "gate_proj", "weight", np.full((f, d), 1.5, np.float32))  # exact
    with pytest.raises(CheckpointError, match=r"experts\.3\.gate_proj\.weight: dtype int32 is not a float type"):
        stack.add("experts.3.gate_proj.weight", 3, "gate_proj", "weight", np.ones((f, d), np.int32))


@pytest.mark.parametrize("taps", [(0, 0, 1), (2, 1, 1), (1, 1)])
def test_repeated_tap_layer_is_refused(taps):
    from flax import nnx
    from ddtree_jax.decode import prefill
    from ddtree_jax.model import KimiModel, causal_mask
    cfg = tiny_config()
    model = KimiModel(cfg, nnx.Rngs(0))
    tokens = jnp.ones((1, 3), jnp.int32)
    positions = jnp.arange(3)[None]
    with pytest.raises(ValueError, match=r"names a layer twice"):
        model(tokens, positions, init_cache(cfg, 1, 8), causal_mask(1, 3), tap_layers=taps)
    graphdef, state = nnx.split(model)
    with pytest.raises(ValueError, match=r"names a layer twice"):
        prefill(graphdef, state, init_cache(cfg, 1, 8), tokens, jnp.array([3]), tap_layers=taps)


@pytest.mark.parametrize("taps", [(4,), (0, -1)])  # 3: the last layer's output after the final norm
def test_tap_layer_outside_the_model_is_refused(taps):
    from flax import nnx
    from ddtree_jax.model import KimiModel, causal_mask
    cfg = tiny_config()  # 3 layers
    model = nnx.eval_shape(lambda: KimiModel(cfg, nnx.Rngs(0)))  # refused before any weight is read
    with pytest.raises(ValueError, match=r"tap layer -?\d outside \[0, 3\] \(3: the last layer's output after"):
        model(jnp.ones((1, 3), jnp.int32), jnp.arange(3)[None], init_cache(cfg, 1, 8), causal_mask(1, 3),
              tap_layers=taps)
