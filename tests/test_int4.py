"""INT4 in the compressed-tensors pack-quantized layout: bit-exact pack/unpack/dequantize against
compressed-tensors, our own quantizer against the rounding it promises, a tiny DeepseekV3 whose experts were
compressed by compressed-tensors' own compressor loads and matches torch, and bad INT4 checkpoints / configs
fail with errors naming the culprit."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from flax import nnx
from transformers import DeepseekV3ForCausalLM

from hf_reference import edited_copy, hf_logits_and_hidden, tiny_hf_model
from int4_reference import ct_compress, ct_decompress, ct_quantization_config, ct_scheme, write_int4_hf_dir
from ddtree_jax.cache import init_cache
from ddtree_jax.config import ConfigError, ModelConfig
from ddtree_jax.hf_loader import load_hf_model
from ddtree_jax.model import causal_mask
from ddtree_jax.quant import (QuantArray, dequantize_int4, pack_int4, parse_quantization_config, quantize_array,
                              quantize_int4, unpack_int4)
from ddtree_jax.safetensors_io import CheckpointError, SafetensorsFile

SHAPES = [(1, 8), (16, 64), (7, 96), (3, 8, 32), (2, 5, 256)]


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_pack_unpack_bit_exact_vs_compressed_tensors(shape):
    rng = np.random.default_rng(sum(shape))
    q = rng.integers(-8, 8, shape).astype(np.int8)
    q.reshape(-1)[:2] = [-8, 7]  # both extremes present
    theirs = pack_to_int32(torch.from_numpy(q), 4).numpy()
    ours = pack_int4(q)
    assert ours.dtype == np.int32 and ours.shape == theirs.shape
    np.testing.assert_array_equal(ours, theirs)
    np.testing.assert_array_equal(np.asarray(pack_int4(jnp.asarray(q))), theirs)  # jnp path, same bits
    np.testing.assert_array_equal(unpack_int4(theirs), q)
    np.testing.assert_array_equal(np.asarray(unpack_int4(jnp.asarray(theirs))), q)
    back = unpack_from_int32(torch.from_numpy(ours), 4, torch.Size(shape)).numpy()
    np.testing.assert_array_equal(back, q)


@pytest.mark.parametrize("shape", [(16, 64), (4, 32, 96)], ids=str)
def test_dequantize_matches_compressed_tensors_decompressor(shape):
    scheme = ct_scheme()
    w = torch.from_numpy(np.random.default_rng(1).normal(0, 0.05, shape).astype(np.float32))
    mats = [ct_compress(m, scheme) for m in w.reshape(-1, *shape[-2:])]
    packed = np.stack([c["weight_packed"].numpy() for c in mats]).reshape(*shape[:-1], -1)
    scale_bf16 = np.stack([c["weight_scale"].view(torch.int16).numpy() for c in mats]).view(ml_dtypes.bfloat16)
    scale_bf16 = scale_bf16.reshape(*shape[:-1], -1)
    for dtype, tdtype in ((jnp.bfloat16, torch.bfloat16), (jnp.float32, torch.float32)):
        ref = np.stack([ct_decompress(c, scheme, tdtype).float().numpy() for c in mats]).reshape(shape)
        for backend in (np, jnp):  # numpy (host) and jax (device) paths
            ours = np.asarray(dequantize_int4(backend.asarray(packed), backend.asarray(scale_bf16), dtype),
                              np.float32)
            np.testing.assert_array_equal(ours, ref)
        q = QuantArray(jnp.asarray(packed), jnp.asarray(scale_bf16))
        assert q.shape == shape and q.group_size == 32
        np.testing.assert_array_equal(np.asarray(q.dequantize(dtype), np.float32), ref)


def test_pack_and_quantize_refuse_what_the_layout_cannot_hold():
    with pytest.raises(ValueError, match="last dim 12 is not a multiple of 8"):
        pack_int4(np.zeros((2, 12), np.int8))
    for bad in (8, -9):
        q = np.zeros((2, 16), np.int8)
        q[1, 3] = bad
        with pytest.raises(ValueError, match=r"int4 values must lie in \[-8, 7\]"):
            pack_int4(q)
    with pytest.raises(ValueError, match="in-dim 48 is not a multiple of group_size 32"):
        quantize_int4(np.zeros((4, 48), np.float32))


@pytest.mark.parametrize("backend", [np, jnp], ids=["numpy", "jax"])
def test_quantizer_rounds_to_the_nearest_step_of_its_group(backend):
    """Our quantizer: scale = max|w| / 7 per group of 32, every weight within half a step of its dequantised value,
    the largest magnitude exact; an all-zero group stays zero (finite, not 0/0)."""
    rng = np.random.default_rng(5)
    w = rng.normal(0, 0.05, (3, 8, 64)).astype(np.float32)
    w[1, 2, 32:] = 0.0
    packed, scale = quantize_int4(backend.asarray(w))
    packed, scale = np.asarray(packed), np.asarray(scale)
    groups = w.reshape(3, 8, 2, 32)
    max_abs = np.abs(groups).max(-1)
    np.testing.assert_allclose(scale, np.where(max_abs == 0, 1.0, max_abs / 7), rtol=1e-6)
    back = np.asarray(dequantize_int4(packed, scale)).reshape(groups.shape)
    assert np.isfinite(back).all() and (back[1, 2, 1] == 0).all()
    assert (np.abs(back - groups) <= scale[..., None] * (0.5 + 1e-5)).all()
    at_max = np.abs(groups) == max_abs[..., None]
    np.testing.assert_allclose(np.abs(back)[at_max], np.abs(groups)[at_max], rtol=1e-6)


def test_quantize_array_packs_against_its_stored_scale():
    """The bf16 scale a QuantArray stores is what the values were rounded against: each packed value is the nearest
    integer to w / stored scale, so dequantisation reproduces exactly what was packed."""
    w = np.random.default_rng(6).normal(0, 0.05, (4, 16, 96)).astype(np.float32)
    arr = quantize_array(w)
    assert arr.scale.dtype == jnp.bfloat16 and arr.shape == w.shape and arr.group_size == 32
    stored = np.asarray(arr.scale, np.float32)
    want = np.clip(np.round(w.reshape(4, 16, 3, 32) / stored[..., None]), -8, 7).reshape(w.shape)
    np.testing.assert_array_equal(np.asarray(unpack_int4(arr.packed)), want)
    assert arr.nbytes == arr.packed.size * 4 + arr.scale.size * 2 == 4 * 16 * 96 // 2 + 4 * 16 * 3 * 2


@jax.jit(static_argnames=("graphdef",))
def _forward(graphdef, state, tokens):
    model = nnx.merge(graphdef, state)
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    return model(tokens, positions, init_cache(model.cfg, b, t), causal_mask(b, t)).logits


def forward(model, tokens):
    graphdef, state = nnx.split(model)
    return _forward(graphdef, state, jnp.asarray(tokens))


@pytest.fixture(scope="module")
def int4_dirs(tmp_path_factory):
    """{"plain": (int4_dir, float_dir), "k26": ...}: the K2-Thinking and the K2.6 wrapper layouts."""
    hf = tiny_hf_model(seed=3)
    plain = write_int4_hf_dir(hf, str(tmp_path_factory.mktemp("plain")), shape_dtype=np.int64)
    k26 = write_int4_hf_dir(hf, str(tmp_path_factory.mktemp("k26")), wrapper=True, shape_dtype=np.int32, shards=3)
    return {"plain": plain, "k26": k26}


@pytest.mark.parametrize("layout", ["plain", "k26"])
def test_int4_model_matches_torch_with_dequantised_experts(int4_dirs, layout):
    int4_dir, float_dir = int4_dirs[layout]
    torch_ref = DeepseekV3ForCausalLM.from_pretrained(float_dir, dtype=torch.float32).eval()
    model = load_hf_model(int4_dir, dtype="float32")
    cfg = model.cfg
    assert cfg.quant is not None and cfg.quant.group_size == 32
    assert cfg.weight_prefix == ("language_model." if layout == "k26" else "")
    w13 = model.layers[1].mlp.w13.value
    assert isinstance(w13, QuantArray) and w13.packed.dtype == jnp.int32 and w13.scale.dtype == jnp.bfloat16
    assert w13.shape == (cfg.n_routed_experts, 2 * cfg.moe_intermediate_size, cfg.hidden_size)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 9))
    ref_logits, _ = hf_logits_and_hidden(torch_ref, tokens)
    assert rel_err(forward(model, tokens), ref_logits) <= 1e-4


def test_int4_bf16_load_keeps_experts_int4_rest_bf16(int4_dirs):
    model = load_hf_model(int4_dirs["k26"][0], dtype="bfloat16")
    for path, variable in nnx.state(model).flat_state():
        value = variable.value
        if isinstance(value, QuantArray):
            assert path[-1] in ("w13", "w2") and value.packed.dtype == jnp.int32
        elif path[-1] in ("router", "router_bias"):
            assert value.dtype == jnp.float32, path
        else:
            assert value.dtype == jnp.bfloat16, path


# ----------------------------------------------------------------------------------------------
# Bad INT4 checkpoints and configs
# ----------------------------------------------------------------------------------------------
EXPERT = "model.layers.2.mlp.experts.3.down_proj."


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop(EXPERT + "weight_scale"),
     r"missing tensors: \['model\.layers\.2\.mlp\.experts\.3\.down_proj\.weight_scale'"),
    (lambda t: t.pop(EXPERT + "weight_shape"), r"experts\.3\.down_proj\.weight_shape"),
    (lambda t: t.update({EXPERT + "weight_packed": t[EXPERT + "weight_packed"][:, :-1]}),
     r"experts\.3\.down_proj\.weight_packed: shape \(64, 3\) != expected \(64, 4\)"),
    (lambda t: t.update({EXPERT + "weight_packed": t[EXPERT + "weight_packed"].astype(np.float32)}),
     r"experts\.3\.down_proj\.weight_packed: dtype float32 != int32"),
    (lambda t: t.update({EXPERT + "weight_scale": t[EXPERT + "weight_scale"].view(np.int16)}),
     r"experts\.3\.down_proj\.weight_scale: dtype int16 is not a float type"),
    (lambda t: t.update({EXPERT + "weight_shape": np.array([64.0, 32.0], np.float32)}),
     r"experts\.3\.down_proj\.weight_shape: dtype float32 is not an integer type"),
    (lambda t: t.update({EXPERT + "weight_shape": np.array([32, 64])}),
     r"experts\.3\.down_proj\.weight_shape: weight_shape \[32, 64\] != expected \[64, 32\]"),
    (lambda t: t.update({"model.layers.0.self_attn.o_proj.weight_packed": np.zeros((64, 8), np.int32)}),
     r"o_proj\.weight_packed: quantized tensor for a module this engine keeps in float"),
    (lambda t: [t.pop(f"model.layers.1.mlp.experts.0.gate_proj.{k}") for k in ("weight_packed", "weight_scale")]
     and t.update({"model.layers.1.mlp.experts.0.gate_proj.weight": np.zeros((32, 64), np.float32)}),
     r"experts\.0\.gate_proj\.weight: float expert weight but quantization_config declares INT4"),
], ids=["missing-scale", "missing-shape", "wrong-shape", "packed-as-float", "scale-as-int", "shape-as-float",
        "shape-values", "quantized-attention", "float-expert"])
def test_bad_int4_tensor_named(int4_dirs, tmp_path, edit, message):
    path = edited_copy(int4_dirs["plain"][0], tmp_path / "m", edit)
    with pytest.raises(CheckpointError, match=message):
        load_hf_model(path, dtype="float32")


def test_truncated_int4_shard_named(int4_dirs, tmp_path):
    dst = tmp_path / "m"
    shutil.copytree(int4_dirs["k26"][0], dst)
    index = json.load(open(dst / "model.safetensors.index.json"))
    last = sorted(set(index["weight_map"].values()))[-1]
    file = SafetensorsFile(str(dst / last))
    name = max(file.keys(), key=lambda k: file.header[k]["data_offsets"][1])  # the tensor stored last
    os.truncate(dst / last, os.path.getsize(dst / last) - 10)
    with pytest.raises(CheckpointError, match=rf"truncated file: tensor '{name}'"):
        load_hf_model(str(dst), dtype="float32")


def test_missing_shard_named(int4_dirs, tmp_path):
    dst = tmp_path / "m"
    shutil.copytree(int4_dirs["k26"][0], dst)
    os.remove(dst / "model-00002-of-00003.safetensors")
    with pytest.raises(CheckpointError, match="model-00002-of-00003.safetensors"):
        load_hf_model(str(dst), dtype="float32")


def _quant(**changes):
    raw = ct_quantization_config()
    weights = raw["config_groups"]["group_0"]["weights"]
    for key, value in changes.items():
        if key in weights:
            weights[key] = value
        else:
            raw[key] = value
    return raw


@pytest.mark.parametrize("raw, message", [
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "unsupported quant_method 'fp8'"),
    ({"quant_method": "gptq", "bits": 4}, "unsupported quant_method 'gptq'"),
    (_quant(format="naive-quantized"), "unsupported compressed-tensors format 'naive-quantized'"),
    (_quant(format="nvfp4-pack-quantized"), "unsupported compressed-tensors format 'nvfp4-pack-quantized'"),
    (_quant(num_bits=8), "num_bits=8"),
    (_quant(type="float"), "type='float'"),
    (_quant(symmetric=False), "asymmetric"),
    (_quant(strategy="channel"), "unsupported quantization strategy 'channel'"),
    (_quant(group_size=12), "group_size 12"),
    (_quant(group_size=0), "group_size 0 must be a positive multiple of 8"),
    (_quant(config_groups={}), "exactly one compressed-tensors config group, found 0"),
    (_quant(config_groups={"a": {}, "b": {}}), "found 2"),
], ids=["fp8", "gptq", "naive", "nvfp4", "int8", "float4", "asym", "channel", "group12", "group0", "no-group",
        "two-groups"])
def test_other_quantization_formats_refused(raw, message):
    with pytest.raises(ConfigError, match=message):
        parse_quantization_config(raw)


def test_absent_symmetric_means_symmetric_as_in_compressed_tensors():
    from compressed_tensors.quantization import QuantizationArgs

    raw = ct_quantization_config()
    del raw["config_groups"]["group_0"]["weights"]["symmetric"]
    assert QuantizationArgs(num_bits=4, strategy="group", group_size=32).symmetric
    assert parse_quantization_config(raw).symmetric


def test_activation_quantization_refused():
    raw = ct_quantization_config()
    raw["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "int", "symmetric": True,
                                                            "strategy": "token", "dynamic": True}
    with pytest.raises(ConfigError, match="activation quantization is not supported"):
        parse_quantization_config(raw)


def test_quantization_config_inside_text_config(int4_dirs):
    raw = json.load(open(os.path.join(int4_dirs["k26"][0], "config.json")))
    assert "quantization_config" not in raw and "quantization_config" in raw["text_config"]
    cfg = ModelConfig.from_hf_dict(raw)
    assert cfg.quant is not None and cfg.weight_prefix == "language_model."
    raw["text_config"]["quantization_config"]["format"] = "float-quantized"
    with pytest.raises(ConfigError, match="'float-quantized'"):
        ModelConfig.from_hf_dict(raw)


def _scales_as_float16(tensors, bump=False):
    """Layer 2's down_proj scales stored as f16 (as an f16 model's compressed-tensors export would); ``bump`` makes
    one of them 1 + 2**-10, which bf16 (the model's scale dtype) cannot hold."""
    for ex in range(8):
        name = f"model.layers.2.mlp.experts.{ex}.down_proj.weight_scale"
        tensors[name] = tensors[name].astype(np.float16)
    if bump:
        tensors["model.layers.2.mlp.experts.5.down_proj.weight_scale"][0, 0] = 1 + 2**-10


def test_int4_scales_not_exact_in_the_scale_dtype_refused(int4_dirs, tmp_path):
    exact = edited_copy(int4_dirs["plain"][0], tmp_path / "exact", _scales_as_float16)
    reference = load_hf_model(int4_dirs["plain"][0], dtype="float32").layers[2].mlp.w2.value.scale
    np.testing.assert_array_equal(np.asarray(load_hf_model(exact, dtype="float32").layers[2].mlp.w2.value.scale),
                                  np.asarray(reference))
    rounded = edited_copy(int4_dirs["plain"][0], tmp_path / "rounded", lambda t: _scales_as_float16(t, bump=True))
    with pytest.raises(CheckpointError, match=r"layers\.2\.mlp\.experts \(w2\): weight_scale stored as float16, "
                                              r"not exactly representable in the model's scale dtype bfloat16"):
        load_hf_model(rounded, dtype="float32")
