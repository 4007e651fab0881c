"""HF checkpoints read as transformers and compressed-tensors read them, or refused by name: RoPE sections, the
quantization config's parts this engine does not implement, safetensors byte ranges, float16 overflow, shapes
that do not fit the heads, and a directory that is not a checkpoint."""

import copy
import json
import os
import struct

import numpy as np
import pytest
from transformers import DeepseekV3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from cli_helpers import refused
from hf_reference import edited_copy, tiny_hf_model

pytest.importorskip("compressed_tensors")  # the quantization configs are built with it (the GPU image lacks it)
from int4_reference import ct_quantization_config  # noqa: E402
from ddtree_jax.config import ConfigError, ModelConfig  # noqa: E402
from ddtree_jax.hf_loader import load_hf_model  # noqa: E402
from ddtree_jax.quant import parse_quantization_config  # noqa: E402
from ddtree_jax.rope import rope_inv_freq  # noqa: E402
from ddtree_jax.safetensors_io import CheckpointError, SafetensorsFile, checkpoint_files  # noqa: E402
from experiments.convert_checkpoint import main as convert_main  # noqa: E402


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_ok")
    tiny_hf_model(seed=0).save_pretrained(path)
    return str(path)


@pytest.fixture
def raw(hf_dir):
    with open(os.path.join(hf_dir, "config.json")) as f:
        return json.load(f)


def transformers_rope(raw):
    """transformers' inverse frequencies and cos/sin amplitude for an HF config dict."""
    hf = DeepseekV3Config.from_dict(copy.deepcopy(raw))
    inv_freq, amplitude = ROPE_INIT_FUNCTIONS[hf.rope_parameters["rope_type"]](hf)
    return inv_freq.numpy(), float(amplitude)


@pytest.mark.parametrize("field, value", [("beta_fast", None), ("beta_fast", 0), ("beta_slow", None),
                                          ("beta_slow", 0), ("mscale_all_dim", None), ("mscale", None)])
def test_null_or_zero_yarn_fields_read_as_transformers_reads_them(raw, field, value):
    raw["rope_parameters"][field] = value
    cfg = ModelConfig.from_hf_dict(copy.deepcopy(raw))
    inv_freq, amplitude = rope_inv_freq(cfg.rope, cfg.qk_rope_head_dim)
    hf_inv_freq, hf_amplitude = transformers_rope(raw)
    np.testing.assert_array_max_ulp(inv_freq, hf_inv_freq, maxulp=1)
    assert amplitude == pytest.approx(hf_amplitude, abs=1e-7)


def test_a_negative_yarn_beta_is_refused(raw):
    raw["rope_parameters"]["beta_slow"] = -1.0
    with pytest.raises(ConfigError, match="beta_slow=-1.0 must be > 0"):
        ModelConfig.from_hf_dict(raw)


def test_rope_parameters_and_rope_scaling_that_differ_are_refused(raw):
    raw["rope_scaling"] = dict(raw["rope_parameters"], factor=2 * raw["rope_parameters"]["factor"])
    with pytest.raises(ConfigError, match="both rope_parameters .* and rope_scaling"):
        ModelConfig.from_hf_dict(raw)
    raw["rope_scaling"] = dict(raw["rope_parameters"])  # the same section twice is one section
    assert ModelConfig.from_hf_dict(raw).rope == ModelConfig.from_hf_dict(
        {k: v for k, v in raw.items() if k != "rope_scaling"}).rope


def test_a_top_level_original_max_position_is_read_as_transformers_reads_it(raw):
    """transformers 5 takes a top-level original_max_position_embeddings over the RoPE section's (for yarn); both,
    differing, are refused (earlier readers take the section's). Before, the top-level one was ignored."""
    from ddtree_jax.drafter import _rope_from_hf

    section = raw["rope_parameters"]
    raw["original_max_position_embeddings"] = section.pop("original_max_position_embeddings", None) or 32
    raw["original_max_position_embeddings"] //= 2  # not max_position_embeddings, the fallback
    cfg = ModelConfig.from_hf_dict(copy.deepcopy(raw))
    assert cfg.rope.original_max_position == raw["original_max_position_embeddings"]
    inv_freq, amplitude = rope_inv_freq(cfg.rope, cfg.qk_rope_head_dim)
    hf_inv_freq, hf_amplitude = transformers_rope(raw)
    np.testing.assert_array_max_ulp(inv_freq, hf_inv_freq, maxulp=1)
    assert amplitude == pytest.approx(hf_amplitude, abs=1e-7)
    assert _rope_from_hf(copy.deepcopy(raw), False).original_max_position == raw["original_max_position_embeddings"]
    section["original_max_position_embeddings"] = 2 * raw["original_max_position_embeddings"]
    for read in (ModelConfig.from_hf_dict, lambda r: _rope_from_hf(r, False)):
        with pytest.raises(ConfigError, match="original_max_position_embeddings .* at the top level and .* in its"):
            read(copy.deepcopy(raw))


def test_drafter_rope_sections_that_differ_are_refused():
    from ddtree_jax.drafter import _rope_from_hf
    section = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 1e4}
    with pytest.raises(ConfigError, match="both rope_parameters"):
        _rope_from_hf({"rope_parameters": section, "rope_scaling": dict(section, factor=8.0)}, False)


GROUP_KEYS = ("output_activations", "format")  # set in the config group; the rest at the config's top level


def quant_config(**changes):
    raw = ct_quantization_config()
    for key, value in changes.items():
        (raw["config_groups"]["group_0"] if key in GROUP_KEYS else raw)[key] = value
    return raw


@pytest.mark.parametrize("changes, message", [
    ({"output_activations": {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}},
     r"activation quantization is not supported \(output_activations"),
    ({"kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}},
     "kv_cache_scheme is not supported"),
    ({"transform_config": {"config_groups": {"u": {"type": "hadamard"}}}}, "transform_config is not supported"),
    ({"sparsity_config": {"format": "sparse-24-bitmask"}}, "sparsity_config is not supported"),
    ({"format": "float-quantized"}, "config group format 'float-quantized'"),
])
def test_quantization_parts_the_engine_does_not_implement_are_refused(changes, message):
    with pytest.raises(ConfigError, match=message):
        parse_quantization_config(quant_config(**changes))


@pytest.mark.parametrize("weights, message", [({"dynamic": True}, "dynamic weight quantization"),
                                              ({"actorder": "group"}, "actorder='group'")])
def test_weight_schemes_the_engine_does_not_implement_are_refused(weights, message):
    raw = quant_config()
    raw["config_groups"]["group_0"]["weights"].update(weights)
    with pytest.raises(ConfigError, match=message):
        parse_quantization_config(raw)


def test_an_absent_strategy_with_a_group_size_is_the_group_strategy():
    """compressed-tensors infers it (``QuantizationArgs(num_bits=4, group_size=32).strategy`` is GROUP)."""
    raw = quant_config()
    del raw["config_groups"]["group_0"]["weights"]["strategy"]
    assert parse_quantization_config(raw).group_size == 32


def test_a_group_size_that_does_not_divide_the_expert_in_dims_is_refused_by_name(raw):
    raw["quantization_config"] = ct_quantization_config(group_size=2 * raw["moe_intermediate_size"])
    with pytest.raises(ConfigError, match="moe_intermediate_size=.* is not a multiple of the quantization group_size"):
        ModelConfig.from_hf_dict(raw)


def write_safetensors(path, header, data: bytes):
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob + data)
    return str(path)


@pytest.mark.parametrize("offsets, message", [
    ([[0, 16], [0, 16]], "overlap or leave a gap"),      # two tensors over the same bytes
    ([[0, 16], [24, 40]], "overlap or leave a gap"),     # a gap
    ([[-8, 8], [8, 24]], r"invalid data_offsets \[-8, 8\]"),  # the header's last bytes read as data
    ([[16, 0], [16, 32]], r"invalid data_offsets \[16, 0\]"),
])
def test_safetensors_byte_ranges_must_lie_end_to_end(tmp_path, offsets, message):
    header = {name: {"dtype": "F32", "shape": [4], "data_offsets": span} for name, span in zip("xy", offsets)}
    path = write_safetensors(tmp_path / "m.safetensors", header, bytes(40))
    with pytest.raises(CheckpointError, match=message):
        SafetensorsFile(path)


def test_float16_overflow_is_refused_by_tensor_name(hf_dir, tmp_path):
    name = "model.layers.1.self_attn.kv_b_proj.weight"

    def edit(tensors):
        tensors[name] = tensors[name].copy()
        tensors[name][0, 0] = 1e6
    path = edited_copy(hf_dir, tmp_path / "m", edit)
    with pytest.raises(CheckpointError, match=r"kv_b_proj\.weight: 1 values overflow float16"):
        load_hf_model(path, dtype="float16")
    load_hf_model(path, dtype="float32")  # the same file in a wide dtype loads


@pytest.mark.parametrize("projection", ["q_b_proj", "kv_b_proj", "o_proj"])
def test_a_projection_that_does_not_fit_the_heads_is_named(hf_dir, tmp_path, projection):
    name = f"model.layers.1.self_attn.{projection}.weight"
    path = edited_copy(hf_dir, tmp_path / "m", lambda t: t.update({name: np.concatenate([t[name], t[name][:1]])}))
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.") + ": shape"):
        load_hf_model(path, dtype="float32")


def test_shared_experts_that_are_not_empty_are_refused_where_the_config_has_none(hf_dir, tmp_path, raw):
    path = edited_copy(hf_dir, tmp_path / "m", lambda tensors: None)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(dict(raw, n_shared_experts=0), f)
    with pytest.raises(CheckpointError, match=r"shared_experts\..*not empty, but n_shared_experts is 0"):
        load_hf_model(path, dtype="float32")


def test_a_directory_that_is_not_a_checkpoint_is_named(tmp_path, capsys):
    with pytest.raises(CheckpointError, match="not a directory"):
        checkpoint_files(str(tmp_path / "nowhere"))
    (tmp_path / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json: malformed index"):
        checkpoint_files(str(tmp_path))
    out = str(tmp_path / "out")
    assert "--hf /no/such: /no/such: not a directory" in refused(convert_main, ["--hf", "/no/such", "--out", out],
                                                                 capsys)
    os.remove(tmp_path / "model.safetensors.index.json")
    write_safetensors(tmp_path / "model.safetensors", {}, b"")
    assert "no config.json" in refused(convert_main, ["--hf", str(tmp_path), "--out", out], capsys)


def test_restoring_in_float16_refuses_a_parameter_that_overflows(tmp_path):
    import dataclasses

    from ddtree_jax.checkpoint import restore_model, save_model
    from ddtree_jax.config import tiny_config
    from tests.test_checkpoint import random_model

    model = random_model(tiny_config(dtype="float32"))
    model.embed.value = model.embed.value.at[3, 1].set(1e6)
    save_model(model, str(tmp_path / "ck"))
    with pytest.raises(CheckpointError, match=r"parameter embed overflows float16 .* from float32"):
        restore_model(str(tmp_path / "ck"), dataclasses.replace(model.cfg, dtype="float16"))
    assert float(restore_model(str(tmp_path / "ck")).embed.value[3, 1]) == 1e6


def test_drafter_restored_in_float16_and_float16_storage_refuse_overflow_and_storage_must_be_float(tmp_path):
    from flax import nnx

    from ddtree_jax.checkpoint import restore_drafter, save_drafter, save_model
    from ddtree_jax.config import tiny_config
    from ddtree_jax.drafter import DFlashDrafter, tiny_drafter_config
    from tests.test_checkpoint import random_model

    drafter = DFlashDrafter(tiny_drafter_config(tiny_config(), dtype="float32"), nnx.Rngs(0))
    drafter.norm.weight.set_value(drafter.norm.weight.get_value().at[0].set(1e6))
    save_drafter(drafter, str(tmp_path / "d"))
    with pytest.raises(CheckpointError, match=r"parameter norm\.weight overflows float16 .* from float32"):
        restore_drafter(str(tmp_path / "d"), dtype="float16")
    with pytest.raises(CheckpointError, match=r"saving: parameter norm\.weight overflows float16"):
        save_drafter(drafter, str(tmp_path / "d16"), storage_dtype="float16")
    model = random_model(tiny_config(dtype="float32"))
    for save, what in ((save_drafter, drafter), (save_model, model)):
        with pytest.raises(CheckpointError, match=r"storage_dtype 'int8' must be one of"):
            save(what, str(tmp_path / "int8"), storage_dtype="int8")
    assert not (tmp_path / "d16").exists() and not (tmp_path / "int8").exists()  # refused before writing


def test_saving_a_state_under_a_config_that_does_not_describe_it_is_refused(tmp_path):
    """Such a checkpoint was committed and could never be restored (Orbax's shape error at restore)."""
    import dataclasses

    from flax import nnx

    from ddtree_jax.checkpoint import save_model
    from ddtree_jax.config import tiny_config
    from tests.test_checkpoint import random_model

    model = random_model(tiny_config(dtype="float32"))
    other = dataclasses.replace(model.cfg, vocab_size=model.cfg.vocab_size + 8)
    with pytest.raises(CheckpointError, match=r"parameter embed has shape\(s\) \[\(\d+, \d+\)\], the config declares"):
        save_model(nnx.state(model), str(tmp_path / "ck"), cfg=other)
    fewer = dataclasses.replace(model.cfg, num_layers=model.cfg.num_layers - 1)
    with pytest.raises(CheckpointError, match=r"parameters missing .* not in the config"):
        save_model(nnx.state(model), str(tmp_path / "ck"), cfg=fewer)
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize("name", ["model.layers.1.mlp.gate.e_score_correction_bias",
                                  "model.layers.0.self_attn.kv_a_layernorm.weight", "model.norm.weight"])
def test_a_missing_tensor_is_named_as_the_checkpoint_names_it(hf_dir, tmp_path, name):
    """It was named by the engine's own path (``layers.1.mlp.router_bias``)."""
    path = edited_copy(hf_dir, tmp_path / "m", lambda tensors: tensors.pop(name))
    with pytest.raises(CheckpointError, match=r"missing 1 parameters, e\.g\. \['" + name.replace(".", r"\.") + "'"):
        load_hf_model(path, dtype="float32")
