"""Bad input gets a clear error; nothing is silently clamped or truncated."""

import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from hf_reference import edited_copy, tiny_hf_model
from ddtree_jax.cache import commit, init_cache
from ddtree_jax.config import ConfigError, ModelConfig, tiny_config
from ddtree_jax.decode import pad_prompts
from ddtree_jax.hf_loader import load_hf_model
from ddtree_jax.safetensors_io import CheckpointError


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
    with pytest.raises(CheckpointError, match=r"missing .*layers\.2\.attn\.kv_b"):
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


def test_bad_config_values():
    with pytest.raises(ConfigError, match="topk_group"):
        tiny_config(n_group=2, topk_group=3)
    with pytest.raises(ConfigError, match="not divisible by n_group"):
        tiny_config(n_group=3)
