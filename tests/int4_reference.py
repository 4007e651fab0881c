"""INT4 HF checkpoints made with compressed-tensors' own compressor, for the loader/converter tests.

``write_int4_hf_dir`` takes a tiny transformers DeepseekV3 (``hf_reference.tiny_hf_model``), compresses
every routed expert's gate/up/down projection with compressed-tensors' ``PackedQuantizationCompressor``
(symmetric int4, group 32, bf16 scales, min-max scales from ``calculate_qparams``) and writes an HF
directory in the K2-Thinking layout (top-level ``quantization_config``) or the K2.5/K2.6 wrapper layout
(``kimi_k25`` with ``text_config``, tensors prefixed ``language_model.``, a vision tensor present).
It also writes a float directory holding the compressor's dequantised expert weights, from which the
torch reference model is loaded.
"""

from __future__ import annotations

import json
import os
import re

import ml_dtypes
import numpy as np
import torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
from compressed_tensors.quantization.utils import calculate_qparams
from transformers import DeepseekV3ForCausalLM

from ddtree_jax.safetensors_io import SafetensorsFile, save_file

K26_IGNORE = ["re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
              "re:.*lm_head.*", "re:vision_tower.*", "re:mm_projector.*"]
_EXPERT_WEIGHT = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")


def ct_scheme(group_size: int = 32) -> QuantizationScheme:
    """The K2.6 scheme: weight-only symmetric int4, group strategy, on Linear targets."""
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size)
    return QuantizationScheme(targets=["Linear"], weights=args)


def ct_quantization_config(group_size: int = 32, ignore=None) -> dict:
    """The ``quantization_config`` dict, built with compressed-tensors' QuantizationConfig."""
    cfg = QuantizationConfig(config_groups={"group_0": ct_scheme(group_size)}, format="pack-quantized",
                             quantization_status="compressed", ignore=list(ignore or K26_IGNORE))
    return json.loads(json.dumps(cfg.model_dump(), default=str))


def ct_compress(weight: torch.Tensor, scheme: QuantizationScheme) -> dict[str, torch.Tensor]:
    """weight [O, I] f32 -> {weight_packed int32 [O, I/8], weight_scale bf16 [O, I/G], weight_shape int64 [2]}."""
    g = scheme.weights.group_size
    groups = weight.reshape(weight.shape[0], weight.shape[1] // g, g)
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
    return PackedQuantizationCompressor.compress({"weight": weight, "weight_scale": scale.to(torch.bfloat16)}, scheme)


def ct_decompress(compressed: dict[str, torch.Tensor], scheme: QuantizationScheme, dtype=torch.float32) -> torch.Tensor:
    """The compressor's own dequantisation, with the scale taken in ``dtype`` (f32: exact q * s)."""
    state = dict(compressed, weight_scale=compressed["weight_scale"].to(dtype))
    return PackedQuantizationCompressor.decompress(state, scheme)["weight"]


def _write_shards(tensors: dict[str, np.ndarray], path: str, shards: int) -> None:
    names = list(tensors)
    if shards <= 1:
        save_file(tensors, os.path.join(path, "model.safetensors"))
        return
    total = sum(t.nbytes for t in tensors.values())
    weight_map, chunk, size, index = {}, {}, 0, 0

    def flush():
        nonlocal chunk, size, index
        file = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        save_file(chunk, os.path.join(path, file))
        weight_map.update({n: file for n in chunk})
        chunk, size, index = {}, 0, index + 1

    for name in names:
        chunk[name] = tensors[name]
        size += tensors[name].nbytes
        if size >= total / shards and index < shards - 1:
            flush()
    if chunk:
        flush()
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)


def write_int4_hf_dir(hf: DeepseekV3ForCausalLM, path: str, *, wrapper: bool = False, shape_dtype=np.int64,
                      shards: int = 1) -> tuple[str, str]:
    """Writes the INT4 directory ``path/int4`` and the dequantised float directory ``path/float``.

    Returns (int4_dir, float_dir). ``wrapper``: K2.6 layout; ``shape_dtype``: dtype of weight_shape.
    """
    raw_dir, int4_dir, float_dir = (os.path.join(path, n) for n in ("raw", "int4", "float"))
    hf.save_pretrained(raw_dir)
    file = SafetensorsFile(os.path.join(raw_dir, "model.safetensors"))
    scheme = ct_scheme()
    quantized, dequantized = {}, {}
    for name in file.keys():
        value = np.array(file.get(name))
        if not _EXPERT_WEIGHT.match(name):
            quantized[name] = dequantized[name] = value
            continue
        compressed = ct_compress(torch.from_numpy(value).float(), scheme)
        stem = name[: -len("weight")]
        quantized[stem + "weight_packed"] = compressed["weight_packed"].numpy()
        quantized[stem + "weight_scale"] = compressed["weight_scale"].view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        quantized[stem + "weight_shape"] = compressed["weight_shape"].numpy().astype(shape_dtype)
        dequantized[name] = ct_decompress(compressed, scheme).numpy()
    with open(os.path.join(raw_dir, "config.json")) as f:
        config = json.load(f)

    os.makedirs(float_dir)
    save_file(dequantized, os.path.join(float_dir, "model.safetensors"))
    with open(os.path.join(float_dir, "config.json"), "w") as f:
        json.dump(config, f)

    os.makedirs(int4_dir)
    qc = ct_quantization_config()
    if wrapper:
        text = dict(config, model_type="kimi_k2", quantization_config=qc)
        top = {"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"], "text_config": text,
               "vision_config": {"hidden_size": 16}}
        quantized = {"language_model." + k: v for k, v in quantized.items()}
        quantized["vision_tower.patch_embed.proj.weight"] = np.ones((16, 3, 2, 2), np.float32)
        quantized["mm_projector.linear_1.weight"] = np.ones((64, 16), np.float32)
    else:
        top = dict(config, quantization_config=qc)
    _write_shards(quantized, int4_dir, shards)
    with open(os.path.join(int4_dir, "config.json"), "w") as f:
        json.dump(top, f)
    return int4_dir, float_dir
